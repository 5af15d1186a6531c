"""Day 020: the residual add fused into day 013's LayerNorm (`pco.add_layer_norm`),
against float64 references, torch's composition, and bitwise against day 013's own ops.

CPU: the op composes torch's add and cast with day 013's CPU ops (MAX), so these tests
check its contract (dtypes, gradients, autocast, errors). CUDA: the fused kernels, and
the launch plans' choices are checked on the CPU as well.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco

# the modules (pco.add_layer_norm and pco.layer_norm are the functions)
ALN = importlib.import_module("pytorch_custom_ops.add_layer_norm")
LN = importlib.import_module("pytorch_custom_ops.layer_norm")

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 2e-5, torch.float64: 1e-6, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def make(rows, cols, x_dtype, delta_dtype, device, seed=0):
    """Random stream, branch, affine parameters (never zeros), as leaf tensors."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    x = (3 * r(rows, cols) + 1).to(x_dtype).to(device).requires_grad_()
    d = r(rows, cols).to(delta_dtype).to(device).requires_grad_()
    w = (1 + 0.5 * r(cols)).to(x_dtype).to(device).requires_grad_()
    b = (0.5 * r(cols)).to(x_dtype).to(device).requires_grad_()
    return x, d, w, b


def reference(x, d, w, b, eps=1e-5):
    """float64 leaves (s, w, b) of the values the op sees (s rounded to x's dtype, as
    torch's add) and y = LayerNorm(s)."""
    s = x.detach() if d is None else (x.detach() + d.detach()).to(x.dtype)
    sd, wd, bd = (t.detach().double().requires_grad_() for t in (s, w, b))
    return sd, wd, bd, F.layer_norm(sd, (x.shape[-1],), wd, bd, eps)


def close(got, want, tol, what):
    got, want = got.double().cpu(), want.double().cpu()
    scale = max(want.abs().max().item(), 1.0)
    err = (got - want).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} x {scale:.3g}"


# (x dtype, delta dtype, out dtype): the same-dtype forms, autocast's (float32 stream, bf16 or
# fp16 branch and output), and delta in neither dtype of the kernels (added first)
FORMS = [
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.float64, torch.float64, torch.float64),
    (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16, torch.float16),
    (torch.float32, torch.float32, torch.bfloat16),
    (torch.float32, torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("x_dtype, delta_dtype, out_dtype", FORMS)
@pytest.mark.parametrize("rows, cols", [(5, 37), (9, 768), (3, 1028), (2, 16388)])
def test_values_and_gradients_match_float64(x_dtype, delta_dtype, out_dtype, rows, cols, device):
    if device == "cpu" and cols > 1028:
        pytest.skip("the CPU composes day 013's ops: the long rows are the GPU's tiers")
    x, d, w, b = make(rows, cols, x_dtype, delta_dtype, device, seed=cols)
    s, y = pco.add_layer_norm(x, d, cols, w, b, out_dtype=out_dtype)
    assert s.dtype == x_dtype and y.dtype == out_dtype and s.shape == y.shape == x.shape
    sd, wd, bd, yd = reference(x, d, w, b)
    close(s, sd, 0, "s")  # the add is exact in the stream's dtype
    close(y, yd, TOL[out_dtype], "y")
    gy, gs = torch.randn_like(y), torch.randn_like(s)
    grads = torch.autograd.grad((y.double() * gy.double()).sum() + (s.double() * gs.double()).sum(), (x, d, w, b))
    want = torch.autograd.grad((yd * gy.double()).sum() + (sd * gs.double()).sum(), (sd, wd, bd))
    assert [g.dtype for g in grads] == [x_dtype, delta_dtype, x_dtype, x_dtype]
    tol = 4 * max(TOL[x_dtype], TOL[out_dtype])
    close(grads[0], want[0], tol, "grad x")
    close(grads[1], want[0], max(tol, TOL[delta_dtype]), "grad delta")
    close(grads[2], want[1], tol * rows, "grad weight")
    close(grads[3], want[2], tol * rows, "grad bias")


@pytest.mark.skipif(not CUDA, reason="the fused kernels run on CUDA")
@pytest.mark.parametrize("x_dtype, delta_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("cols", [768, 4100, 16388])
def test_cuda_fused_kernels_match_day013s_composition(x_dtype, delta_dtype, cols):
    """One pass forward and backward against add, LayerNorm, cast (and in backward cast,
    LayerNorm backward, add, cast) done by day 013's own kernels: the same bits, except
    that the fused backward adds the residual gradient with an FMA (one rounding instead
    of two, so x's gradient may differ in the last bit, and delta's by one step of its
    dtype where that bit decides the rounding)."""
    x, d, w, b = make(33, cols, x_dtype, delta_dtype, "cuda", seed=1)
    s, y = pco.add_layer_norm(x, d, cols, w, b, out_dtype=delta_dtype)
    gy, gs = torch.randn_like(y), torch.randn_like(s)
    fused = torch.autograd.grad((y, s), (x, d, w, b), (gy, gs))
    x2, d2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, d, w, b))
    s2 = x2 + d2
    y2 = pco.layer_norm(s2, (cols,), w2, b2).to(delta_dtype)
    composed = torch.autograd.grad((y2, s2), (x2, d2, w2, b2), (gy, gs))
    assert torch.equal(s, s2) and torch.equal(y, y2)
    assert torch.equal(fused[2], composed[2]) and torch.equal(fused[3], composed[3])  # weight, bias
    ln_part = (composed[0] - gs).abs()  # the LayerNorm's term, the one the FMA does not round
    last_bit = 2**-23 * (ln_part + composed[0].abs())
    assert ((fused[0] - composed[0]).abs() <= last_bit).all()
    step = torch.finfo(delta_dtype).eps * composed[1].float().abs()
    assert ((fused[1].float() - composed[1].float()).abs() <= step + last_bit).all()


