"""Day 012 smoke tests: softmax, log_softmax and their backwards against float64 references.

Also the GPU launch plan (day 016): on any machine, which kernel, grid, block, shared
memory and cluster it picks for each shape; with a GPU, one case per dispatch branch.
"""

import math

import pytest
import torch

import pytorch_custom_ops as pco
from pytorch_custom_ops import programs
from pytorch_custom_ops import softmax_family as sf

# relative tolerance per dtype; softmax outputs are also checked with an absolute floor
# that shrinks with the row length, so the small outputs of long rows still count
# float64 1e-13: Mojo 1.2's own float64 exp was ~3e-13 off (days/day009/exp_f64.mojo)
TOL = {torch.float32: 3e-6, torch.float64: 1e-13, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

FORWARD = {
    "softmax": (pco.softmax, torch.softmax),
    "log_softmax": (pco.log_softmax, torch.log_softmax),
}


def ref_backward(name, g, y, dim):
    """float64 backward from the float64 forward output y."""
    if name == "softmax":
        return y * (g - (g * y).sum(dim, keepdim=True))
    return g - torch.exp(y) * g.sum(dim, keepdim=True)


def check_forward(name, x, dim=-1):
    ours, theirs = FORWARD[name]
    y = ours(x, dim)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    want = theirs(x.double(), dim)
    n = max(x.shape[dim], 1) if x.dim() else 1
    tol = TOL[x.dtype]
    if name == "softmax":
        # probabilities of long rows are ~1/n: below fp16's normal range, where one subnormal
        # step (6e-8) is the finest difference the output can hold
        finfo = torch.finfo(x.dtype)
        torch.testing.assert_close(y.double(), want, rtol=tol, atol=max(tol / n, finfo.smallest_normal * finfo.eps))
    else:  # log-probabilities: relative to the row's scale
        torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * (1 + want.abs().amax()))
    return y


def unaligned(t, offset):
    """A copy of t whose data starts `offset` elements into its storage (offset 1: not
    16-byte aligned, so the GPU plan must pick scalar loads)."""
    if not offset:
        return t
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    return buf[offset:].view(t.shape).copy_(t)


def check_backward(name, x, dim=-1, offset=0):
    torch.manual_seed(x.numel())
    y64 = FORWARD[name][1](x.double(), dim)
    g = unaligned(torch.randn_like(x), offset)
    y = y64.to(x.dtype)  # the forward output as the forward would have stored it
    ours = pco.softmax_backward if name == "softmax" else pco.log_softmax_backward
    dx = ours(g, y, dim)
    assert dx.shape == x.shape and dx.dtype == x.dtype
    want = ref_backward(name, g.double(), y.double(), dim)
    tol = TOL[x.dtype]
    torch.testing.assert_close(dx.double(), want, rtol=tol, atol=tol * (1 + want.abs().amax()))


def test_mojo_paths_are_live():
    for op in ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward"):
        assert pco.use_mojo(op), pco.KERNELS[op].failure


# 1 and 37: scalar loads; 256, 1000: a warp per row; 4097: unaligned, a block per row
@pytest.mark.parametrize("shape", [(3, 1), (9, 37), (64, 256), (7, 1000), (3, 4097), (2, 40000)])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_forward_fp32_shapes(name, shape, device):
    torch.manual_seed(sum(shape))
    check_forward(name, torch.randn(shape, device=device) * 4)


