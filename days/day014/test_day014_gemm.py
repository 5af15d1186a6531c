"""Day 014: the GEMM ops and MojoGEMM against float64 references.

Graph compiles dominate the CPU time (~17 s per op x dtype x transpose pair), so the
tests reuse a small set: gemm fp32 in all four transpose pairs, gemm fp64 NN/NT/TN
(gradcheck), gemm bf16/fp16 NN, gemm_batched fp32 NN/NT/TN.
"""

import os
import subprocess
import sys

import pytest
import torch

import pytorch_custom_ops as pco
from pytorch_custom_ops.library import REPO_ROOT

# allowed |got - want| relative to the error scale of the dot products (see `check`)
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
TRANSPOSES = [(False, False), (False, True), (True, False), (True, True)]


def stored(x: torch.Tensor, transpose: bool) -> torch.Tensor:
    """The contiguous tensor to pass for op(x) = x (or x^T when transpose)."""
    return x.mT.contiguous() if transpose else x.contiguous()


def op(x: torch.Tensor, transpose: bool) -> torch.Tensor:
    return x.mT if transpose else x


def check(y, a, b, c=None, alpha=1.0, beta=0.0, ta=False, tb=False):
    """y == alpha * op(a) @ op(b) + beta * c, in float64, to within TOL of the error scale
    alpha * |op(a)| @ |op(b)| + |beta * c| (a dot product's rounding grows with it)."""
    pa, pb = op(a.double(), ta), op(b.double(), tb)
    want = alpha * (pa @ pb)
    scale = abs(alpha) * (pa.abs() @ pb.abs())
    if c is not None and beta != 0:
        want = want + beta * c.double()
        scale = scale + abs(beta) * c.double().abs()
    assert y.shape == want.shape and y.dtype == a.dtype and y.device == a.device
    assert torch.isfinite(y).all()
    err = (y.double() - want).abs()
    bound = TOL[a.dtype] * scale + 1e-30
    worst = (err / bound).max().item() if y.numel() else 0.0
    assert worst <= 1.0, f"max error {err.max().item():.3g} is {worst:.2f}x the bound"


