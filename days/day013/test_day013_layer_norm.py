"""Day 013: LayerNorm forward and backward (Mojo) against float64 references and torch.

Compile budget: one MAX graph per (op, dtype, device) is built on first use (~17 s each
on a 2-core CPU). These tests use 7 per device: the forward in 4 dtypes, the backward
in float32, float64 and bfloat16.
"""

import math
import re
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco

FWD_TOL = {torch.float32: 2e-6, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
BWD_TOL = {
    torch.float32: 2e-5,
    torch.float64: 1e-6,
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
}  # fp64 grads use float32 rstd


def reference(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """float64 layer norm and its (mean, rstd) over the flattened normalized dims."""
    k = len(normalized_shape)
    xd = x.double()
    dims = tuple(range(x.dim() - k, x.dim()))
    var, mean = torch.var_mean(xd, dim=dims, unbiased=False)
    y = F.layer_norm(
        xd, normalized_shape, None if weight is None else weight.double(), None if bias is None else bias.double(), eps
    )
    # eps travels as float32 to the kernel: the reference uses the same number
    return y, mean, torch.rsqrt(var + torch.tensor(eps, dtype=torch.float32).double())


def make(rows, cols, dtype=torch.float32, device="cpu", offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 2 + offset).to(dtype).to(device)
    w = (1 + 0.5 * torch.randn(cols, generator=g, dtype=torch.float64)).to(dtype).to(device)
    b = (0.5 * torch.randn(cols, generator=g, dtype=torch.float64)).to(dtype).to(device)
    return x, w, b


def scaled_close(got, want, tol, what, floor=0.0):
    """|got - want| <= tol * max(max|want|, 1, floor): error on the scale of the output (or of
    the terms it cancels from, `floor`, when that is larger)."""
    got, want = got.double().cpu(), want.double().cpu()
    scale = max(want.abs().max().item() if want.numel() else 0.0, 1.0, floor)
    err = (got - want).abs().max().item() if want.numel() else 0.0
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} x {scale:.3g}"


def test_mojo_path_is_live():
    assert pco.use_mojo("layer_norm"), pco.layer_norm_kernel.failure
    assert pco.use_mojo("layer_norm_backward"), pco.layer_norm_backward_kernel.failure
    assert pco.MojoLayerNorm(8).use_mojo


# -- forward ----------------------------------------------------------------------------
# every forward tier of the launch plan, 16-byte and element loads (see test_plan_*)
@pytest.mark.parametrize(
    "rows, cols",
    [(1, 1), (3, 17), (7, 1000), (2, 4097), (64, 128), (1, 70000), (9, 4096), (3, 1026), (7, 12288), (5, 6000)],
)
def test_forward_fp32_matches_float64(rows, cols, device):
    x, w, b = make(rows, cols, device=device, seed=cols)
    y, mean, rstd = torch.ops.gpu_days.layer_norm(x, [cols], w, b, 1e-5)
    ref_y, ref_mean, ref_rstd = reference(x, (cols,), w, b)
    assert y.dtype == x.dtype and mean.dtype == rstd.dtype == torch.float32 and mean.shape == (rows,)
    scaled_close(y, ref_y, FWD_TOL[torch.float32], "y")
    scaled_close(mean, ref_mean, 1e-6, "mean")
    torch.testing.assert_close(rstd.double().cpu(), ref_rstd.cpu(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_forward_other_dtypes(dtype, device):
    for rows, cols in [(5, 17), (9, 4096), (3, 4097)]:
        x, w, b = make(rows, cols, dtype, device, seed=rows)
        y = pco.layer_norm(x, (cols,), w, b)
        assert y.dtype == dtype
        scaled_close(y, reference(x, (cols,), w, b)[0], FWD_TOL[dtype], f"{dtype} {rows}x{cols}")


def test_large_offset_keeps_the_variance(device):
    """x = 1e4 + N(0, 4) in float32: E[x^2] - E[x]^2 subtracts two numbers near 1e8
    (float32 spacing 8) and loses the variance; the merged (count, mean, M2) partials
    computed around a shift do not."""
    x, w, b = make(16, 4096, device=device, offset=1e4)
    y, mean, rstd = torch.ops.gpu_days.layer_norm(x, [4096], w, b, 1e-5)
    ref_y, _, ref_rstd = reference(x, (4096,), w, b)
    rstd_err = (rstd.double().cpu() / ref_rstd.cpu() - 1).abs().max().item()
    naive_var = (x * x).mean(-1) - x.mean(-1) ** 2
    naive_err = (torch.rsqrt(naive_var.double().clamp_min(1e-30) + 1e-5).cpu() / ref_rstd.cpu() - 1).abs().max()
    assert rstd_err < 1e-5 < naive_err.item()
    # y is as good as for a centred row, and no worse than torch's own float32 result
    torch_err = (F.layer_norm(x, (4096,), w, b).double() - ref_y).abs().max().item()
    our_err = (y.double() - ref_y).abs().max().item()
    assert our_err < max(1e-5, 2 * torch_err)


@pytest.mark.parametrize("scale", [1e-3, 1e3, 1e15])  # 1e20 would overflow x^2, as in torch
def test_large_and_small_magnitudes(scale, device):
    x, w, b = make(4, 1000, device=device, seed=3)
    x = x * scale
    y = pco.layer_norm(x, (1000,), w, b, eps=1e-5)
    assert torch.isfinite(y).all()
    scaled_close(y, reference(x, (1000,), w, b)[0], 1e-5, f"scale {scale}")


def test_non_finite_rows_are_nan_like_torch(device):
    x, w, b = make(3, 33, device=device)
    x[1, 5] = math.inf
    x[2, 7] = math.nan
    y = pco.layer_norm(x, (33,), w, b)
    assert torch.equal(torch.isnan(y), torch.isnan(F.layer_norm(x, (33,), w, b)))


def test_eps_is_a_runtime_value(device):
    x, w, b = make(4, 64, device=device)
    pco.layer_norm(x, (64,), w, b, eps=1e-5)
    n_models = len(pco.layer_norm_kernel._models)
    for eps in (1e-6, 0.1, 3.0):
        scaled_close(pco.layer_norm(x, (64,), w, b, eps=eps), reference(x, (64,), w, b, eps)[0], 1e-5, f"eps {eps}")
    assert len(pco.layer_norm_kernel._models) == n_models


def test_layouts_and_multi_dim_normalized_shape(device):
    x, w, b = make(6, 35, device=device)
    x3 = x.view(2, 3, 5, 7)
    w2, b2 = w.view(5, 7), b.view(5, 7)
    scaled_close(pco.layer_norm(x3, (5, 7), w2, b2), reference(x3, (5, 7), w2, b2)[0], 1e-5, "2 normalized dims")
    xt = x3.transpose(0, 1)  # not contiguous
    scaled_close(pco.layer_norm(xt, (5, 7), w2, b2), reference(xt, (5, 7), w2, b2)[0], 1e-5, "transposed")
    v = torch.randn(10, device=device)
    scaled_close(pco.layer_norm(v, 10), reference(v, (10,))[0], 1e-5, "1-D input, int normalized_shape")
    assert pco.layer_norm(torch.randn(0, 8, device=device), (8,)).shape == (0, 8)
    assert pco.layer_norm(torch.randn(3, 0, device=device), (0,)).shape == (3, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_call_without_autograd_makes_y_alone(dtype, device):
    """Without autograd the public function wants y only: on CUDA the kernels skip mean
    and rstd (NO_STATS), so a call allocates y and nothing else. y is the same as the
    grad-mode call's, on each forward kernel (warp, block and streaming tiers)."""
    for rows, cols in [(3, 17), (9, 768), (5, 4097), (2, 70000)]:
        x, w, b = make(rows, cols, dtype, device, seed=cols)
        y = pco.layer_norm(x, (cols,), w, b)
        scaled_close(y, reference(x, (cols,), w, b)[0], FWD_TOL[dtype], f"no grad {rows}x{cols}")
        with torch.enable_grad():
            y_grad = pco.layer_norm(x.clone().requires_grad_(True), (cols,), w, b)
        assert torch.equal(y, y_grad.detach()), (rows, cols)
    if device == "cuda":
        x, w, b = make(8, 768, dtype, device)
        for _ in range(3):  # recorded, then replayed
            pco.layer_norm(x, (768,), w, b)
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        ys = [pco.layer_norm(x, (768,), w, b) for _ in range(10)]
        assert torch.cuda.memory_stats()["allocation.all.allocated"] - before == len(ys)


# -- backward ---------------------------------------------------------------------------
def _grads(fn, x, w, b, dy):
    x, w, b = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    fn(x, w, b).backward(dy)
    return x.grad, w.grad, b.grad


# every backward tier: warp (3000 x 64: several row groups per worker), 256 x 4, 512 x 4,
# 512 x 8, streaming with 16-byte and element loads (140 x 17000: rows > workers)
@pytest.mark.parametrize(
    "rows, cols",
    [(1, 1), (3, 17), (300, 64), (3000, 64), (5, 1000), (2, 4097), (9, 4096), (5, 6000), (7, 12288), (140, 17000)],
)
def test_backward_fp32_matches_float64(rows, cols, device):
    x, w, b = make(rows, cols, device=device, seed=rows + cols)
    dy = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)).to(device)
    got = _grads(lambda x, w, b: pco.layer_norm(x, (cols,), w, b), x, w, b, dy)
    want = _grads(lambda x, w, b: F.layer_norm(x, (cols,), w, b), x.double(), w.double(), b.double(), dy.double())
    # grad_x = rstd * (w*dy - mean(w*dy) - y * mean(w*dy*y)): float32 rounding of the bracket
    # is amplified by rstd (316 for one column: var = 0, rstd = 1/sqrt(eps))
    rstd = reference(x, (cols,))[2].max().item()
    amplified = 8 * 2**-24 * rstd * (w.abs().max() * dy.abs().max()).item() / BWD_TOL[torch.float32]
    for g, r, name in zip(got, want, ("grad_x", "grad_weight", "grad_bias"), strict=True):
        assert g.dtype == torch.float32
        floor = amplified if name == "grad_x" else 0.0
        scaled_close(g, r, BWD_TOL[torch.float32], f"{name} {rows}x{cols}", floor=floor)


@pytest.mark.parametrize(
    "dtype, rows, cols",
    [
        (torch.bfloat16, 33, 1000),
        (torch.bfloat16, 3, 24576),  # 512 x 8 with 192 KiB of column sums
        (torch.bfloat16, 3, 26000),  # 208 KB of column sums > SMEM_CAP: streaming
        (torch.float16, 33, 1000),
        (torch.float64, 33, 1000),
        (torch.float64, 3, 3001),
    ],
)
def test_backward_other_dtypes(dtype, rows, cols, device):
    if dtype == torch.float16 and device == "cpu":
        pytest.skip("compile budget: the CPU branch is the same code for every dtype")
    x, w, b = make(rows, cols, dtype, device, offset=1e3 if dtype == torch.float64 else 0.0)
    dy = torch.randn(rows, cols, device=device).to(dtype)
    got = _grads(lambda x, w, b: pco.layer_norm(x, (cols,), w, b), x, w, b, dy)
    want = _grads(lambda x, w, b: F.layer_norm(x, (cols,), w, b), x.double(), w.double(), b.double(), dy.double())
    for g, r, name in zip(got, want, ("grad_x", "grad_weight", "grad_bias"), strict=True):
        assert g.dtype == dtype
        scaled_close(g, r, BWD_TOL[dtype], f"{dtype} {rows}x{cols} {name}")


def test_gradcheck_float64():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: pco.layer_norm(x, (2, 5), w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x: pco.layer_norm(x, (5,)), (x,))  # no affine


def test_double_backward_is_refused_clearly(device):
    """The backward kernels have no derivative, and mean and rstd are saved as
    non-differentiable: create_graph=True raises, rather than a silently wrong gradient."""
    x = torch.randn(6, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device, requires_grad=True)
    y = pco.layer_norm(x, 40, w)
    with pytest.raises(NotImplementedError, match="layer_norm: double backward"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)
    (gx,) = torch.autograd.grad(pco.layer_norm(x, 40, w).square().sum(), x)
    assert torch.isfinite(gx).all()


def test_opcheck():
    x, w, b = make(4, 9)
    for args in [
        (x, [9], w, b, 1e-5),
        (x.view(2, 2, 9).clone().requires_grad_(), [9], w.clone().requires_grad_(), b.clone().requires_grad_(), 1e-3),
        (x.view(4, 3, 3), [3, 3], None, None, 1e-5),
    ]:
        torch.library.opcheck(torch.ops.gpu_days.layer_norm.default, args)
    y, mean, rstd = torch.ops.gpu_days.layer_norm(x, [9], w, b, 1e-5)
    torch.library.opcheck(torch.ops.gpu_days.layer_norm_backward.default, (torch.randn(4, 9), x, [9], w, mean, rstd))
    torch.library.opcheck(torch.ops.gpu_days.layer_norm_backward.default, (torch.randn(4, 9), x, [9], None, mean, rstd))


def test_empty_inputs_give_zero_parameter_grads(device):
    x = torch.randn(0, 8, device=device, requires_grad=True)
    w = torch.randn(8, device=device, requires_grad=True)
    b = torch.randn(8, device=device, requires_grad=True)
    pco.layer_norm(x, (8,), w, b).sum().backward()
    assert x.grad.shape == (0, 8) and (w.grad == 0).all() and (b.grad == 0).all()


# -- the drop-in module -------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"elementwise_affine": False}, {"bias": False}, {"eps": 1e-3}],
    ids=["affine", "no_affine", "no_bias", "eps"],
)
def test_module_is_a_drop_in_for_nn_layernorm(kwargs, device):
    torch.manual_seed(1)
    ref = torch.nn.LayerNorm((4, 6), device=device, **kwargs)
    if ref.weight is not None:  # not the default ones/zeros
        torch.nn.init.normal_(ref.weight)
    if ref.bias is not None:
        torch.nn.init.normal_(ref.bias)
    mine = pco.MojoLayerNorm((4, 6), device=device, **kwargs)
    mine.load_state_dict(ref.state_dict())
    assert isinstance(mine, torch.nn.LayerNorm) and mine.extra_repr() == ref.extra_repr()
    x = torch.randn(2, 3, 4, 6, device=device)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = mine(x1), ref(x2)
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y1)
    y1.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-5)
    for p, q in zip(mine.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_torch_compile_fullgraph():
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), pco.MojoLayerNorm(24), torch.nn.GELU())
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(5, 16)
    ref = torch.nn.Sequential(model[0], torch.nn.LayerNorm(24), model[2])
    ref[1].load_state_dict(model[1].state_dict())
    torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-5)
    compiled(x).square().sum().backward()
    grad = model[0].weight.grad.clone()
    model[0].weight.grad = None
    ref(x).square().sum().backward()
    torch.testing.assert_close(grad, model[0].weight.grad, rtol=1e-4, atol=1e-5)