@pytest.mark.parametrize("shape", [(3, 1), (9, 37), (7, 1000), (3, 4097)])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_backward_fp32_shapes(name, shape, device):
    torch.manual_seed(sum(shape))
    check_backward(name, torch.randn(shape, device=device) * 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_forward_other_dtypes(name, dtype, device):
    torch.manual_seed(5)
    check_forward(name, (torch.randn(33, 1024, device=device) * 4).to(dtype))
    check_forward(name, (torch.randn(5, 999, device=device) * 4).to(dtype))  # unaligned rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_backward_other_dtypes(name, dtype, device):
    torch.manual_seed(6)
    check_backward(name, (torch.randn(33, 1024, device=device) * 4).to(dtype))


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_every_dim_and_layout(name, dim, device):
    torch.manual_seed(7)
    x = torch.randn(5, 6, 7, device=device) * 3
    check_forward(name, x, dim)
    check_forward(name, x.transpose(0, 2), dim)  # non-contiguous
    check_backward(name, x, dim)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_large_magnitudes(name, device):
    torch.manual_seed(8)
    x = (torch.rand(16, 513, device=device) * 2 - 1) * 1e4
    x[:, 100] = 1e4  # exp without the max shift would overflow
    check_forward(name, x)
    check_forward(name, x + 1e4)  # a large common offset cancels


# a warp per row, a block per row, the cluster kernel (its own write pass)
@pytest.mark.parametrize("cols", [8, 1000, 40000])
def test_log_softmax_exact_far_from_zero(cols, device):
    """log_softmax = (x - max) - log(sum): a row far from 0 (a whole row masked with
    -1e9, a common offset of 1e5) keeps log(sum), which x - (max + log(sum)) lost in
    max's rounding (the -1e9 row came out 0 instead of -log(cols)). The tolerance is
    relative to the output, not to the input's magnitude, so that loss shows."""
    torch.manual_seed(cols)
    x = torch.randn(4, cols, device=device) * 4
    x[0] = -1e9  # every score masked: uniform, -log(cols)
    x[1, 3:] = -1e9  # all but three masked
    x[2] += 1e5  # a large common offset
    x[3] -= 3e7
    y, want = pco.log_softmax(x, -1), torch.log_softmax(x.double(), -1)
    torch.testing.assert_close(y.double(), want, rtol=3e-6, atol=3e-6 * (1 + want[:, :3].abs().amax()))


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
# vector loads; scalar loads (a NaN alone in its vector); rows long enough for the cluster
# kernel, whose first pass (fold_and_cache) tests for NaN and +inf its own way
@pytest.mark.parametrize("cols", [300, 301, 40000, 40001])
def test_masked_rows_and_nan_match_torch(name, cols, device):
    ours, theirs = FORWARD[name]
    x = torch.randn(5, cols, device=device)
    x[0, :100] = float("-inf")  # partly masked: softmax 0 / log_softmax -inf there
    x[2] = float("-inf")  # fully masked: NaN, like torch
    x[3, 7] = float("nan")  # a NaN poisons its row
    x[4, 9] = float("inf")  # so does +inf (inf - inf)
    y, want = ours(x, -1), theirs(x, -1)
    assert torch.equal(torch.isnan(y), torch.isnan(want))
    assert torch.equal(torch.isneginf(y), torch.isneginf(want))
    ok = ~torch.isnan(want) & torch.isfinite(want)
    torch.testing.assert_close(y[ok], want[ok], rtol=3e-6, atol=3e-6)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_gradcheck_and_gradgradcheck(name, device):
    x = torch.randn(3, 11, dtype=torch.float64, device=device, requires_grad=True)
    fn = FORWARD[name][0]
    assert torch.autograd.gradcheck(lambda t: fn(t, 1), (x,))
    assert torch.autograd.gradgradcheck(lambda t: fn(t, 0), (x,))


def test_autograd_runs_the_mojo_backward(monkeypatch, device):
    # through the op's Python call: a repeated call on CUDA is otherwise replayed from C++
    # without it (day 016's programs, tested in days/day016/test_day016_programs.py)
    monkeypatch.setattr(programs, "ENABLED", False)
    calls = []
    kernel = pco.KERNELS["softmax_backward"]
    original = type(kernel).__call__

    def spy(self, inputs, *args, **kwargs):
        calls.append(self.spec.name)
        return original(self, inputs, *args, **kwargs)

    monkeypatch.setattr(type(kernel), "__call__", spy)
    x = torch.randn(4, 50, device=device, requires_grad=True)
    pco.softmax(x, -1).sum().backward()
    pco.online_softmax(x, -1).pow(2).sum().backward()  # day009's op uses the same backward
    assert calls.count("softmax_backward") == 2


@pytest.mark.parametrize(
    "op, args",
    [
        ("softmax", lambda d: (torch.randn(4, 9, device=d), 1)),
        ("log_softmax", lambda d: (torch.randn(4, 9, device=d), 0)),
        ("softmax_backward", lambda d: (torch.randn(4, 9, device=d), torch.rand(4, 9, device=d), 1)),
        ("log_softmax_backward", lambda d: (torch.randn(4, 9, device=d), torch.randn(4, 9, device=d), 1)),
    ],
)
def test_opcheck(op, args, device):
    torch.library.opcheck(getattr(torch.ops.gpu_days, op).default, args(device))


def test_torch_compile_fullgraph_forward_and_backward(device):
    torch._dynamo.reset()

    def f(t):
        return pco.log_softmax(pco.softmax(t, 0) * 3, -1)

    x = torch.randn(6, 10, device=device, requires_grad=True)
    y = torch.compile(f, fullgraph=True)(x)
    y.sum().backward()
    x_ref = x.detach().double().requires_grad_(True)
    y_ref = torch.log_softmax(torch.softmax(x_ref, 0) * 3, -1)
    y_ref.sum().backward()
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), x_ref.grad, atol=1e-5, rtol=1e-5)