def test_without_delta_the_stream_is_x(device):
    x, _, w, b = make(6, 40, torch.float32, torch.float32, device)
    s, y = pco.add_layer_norm(x, None, 40, w, b, out_dtype=torch.bfloat16 if device == "cuda" else None)
    assert s is x
    sd, wd, bd, yd = reference(x, None, w, b)
    close(y, yd, TOL[y.dtype], "y")
    (gx,) = torch.autograd.grad((y.double() ** 2).sum(), (x,))
    (want,) = torch.autograd.grad((yd**2).sum(), (sd,))
    close(gx, want, 4 * TOL[y.dtype], "grad x")


@pytest.mark.parametrize("used", ["y", "s"])
def test_one_output_unused(used, device):
    """The final LayerNorm's sum is used by nothing; a stream whose norm is unused (not in
    the model, but legal) passes the gradient through the add."""
    x, d, w, b = make(4, 24, torch.float32, torch.float32, device)
    s, y = pco.add_layer_norm(x, d, 24, w, b)
    out = y if used == "y" else s
    grads = torch.autograd.grad(out.square().sum(), (x, d), allow_unused=True)
    sd, wd, bd, yd = reference(x, d, w, b)
    (want,) = torch.autograd.grad((yd if used == "y" else sd).square().sum(), (sd,))
    for g in grads:
        close(g, want, 1e-4, "grad")


def test_autocast_writes_y_in_the_autocast_dtype(device):
    dtype = torch.bfloat16
    x, d, _, _ = make(8, 64, torch.float32, dtype, device)
    ln = pco.MojoAddLayerNorm(64, device=device)
    ref = torch.nn.LayerNorm(64, device=device)
    with torch.no_grad():
        for p in (ln.weight, ln.bias):
            p.normal_()
    ref.load_state_dict(ln.state_dict())
    with torch.autocast(device, dtype=dtype):
        s, y = ln(x, d)
        s2 = x + d
        y2 = ref(s2)
    assert s.dtype == torch.float32 and y.dtype == dtype and y2.dtype == torch.float32
    torch.testing.assert_close(s, s2, rtol=0, atol=0)
    torch.testing.assert_close(y, y2.to(dtype), rtol=0, atol=0) if device == "cuda" else close(y, y2, 1e-2, "y")
    (y.float().square().sum() + s.sum()).backward()
    assert x.grad.dtype == torch.float32 and d.grad.dtype == dtype and ln.weight.grad.dtype == torch.float32


def test_double_backward_is_refused_clearly(device):
    """y's backward runs day 013's kernels, which have no derivative: create_graph=True
    through y raises with the reason, not torch's "no autograd formula" message."""
    x, d = (torch.randn(4, 32, device=device, requires_grad=True) for _ in range(2))
    s, y = pco.add_layer_norm(x, d, 32)
    with pytest.raises(NotImplementedError, match="add_layer_norm: double backward"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)
    s, y = pco.add_layer_norm(x, d, 32)  # the stream alone: its gradient is the add's
    (gx,) = torch.autograd.grad(s.square().sum(), x, create_graph=True)
    torch.testing.assert_close(gx, 2 * (x + d))