# -- bad inputs ---------------------------------------------------------------------------
def test_bad_inputs_raise_clear_errors():
    x, w, b = make(3, 4)
    with pytest.raises(ValueError, match=r"layer_norm: normalized_shape \(5,\) does not match the last 1 dim"):
        pco.layer_norm(x, (5,))
    with pytest.raises(ValueError, match="layer_norm: normalized_shape must have at least one dim"):
        pco.layer_norm(x, ())
    with pytest.raises(TypeError, match="layer_norm: normalized_shape must be an int or a sequence of ints"):
        pco.layer_norm(x, (4.0,))
    with pytest.raises(ValueError, match=r"layer_norm: weight must have shape \(4,\) \(normalized_shape\), got \(3,\)"):
        pco.layer_norm(x, (4,), w[:3])
    with pytest.raises(ValueError, match=r"layer_norm: bias must have shape"):
        pco.layer_norm(x, (4,), w, b.view(2, 2))
    with pytest.raises(TypeError, match="layer_norm: weight is torch.float64 but the input is torch.float32"):
        pco.layer_norm(x, (4,), w.double(), b)
    with pytest.raises(TypeError, match="layer_norm: bias is torch.bfloat16"):
        pco.layer_norm(x, (4,), w, b.bfloat16())
    with pytest.raises(TypeError, match="layer_norm: dtype torch.int64 is not supported"):
        pco.layer_norm(torch.arange(12).view(3, 4), (4,))
    with pytest.raises(TypeError, match="layer_norm: expected a torch.Tensor"):
        pco.layer_norm([1.0, 2.0], (2,))
    with pytest.raises(TypeError, match="layer_norm: weight must be a torch.Tensor or None"):
        pco.layer_norm(x, (4,), [1.0] * 4)
    with pytest.raises(TypeError, match="layer_norm: eps must be a float"):
        pco.layer_norm(x, (4,), eps="1e-5")
    with pytest.raises(ValueError, match="layer_norm: eps must be finite and >= 0"):
        pco.layer_norm(x, (4,), eps=-1.0)
    with pytest.raises(ValueError, match="layer_norm: device meta is not supported"):
        pco.layer_norm(x.to("meta"), (4,))
    # the same messages through autograd (the registered op) and for the module
    with pytest.raises(TypeError, match="layer_norm: weight is torch.float64"):
        pco.layer_norm(x.requires_grad_(), (4,), w.double())
    with pytest.raises(ValueError, match=r"layer_norm: normalized_shape \(8,\) does not match"):
        pco.MojoLayerNorm(8)(x)
    stats = x.detach()[:, 0]
    with pytest.raises(ValueError, match="layer_norm_backward: grad_out"):
        torch.ops.gpu_days.layer_norm_backward(torch.randn(3, 5), x.detach(), [4], None, stats, stats)
    # torch's backward refuses integer statistics; cast, a truncated mean gave wrong gradients
    g = torch.randn(3, 4)
    with pytest.raises(TypeError, match="layer_norm_backward: mean has dtype torch.int64"):
        pco.layer_norm_backward(g, x.detach(), 4, None, stats.long(), stats)
    with pytest.raises(TypeError, match="layer_norm_backward: grad_out has dtype torch.int64"):
        pco.layer_norm_backward(g.long(), x.detach(), 4, None, stats, stats)
    with pytest.raises(ValueError, match=r"mean and rstd must hold one value per row \(3\), got 2 and 3"):
        pco.layer_norm_backward(g, x.detach(), 4, None, stats[:2], stats)