def rand(*shape, device="cpu", dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def test_mojo_path_is_live():
    assert pco.use_mojo("gemm"), pco.gemm_kernel.failure
    assert pco.use_mojo("gemm_batched"), pco.gemm_batched_kernel.failure


def test_every_orientation_returns_its_output_without_a_copy():
    # the transposes are fixed per MojoOp, so op(a)'s rows and op(b)'s columns name
    # the output's dims: MAX allocates it and torch wraps it (no out= destination)
    from pytorch_custom_ops.gemm import _KERNELS

    assert len(_KERNELS) == 8
    for (batched, ta, tb), kernel in _KERNELS.items():
        assert kernel.spec.destinations == ()
        assert kernel.spec.params == {"TRANSPOSE_A": ta, "TRANSPOSE_B": tb}
        assert kernel.spec.name == ("gemm_batched" if batched else "gemm")


# (M, N, K): 1, 17, 1000, 4097 in each position (4097 with the other dims small)
SHAPES = [
    (1, 1, 1),
    (17, 17, 17),
    (1000, 17, 5),
    (17, 1000, 3),
    (5, 17, 1000),
    (4097, 3, 5),
    (3, 4097, 5),
    (5, 3, 4097),
]


@pytest.mark.parametrize("ta,tb", TRANSPOSES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp32_sizes_and_transposes(shape, ta, tb, device):
    m, n, k = shape
    torch.manual_seed(m + 3 * n + 7 * k)
    a, b = rand(m, k, device=device), rand(k, n, device=device)
    c = rand(m, n, device=device) if m % 2 else rand(1, n, device=device)  # full c or a bias row
    y = pco.gemm(stored(a, ta), stored(b, tb), c, alpha=1.25, beta=-0.75, transpose_a=ta, transpose_b=tb)
    check(y, a, b, c, 1.25, -0.75)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_dtypes(dtype, device):
    torch.manual_seed(1)
    a, b, c = rand(33, 1000, device=device, dtype=dtype), rand(1000, 17, device=device, dtype=dtype), None
    check(pco.gemm(a, b), a, b)
    c = rand(33, 1, device=device, dtype=dtype)  # a column of c broadcast along N
    check(pco.gemm(a, b, c, alpha=0.5, beta=2.0), a, b, c, 0.5, 2.0)


def test_large_magnitudes(device):
    torch.manual_seed(2)
    a, b = rand(64, 300, device=device, scale=1e4), rand(300, 40, device=device, scale=1e3)
    c = rand(64, 40, device=device)
    check(pco.gemm(a, b, c, alpha=-3.0, beta=1e6), a, b, c, -3.0, 1e6)


def test_beta_zero_never_reads_c(device):
    a, b = rand(9, 20, device=device), rand(20, 11, device=device)
    for fill in (float("nan"), float("inf")):
        c = torch.full((9, 11), fill, device=device)
        y = pco.gemm(a, b, c, alpha=2.0, beta=0.0)
        check(y, a, b, None, 2.0)  # asserts the result is finite
    with pytest.raises(ValueError, match="gemm: beta is 0.5 but c is None"):
        pco.gemm(a, b, None, beta=0.5)


def test_transposed_views_need_no_copy(device):
    a, b = rand(40, 30, device=device), rand(20, 30, device=device)
    check(pco.gemm(a, b.t()), a, b.t())  # b.t() is passed as b with transpose_b flipped
    check(pco.gemm(a.t(), a.t(), transpose_a=True), a.t(), a.t(), ta=True)  # a flag flipped back
    x, y = rand(40, 30, device=device)[:, ::2], rand(15, 60, device=device)[:, ::3]  # copied: no layout fits
    check(pco.gemm(x, y, alpha=0.5), x, y, alpha=0.5)


def test_new_alpha_beta_do_not_recompile(device):
    a, b, c = rand(8, 8, device=device), rand(8, 8, device=device), rand(8, 8, device=device)
    pco.gemm(a, b, c, alpha=1.0, beta=1.0)
    models = len(pco.gemm_kernel._models)
    for alpha, beta in ((2.5, -1.0), (-0.125, 3.0)):
        check(pco.gemm(a, b, c, alpha=alpha, beta=beta), a, b, c, alpha, beta)
    assert len(pco.gemm_kernel._models) == models


def test_alpha_beta_keep_their_precision(device):
    """The kernels read alpha and beta as float32. A float64 GEMM applies the ones float32
    would round itself (in float64, like torch.addmm); a float32 one refuses an alpha that
    overflows float32 (torch raises too), instead of returning inf."""
    torch.manual_seed(3)
    a, b = torch.randn(5, 7, dtype=torch.float64, device=device), torch.randn(7, 3, dtype=torch.float64, device=device)
    c = torch.randn(3, dtype=torch.float64, device=device)
    for alpha, beta in ((0.1, 0.0), (1 / 3, 0.7), (1e-50, 1.0), (1e40, 1e-3)):
        want = torch.addmm(c.expand(5, 3), a, b, alpha=alpha, beta=beta)
        for _ in range(3):  # a repeated call may replay from C++ (programs.py): the same result
            torch.testing.assert_close(pco.gemm(a, b, c, alpha, beta), want, rtol=1e-13, atol=0)
            batched = pco.gemm_batched(a[None], b[None], c, alpha, beta)
            torch.testing.assert_close(batched, want[None], rtol=1e-13, atol=0)
    x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
    want = 0.1 * torch.ones(5, 3, dtype=torch.float64, device=device) @ b.T
    for _ in range(3):  # the backward's program too
        (gx,) = torch.autograd.grad(pco.gemm(x, w, alpha=0.1).sum(), x)
        torch.testing.assert_close(gx, want, rtol=1e-13, atol=0)
    with pytest.raises(ValueError, match="alpha=1e\\+40 overflows float32"):
        pco.gemm(a.float(), b.float(), alpha=1e40)
    with pytest.raises(ValueError, match="beta=-1e\\+39 overflows float32"):
        pco.gemm(a.float(), b.float(), c.float(), beta=-1e39)


def test_empty_like_torch(device):
    a, b = rand(0, 5, device=device), rand(5, 3, device=device)
    assert pco.gemm(a, b).shape == (0, 3)
    c = rand(4, 3, device=device)
    y = pco.gemm(rand(4, 0, device=device), rand(0, 3, device=device), c, beta=2.0)  # K = 0
    torch.testing.assert_close(y, torch.addmm(c, rand(4, 0, device=device), rand(0, 3, device=device), beta=2.0))
    assert pco.gemm_batched(rand(0, 2, 3, device=device), rand(0, 3, 4, device=device)).shape == (0, 2, 4)


@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False)])
def test_batched(ta, tb, device):
    torch.manual_seed(3)
    a, b = rand(3, 17, 40, device=device), rand(3, 40, 9, device=device)
    bias = rand(9, device=device)  # broadcasts to (3, 17, 9)
    y = pco.gemm_batched(stored(a, ta), stored(b, tb), bias, alpha=0.75, beta=1.5, transpose_a=ta, transpose_b=tb)
    check(y, a, b, bias, 0.75, 1.5)
    c = rand(3, 17, 1, device=device)
    check(pco.gemm_batched(a, b, c, beta=-1.0), a, b, c, 1.0, -1.0)
    one = pco.gemm_batched(rand(1, 1, 1, device=device), rand(1, 1, 4097, device=device))
    assert one.shape == (1, 1, 4097)


def test_gradcheck_float64(device):
    torch.manual_seed(4)
    a = torch.randn(5, 7, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(7, 3, dtype=torch.float64, device=device, requires_grad=True)
    c = torch.randn(1, 3, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: pco.gemm(a, b, c, alpha=1.3, beta=0.7), (a, b, c))


@pytest.mark.parametrize("ta,tb", TRANSPOSES)
def test_backward_fp32_matches_torch(ta, tb, device):
    torch.manual_seed(5)
    a0, b0, c0 = rand(6, 11, device=device), rand(11, 4, device=device), rand(6, 1, device=device)
    a, b, c = (stored(a0, ta).requires_grad_(), stored(b0, tb).requires_grad_(), c0.clone().requires_grad_())
    g = rand(6, 4, device=device)
    pco.gemm(a, b, c, alpha=-0.5, beta=2.0, transpose_a=ta, transpose_b=tb).backward(g)
    ref = [t.detach().double().requires_grad_() for t in (a, b, c)]
    (-0.5 * op(ref[0], ta) @ op(ref[1], tb) + 2.0 * ref[2]).backward(g.double())
    for got, want in zip((a, b, c), ref, strict=True):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5)