def test_module_keeps_nn_layernorms_parameters():
    ref = torch.nn.LayerNorm(10, eps=1e-3)
    mine = pco.MojoAddLayerNorm(10, eps=1e-3)
    mine.load_state_dict(ref.state_dict())
    assert isinstance(mine, torch.nn.LayerNorm) and mine.extra_repr() == ref.extra_repr()
    x = torch.randn(3, 10)
    s, y = mine(x)
    assert s is x
    torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_clear_errors():
    x, d, w, b = make(3, 8, torch.float32, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"add_layer_norm: delta \(3, 7\) must have x's shape"):
        pco.add_layer_norm(x, torch.randn(3, 7), 8)
    with pytest.raises(TypeError, match="add_layer_norm: delta is torch.float64 but x is torch.float32"):
        pco.add_layer_norm(x, d.double(), 8)
    with pytest.raises(TypeError, match="add_layer_norm: delta must be a torch.Tensor or None"):
        pco.add_layer_norm(x, 1.0, 8)
    with pytest.raises(
        TypeError, match="add_layer_norm: out_dtype torch.float16 is not supported for a torch.bfloat16"
    ):
        pco.add_layer_norm(x.bfloat16(), None, 8, out_dtype=torch.float16)
    with pytest.raises(TypeError, match="add_layer_norm: out_dtype must be a torch.dtype"):
        pco.add_layer_norm(x, None, 8, out_dtype="bf16")
    with pytest.raises(ValueError, match=r"add_layer_norm: normalized_shape \(9,\) does not match"):
        pco.add_layer_norm(x, d, 9)
    _, s, mean, rstd = torch.ops.gpu_days.add_layer_norm(x.detach(), None, [8], None, None, 1e-5, torch.float32)
    with pytest.raises(TypeError, match="add_layer_norm_backward: grad_y is torch.float64 but x is torch.float32"):
        torch.ops.gpu_days.add_layer_norm_backward(
            torch.randn(3, 8).double(), None, x.detach(), [8], None, mean, rstd, False
        )
    with pytest.raises(ValueError, match="add_layer_norm_backward: write_low needs grad_y narrower than x"):
        torch.ops.gpu_days.add_layer_norm_backward(torch.randn(3, 8), None, x.detach(), [8], None, mean, rstd, True)
    with pytest.raises(TypeError, match="add_layer_norm: x must be a torch.Tensor"):
        pco.add_layer_norm([1.0], None, 1)
    with pytest.raises(
        TypeError, match="add_layer_norm: delta has dtype torch.int64|add_layer_norm: dtype torch.int64"
    ):
        pco.add_layer_norm(x, torch.ones(3, 8, dtype=torch.int64), 8)


def test_opcheck():
    x, d, w, b = make(4, 9, torch.float32, torch.float32, "cpu")
    x, d, w, b = (t.detach() for t in (x, d, w, b))
    for args in [
        (x, d, [9], w, b, 1e-5, torch.float32),
        (x, d.bfloat16(), [9], w, b, 1e-5, torch.bfloat16),
        (x.requires_grad_(), d.clone().requires_grad_(), [9], w.clone().requires_grad_(), None, 1e-3, torch.float32),
        (x.view(2, 2, 9), None, [9], None, None, 1e-5, torch.float32),
    ]:
        torch.library.opcheck(torch.ops.gpu_days.add_layer_norm.default, args)
    _, s, mean, rstd = torch.ops.gpu_days.add_layer_norm(x.detach(), d, [9], w, b, 1e-5, torch.bfloat16)
    gy = torch.randn(4, 9, dtype=torch.bfloat16)
    op = torch.ops.gpu_days.add_layer_norm_backward.default
    torch.library.opcheck(op, (gy, torch.randn(4, 9), s, [9], w, mean, rstd, True))
    torch.library.opcheck(op, (gy.float(), None, s, [9], None, mean, rstd, False))