def test_numpy_and_symbolic_sizes():
    """normalized_shape may hold numpy ints (as F.layer_norm takes them), and under
    torch.compile a dynamic width (a SymInt) once dynamo sees a second width."""
    x = torch.randn(3, 6)
    want = F.layer_norm(x, (6,))
    torch.testing.assert_close(pco.layer_norm(x, (np.int64(6),)), want)
    torch.testing.assert_close(pco.layer_norm(x, np.int64(6)), want)
    f = torch.compile(lambda t: pco.layer_norm(t, t.shape[-1:]), fullgraph=True, dynamic=True)
    h = torch.compile(lambda t: pco.add_layer_norm(t, None, t.shape[-1])[1], fullgraph=True, dynamic=True)
    for n in (5, 9):
        t = torch.randn(3, n)
        torch.testing.assert_close(f(t), F.layer_norm(t, (n,)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h(t), F.layer_norm(t, (n,)), atol=1e-5, rtol=1e-5)


# -- the GPU launch plans, checked on CPU tensors (plans read shapes, dtypes and pointers) ---
LN = sys.modules["pytorch_custom_ops.layer_norm"]  # the module (pco.layer_norm is the function)
CUDA_GRID_X, CUDA_GRID_YZ, H100_SMEM = 2**31 - 1, 65535, 227 * 1024
VEC = {torch.float32: 4, torch.float16: 8, torch.bfloat16: 8, torch.float64: 2}  # 16 bytes


def fake(shape, dtype, misaligned=False):
    """A tensor of `shape` without its memory (a broadcast scalar): the plans only read
    shape, dtype and data_ptr. `misaligned` puts the pointer one element past 16 bytes."""
    base = torch.empty(16, dtype=dtype)
    assert base.data_ptr() % 16 == 0
    return base[int(misaligned) : int(misaligned) + 1].view([1] * len(shape)).expand(shape)


def forward_plan(rows, cols, dtype=torch.float32, misaligned=(), ldtype=None):
    """`ldtype`: y's dtype when it is not x's (day 020's fused form writes bf16 or fp16)."""
    names = ("y", "mean", "rstd", "x", "weight", "bias", "eps")
    shapes = ((rows, cols), (rows,), (rows,), (rows, cols), (cols,), (cols,), (1,))
    dtypes = (ldtype or dtype, torch.float32, torch.float32, dtype, dtype, dtype, torch.float32)
    t = [fake(s, d, n in misaligned) for n, s, d in zip(names, shapes, dtypes, strict=True)]
    return LN._layer_norm_gpu(t[:3], t[3:], {})


def backward_plan(rows, cols, dtype=torch.float32, misaligned=(), ldtype=None):
    """`ldtype`: grad_out's dtype when it is not x's (day 020's fused form)."""
    names = ("grad_x", "grad_weight", "grad_bias", "grad_out", "x", "weight", "mean", "rstd")
    shapes = ((rows, cols), (cols,), (cols,), (rows, cols), (rows, cols), (cols,), (rows,), (rows,))
    dtypes = (dtype,) * 3 + (ldtype or dtype,) + (dtype,) * 2 + (torch.float32,) * 2
    t = [fake(s, d, n in misaligned) for n, s, d in zip(names, shapes, dtypes, strict=True)]
    return LN._layer_norm_backward_gpu(t[:3], t[3:], {})


def check_launches(launches, plan, cols):
    """What any launch must satisfy, and what each kernel's parameters imply."""
    for launch in launches:
        family, params = launch.kernel.family, launch.kernel.params
        assert family in plan.families and family[params] is launch.kernel  # declared: gpu_build built it
        grid = (launch.grid,) if isinstance(launch.grid, int) else launch.grid
        block = (launch.block,) if isinstance(launch.block, int) else launch.block
        assert 1 <= grid[0] <= CUDA_GRID_X and all(1 <= g <= CUDA_GRID_YZ for g in grid[1:])
        assert 1 <= math.prod(block) <= 1024 and 0 <= launch.smem <= H100_SMEM
        assert len(launch.args) == len(family.args) and launch.cluster is None
        if family in (LN.LN_FWD, LN.LN_BWD, LN.LN_BWD_ONE):  # (..., VEC, TPR, ITEMS, ROWS): TPR x ROWS threads
            vec, tpr, items, rows_per_block = params[-4:]
            assert launch.block == tpr * rows_per_block and cols // vec <= tpr * items
        if family is LN.LN_BWD:  # 2 * cols accumulators per worker in dynamic shared memory
            assert launch.smem == params[-1] * 2 * cols * params[2].itemsize <= LN.SMEM_CAP
        if family is LN.LN_BWD_ONE:  # column blocks, then row workers; 2 VEC sums a thread
            vec, rows = params[3], launch.args[-4]
            col_blocks = -(-cols // vec // LN.COL_THREADS)
            assert launch.args[-1] == col_blocks and launch.grid == col_blocks + max(1, -(-rows // params[-1]))
            assert launch.smem == launch.block * vec * 2 * 4 and rows <= LN.ONE_LAUNCH_ROWS.value
        if family in (LN.LN_FWD_STREAM, LN.LN_BWD_STREAM):
            assert launch.block == params[-1] and launch.smem == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [768, 1024])
def test_plan_model_shapes_take_the_fastest_path(dtype, cols):
    """The GPT block's LayerNorms: a warp per row with 16-byte loads, both directions."""
    for rows in (1, 7, 4096, 8192):
        # rows of <= 192 vectors: 6 per lane (day 020: fewer registers, more loads in flight),
        # and 12 warps a block in the backward
        short = cols // VEC[dtype] <= 192
        (fwd,) = forward_plan(rows, cols, dtype)
        assert fwd.kernel is LN.LN_FWD[dtype, dtype, VEC[dtype], 32, 6 if short else 8, 8]
        assert fwd.grid == -(-rows // 8)
        bwd = backward_plan(rows, cols, dtype)
        items, warps = (6, 12) if short else (8, 8)
        tier = (dtype, dtype, torch.float32, VEC[dtype], 32, items, warps)
        if rows <= LN.ONE_LAUNCH_ROWS.value:  # a few rows: one launch, no workspace (day 016)
            (one,) = bwd
            assert one.kernel is LN.LN_BWD_ONE[tier]
            continue
        stage1, stage2 = bwd
        assert stage1.kernel is LN.LN_BWD[tier]
        assert stage1.smem == warps * 2 * cols * 4


# (dtype, cols) -> forward tier, backward tier as (TPR, ITEMS, ROWS); ITEMS 0: streaming
TIERS = [
    (torch.float32, 768, (32, 6, 8), (32, 6, 12)),
    (torch.float32, 1024, (32, 8, 8), (32, 8, 8)),
    (torch.float32, 1028, (256, 4, 1), (256, 4, 1)),
    (torch.float32, 4096, (256, 4, 1), (256, 4, 1)),
    (torch.float32, 4100, (512, 8, 1), (512, 4, 1)),
    (torch.float32, 8192, (512, 8, 1), (512, 4, 1)),
    (torch.float32, 8196, (512, 8, 1), (512, 8, 1)),
    (torch.float32, 16384, (512, 8, 1), (512, 8, 1)),  # 128 KiB of column sums
    (torch.float32, 16388, (512, 0, 1), (512, 0, 1)),
    (torch.bfloat16, 2048, (32, 8, 8), (32, 8, 8)),  # 8 warps x 16 KiB of sums
    (torch.bfloat16, 24576, (512, 8, 1), (512, 8, 1)),  # 192 KiB <= SMEM_CAP
    (torch.bfloat16, 26000, (512, 8, 1), (512, 0, 1)),  # 203 KiB > SMEM_CAP: streaming
    (torch.bfloat16, 32768, (512, 8, 1), (512, 0, 1)),
    (torch.float16, 32776, (512, 0, 1), (512, 0, 1)),
    (torch.float64, 512, (32, 8, 8), (32, 8, 8)),
    (torch.float64, 8192, (512, 8, 1), (512, 8, 1)),  # float64 sums: 128 KiB
    (torch.float64, 8194, (512, 0, 1), (512, 0, 1)),
]


@pytest.mark.parametrize("dtype, cols, fwd_tier, bwd_tier", TIERS)
def test_plan_picks_the_tier_for_the_row_length(dtype, cols, fwd_tier, bwd_tier):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for rows in (1, 5, 3000):
        (fwd,) = forward_plan(rows, cols, dtype)
        check_launches([fwd], LN._layer_norm_gpu, cols)
        tpr, items, per_block = fwd_tier
        want = (
            LN.LN_FWD[dtype, dtype, VEC[dtype], *fwd_tier] if items else LN.LN_FWD_STREAM[dtype, dtype, VEC[dtype], tpr]
        )
        assert fwd.kernel is want and fwd.grid == -(-rows // per_block)
        bwd = backward_plan(rows, cols, dtype)
        check_launches(bwd, LN._layer_norm_backward_gpu, cols)
        tpr, items, _ = bwd_tier
        one = items and dtype != torch.float64 and rows <= LN.ONE_LAUNCH_ROWS.value  # day 016's one launch
        assert len(bwd) == (1 if one else 2)
        if not items:
            want = LN.LN_BWD_STREAM[dtype, dtype, acc, VEC[dtype], tpr]
        else:
            want = (LN.LN_BWD_ONE if one else LN.LN_BWD)[dtype, dtype, acc, VEC[dtype], *bwd_tier]
        assert bwd[0].kernel is want


def test_plan_without_statistics():
    """The op without autograd (LAYER_NORM_Y): the same kernel and grid as the full
    forward's, null mean and rstd pointers and the NO_STATS flag."""
    for dtype, cols in [(torch.float32, 768), (torch.bfloat16, 4096), (torch.float32, 70000)]:
        y, x, w, b = (fake(s, dtype) for s in ((9, cols), (9, cols), (cols,), (cols,)))
        mean, rstd, eps = (fake(s, torch.float32) for s in ((9,), (9,), (1,)))
        (full,) = LN._layer_norm_gpu([y, mean, rstd], [x, w, b, eps], {})
        (alone,) = LN._layer_norm_y_gpu([y], [x, w, b, eps], {})
        check_launches([alone], LN._layer_norm_y_gpu, cols)
        assert (alone.kernel, alone.grid, alone.block) == (full.kernel, full.grid, full.block)
        assert alone.args[1] == alone.args[2] == 0 and full.args[1] != 0
        assert alone.args[-1] == LN.NO_STATS and full.args[-1] == 0
        assert alone.args[0] == full.args[0] and alone.args[3:-1] == full.args[3:-1]


def test_plan_falls_back_to_element_loads():
    """Odd rows and any misaligned data pointer give VEC = 1; mean, rstd and eps are read
    one value at a time and may sit anywhere."""
    assert forward_plan(3, 1026)[0].kernel.params[2] == 1  # 1026 % 4 != 0
    assert forward_plan(3, 1026, torch.float64)[0].kernel.params[2] == 2
    for name in ("y", "x", "weight", "bias"):
        assert forward_plan(9, 1024, misaligned={name})[0].kernel.params[2] == 1, name
    assert forward_plan(9, 1024, misaligned={"mean", "rstd", "eps"})[0].kernel.params[2] == 4
    for name in ("grad_x", "grad_out", "x", "weight"):
        assert backward_plan(9, 1024, torch.bfloat16, misaligned={name})[0].kernel.params[3] == 1, name
    assert backward_plan(9, 1024, torch.bfloat16, misaligned={"mean", "rstd", "grad_weight"})[0].kernel.params[3] == 8
    # element loads hold 4x fewer columns per tier: 1026 fp32 elements go to 512 threads
    assert forward_plan(3, 1026)[0].kernel is LN.LN_FWD[torch.float32, torch.float32, 1, 512, 8, 1]
    assert backward_plan(3, 1026)[0].kernel is LN.LN_BWD_ONE[torch.float32, torch.float32, torch.float32, 1, 512, 4, 1]
    assert backward_plan(3000, 1026)[0].kernel is LN.LN_BWD[torch.float32, torch.float32, torch.float32, 1, 512, 4, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plan_backward_grid_workspace_and_second_stage(dtype, monkeypatch):
    """Day 013's two kernels (here for every row count: day 016's one launch is off)."""
    monkeypatch.setattr(LN.ONE_LAUNCH_ROWS, "value", 0)
    acc = dtype
    wide = 4096 if dtype == torch.float32 else 1024  # the 256 x 4 tier: about 2 blocks per SM
    cases = [  # (rows, cols, SMs, expected grid)
        (3, 17, 132, 1),  # one row group
        (300, 64, 132, 25),  # fewer row groups (of 12 rows) than SMs: one each
        (3000, 64, 132, 132),  # warp tier, 1 block per SM: 375 groups over 132 blocks
        (1 << 20, 64, 132, 132),
        (4096, wide, 132, 264),  # 2 blocks per SM
        (1600, wide, 132, 200),  # ... but at least 8 rows per block
        (1000, wide, 132, 132),  # ... and at least one block per SM
        (3000, 64, 78, 78),  # another GPU's SM count
    ]
    for rows, cols, sms, grid in cases:
        monkeypatch.setitem(LN._SM_COUNTS, torch.device("cpu"), sms)
        launches = backward_plan(rows, cols, dtype)
        check_launches(launches, LN._layer_norm_backward_gpu, cols)
        stage1, stage2 = launches
        assert stage1.grid == grid, (rows, cols, sms)
        ws = launches.workspace  # held by the launch list until direct.run has queued both
        assert ws.dtype == acc and ws.shape == (grid, 2 * cols) and ws.is_contiguous()
        assert stage1.args[1] == ws.data_ptr() == stage2.args[2]
        assert stage2.kernel is LN.LN_SUM_PARTIALS[dtype, acc, LN.SUM_COLS, LN.SUM_LANES]
        assert stage2.args[3:] == (grid, cols, 2 * cols)
        assert stage2.grid == -(-2 * cols // LN.SUM_COLS) and stage2.block == LN.SUM_COLS * LN.SUM_LANES


def test_plan_one_launch_for_a_few_rows():
    """Day 016, part eighteen: up to ONE_LAUNCH_ROWS rows (not float64, not the streaming
    tier) the backward is one launch without a workspace: column blocks, then row workers."""
    for dtype, rows, cols in [(torch.float32, 1, 768), (torch.bfloat16, 64, 768), (torch.float16, 2048, 1000)]:
        shapes = ((rows, cols), (cols,), (cols,), (rows, cols), (rows, cols), (cols,), (rows,), (rows,))
        dtypes = (dtype,) * 6 + (torch.float32,) * 2
        t = [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)]
        launches = LN._layer_norm_backward_gpu(t[:3], t[3:], {})
        check_launches(launches, LN._layer_norm_backward_gpu, cols)
        (one,) = launches
        assert one.kernel.family is LN.LN_BWD_ONE and not hasattr(launches, "workspace")
        vec = VEC[dtype] if cols % VEC[dtype] == 0 else 1
        col_blocks = -(-cols // vec // LN.COL_THREADS)
        assert one.args == (*(x.data_ptr() for x in t), 0, 0, rows, cols, 0, col_blocks)
    two = [(torch.float32, LN.ONE_LAUNCH_ROWS.value + 1, 768), (torch.float64, 3, 17), (torch.float32, 3, 17000)]
    for dtype, rows, cols in two:  # more rows, float64, the streaming tier: day 013's kernels
        assert len(backward_plan(rows, cols, dtype)) == 2, (dtype, rows, cols)


def test_plan_huge_shapes_stay_within_cuda_limits():
    rows = 3 * 2**31  # more rows than a grid may have blocks: the row loops cover them
    (fwd,) = forward_plan(rows, 1)
    check_launches([fwd], LN._layer_norm_gpu, 1)
    assert fwd.grid == LN.MAX_GRID
    (fwd,) = forward_plan(rows, 70001)
    assert fwd.kernel.family is LN.LN_FWD_STREAM and fwd.grid == LN.MAX_GRID
    bwd = backward_plan(rows, 1)
    check_launches(bwd, LN._layer_norm_backward_gpu, 1)
    assert bwd[0].grid == LN.H100_SMS  # per_sm = 1: 132 workers for any number of rows
    bwd = backward_plan(1, 10**6)  # one huge row: streaming, stage 2 spans 62500 blocks
    check_launches(bwd, LN._layer_norm_backward_gpu, 10**6)
    assert bwd[0].kernel.family is LN.LN_BWD_STREAM and bwd[1].grid == 2 * 10**6 // LN.SUM_COLS


def test_plan_reaches_every_declared_variant():
    """Each declared kernel is picked by some shape (no dead builds), and each pick is
    launchable; the CUDA tests above run one shape per tier."""
    picked = set()
    for dtype, ldtype in LN.DTYPE_PAIRS:  # day 020's fused forms too (float32 x, bf16/fp16 y)
        for vec, misaligned in ((VEC[dtype], ()), (1, {"x", "grad_out"})):
            for cols in (vec * nvec for nvec in (7, 256, 1024, 2048, 3000, 4096, 5000)):
                fwd = forward_plan(17, cols, dtype, misaligned, ldtype)
                check_launches(fwd, LN._layer_norm_gpu, cols)
                picked |= {launch.kernel for launch in fwd}
                for rows in (17, 3000):  # day 016's one launch, day 013's two kernels
                    bwd = backward_plan(rows, cols, dtype, misaligned, ldtype)
                    check_launches(bwd, LN._layer_norm_backward_gpu, cols)
                    picked |= {launch.kernel for launch in bwd}
    declared = set(pco.layer_norm_kernel.gpu_kernels() + pco.layer_norm_backward_kernel.gpu_kernels())
    assert picked == declared


def test_plan_blocks_match_the_kernels_thread_limits():
    """Each kernel declares its block size to ptxas (MAX_THREADS_PER_BLOCK_METADATA, `.maxntid`
    in its PTX): a launch with more threads fails. Read it back from the GPU build."""
    from pytorch_custom_ops import direct

    maxntid = {}
    for day in ("day013", "day016"):  # day 016: the one-launch backward
        path, manifest = direct._day_build(day)
        for key in manifest["kernels"]:
            found = re.search(r"\.maxntid\s+(\d+)", (path / f"{key}.ptx").read_text())
            if found:
                maxntid[key] = int(found.group(1))
    for dtype in VEC:
        for cols in (7, 1024 * VEC[dtype], 4096 * VEC[dtype], 5000 * VEC[dtype]):
            plans = (*forward_plan(9, cols, dtype), *backward_plan(9, cols, dtype), *backward_plan(3000, cols, dtype))
            for launch in plans:
                assert launch.block == maxntid[launch.kernel.key], launch.kernel.key