def test_modules_train_like_torch_modules(device):
    torch.manual_seed(9)
    ours = torch.nn.Sequential(torch.nn.Linear(8, 5), pco.MojoLogSoftmax(-1)).to(device)
    theirs = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.LogSoftmax(-1)).to(device)
    theirs.load_state_dict(ours.state_dict())
    x, target = torch.randn(16, 8, device=device), torch.randint(0, 5, (16,), device=device)
    for model in (ours, theirs):
        torch.nn.functional.nll_loss(model(x), target).backward()
    assert ours[1].use_mojo and pco.MojoSoftmax().use_mojo
    torch.testing.assert_close(ours[0].weight.grad, theirs[0].weight.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(pco.MojoSoftmax(0)(x), torch.softmax(x, 0), atol=1e-6, rtol=1e-5)


def test_scalar_and_empty(device):
    assert pco.softmax(torch.tensor(3.0, device=device)).item() == 1.0
    assert pco.log_softmax(torch.tensor(3.0, device=device)).item() == 0.0
    assert pco.softmax(torch.empty(0, 5, device=device)).shape == (0, 5)
    assert pco.log_softmax(torch.empty(2, 0, 3, device=device), dim=1).shape == (2, 0, 3)
    e = torch.empty(4, 0, device=device)
    assert pco.softmax_backward(e, e, -1).shape == (4, 0)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(TypeError, match="log_softmax: dtype torch.int64"):
        pco.log_softmax(torch.arange(6).reshape(2, 3))
    with pytest.raises(IndexError, match="softmax: dim 2 is out of range"):
        pco.softmax(torch.randn(2, 3), dim=2)
    with pytest.raises(ValueError, match=r"softmax_backward: grad_output has shape \(2, 3\) but output has \(3, 2\)"):
        pco.softmax_backward(torch.randn(2, 3), torch.randn(3, 2))
    mixed = "log_softmax_backward: grad_output is torch.float32 but output is torch.float64"
    with pytest.raises(TypeError, match=mixed):
        pco.log_softmax_backward(torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="softmax: expected a torch.Tensor"):
        pco.softmax([1.0, 2.0])


# -- the GPU launch plan ------------------------------------------------------------------------
OPS = ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward")
KiB = 1024


def plan_tensors(op, shape, dtype, offsets=(0, 0, 0)):
    """(out, inputs) for `op` that only a plan may read: shape, dtype and data_ptr. They
    share a tiny buffer through zero strides, so huge shapes cost no memory; offsets
    (elements) move each tensor's pointer like a storage offset would."""
    n_inputs = 2 if op.endswith("backward") else 1
    buf = torch.empty(64, dtype=dtype)  # the CPU allocator aligns to 64 bytes
    out, *inputs = [buf.as_strided(shape, (0, 0), off) for off in offsets[: 1 + n_inputs]]
    return out, inputs


def plan(op, out, inputs):
    kernel = pco.KERNELS[op]
    launches = kernel.gpu([out], inputs, kernel.spec.params)
    assert len(launches) == 1
    return launches[0]


def _slice(n, c, w):
    return math.ceil(math.ceil(n / c) / w) * w


def check_launch(op, out, inputs, launch) -> str:
    """Everything a launch must satisfy; returns which kind of kernel it is."""
    families = sf.BACKWARD_KERNELS if op.endswith("backward") else sf.FORWARD_KERNELS
    kernel = launch.kernel
    assert kernel.family in families and kernel.family[kernel.params] is kernel  # declared: gpu_build has it
    dtype, log, w = kernel.params[:3]
    assert dtype == out.dtype and log == op.startswith("log_")
    rows, cols = out.shape
    elem, tensors = out.element_size(), len(inputs)
    ptrs = tuple(t.data_ptr() for t in (out, *inputs))
    assert len(launch.args) == len(kernel.family.args) and launch.args[: len(ptrs)] == ptrs
    assert isinstance(launch.block, int) and 32 <= launch.block <= 1024 and launch.block % 32 == 0
    assert isinstance(launch.grid, int) and 1 <= launch.grid < 2**31
    assert 0 <= launch.smem <= 227 * KiB
    # 16-byte vectors exactly when every row of every tensor starts on a 16-byte boundary
    aligned = cols * elem % 16 == 0 and all(p % 16 == 0 for p in ptrs)
    assert w == (16 // elem if aligned else 1)
    if kernel.family is families.rows:
        nv, g, block = kernel.params[3:]
        assert block == launch.block == (128 if g <= 32 else g)  # rows of a warp or part of one, or 1 row
        assert cols <= g * nv * w and nv * w <= 32  # the row fits, at most 32 values a thread
        smaller = [(gg, e) for gg, e in sf.ROW_CONFIGS if e % w == 0 and gg * e < g * nv * w]
        assert all(cols > gg * e for gg, e in smaller)  # the smallest layout that holds the row
        assert launch.grid == math.ceil(rows / (block // g))  # every row, once
        assert launch.args[-2:] == (rows, cols) and launch.smem == 0 and launch.cluster is None
        return "rows"
    assert cols > 512 * 32  # no register layout holds the row
    row_bytes = tensors * cols * elem
    if kernel.family is families.cluster:
        block, c = kernel.params[3:]
        slice_len = launch.args[-1]
        assert dtype != torch.float64 and row_bytes > sf.CACHE_BYTES
        assert launch.cluster == c and launch.grid == rows * c and launch.block == block
        assert launch.args[-2] == cols and slice_len % w == 0 and cols <= c * slice_len
        assert launch.smem == tensors * slice_len * elem <= 224 * KiB
        assert (block == 1024) == (launch.smem > 112 * KiB)
        budget = (112 if block == 512 else 224) * KiB  # and no smaller cluster fits that budget
        assert all(tensors * _slice(cols, cc, w) * elem > budget for cc in (2, 4, 8) if cc < c)
        return "cluster"
    assert kernel.family is families.looped
    cached = launch.args[-1]
    assert launch.grid == rows and launch.block == 1024 and launch.cluster is None and launch.args[-2] == cols
    assert 0 < cached <= cols and cached % w == 0 and launch.smem == tensors * cached * elem <= sf.CACHE_BYTES
    if row_bytes <= sf.CACHE_BYTES:
        assert cached == cols  # the whole row is cached
    else:
        assert tensors * (cached + w) * elem > sf.CACHE_BYTES  # as much as fits
        if dtype != torch.float64 and sf.USE_CLUSTERS:  # not even 8 CTAs could hold it
            assert tensors * _slice(cols, 8, w) * elem > 224 * KiB
    return "looped"


PLAN_SHAPES = [
    (1, 1), (3, 1), (1, 7), (5, 128), (5, 129), (33, 256), (7, 1000), (7, 1024), (7, 1025), (2, 2048),
    (2, 4097), (2, 8192), (2, 16384), (2, 16385), (2, 16388), (1, 25600), (1, 25604), (1, 30001), (1, 40000),
    (1, 51200), (1, 51204), (1, 53248), (1, 57344), (1, 57348), (1, 102408), (1, 128256), (1, 229376),
    (1, 229380), (1, 300000), (1, 458752), (1, 458756), (1, 917504), (1, 1_000_003), (1, 2**24),
    (100_003, 3), (2**20, 64), (2**31 - 1, 1),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("op", OPS)
def test_plan_launches_are_declared_and_launchable(op, dtype):
    seen = set()
    for shape in PLAN_SHAPES:
        for offsets in ((0, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 0)):
            out, inputs = plan_tensors(op, shape, dtype, offsets)
            seen.add(check_launch(op, out, inputs, plan(op, out, inputs)))
    assert seen == {"rows", "looped", "cluster"} if dtype != torch.float64 else {"rows", "looped"}


def test_plan_picks_every_declared_kernel():
    """A sweep of row lengths (every 1%, multiples of 16 and odd ones) over every op,
    dtype and alignment reaches each declared variant, and only declared ones."""
    lengths = sorted({c for k in range(1700) for c in (int(1.01**k) // 16 * 16 or 16, int(1.01**k) | 1)})
    picked = set()
    for op in OPS:
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            for offsets in ((0, 0, 0), (1, 1, 1)):
                out, inputs = plan_tensors(op, (3, 1), dtype, offsets)
                for cols in lengths:
                    shaped = [t.as_strided((3, cols), (0, 0)) for t in (out, *inputs)]
                    picked.add(plan(op, shaped[0], shaped[1:]).kernel)
    declared = {k for fams in (sf.FORWARD_KERNELS, sf.BACKWARD_KERNELS) for f in fams for k in f.kernels()}
    assert picked == declared, sorted(k.key for k in declared ^ picked)[:10]


def test_plan_without_clusters_keeps_the_looped_kernel(monkeypatch):
    monkeypatch.setattr(sf, "USE_CLUSTERS", False)
    out, inputs = plan_tensors("softmax", (4, 128256), torch.float32)
    launch = plan("softmax", out, inputs)
    assert check_launch("softmax", out, inputs, launch) == "looped"
    assert launch.args[-1] == 51200 and launch.smem == 200 * KiB  # head cached, tail read twice


def test_plan_refuses_a_grid_cuda_cannot_launch():
    out, inputs = plan_tensors("log_softmax_backward", (2**35 + 17, 1), torch.float16)  # 16 rows a block
    with pytest.raises(ValueError, match=r"log_softmax_backward: 34359738385 rows of 1 need 2147483650 blocks"):
        plan("log_softmax_backward", out, inputs)


# One case per dispatch branch: (op, dtype, shape, storage offset of the first input,
# the kernel the plan must pick, CTAs per cluster). The key is
# day012.<function>.<dtype>.<LOG>.<W>.<NV>.<G>.<BLOCK> for the register kernels,
# .<dtype>.<LOG>.<W>.<BLOCK> for the looped ones and .<dtype>.<LOG>.<W>.<BLOCK>.<C> for clusters.
BRANCHES = [
    # a warp per row, 16-byte vectors / scalars (unaligned width or pointer)
    ("softmax", torch.float32, (33, 256), 0, "softmax_rows_kernel.float32.0.4.2.32.128"),
    ("log_softmax", torch.float32, (9, 37), 0, "softmax_rows_kernel.float32.1.1.8.8.128"),  # 8 lanes a row
    ("softmax", torch.float32, (6, 1000), 1, "softmax_rows_kernel.float32.0.1.32.32.128"),
    ("log_softmax", torch.float64, (4, 100), 0, "softmax_rows_kernel.float64.1.2.4.16.128"),  # 16 lanes a row
    # attention scores at s = 128 and 64: 2 and 4 rows a warp; 37 and 13 rows leave the last
    # warp's last groups without a row (they redo the last one and store nothing)
    ("softmax", torch.bfloat16, (37, 128), 0, "softmax_rows_kernel.bfloat16.0.8.1.16.128"),
    ("log_softmax", torch.float16, (13, 64), 0, "softmax_rows_kernel.float16.1.8.1.8.128"),
    # a block per row
    ("log_softmax", torch.bfloat16, (5, 3000), 0, "softmax_rows_kernel.bfloat16.1.8.2.256.256"),
    ("softmax", torch.float16, (3, 12000), 0, "softmax_rows_kernel.float16.0.8.4.512.512"),
    # looped: the whole row cached; the head cached and the tail read twice
    ("log_softmax", torch.float32, (2, 20000), 0, "softmax_looped_kernel.float32.1.4.1024"),
    ("softmax", torch.float64, (3, 30001), 0, "softmax_looped_kernel.float64.0.1.1024"),
    ("log_softmax", torch.float32, (1, 470000), 0, "softmax_looped_kernel.float32.1.4.1024"),
    # a row over a cluster of 2, 4, 8 CTAs; 1024 threads when a CTA has its SM alone
    ("softmax", torch.float32, (2, 53248), 0, "softmax_cluster_kernel.float32.0.4.512.2"),
    ("log_softmax", torch.bfloat16, (2, 150000), 0, "softmax_cluster_kernel.bfloat16.1.8.512.4"),
    ("softmax", torch.float16, (2, 120001), 1, "softmax_cluster_kernel.float16.0.1.512.4"),
    ("softmax", torch.float32, (2, 128256), 0, "softmax_cluster_kernel.float32.0.4.512.8"),
    ("log_softmax", torch.float32, (2, 300000), 0, "softmax_cluster_kernel.float32.1.4.1024.8"),
    # the backwards
    ("softmax_backward", torch.float32, (7, 1000), 0, "softmax_backward_rows_kernel.float32.0.4.8.32.128"),
    ("softmax_backward", torch.bfloat16, (37, 128), 0, "softmax_backward_rows_kernel.bfloat16.0.8.1.16.128"),
    ("log_softmax_backward", torch.float16, (13, 64), 0, "softmax_backward_rows_kernel.float16.1.8.1.8.128"),
    ("log_softmax_backward", torch.float32, (5, 4097), 0, "softmax_backward_rows_kernel.float32.1.1.16.512.512"),
    ("softmax_backward", torch.bfloat16, (3, 2048), 1, "softmax_backward_rows_kernel.bfloat16.0.1.16.128.128"),
    ("log_softmax_backward", torch.float32, (2, 20000), 0, "softmax_backward_looped_kernel.float32.1.4.1024"),
    ("softmax_backward", torch.float32, (2, 240000), 0, "softmax_backward_looped_kernel.float32.0.4.1024"),
    ("log_softmax_backward", torch.float64, (2, 30000), 0, "softmax_backward_looped_kernel.float64.1.2.1024"),
    ("softmax_backward", torch.float32, (2, 26000), 0, "softmax_backward_cluster_kernel.float32.0.4.512.2"),
    ("log_softmax_backward", torch.float32, (2, 30001), 0, "softmax_backward_cluster_kernel.float32.1.1.512.4"),
    ("softmax_backward", torch.bfloat16, (2, 60000), 0, "softmax_backward_cluster_kernel.bfloat16.0.8.512.4"),
    ("log_softmax_backward", torch.float32, (2, 128256), 0, "softmax_backward_cluster_kernel.float32.1.4.1024.8"),
]


@pytest.mark.parametrize(
    "op, dtype, shape, offset, key", BRANCHES, ids=[f"{b[0]}-{b[4].split('.', 1)[1]}" for b in BRANCHES]
)
def test_every_dispatch_branch(op, dtype, shape, offset, key, device):
    """The plan picks `key` for these tensors; on CUDA the op then runs it and is checked
    against float64 (on the CPU, MAX runs the CPU kernels, covered above)."""
    torch.manual_seed(shape[1])
    x = unaligned((torch.randn(shape, device=device) * 2).to(dtype), offset)  # x2: long rows stay in fp32 range
    backward = op.endswith("backward")
    inputs = [x, torch.empty_like(x)] if backward else [x]
    out = torch.empty_like(x)
    launch = plan(op, out, inputs)
    check_launch(op, out, inputs, launch)
    assert launch.kernel.key == f"day012.{key}"
    if device == "cuda":
        name = op.removesuffix("_backward")
        if backward:
            check_backward(name, x, offset=offset)
        else:
            check_forward(name, x)
