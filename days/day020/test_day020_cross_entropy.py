"""The fused cross-entropy op against float64 and F.cross_entropy (CPU through MAX; CUDA
through the direct launch path when a GPU is present), its launch plan on CPU tensors,
and its errors."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco
from pytorch_custom_ops.cross_entropy import (
    SMALL_ROW,
    _torch_forward,
    cross_entropy_backward_kernel,
    cross_entropy_kernel,
    cross_entropy_with_grad_kernel,
    scale_launch,
    scale_unless_one_,
    sum_rows_launch,
    target_stats_launch,
)

ce_module = importlib.import_module("pytorch_custom_ops.cross_entropy")  # not the function of that name

DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.float64, 1e-14, 1e-14), (torch.bfloat16, 1e-2, 1e-2)]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def reference(logits, targets, ignore_index, reduction, grad_out):
    """float64 loss and gradient of the logits."""
    x = logits.detach().double().requires_grad_()
    loss = F.cross_entropy(x, targets, ignore_index=ignore_index, reduction=reduction)
    loss.backward(grad_out.double())
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype, loss_tol, grad_tol", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("rows, cols", [(1, 2), (13, 301), (5, 1000), (3, 9000)])
def test_loss_and_grad_match_float64(device, dtype, loss_tol, grad_tol, reduction, rows, cols):
    g = torch.Generator().manual_seed(rows * 7 + cols)
    logits = (torch.randn(rows, cols, generator=g) * 4).to(dtype).to(device)
    targets = torch.randint(0, cols, (rows,), generator=g).to(device)
    if rows > 2:
        targets[1] = -100  # one ignored row
    x = logits.clone().requires_grad_()
    loss = pco.cross_entropy(x, targets, reduction=reduction)
    assert loss.dtype == dtype and loss.shape == ((rows,) if reduction == "none" else ())
    grad_out = torch.randn(loss.shape, generator=g).to(device)
    loss.backward(grad_out.to(dtype))
    ref_loss, ref_grad = reference(logits, targets, -100, reduction, grad_out.to(dtype))
    assert rel(loss.detach(), ref_loss) < loss_tol
    assert rel(x.grad, ref_grad) < grad_tol
    if rows > 2:
        assert torch.all(x.grad[1] == 0)
    with torch.no_grad():  # the loss-only kernel
        assert rel(pco.cross_entropy(logits, targets, reduction=reduction), ref_loss) < loss_tol


@pytest.mark.parametrize("dtype, loss_tol, grad_tol", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_one_pass_gradient_for_loss_backward(device, dtype, loss_tol, grad_tol, reduction):
    """loss.backward() (grad_loss = 1): the forward wrote the gradient and the backward
    hands it over unscaled; a second backward through the same graph recomputes it."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(7, 515, generator=g) * 3).to(dtype).to(device)
    targets = torch.randint(0, 515, (7,), generator=g).to(device)
    targets[2] = -100
    x = logits.clone().requires_grad_()
    loss = pco.cross_entropy(x, targets, reduction=reduction)
    assert loss.grad_fn.name() == "CrossEntropyWithGradBackward"
    loss.backward(retain_graph=True)
    ref_loss, ref_grad = reference(logits, targets, -100, reduction, torch.ones((), dtype=dtype))
    assert rel(loss.detach(), ref_loss) < loss_tol
    assert rel(x.grad, ref_grad) < grad_tol
    first = x.grad.clone()
    (loss * 3).backward()  # the two-pass way now: the one-pass gradient was handed over
    assert rel(x.grad, 4 * first) < grad_tol
    assert torch.all(x.grad[2] == 0)


def test_the_one_pass_gradient_is_scaled_in_place():
    data = torch.randn(10, dtype=torch.bfloat16)
    before = data.clone()
    scale_unless_one_(data, torch.ones(1, dtype=torch.float64))
    assert torch.equal(data, before)
    scale_unless_one_(data, torch.tensor([-2.5], dtype=torch.float64))
    torch.testing.assert_close(data, before * -2.5)