def test_torch_compile_fullgraph(device):
    torch.manual_seed(3)
    ln = pco.MojoAddLayerNorm(24, device=device)
    lin = torch.nn.Linear(24, 24, device=device)

    def f(x, delta):
        s, y = ln(x, lin(delta))
        return s, y

    # aot_eager on the CPU: inductor's CPU backend needs a C++ toolchain
    compiled = torch.compile(f, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    x, d = torch.randn(5, 24, device=device), torch.randn(5, 24, device=device)
    s, y = compiled(x, d)
    s2 = x + lin(d)
    torch.testing.assert_close(s, s2)
    torch.testing.assert_close(y, F.layer_norm(s2, (24,), ln.weight, ln.bias), rtol=1e-5, atol=1e-5)
    (s.sum() + y.square().sum()).backward()
    grad = lin.weight.grad.clone()
    lin.weight.grad = None
    s2 = x + lin(d)
    (s2.sum() + F.layer_norm(s2, (24,), ln.weight, ln.bias).square().sum()).backward()
    torch.testing.assert_close(grad, lin.weight.grad, rtol=1e-4, atol=1e-5)


# -- the launch plans of the fused forms, on CPU tensors ----------------------------------
def _fakes(specs, misaligned=()):
    base = {d: torch.empty(16, dtype=d) for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
    return [base[d][int(n in misaligned) :][:1].view([1] * len(s)).expand(s) for n, s, d in specs]


def test_plans_pass_the_fused_pointers_and_flags():
    rows, cols, f32, bf16 = 16384, 768, torch.float32, torch.bfloat16
    rc = (rows, cols)
    out = _fakes([("y", rc, bf16), ("mean", (rows,), f32), ("rstd", (rows,), f32), ("x_sum", rc, f32)])
    inp = _fakes([("x", rc, f32), ("w", (cols,), f32), ("b", (cols,), f32), ("eps", (1,), f32), ("d", rc, bf16)])
    (fwd,) = ALN._forward_gpu(out, inp, {})
    assert fwd.kernel is LN.LN_FWD[f32, bf16, 4, 32, 6, 8] and fwd.grid == rows // 8 and fwd.block == 256
    assert fwd.args[7:] == (inp[4].data_ptr(), out[3].data_ptr(), rows, cols, LN.ADD_DELTA)
    (plain,) = ALN._forward_gpu(out[:3], inp[:4], {})
    assert plain.kernel is fwd.kernel and plain.args[7:] == (0, 0, rows, cols, 0)

    out = _fakes([("gx", rc, f32), ("gw", (cols,), f32), ("gb", (cols,), f32), ("glow", rc, bf16)])
    inp = _fakes(
        [
            ("gy", rc, bf16),
            ("x", rc, f32),
            ("w", (cols,), f32),
            ("m", (rows,), f32),
            ("r", (rows,), f32),
            ("gs", rc, f32),
        ]
    )
    stage1, stage2 = ALN._backward_gpu(out, inp, {})
    assert stage1.kernel is LN.LN_BWD[f32, bf16, f32, 4, 32, 6, 12] and stage1.block == 384
    assert stage1.args[7:] == (inp[5].data_ptr(), out[3].data_ptr(), rows, cols, LN.ADD_GRAD | LN.WRITE_LOW)
    stage1, _ = ALN._backward_gpu(out[:3], inp, {})
    assert stage1.args[7:] == (inp[5].data_ptr(), 0, rows, cols, LN.ADD_GRAD)
    stage1, _ = ALN._backward_gpu(out[:3], inp[:5], {})
    assert stage1.args[7:] == (0, 0, rows, cols, 0)
    # a misaligned bf16 side gives element loads for every tensor of the row
    inp = _fakes(
        [("gy", rc, bf16), ("x", rc, f32), ("w", (cols,), f32), ("m", (rows,), f32), ("r", (rows,), f32)], {"gy"}
    )
    assert ALN._backward_gpu(out[:3], inp, {})[0].kernel.params[3] == 1
    # a few rows: day 016's one launch passes the same pointers and flags
    rows, rc = 64, (64, cols)
    out = _fakes([("gx", rc, f32), ("gw", (cols,), f32), ("gb", (cols,), f32), ("glow", rc, bf16)])
    inp = _fakes([("gy", rc, bf16), ("x", rc, f32), ("w", (cols,), f32), ("m", (64,), f32), ("r", (64,), f32)])
    inp += _fakes([("gs", rc, f32)])
    (one,) = ALN._backward_gpu(out, inp, {})
    assert one.kernel is LN.LN_BWD_ONE[f32, bf16, f32, 4, 32, 6, 12] and one.block == 384
    assert one.args[8:] == (inp[5].data_ptr(), out[3].data_ptr(), rows, cols, LN.ADD_GRAD | LN.WRITE_LOW, 768 // 4 // 8)