def test_batched_backward(device):
    torch.manual_seed(6)
    a, b = rand(2, 5, 7, device=device).requires_grad_(), rand(2, 7, 3, device=device).requires_grad_()
    bias = rand(3, device=device).requires_grad_()
    pco.gemm_batched(a, b, bias, alpha=2.0, beta=1.0).sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (a, b, bias)]
    (2.0 * ref[0] @ ref[1] + ref[2]).sum().backward()
    for got, want in zip((a, b, bias), ref, strict=True):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5)


def test_opcheck(device):
    a, b, c = rand(4, 6, device=device), rand(6, 5, device=device), rand(1, 5, device=device)
    torch.library.opcheck(torch.ops.gpu_days.gemm.default, (a, b, c, 1.5, 0.5, False, False))
    torch.library.opcheck(
        torch.ops.gpu_days.gemm.default, (a.requires_grad_(), b.requires_grad_(), None, 1.0, 0.0, False, False)
    )
    a3, b3 = rand(2, 4, 6, device=device), rand(2, 6, 5, device=device)
    torch.library.opcheck(torch.ops.gpu_days.gemm_batched.default, (a3, b3, c, 2.0, 1.0, False, False))


def test_torch_compile_fullgraph(device):
    a, b, c = rand(8, 16, device=device), rand(16, 4, device=device), rand(4, device=device)
    fn = torch.compile(lambda a, b, c: torch.relu(pco.gemm(a, b, c, alpha=2.0, beta=1.0)), fullgraph=True)
    torch.testing.assert_close(fn(a, b, c), torch.relu(torch.addmm(c, a, b, alpha=2.0)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_mojogemm_matches_linear(bias, device):
    torch.manual_seed(7)
    linear = torch.nn.Linear(37, 23, bias=bias, device=device)
    layer = pco.MojoGEMM(37, 23, bias=bias, device=device)
    assert layer.use_mojo
    layer.load_state_dict(linear.state_dict())
    torch.nn.Linear(37, 23, bias=bias, device=device).load_state_dict(layer.state_dict())  # and back
    x = rand(2, 5, 37, device=device, scale=3.0)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    y = layer(x)
    torch.testing.assert_close(y, linear(x_ref), rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    linear(x_ref).backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad, linear.weight.grad, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(layer.bias.grad, linear.bias.grad, rtol=1e-5, atol=1e-5)
    assert "in_features=37, out_features=23" in repr(layer)


@pytest.mark.parametrize("cls", [pco.MojoGEMM, pco.MojoLinear])
def test_mojogemm_is_an_nn_linear_for_code_that_looks_for_one(cls):
    """A model's `_init_weights` (GPT-2's: `if isinstance(m, nn.Linear): normal_(0, 0.02)`)
    skipped a plain-Module MojoGEMM silently, and a bias=False layer kept `bias` as a plain
    attribute: a tensor assigned to it later was no parameter (not trained, not saved)."""
    model = torch.nn.Sequential(cls(64, 48), cls(48, 8, bias=False))
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.zeros_(m.weight)
    assert all(not layer.weight.any() for layer in model)
    no_bias = model[1]
    assert "bias" in no_bias._parameters and no_bias.bias is None
    with pytest.raises(TypeError):
        no_bias.bias = torch.zeros(8)  # as nn.Linear: a parameter slot, not an attribute
    assert repr(no_bias).startswith(f"{cls.__name__}(in_features=48, out_features=8, bias=False")


def test_seed_check_prints_mojo_enabled():
    """Issue #3's check, verbatim, in a fresh interpreter."""
    cmd = "from pytorch_custom_ops import MojoGEMM; layer = MojoGEMM(10, 10); print(f'Mojo enabled: {layer.use_mojo}')"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", cmd], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "Mojo enabled: True" in proc.stdout


def test_bad_inputs_raise_clear_errors():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with pytest.raises(ValueError, match=r"gemm: inner dimensions differ: op\(a\) is 3x4 and op\(b\) is 5x4"):
        pco.gemm(a, b, transpose_b=True)
    with pytest.raises(ValueError, match="gemm: 'a' must have rank 2"):
        pco.gemm(torch.randn(2, 3, 4), b)
    with pytest.raises(ValueError, match="gemm_batched: 'b' must have rank 3"):
        pco.gemm_batched(torch.randn(2, 3, 4), b)
    with pytest.raises(ValueError, match="gemm_batched: batch sizes differ"):
        pco.gemm_batched(torch.randn(2, 3, 4), torch.randn(3, 4, 5))
    with pytest.raises(TypeError, match="gemm: 'b' is torch.float64 but 'a' is torch.float32"):
        pco.gemm(a, b.double())
    with pytest.raises(TypeError, match="gemm: 'a' has dtype torch.int64"):
        pco.gemm(torch.ones(3, 4, dtype=torch.int64), b)
    with pytest.raises(ValueError, match=r"gemm: c of shape \(2, 5\) does not broadcast to the output \(3, 5\)"):
        pco.gemm(a, b, torch.randn(2, 5), beta=1.0)
    with pytest.raises(TypeError, match="gemm: 'a' must be a torch.Tensor"):
        pco.gemm([[1.0]], b)
    with pytest.raises(TypeError, match="gemm: alpha must be a real number"):
        pco.gemm(a, b, alpha="2")
    with pytest.raises(TypeError, match="gemm: transpose_a must be a bool"):
        pco.gemm(a, b, transpose_a=1)
    with pytest.raises(ValueError, match="gemm: device meta is not supported"):
        pco.gemm(a.to("meta"), b.to("meta"))
    with pytest.raises(ValueError, match="MojoGEMM: input of shape"):
        pco.MojoGEMM(5, 2)(torch.randn(3, 4))
    a.requires_grad_()  # the autograd path checks first, with the same messages
    with pytest.raises(ValueError, match="gemm: inner dimensions differ"):
        pco.gemm(a, b.t())


def test_the_kernels_index_math_emulated_in_numpy():
    # emulate_kernels.py ports each GPU kernel's thread -> element mapping, fragment
    # layouts and wgmma descriptors to numpy and checks them against A @ B (asserts inside)
    from days.day014 import emulate_kernels

    emulate_kernels.main()


# -- CUDA: every branch of the launch plan (pytorch_custom_ops/gemm_gpu.py) -------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
# (version, dtype, batch, m, n, k) -> the kernel the plan must pick. Sizes are tile tails
# in every dim (k too) unless a grid size is the point.
BRANCHES = [
    ("AUTO", BF16, None, 200, 264, 136, "pingpong 64x64 tma"),  # 6 square tiles: FEW_TILES, 20 of 64 x 64
    ("AUTO", BF16, None, 1160, 1160, 136, "tma 128x128"),  # 81 square tiles: more than half a round
    ("AUTO", FP16, None, 1160, 1160, 4104, "pingpong 128x128 tma"),  # the same, K >= 1024: ONE_ROUND_LONG_K
    ("AUTO", BF16, None, 1160, 1160, 1032, "pingpong 128x128 tma"),  # ... from its threshold (part 29)
    ("AUTO", BF16, None, 1160, 1160, 16392, "pingpong 128x128 tma"),  # K >= 16384: not split (ONE_ROUND_UNSPLIT_K)
    ("PINGPONG_TMA_128x128", FP16, 2, 1000, 520, 16392, "pingpong 128x128 tma"),  # 8 x 5 x 2 tiles, K past 2^14
    ("AUTO", FP16, None, 1536, 2816, 72, "coop 256x128 tma"),  # 6 x 22 = 132 wide tiles: version 4
    ("AUTO", BF16, 33, 200, 264, 72, "coop 128x192"),  # 132 tiles of 128 x 192 fill the grid (99 of 256 x 128)
    ("AUTO", BF16, None, 201, 135, 77, "mma 64 novec"),
    ("AUTO", FP16, None, 1601, 1601, 33, "mma 128 novec"),
    ("MMA_SYNC", BF16, None, 200, 264, 136, "mma 64 vec"),
    ("MMA_SYNC", FP16, None, 1600, 1608, 40, "mma 128 vec"),
    ("MMA_SYNC", BF16, 3, 40, 24, 16, "mma 64 vec"),
    ("WG_64x128", BF16, None, 200, 264, 136, "wgmma 64x128"),
    ("WG_128x128", FP16, None, 200, 264, 136, "wgmma 128x128"),
    ("WG_128x256", BF16, 2, 200, 264, 136, "wgmma 128x256"),
    ("TMA_128x128", FP16, 2, 200, 264, 136, "tma 128x128"),
    ("TMA_128x256", BF16, None, 200, 264, 136, "tma 128x256"),
    ("TMA_192x128", BF16, None, 1000, 1032, 200, "tma 192x128"),  # three consumers; tails in m, n, k
    ("TMA_192x128", FP16, 3, 520, 264, 4104, "tma 192x128"),  # a long K, batched
    ("AUTO", BF16, None, 3000, 1000, 2056, "tma 192x128"),  # 128 tiles of 192 x 128, one round
    # day 019's version 4: more tiles than blocks, so each block runs several (both consumers)
    ("PINGPONG_64x256", BF16, None, 1000, 1032, 200, "pingpong 64x256"),
    ("PINGPONG_128x128", FP16, 3, 520, 264, 136, "pingpong 128x128"),
    ("PINGPONG_64x256", FP16, None, 200, 264, 136, "pingpong 64x256"),
    ("PINGPONG_128x128", BF16, 40, 136, 136, 72, "pingpong 128x128"),  # 2 x 2 x 40 = 160 tiles
    ("MULTICAST_128x128", BF16, None, 1000, 1024, 200, "pingpong 128x128 cluster 2"),
    ("MULTICAST_128x128", FP16, 3, 520, 512, 136, "pingpong 128x128 cluster 2"),
    ("MULTICAST_128x128", BF16, 2, 200, 264, 136, "pingpong 128x128"),  # 3 tiles in n: no pairs
    ("COOP_128x256", BF16, None, 1000, 1032, 200, "coop 128x256"),
    ("COOP_128x256", FP16, 3, 520, 264, 136, "coop 128x256"),
    ("COOP_256x128", BF16, None, 1000, 1032, 200, "coop 256x128"),
    ("COOP_256x128", FP16, 3, 520, 264, 136, "coop 256x128"),
    # day 019, part 10: the epilogue stored by TMA from shared memory (tails clipped by TMA)
    ("COOP_TMA_256x128", BF16, None, 1000, 1032, 200, "coop 256x128 tma"),
    ("COOP_TMA_256x128", FP16, 3, 520, 264, 136, "coop 256x128 tma"),
    ("COOP_TMA_128x256", BF16, 2, 1000, 1032, 4104, "coop 128x256 tma"),
    ("COOP_TMA_128x256", FP16, None, 136, 72, 72, "coop 128x256 tma"),  # one tile, mostly outside
    ("PINGPONG_TMA_128x128", BF16, None, 1000, 1032, 200, "pingpong 128x128 tma"),  # the consumers take turns
    ("PINGPONG_TMA_128x128", FP16, 3, 520, 264, 136, "pingpong 128x128 tma"),
    ("PINGPONG_TMA_128x64", BF16, 5, 296, 64, 1032, "pingpong 128x64 tma"),  # attention's P V: 64 wide, a long K
    ("PINGPONG_TMA_128x64", FP16, None, 1000, 200, 200, "pingpong 128x64 tma"),  # tails in m, n, k
    ("AUTO", FP16, 300, 104, 120, 64, "pingpong 128x128 tma"),  # 300 tiles, K = 64: SHORT_K
    ("COOP_MULTICAST_256x128", BF16, None, 1000, 1024, 200, "coop 256x128 cluster 2"),
    ("COOP_MULTICAST_256x128", FP16, 3, 520, 512, 136, "coop 256x128 cluster 2"),
    ("COOP_MULTICAST_256x128", BF16, 2, 200, 264, 136, "coop 256x128"),  # 3 tiles in n: no pairs
    ("COOP_256x192", BF16, None, 1000, 1032, 200, "coop 256x192"),  # 1032 = 5 x 192 + 72
    ("COOP_256x192", FP16, 3, 520, 264, 136, "coop 256x192"),
    ("COOP_128x192", BF16, None, 1000, 1032, 200, "coop 128x192"),  # 8 x 6 tiles, tails in m, n, k
    ("COOP_128x192", FP16, 2, 136, 392, 4104, "coop 128x192"),  # a long K, 2 x 3 tiles per batch
    ("AUTO", FP16, None, 8000, 768, 72, "coop 256x192"),  # 128 tiles of 256x192: one round
    ("AUTO", BF16, 200, 120, 128, 72, "pingpong 128x128 tma"),  # 200 tiles, K = 72: ping-pong (SHORT_K)
    ("AUTO", FP16, 7, 296, 40, 520, "pingpong 128x64 tma"),  # at most 64 wide (NARROW_TILE)
    ("COOP_256x64", BF16, None, 1000, 200, 200, "coop 256x64"),  # 4 x 4 tiles, tails in m, n, k
    ("COOP_256x64", FP16, 5, 296, 64, 1032, "coop 256x64"),  # attention's P V: 64 wide, a long K
    ("PINGPONG_128x64", BF16, 3, 200, 136, 72, "pingpong 128x64"),
    ("PINGPONG_128x64", FP16, None, 1000, 64, 520, "pingpong 128x64"),
    ("PINGPONG_64x64", BF16, None, 64, 776, 1032, "pingpong 64x64"),  # a few tokens, 13 tiles, tail in n
    ("PINGPONG_64x64", FP16, 3, 200, 136, 72, "pingpong 64x64"),  # 4 x 3 x 3 tiles, tails in m, n, k
    ("PINGPONG_TMA_64x64", BF16, None, 40, 2312, 776, "pingpong 64x64 tma"),  # 37 tiles, tails everywhere
    ("PINGPONG_TMA_64x64", FP16, 2, 1000, 520, 200, "pingpong 64x64 tma"),  # 16 x 9 x 2 = 288 tiles, both consumers
    # day 019, part 3: stream-K; tiles split among blocks in 1 to 22 pieces, tails in m, n, k
    ("STREAMK_256x128", BF16, None, 1000, 1032, 200, "streamk 256x128"),  # 36 tiles x 4 k-steps
    ("STREAMK_256x128", FP16, 3, 520, 264, 136, "streamk 256x128"),  # 27 tiles x 3: a block each
    ("STREAMK_256x128", BF16, None, 296, 264, 4104, "streamk 256x128"),  # 6 tiles x 65 k-steps
    ("SPLITK_256x128", FP16, None, 296, 264, 4104, "splitk 256x128"),  # 6 tiles x 22 pieces
    ("AUTO", BF16, None, 776, 520, 16392, "clustersplit 128x128 cluster 3"),  # a dW's shape: 35 tiles, 105 CTAs
    # day 019, part 28: split-K in a cluster; tails in m, n, k, uneven shares of the k-steps
    ("CLUSTER_SPLITK_128x128", BF16, None, 296, 264, 4104, "clustersplit 128x128 cluster 4"),  # 9 tiles
    ("CLUSTER_SPLITK_128x128", FP16, 3, 200, 136, 2056, "clustersplit 128x128 cluster 4"),  # 2 x 2 x 3 tiles
    ("CLUSTER_SPLITK_128x128", BF16, None, 520, 776, 4104, "clustersplit 128x128 cluster 3"),  # 5 x 7 tiles
    ("CLUSTER_SPLITK_128x128", FP16, None, 904, 776, 1032, "clustersplit 128x128 cluster 2"),  # 56 tiles
    ("AUTO", BF16, None, 776, 776, 8200, "clustersplit 128x128 cluster 2"),  # a dW's shape: 49 tiles
    # float32: 3xTF32 (day 019, part 9) where it fits (N even) and its cost model says so
    ("TF32X3_128x128", FP32, None, 300, 200, 136, "tf32x3 128x128"),
    ("TF32X3_128x128", FP32, 3, 301, 202, 37, "tf32x3 128x128"),  # K = 37: the planes' rows padded to 40
    ("TF32X3_128x128", FP32, None, 1000, 1032, 200, "tf32x3 128x128"),
    ("TF32X3_128x128", FP32, 2, 136, 392, 4103, "tf32x3 128x128"),  # a long, odd K
    ("AUTO", FP32, None, 2056, 2056, 1032, "tf32x3 128x128"),
    ("AUTO", FP32, None, 300, 200, 136, "simt 64 vec"),  # 6 tiles: the SIMT kernel
    ("SIMT", FP32, None, 2056, 2056, 1032, "simt 128 vec"),
    ("SIMT", FP32, None, 1600, 1604, 24, "simt 128 vec"),
    ("SIMT", FP32, 5, 1296, 64, 1032, "simt 64 vec"),  # attention's P V: 64 wide, 64 x 64 tiles
    ("AUTO", FP32, 2, 301, 199, 37, "simt 64 novec"),
    ("AUTO", FP32, None, 1601, 1601, 17, "simt 128 novec"),
    ("AUTO", FP64, None, 300, 200, 136, "simt 64 vec"),
    ("AUTO", FP64, None, 301, 199, 37, "simt 64 novec"),
]


def _planned(a, b, c, ta, tb):
    """What the launch plan picks for these tensors (days/day014/test_day014_launch_plan.py names it)."""
    from days.day014.test_day014_launch_plan import choice
    from pytorch_custom_ops.gemm_gpu import TF32_SPLIT_KERNEL, gemm_gpu

    out = torch.empty(0, dtype=a.dtype, device=a.device)  # only its data_ptr is read: aligned
    params = {"TRANSPOSE_A": ta, "TRANSPOSE_B": tb}
    launches = gemm_gpu([out], [a, b, c, torch.empty(2, device=a.device)], params)
    return choice(launches[2] if launches[0].kernel.family is TF32_SPLIT_KERNEL else launches[0])


@needs_cuda
@pytest.mark.parametrize("ta,tb", TRANSPOSES)
@pytest.mark.parametrize("version,dtype,batch,m,n,k,want", BRANCHES, ids=lambda v: str(v).removeprefix("torch."))
def test_cuda_every_kernel_branch(version, dtype, batch, m, n, k, want, ta, tb):
    torch.manual_seed(m + n + k)
    lead = () if batch is None else (batch,)
    a, b = rand(*lead, m, k, device="cuda", dtype=dtype), rand(*lead, k, n, device="cuda", dtype=dtype)
    c = rand(*lead, m, n, device="cuda", dtype=dtype) if ta else rand(n, device="cuda", dtype=dtype)
    sa, sb = stored(a, ta), stored(b, tb)
    fn = pco.gemm_batched if batch else pco.gemm
    with pco.gemm_version(version):
        # the sizes are alignment-neutral: every transpose pair takes the same branch
        assert _planned(sa, sb, c.reshape((1,) * (len(lead) + 2 - c.dim()) + c.shape), ta, tb) == want
        y = fn(sa, sb, c, alpha=1.25, beta=-0.75, transpose_a=ta, transpose_b=tb)
        check(y, a, b, c, 1.25, -0.75)
        nan_c = torch.full_like(c, float("nan"))  # beta == 0: c is never read, in any kernel
        check(fn(sa, sb, nan_c, alpha=0.5, beta=0.0, transpose_a=ta, transpose_b=tb), a, b, None, 0.5)
        # c's pairs by 4-byte loads only where rows are contiguous and 4-byte aligned: an
        # odd element offset, and column-major rows, take the 2-byte loads
        flat = torch.empty(c.numel() + 1, device="cuda", dtype=dtype)
        odd = flat[1:].view_as(c).copy_(c)
        check(fn(sa, sb, odd, alpha=1.25, beta=-0.75, transpose_a=ta, transpose_b=tb), a, b, c, 1.25, -0.75)
        if c.dim() >= 2:
            cols = c.mT.contiguous().mT  # column-major
            check(fn(sa, sb, cols, alpha=1.25, beta=-0.75, transpose_a=ta, transpose_b=tb), a, b, c, 1.25, -0.75)


@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_cuda_k_zero_through_the_kernel(dtype):
    # the public op answers K == 0 without a kernel; the MojoOp itself runs the kernel
    # with an empty k loop (mma.sync / SIMT: TMA cannot map a zero-size dim)
    from pytorch_custom_ops.gemm import _KERNELS, _alpha_beta

    a, b = torch.empty(40, 0, dtype=dtype, device="cuda"), torch.empty(0, 24, dtype=dtype, device="cuda")
    c = rand(1, 24, device="cuda", dtype=dtype)
    (y,) = _KERNELS[(False, False, False)]([a, b, c, _alpha_beta(2.0, -1.5, a.device)])
    torch.testing.assert_close(y, (-1.5 * c.float()).expand(40, 24).to(dtype))


@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_cuda_gpt2_linear_forward_and_backward(dtype):
    torch.manual_seed(8)
    layer = pco.MojoGEMM(768, 2304, device="cuda", dtype=dtype)
    x = rand(2, 65, 768, device="cuda", dtype=dtype).requires_grad_()  # 130 tokens: tails
    y = layer(x)
    g = rand(*y.shape, device="cuda", dtype=dtype)
    y.backward(g)
    w, bias, x2, g2 = layer.weight.detach(), layer.bias.detach(), x.detach().reshape(-1, 768), g.reshape(-1, 2304)
    check(y.reshape(-1, 2304), x2, w, bias, tb=True, beta=1.0)
    check(x.grad.reshape(-1, 768), g2, w)
    check(layer.weight.grad, g2, x2, ta=True)


@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, FP32])  # bf16: the TMA kernel, its tensor maps encoded while capturing
def test_cuda_graph_capture_with_new_alpha_beta(dtype):
    # an (alpha, beta) first seen while capturing is written by kernels the graph records
    a, b = rand(64, 72, device="cuda", dtype=dtype), rand(72, 40, device="cuda", dtype=dtype)
    c = rand(64, 40, device="cuda", dtype=dtype)
    pco.gemm(a, b)  # warm-up (loads the kernel)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = pco.gemm(a, b, c, alpha=0.3125, beta=-2.75)
    a.copy_(rand(64, 72, device="cuda", dtype=dtype))
    graph.replay()
    torch.cuda.synchronize()
    check(y, a, b, c, 0.3125, -2.75)


@needs_cuda
@pytest.mark.parametrize(
    "m,n,k,c_shape", [(776, 768, 8192, (776, 768)), (300, 1028, 4096, (1028,)), (124, 36, 2048, (124, 1))]
)
def test_cuda_fp32_weight_gradient_split_k(m, n, k, c_shape):
    # few output tiles and a long K, both operands along K in memory (A read transposed):
    # pieces of K through the SIMT kernel, then day 019's sum kernel (alpha, beta, c)
    from pytorch_custom_ops.gemm_gpu import simt_split_k, sm_count

    assert simt_split_k(m, n, k, sm_count(0)) > 1
    torch.manual_seed(m + n)
    a, b = rand(m, k, device="cuda"), rand(k, n, device="cuda")
    c = rand(*c_shape, device="cuda")
    sa = stored(a, True)
    for version, want in (("SIMT", "simt 128 vec"), ("TF32X3_128x128", "tf32x3 128x128")):
        with pco.gemm_version(version):
            assert _planned(sa, b, c.reshape((1,) * (2 - c.dim()) + c.shape), True, False) == want
            check(pco.gemm(sa, b, c, alpha=0.75, beta=-1.5, transpose_a=True), a, b, c, 0.75, -1.5)
            nan_c = torch.full_like(c, float("nan"))  # beta == 0: c is never read
            check(pco.gemm(sa, b, nan_c, alpha=2.0, beta=0.0, transpose_a=True), a, b, None, 2.0)


@needs_cuda
@pytest.mark.parametrize("ta,tb", TRANSPOSES)
@pytest.mark.parametrize(
    "m,n,k,c_shape", [(64, 768, 3072, (768,)), (40, 200, 1000, (40, 200)), (52, 100, 2048, (52, 1))]
)
def test_cuda_fp32_few_tokens_split_k(m, n, k, c_shape, ta, tb):
    # a linear layer at a few dozen tokens: fewer 64 x 64 tiles than SMs and a long K, so
    # K splits into pieces read inside the whole operands' rows (1000 / 10 = 100: each
    # piece ends in a partial k-step); day 019's sum kernel applies alpha, beta and c
    from pytorch_custom_ops.gemm_gpu import float_kernel, sm_count

    assert float_kernel(m, n, k, 1, ta, tb, True, torch.float32, sm_count(0), False)[1] > 1
    torch.manual_seed(m + n + k)
    a, b = rand(m, k, device="cuda"), rand(k, n, device="cuda")
    c = rand(*c_shape, device="cuda")
    sa, sb = stored(a, ta), stored(b, tb)
    with pco.gemm_version("SIMT"):
        check(pco.gemm(sa, sb, c, alpha=0.75, beta=-1.5, transpose_a=ta, transpose_b=tb), a, b, c, 0.75, -1.5)
        nan_c = torch.full_like(c, float("nan"))  # beta == 0: c is never read
        check(pco.gemm(sa, sb, nan_c, alpha=2.0, beta=0.0, transpose_a=ta, transpose_b=tb), a, b, None, 2.0)
    y = pco.gemm(sa, sb, c, alpha=0.75, beta=-1.5, transpose_a=ta, transpose_b=tb)  # AUTO
    check(y, a, b, c, 0.75, -1.5)


@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("ta,tb", TRANSPOSES)
@pytest.mark.parametrize(
    "m,n,k,pieces,c_shape", [(64, 768, 3072, 16, (768,)), (40, 200, 1000, 5, (40, 200)), (136, 72, 2048, 8, (136, 1))]
)
def test_cuda_16_bit_few_tokens_split_k(m, n, k, pieces, c_shape, ta, tb, dtype):
    # day 019: K in pieces on version 3's 128 x 64 tiles (strided tensor maps, float32
    # pieces), then the sum kernel; 1000 / 5 = 200: each piece ends in a partial k-step
    from pytorch_custom_ops.gemm_gpu import split_pieces

    torch.manual_seed(m + n + k)
    a, b = rand(m, k, device="cuda", dtype=dtype), rand(k, n, device="cuda", dtype=dtype)
    c = rand(*c_shape, device="cuda", dtype=dtype)
    sa, sb = stored(a, ta), stored(b, tb)
    with split_pieces(pieces):
        assert _planned(sa, sb, c.reshape((1,) * (2 - c.dim()) + c.shape), ta, tb) == "tma 128x64"
        check(pco.gemm(sa, sb, c, alpha=0.75, beta=-1.5, transpose_a=ta, transpose_b=tb), a, b, c, 0.75, -1.5)
        nan_c = torch.full_like(c, float("nan"))  # beta == 0: c is never read
        check(pco.gemm(sa, sb, nan_c, alpha=2.0, beta=0.0, transpose_a=ta, transpose_b=tb), a, b, None, 2.0)


@needs_cuda
@pytest.mark.parametrize("ta,tb", TRANSPOSES)
@pytest.mark.parametrize("m,n,k", [(4096, 1024, 4096), (768, 2304, 8192), (257, 130, 20000)])
def test_cuda_3xtf32_is_as_accurate_as_float32(m, n, k, ta, tb):
    # 3xTF32 drops lo*lo (~2^-22 of a product) and sums in the tensor cores between
    # promotions: its error against float64 must stay within a small factor of cuBLAS's
    # IEEE float32 (torch.mm, allow_tf32 off), never near tf32's own ~1e-3
    torch.manual_seed(m + k)
    a, b = rand(m, k, device="cuda"), rand(k, n, device="cuda")
    sa, sb = stored(a, ta), stored(b, tb)
    want = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    with pco.gemm_version("TF32X3_128x128"):
        assert _planned(sa, sb, torch.zeros(1, 1, device="cuda"), ta, tb) == "tf32x3 128x128"
        y = pco.gemm(sa, sb, transpose_a=ta, transpose_b=tb)
    ours = ((y.double() - want).abs() / scale).max().item()
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        theirs = ((a @ b).double() - want).abs().div(scale).max().item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    print(f"max |error| / (|a| @ |b|): 3xTF32 {ours:.2e}, cuBLAS float32 {theirs:.2e}")
    assert ours <= max(4 * theirs, 5e-7)


@needs_cuda
def test_cuda_3xtf32_special_values():
    # an inf or a NaN in an operand makes its row / column of the output non-finite (as in
    # float32, though an inf comes out as NaN: lo = inf - inf); large and small magnitudes
    # keep 3xTF32's accuracy while the lo products stay normal (above ~1e-38)
    a, b = rand(64, 96, device="cuda"), rand(96, 128, device="cuda")
    assert _planned(a, b, torch.zeros(1, 1, device="cuda"), False, False).startswith("simt")  # one tile
    with pco.gemm_version("TF32X3_128x128"):
        _check_special_values(a, b)


def _check_special_values(a, b):
    a[3, 5] = float("inf")
    b[7, 9] = float("nan")
    y = pco.gemm(a, b)
    assert not torch.isfinite(y[3]).any() and not torch.isfinite(y[:, 9]).any()
    finite = torch.ones_like(y, dtype=torch.bool)
    finite[3], finite[:, 9] = False, False
    assert torch.isfinite(y[finite]).all()
    for sa, sb in ((1e18, 1e17), (1e-16, 1e-16)):  # products of 1e35 and of 1e-32
        big_a, big_b = rand(64, 96, device="cuda", scale=sa), rand(96, 128, device="cuda", scale=sb)
        check(pco.gemm(big_a, big_b), big_a, big_b)