def test_a_custom_ignore_index_and_every_row_ignored(device):
    logits = torch.randn(6, 50, device=device)
    targets = torch.tensor([3, 7, 7, 0, 49, 7], device=device)
    torch.testing.assert_close(
        pco.cross_entropy(logits, targets, ignore_index=7), F.cross_entropy(logits, targets, ignore_index=7)
    )
    none_counted = torch.full((6,), 7, device=device)
    assert math.isnan(pco.cross_entropy(logits, none_counted, ignore_index=7).item())  # 0 / 0, as torch
    assert math.isnan(F.cross_entropy(logits, none_counted, ignore_index=7).item())
    assert pco.cross_entropy(logits, none_counted, ignore_index=7, reduction="sum").item() == 0


def test_a_numpy_ignore_index_like_torch(device):
    np = pytest.importorskip("numpy")
    x, t = torch.randn(4, 6, device=device), torch.tensor([0, 1, 2, 3], device=device)
    torch.testing.assert_close(pco.cross_entropy(x, t, ignore_index=np.int64(2)), F.cross_entropy(x, t, ignore_index=2))


def test_large_logits_are_stable_and_nan_propagates(device):
    logits = torch.tensor([[1e4, -1e4, 0.0], [-3e4, -3e4 + 1.0, -3e4], [0.0, float("nan"), 1.0]], device=device)
    targets = torch.tensor([0, 1, 2], device=device)
    ours = pco.cross_entropy(logits, targets, reduction="none")
    ref = F.cross_entropy(logits.double(), targets, reduction="none")
    torch.testing.assert_close(ours[:2].double(), ref[:2], rtol=1e-5, atol=1e-5)  # float32 math
    assert math.isnan(ours[2].item())


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_rows_without_a_finite_max_give_nan_like_torch(device, reduction):
    """A row holding NaN or +inf, or only -inf: torch's loss and that row's gradient are
    NaN. Ours gave +inf gradients (Mojo's exp(NaN) is +inf) and, for a +inf logit, a +inf
    loss; the other rows stay finite."""
    inf, nan = float("inf"), float("nan")
    logits = torch.randn(5, 6, device=device)
    logits[0, 3], logits[1, 2], logits[2] = nan, inf, -inf
    targets = torch.tensor([0, 0, 1, 4, 5], device=device)
    x, xr = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours, ref = pco.cross_entropy(x, targets, reduction=reduction), F.cross_entropy(xr, targets, reduction=reduction)
    ours.sum().backward()
    ref.sum().backward()
    assert torch.equal(torch.isnan(ours), torch.isnan(ref))
    assert torch.equal(torch.isnan(x.grad), torch.isnan(xr.grad))
    assert not torch.isinf(x.grad).any() and not torch.isinf(ours).any()
    if reduction == "none":
        torch.testing.assert_close(ours[3:], ref[3:])
        torch.testing.assert_close(x.grad[3:], xr.grad[3:])


def test_gradcheck(device):
    x = torch.randn(4, 9, dtype=torch.float64, device=device, requires_grad=True)
    t = torch.tensor([0, 8, -100, 3], device=device)
    for reduction in ("mean", "sum", "none"):
        assert torch.autograd.gradcheck(lambda x, r=reduction: pco.cross_entropy(x, t, reduction=r), (x,))
        # create_graph=True (double backward) takes torch's differentiable formula
        assert torch.autograd.gradgradcheck(lambda x, r=reduction: pco.cross_entropy(x, t, reduction=r), (x,))


def test_opcheck_and_compile(device):
    x = torch.randn(5, 33, device=device, requires_grad=True)
    t = torch.randint(0, 33, (5,), device=device)
    torch.library.opcheck(torch.ops.gpu_days.cross_entropy, (x, t, -100, "mean"))
    torch.library.opcheck(torch.ops.gpu_days.cross_entropy, (x.detach(), t, -100, "none"))
    _, lse, _ = torch.ops.gpu_days.cross_entropy(x.detach(), t, -100, "none")
    for n in (1, 5):  # one factor (mean, sum), one per row (none)
        factor = torch.rand(n, dtype=torch.float64, device=device)
        torch.library.opcheck(torch.ops.gpu_days.cross_entropy_backward, (x.detach(), t, lse, factor, -100))
    compiled = torch.compile(lambda x, t: pco.cross_entropy(x, t), fullgraph=True)
    loss = compiled(x, t)
    loss.backward()
    torch.testing.assert_close(loss, F.cross_entropy(x, t))
    ref = x.detach().clone().requires_grad_()
    F.cross_entropy(ref, t).backward()
    torch.testing.assert_close(x.grad, ref.grad)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda x, t: pco.cross_entropy(x[0], t), ValueError, r"logits must be \(N, C\)"),
        (lambda x, t: pco.cross_entropy(x, t.int()), TypeError, "int64 class indices"),
        (lambda x, t: pco.cross_entropy(x, t[:2]), ValueError, r"targets must be \(3,\)"),
        (lambda x, t: pco.cross_entropy(x, t, reduction="avg"), ValueError, "reduction must be one of"),
        (lambda x, t: pco.cross_entropy(x, t, ignore_index=1.5), TypeError, "ignore_index must be an int"),
        (lambda x, t: pco.cross_entropy(x, t, ignore_index=2**70), ValueError, "outside int64's range"),
        (lambda x, t: pco.cross_entropy(x.int(), t), TypeError, "not supported"),
        (lambda x, t: pco.cross_entropy(x, t + 10), ValueError, "target 1[0-9] is out of range for 10 classes"),
        (lambda x, t: pco.cross_entropy(x, t - 10), ValueError, "target -[0-9]+ is out of range"),
    ],
)
def test_bad_inputs_are_named(device, call, error, message):
    x = torch.randn(3, 10, device=device)
    t = torch.tensor([1, 2, 3], device=device)
    with pytest.raises(error, match=message):
        call(x, t)
    with pytest.raises(error, match=message):
        call(x.requires_grad_(), t)  # the autograd route checks the same
    # CUDA checks the targets behind the kernels (they only make NaNs of a bad target): the
    # stream and the process are fine afterwards
    torch.testing.assert_close(pco.cross_entropy(x, t), F.cross_entropy(x, t))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("small", [True, False])
def test_cuda_bad_targets_both_ways(monkeypatch, small):
    """target_stats_kernel's count (small) and torch's ops find the same bad targets;
    ignore_index itself is not one, and the first bad target is named."""
    monkeypatch.setattr(ce_module, "SMALL_KERNELS", small)
    x = torch.randn(2000, 10, device="cuda", requires_grad=True)
    t = torch.randint(0, 10, (2000,), device="cuda")
    t[::3] = -1
    torch.testing.assert_close(pco.cross_entropy(x, t, ignore_index=-1), F.cross_entropy(x, t, ignore_index=-1))
    t[1500], t[1700] = 10, -7
    for reduction in ("mean", "sum", "none"):
        with pytest.raises(ValueError, match="target 10 is out of range for 10 classes"):
            pco.cross_entropy(x, t, ignore_index=-1, reduction=reduction)


def test_the_torch_fallback_reads_no_column_out_of_range():
    """The fallback may run before the deferred check raises: a bad target reads column 0."""
    x = torch.randn(3, 10)
    rows, lse = _torch_forward(x, torch.tensor([1, 10, -5]), -100)
    assert torch.isfinite(rows).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("cols", [256, 1001, 50304, 128256])
def test_plans_on_cpu_tensors(dtype, cols):
    """What the CUDA launches would be, from CPU tensors: a block per row, 16-byte vectors
    when rows allow, no shared-memory row cache; the backward's factor is one value
    (stride 0) or one per row (stride 1)."""
    rows = 3
    logits = torch.empty(rows, cols, dtype=dtype)
    targets = torch.zeros(rows, dtype=torch.int64)
    per_row = [torch.empty(rows, dtype=torch.float64) for _ in range(2)]
    params = {"IGNORE_INDEX": -100}
    vec = 16 // dtype.itemsize
    block = 256 if cols <= SMALL_ROW else 1024
    w = vec if cols % vec == 0 else 1
    (fwd,) = cross_entropy_kernel.gpu(per_row, [logits, targets], params)
    assert fwd.kernel.params == (dtype, w, 256)  # the forward: 256 threads at any width (measured)
    assert fwd.grid == rows and fwd.block == 256 and fwd.smem == 0
    assert fwd.args[4:] == (cols, -100)
    for factors, stride in ((1, 0), (rows, 1)):
        inputs = [logits, targets, per_row[1], torch.ones(factors, dtype=torch.float64)]
        (bwd,) = cross_entropy_backward_kernel.gpu([torch.empty_like(logits)], inputs, params)
        assert bwd.kernel.params == (dtype, w, block) and (bwd.grid, bwd.block, bwd.smem) == (rows, block, 0)
        assert bwd.args[5:] == (stride, cols, -100)
    with pytest.raises(ValueError, match="2 factors for 3 rows"):
        inputs = [logits, targets, per_row[1], torch.ones(2, dtype=torch.float64)]
        cross_entropy_backward_kernel.gpu([torch.empty_like(logits)], inputs, params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("cols", [1001, 32000, 50304, 128256])
def test_the_one_pass_plan_caches_what_fits(dtype, cols):
    """A row of up to 112 KB whole in the shared memory of a 512-thread block (two
    blocks per SM); a longer one with 1024 threads, 200 KB of it cached, the rest read
    again; one factor for the whole batch."""
    rows = 3
    logits = torch.empty(rows, cols, dtype=dtype)
    targets = torch.zeros(rows, dtype=torch.int64)
    outs = [torch.empty(rows, dtype=torch.float64) for _ in range(2)] + [torch.empty_like(logits)]
    (launch,) = cross_entropy_with_grad_kernel.gpu(
        outs, [logits, targets, torch.ones(1, dtype=torch.float64)], {"IGNORE_INDEX": -5}
    )
    vec = 16 // dtype.itemsize
    w = vec if cols % vec == 0 else 1
    cached = launch.args[-1]
    whole = cols * dtype.itemsize <= 112 * 1024
    block = 512 if whole else 1024
    assert launch.kernel.params == (dtype, w, block) and (launch.grid, launch.block) == (rows, block)
    assert launch.args[6:8] == (cols, -5)
    assert launch.smem == cached * dtype.itemsize <= 200 * 1024 and cached % w == 0
    assert cached == min(cols, 200 * 1024 // dtype.itemsize)


@pytest.mark.parametrize(
    "count, dtype, w, grid, factor_dtype",
    [
        (8 * 1024, torch.bfloat16, 8, 4, torch.bfloat16),
        (8 * 1024, torch.bfloat16, 8, 4, torch.float32),  # autocast's float32 loss
        (7, torch.float32, 1, 1, torch.float32),
        (10**8, torch.float32, 4, 1056, torch.float32),
    ],
)
def test_the_scale_launch(count, dtype, w, grid, factor_dtype):
    data = torch.empty(count, dtype=dtype)
    launch = scale_launch(data, torch.ones(1, dtype=factor_dtype))  # a CPU tensor: the H100's 132 SMs
    assert launch.kernel.params == (dtype, w, 256, factor_dtype) and (launch.grid, launch.block) == (grid, 256)
    assert launch.args[2] == count


def test_the_small_launches():
    """The targets' pass and the sum of the rows: one block each, arguments in the
    kernels' order."""
    targets = torch.zeros(8193, dtype=torch.int64)
    scale, bad = torch.empty(1, dtype=torch.float64), torch.empty(1, dtype=torch.int64)
    stats = target_stats_launch(scale, bad, targets, 50304, -100, True)
    assert (stats.grid, stats.block) == (1, 1024)
    assert stats.args[3:] == (8193, 50304, -100, 1)
    assert stats.args[:3] == (scale.data_ptr(), bad.data_ptr(), targets.data_ptr())
    rows, loss = torch.empty(8193, dtype=torch.float64), torch.empty((), dtype=torch.bfloat16)
    total = sum_rows_launch(loss, rows, scale)
    assert total.kernel.params == (torch.bfloat16, 1024) and (total.grid, total.block) == (1, 1024)
    assert total.args == (loss.data_ptr(), rows.data_ptr(), scale.data_ptr(), 8193)


# on CUDA a mean or sum with autograd: the targets' pass, the one-pass kernel, the rows' sum
SMALL_AND_ONE_PASS = ["target_stats_kernel", "cross_entropy_with_grad_kernel", "sum_rows_kernel"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 31, 1024, 1025, 8193])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cuda_small_kernels_count_check_and_sum(rows, dtype):
    """target_stats_kernel's count and bad targets, and sum_rows_kernel's mean, against
    torch, for row counts around the block's 1024 threads."""
    g = torch.Generator().manual_seed(rows)
    classes = 1000
    targets = torch.randint(0, classes, (rows,), generator=g)
    targets[torch.rand(rows, generator=g) < 0.2] = -1
    wrong = torch.rand(rows, generator=g) < 0.05
    targets[wrong] = torch.where(torch.rand(rows, generator=g) < 0.5, -5, classes)[wrong]
    targets = targets.cuda()
    per_row = (torch.rand(rows, generator=g, dtype=torch.float64) * 9).cuda()
    for mean in (True, False):
        scale = torch.full((1,), 7.0, dtype=torch.float64, device="cuda")
        bad = torch.full((1,), 99, dtype=torch.int64, device="cuda")
        loss = torch.full((), 7.0, dtype=dtype, device="cuda")
        launches = [target_stats_launch(scale, bad, targets, classes, -1, mean), sum_rows_launch(loss, per_row, scale)]
        ce_module.direct.run(launches, 0)
        counted = (targets != -1).sum().item()
        out_of_range = ((targets != -1) & ((targets < 0) | (targets >= classes))).sum().item()
        assert bad.item() == out_of_range
        assert scale.item() == ((1 / counted if counted else math.inf) if mean else 1.0)
        expected = per_row.sum() * scale[0]  # float64, cast once: within one rounding of it
        torch.testing.assert_close(loss.double(), expected, rtol=torch.finfo(dtype).eps, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_one_pass_launches_and_is_captured(launched):
    """On CUDA the one-pass kernel and the in-place scale run (not the two passes), and a
    captured forward + backward replays correctly with new logits and a new grad_loss."""
    rows, cols = 37, 50304
    x = (torch.randn(rows, cols, device="cuda") * 2).bfloat16().requires_grad_()
    t = torch.randint(0, cols, (rows,), device="cuda")
    t[5] = -100
    weight = torch.ones((), device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = None
        loss = pco.cross_entropy(x, t)
        (loss * weight).backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (kernel loads, allocator)
        step()
    torch.cuda.current_stream().wait_stream(side)
    kinds = [key.split(".")[1] for key in launched]
    assert kinds == [*SMALL_AND_ONE_PASS, "scale_unless_one_kernel"], launched
    graph = torch.cuda.CUDAGraph()
    x.grad = None
    with torch.cuda.graph(graph):
        loss = pco.cross_entropy(x, t)
        (loss * weight).backward()
    for trial, w in enumerate((1.0, 0.5, -3.0)):
        with torch.no_grad():
            x.copy_(torch.randn_like(x) * (trial + 1))
        weight.fill_(w)
        t[trial + 9] = -100  # one more ignored row each replay: the mean's count is the GPU's
        graph.replay()
        ref_loss, ref_grad = reference(x.detach(), t, -100, "mean", torch.tensor(w, dtype=torch.bfloat16))
        assert rel(loss, ref_loss) < 1e-2
        assert rel(x.grad, ref_grad) < 1e-2
        assert torch.all(x.grad[5] == 0) and torch.all(x.grad[trial + 9] == 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, cols", [(torch.float32, 60001), (torch.bfloat16, 128256), (torch.float16, 50304)])
def test_cuda_one_pass_rows_the_cache_holds_in_part(launched, dtype, cols):
    """Rows over 112 KB: 1024 threads, 200 KB of the row cached and the tail read again
    (targets in the cached head, in the tail, at the last column; an ignored row; a row
    with a NaN in the tail); 50304 fp16 columns are cached whole."""
    g = torch.Generator().manual_seed(cols)
    logits = (torch.randn(6, cols, generator=g) * 3).to(dtype).cuda()
    logits[5, cols - 2] = float("nan")
    targets = torch.tensor([3, cols // 2, cols - 7, cols - 1, -100, 0], device="cuda")
    x = logits.clone().requires_grad_()
    loss = pco.cross_entropy(x, targets, reduction="sum")
    loss.backward()
    assert [key.split(".")[1] for key in launched] == [*SMALL_AND_ONE_PASS, "scale_unless_one_kernel"]
    assert launched[1].endswith(".1024" if cols * dtype.itemsize > 112 * 1024 else ".512")
    assert torch.isnan(loss) and torch.isnan(x.grad[5]).all()
    ref_loss, ref_grad = reference(logits[:5], targets[:5], -100, "sum", torch.ones((), device="cuda"))
    ours = pco.cross_entropy(x[:5], targets[:5], reduction="sum")  # the first five rows alone
    x.grad = None
    ours.backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # the loss comes back in the logits' dtype
    assert rel(ours.detach(), ref_loss) < tol
    assert rel(x.grad[:5], ref_grad) < tol
    assert torch.all(x.grad[4] == 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, cols", [(torch.bfloat16, 50304), (torch.float32, 9001), (torch.float16, 1003)])
@pytest.mark.parametrize("shape", [(512, 100 * 1024), (1024, 8 * 1024), (1024, 0)])
def test_cuda_every_one_pass_launch_shape(monkeypatch, launched, dtype, cols, shape):
    """The one-pass kernel with the row cached whole, in part or not at all, against
    float64: targets across the row and at its last column, ignored rows, a row with a
    NaN."""
    monkeypatch.setattr(ce_module, "one_pass_shape", lambda cols, elem: shape)  # (no recipes: `launched`)
    g = torch.Generator().manual_seed(cols)
    rows = 23
    logits = (torch.randn(rows, cols, generator=g) * 3).to(dtype).cuda()
    targets = torch.randint(0, cols, (rows,), generator=g)
    targets[0] = cols - 1
    targets[1::7] = -100
    targets[-1] = 5  # counted: its NaN must show
    logits[rows - 1, cols // 3] = float("nan")
    targets = targets.cuda()
    factor = torch.full((1,), 0.37, dtype=torch.float64, device="cuda")
    rows_loss, lse, grad = cross_entropy_with_grad_kernel([logits, targets, factor], params={"IGNORE_INDEX": -100})
    ok = slice(0, rows - 1)
    ref_loss, ref_grad = reference(logits[ok], targets[ok], -100, "none", torch.full((rows - 1,), 0.37, device="cuda"))
    assert rel(rows_loss[ok], ref_loss) < 1e-5
    assert rel(grad[ok], ref_grad) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.all(grad[1] == 0) and rows_loss[1] == 0 and lse[1] == 0
    assert torch.isnan(rows_loss[-1]) and torch.isnan(grad[-1]).all()
    assert [key.split(".")[1] for key in launched] == ["cross_entropy_with_grad_kernel"]
