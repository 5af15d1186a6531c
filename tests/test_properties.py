"""Property-based tests of every public op and module: shapes, dims, layouts, dtypes nobody listed.

Each example draws a shape (sizes 1 and odd ones included), a dtype, a layout (contiguous,
a transposed view, a strided slice, an expanded stride-0 view, channels-last) and a seed,
and compares the op and its gradients with float64 torch on the same (rounded) inputs,
within per-dtype tolerances. Unsupported inputs must raise the op's clear error, and the
next valid call must still be right.

Examples per test: the `ci` profile (conftest.py) runs 20 with a fixed seed (derandomized,
so CI is repeatable and its time bounded); `pytest --hypothesis-profile=deep` runs 300.
On a GPU machine the same tests run on CUDA (the `cuda` cases) in strict mode.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import pytorch_custom_ops as pco

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# (rtol, atol) of an output against float64 on the same rounded inputs
TOL = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (2e-5, 2e-6),
    torch.float16: (4e-3, 2e-3),
    torch.bfloat16: (3e-2, 1.6e-2),
}
LAYOUTS = ("contiguous", "transposed", "strided", "expanded", "channels_last")
# `device` is conftest.py's fixture: cpu, and cuda where torch sees a GPU


@st.composite
def tensors(draw, min_dims=1, max_dims=4, max_side=33, dtypes=DTYPES, layouts=LAYOUTS):
    """A random tensor (never zeros) in a random layout; its values are torch.randn's."""
    shape = draw(st.lists(st.integers(1, max_side), min_size=min_dims, max_size=max_dims))
    dtype = draw(st.sampled_from(dtypes))
    layout = draw(st.sampled_from(layouts))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([0.5, 3.0, 20.0]))

    def randn(s):
        return torch.randn(s, generator=gen, dtype=torch.float64) * scale

    if layout == "transposed" and len(shape) >= 2:
        x = randn([*shape[:-2], shape[-1], shape[-2]]).transpose(-1, -2)
    elif layout == "strided":
        x = randn([*shape[:-1], 2 * shape[-1]])[..., ::2]
    elif layout == "expanded":
        x = randn([1, *shape[1:]]).expand(shape)
    elif layout == "channels_last" and len(shape) == 4:
        x = randn(shape).contiguous(memory_format=torch.channels_last)
    else:
        x = randn(shape)
    return x.to(dtype)


def close(actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    rtol, atol = TOL[dtype]
    assert actual.dtype == dtype and actual.shape == expected64.shape
    assert torch.isfinite(actual).all(), "non-finite values in the output"
    torch.testing.assert_close(actual.cpu().double(), expected64, rtol=rtol, atol=atol * scale)


# -- softmax family ----------------------------------------------------------------------------
SOFTMAXES = {
    "softmax": (pco.softmax, torch.softmax),
    "log_softmax": (pco.log_softmax, torch.log_softmax),
    "online_softmax": (pco.online_softmax, torch.softmax),
    "long_softmax": (pco.long_softmax, torch.softmax),
}


@pytest.mark.parametrize("name", sorted(SOFTMAXES))
@given(data=st.data())
def test_softmaxes_match_float64_in_any_layout_and_dim(name, device, data):
    op, ref = SOFTMAXES[name]
    x = data.draw(tensors(max_dims=2 if name == "long_softmax" else 4), label="x")
    dim = data.draw(st.integers(-x.dim(), x.dim() - 1), label="dim")
    y = op(x.to(device), dim)
    close(y, ref(x.double(), dim), x.dtype, scale=1 if name != "log_softmax" else 10)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
@given(data=st.data())
def test_softmax_grads_match_float64(name, device, data):
    op, ref = SOFTMAXES[name]
    x = data.draw(tensors(max_dims=3, dtypes=(torch.float32, torch.float64, torch.bfloat16)), label="x")
    dim = data.draw(st.integers(-x.dim(), x.dim() - 1), label="dim")
    w = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    xd = x.detach().to(device).requires_grad_()
    (op(xd, dim).double() * w.to(device)).sum().backward()
    x64 = x.double().requires_grad_()
    (ref(x64, dim) * w).sum().backward()
    close(xd.grad, x64.grad, x.dtype, scale=10 * (1 + w.abs().max().item()))


# -- layer norm -------------------------------------------------------------------------------
@given(data=st.data())
def test_layer_norm_and_its_grads_match_float64(device, data):
    x = data.draw(tensors(min_dims=1, max_dims=4, dtypes=(torch.float32, torch.float64, torch.bfloat16)), label="x")
    k = data.draw(st.integers(1, min(2, x.dim())), label="normalized dims")
    shape = tuple(x.shape[x.dim() - k :])
    affine = data.draw(st.booleans(), label="affine")
    eps = data.draw(st.sampled_from([1e-5, 1e-3, 0.5]), label="eps")
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(shape, generator=gen, dtype=torch.float64) + 1).to(x.dtype) if affine else None
    b = torch.randn(shape, generator=gen, dtype=torch.float64).to(x.dtype) if affine else None
    grad_needed = data.draw(st.booleans(), label="grads")
    xd = x.detach().to(device).requires_grad_(grad_needed)
    wd = None if w is None else w.detach().to(device).requires_grad_(grad_needed)
    bd = None if b is None else b.detach().to(device).requires_grad_(grad_needed)
    y = pco.layer_norm(xd, shape, wd, bd, eps)
    x64 = x.double().requires_grad_(grad_needed)
    w64 = None if w is None else w.detach().double().requires_grad_(grad_needed)
    b64 = None if b is None else b.detach().double().requires_grad_(grad_needed)
    eps32 = torch.tensor(eps, dtype=torch.float32).item()  # eps travels to the kernel as a float32
    y64 = torch.nn.functional.layer_norm(x64, shape, w64, b64, eps32)
    close(y, y64.detach(), x.dtype, scale=4)
    if grad_needed:
        g = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        (y.double() * g.to(device)).sum().backward()
        (y64 * g).sum().backward()
        # the saved statistics are float32 for every dtype (day013), and grad_x's rounding is
        # amplified by rstd: float64 grads are float32-accurate, on the scale of rstd * |g|
        rstd = x64.detach().flatten(-k).var(-1, unbiased=False).add(eps32).rsqrt().max().item()
        gscale = 8 * g.abs().max().item() * math.sqrt(math.prod(shape)) * max(1.0, rstd)
        gdtype = torch.float32 if x.dtype == torch.float64 else x.dtype
        close(xd.grad.to(gdtype), x64.grad, gdtype, scale=gscale)
        if affine:
            close(wd.grad.to(gdtype), w64.grad, gdtype, scale=gscale)
            close(bd.grad.to(gdtype), b64.grad, gdtype, scale=gscale)


# -- GEMM -------------------------------------------------------------------------------------
@st.composite
def gemm_problem(draw, batched: bool):
    dtype = draw(st.sampled_from(DTYPES))
    m, n, k = (draw(st.integers(1, 40), label=d) for d in "mnk")
    batch = draw(st.integers(1, 4), label="batch") if batched else None
    ta, tb = draw(st.booleans(), label="transpose_a"), draw(st.booleans(), label="transpose_b")
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lead = (batch,) if batched else ()

    def operand(rows, cols, transpose):
        layout = draw(st.sampled_from(["contiguous", "view", "strided"]))
        stored = (cols, rows) if transpose else (rows, cols)
        if layout == "view":  # the same values reached through a transposed view of a copy
            t = torch.randn(*lead, stored[1], stored[0], generator=gen, dtype=torch.float64).mT
        elif layout == "strided":
            t = torch.randn(*lead, stored[0], 2 * stored[1], generator=gen, dtype=torch.float64)[..., ::2]
        else:
            t = torch.randn(*lead, *stored, generator=gen, dtype=torch.float64)
        return t.to(dtype)

    a, b = operand(m, k, ta), operand(k, n, tb)
    c_shape = draw(st.sampled_from([None, (n,), (1, n), (m, 1), (m, n)]), label="c shape")
    c = None if c_shape is None else torch.randn(c_shape, generator=gen, dtype=torch.float64).to(dtype)
    alpha = draw(st.sampled_from([1.0, -0.5, 2.0]), label="alpha")
    beta = 0.0 if c is None else draw(st.sampled_from([0.0, 1.0, 0.25]), label="beta")
    return a, b, c, alpha, beta, ta, tb, k


@pytest.mark.parametrize("batched", [False, True], ids=["gemm", "gemm_batched"])
@given(data=st.data())
def test_gemm_matches_float64(batched, device, data):
    a, b, c, alpha, beta, ta, tb, k = data.draw(gemm_problem(batched))
    op = pco.gemm_batched if batched else pco.gemm
    y = op(a.to(device), b.to(device), None if c is None else c.to(device), alpha, beta, ta, tb)
    pa = a.double().mT if ta else a.double()
    pb = b.double().mT if tb else b.double()
    ref = alpha * (pa @ pb) + (beta * c.double() if c is not None and beta != 0 else 0)
    close(y, ref, a.dtype, scale=4 * math.sqrt(k) * (1 + abs(alpha)))


@given(data=st.data())
def test_mojo_gemm_module_grads_match_float64(device, data):
    dtype = data.draw(st.sampled_from((torch.float32, torch.float64)), label="dtype")
    rows, fin, fout = (data.draw(st.integers(1, 24), label=d) for d in ("rows", "in", "out"))
    bias = data.draw(st.booleans(), label="bias")
    torch.manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    layer = pco.MojoGEMM(fin, fout, bias=bias, dtype=dtype).to(device)
    ref = torch.nn.Linear(fin, fout, bias=bias, dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    x = torch.randn(rows, fin, dtype=torch.float64)
    xd = x.to(dtype).to(device).requires_grad_()
    x64 = x.to(dtype).double().requires_grad_()
    g = torch.randn(rows, fout, dtype=torch.float64)
    (layer(xd).double() * g.to(device)).sum().backward()
    (ref(x64) * g).sum().backward()
    close(xd.grad, x64.grad, dtype, scale=4 * math.sqrt(fout))
    close(layer.weight.grad, ref.weight.grad, dtype, scale=4 * math.sqrt(rows))


# -- bad input: a clear error, then the next valid call is right --------------------------------
def _bad_calls(x):
    """(op name, a bad call, the error it must raise, a fragment of its message)."""
    i = x.to(torch.int32)
    w = torch.ones(x.shape[-1], device=x.device)
    return [
        ("softmax", lambda: pco.softmax(i, -1), TypeError, "softmax: dtype torch.int32"),
        ("softmax", lambda: pco.softmax(x, 5), IndexError, "softmax: dim 5 is out of range"),
        ("log_softmax", lambda: pco.log_softmax(x.to("meta"), -1), ValueError, "meta"),
        ("online_softmax", lambda: pco.online_softmax(x, "a"), TypeError, "dim must be an int"),
        ("softmax_backward", lambda: pco.softmax_backward(x, x[:1], -1), ValueError, "shape"),
        ("log_softmax_backward", lambda: pco.log_softmax_backward(x, x.double(), -1), TypeError, "float64"),
        ("long_softmax", lambda: pco.long_softmax(x, -1, pipeline="bogus"), ValueError, "pipeline"),
        ("layer_norm", lambda: pco.layer_norm(x, (x.shape[-1] + 1,)), ValueError, "normalized_shape"),
        ("layer_norm", lambda: pco.layer_norm(x, (x.shape[-1],), w.double()), TypeError, "weight"),
        (
            "layer_norm_backward",
            lambda: pco.layer_norm_backward(x[:, :3], x, (x.shape[-1],), w, x, x),
            ValueError,
            "grad_out",
        ),
        ("gemm", lambda: pco.gemm(x, x), ValueError, "inner dimensions differ"),
        ("gemm", lambda: pco.gemm(x, x.t().double()), TypeError, "'b' is torch.float64"),
        ("gemm_batched", lambda: pco.gemm_batched(x, x.t()), ValueError, "rank 3"),
    ]


VALID = {
    "softmax": (lambda x: pco.softmax(x, -1), lambda x: torch.softmax(x, -1)),
    "log_softmax": (lambda x: pco.log_softmax(x, -1), lambda x: torch.log_softmax(x, -1)),
    "online_softmax": (lambda x: pco.online_softmax(x, 0), lambda x: torch.softmax(x, 0)),
    "softmax_backward": (
        lambda x: pco.softmax_backward(x, torch.softmax(x, -1), -1),
        lambda x: torch.softmax(x, -1) * (x - (x * torch.softmax(x, -1)).sum(-1, keepdim=True)),
    ),
    "log_softmax_backward": (
        lambda x: pco.log_softmax_backward(x, torch.log_softmax(x, -1), -1),
        lambda x: x - torch.softmax(x, -1) * x.sum(-1, keepdim=True),
    ),
    "long_softmax": (lambda x: pco.long_softmax(x, -1), lambda x: torch.softmax(x, -1)),
    "layer_norm": (
        lambda x: pco.layer_norm(x, (x.shape[-1],)),
        lambda x: torch.nn.functional.layer_norm(x, (x.shape[-1],)),
    ),
    "layer_norm_backward": (
        lambda x: pco.layer_norm_backward(x, x, (x.shape[-1],), None, x.mean(-1), x.var(-1, unbiased=False).rsqrt())[1],
        lambda x: (x * (x - x.mean(-1, keepdim=True)) * x.var(-1, unbiased=False, keepdim=True).rsqrt()).sum(0),
    ),
    "gemm": (lambda x: pco.gemm(x, x.t()), lambda x: x @ x.t()),
    "gemm_batched": (lambda x: pco.gemm_batched(x[None], x.t()[None])[0], lambda x: x @ x.t()),
}


def test_after_any_error_the_next_valid_call_is_right(device):
    torch.manual_seed(3)
    x = torch.randn(6, 9, device=device)
    for name, bad, error, fragment in _bad_calls(x):
        with pytest.raises(error, match=fragment):
            bad()
        ours, ref = VALID[name]
        x2 = torch.randn(7, 11, device=device)
        torch.testing.assert_close(ours(x2), ref(x2), rtol=2e-5, atol=2e-5, msg=f"{name} after an error")


@given(dtype=st.sampled_from([torch.int64, torch.int32, torch.bool, torch.complex64, torch.uint8]))
def test_unsupported_dtypes_raise_for_every_op(device, dtype):
    x = torch.ones(3, 4, device=device).to(dtype)
    for call in (
        lambda: pco.softmax(x, -1),
        lambda: pco.log_softmax(x, -1),
        lambda: pco.online_softmax(x, -1),
        lambda: pco.long_softmax(x, -1),
        lambda: pco.layer_norm(x, (4,)),
        lambda: pco.gemm(x, x.t()),
        lambda: pco.gemm_batched(x[None], x.t()[None]),
    ):
        with pytest.raises(TypeError, match="dtype"):
            call()


# -- attention (day017's Triton kernels: CUDA here; their CPU interpreter runs in days/day017) ----
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels need CUDA outside the interpreter")
@given(data=st.data())
def test_cuda_flash_attention_and_grads_match_float64(data):
    d = data.draw(st.sampled_from([32, 64, 128]), label="head_dim")
    hkv = data.draw(st.sampled_from([1, 2]), label="kv heads")
    hq = hkv * data.draw(st.sampled_from([1, 2]), label="group")
    b = data.draw(st.integers(1, 2), label="batch")
    lq = data.draw(st.integers(1, 150), label="Lq")
    causal = data.draw(st.booleans(), label="causal")
    lk = lq if causal else data.draw(st.integers(1, 150), label="Lk")
    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float16]), label="dtype")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))

    def t(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q64, k64, v64, g64 = t(b, hq, lq, d), t(b, hkv, lk, d), t(b, hkv, lk, d), t(b, hq, lq, d)
    q, k, v = (x.to(dtype).cuda().requires_grad_() for x in (q64, k64, v64))
    o = pco.flash_attention(q, k, v, causal=causal)
    (o.double() * g64.cuda()).sum().backward()
    qr, kr, vr = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    rep = hq // hkv
    scores = qr @ kr.repeat_interleave(rep, 1).mT / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(scores, -1) @ vr.repeat_interleave(rep, 1)
    (ref * g64).sum().backward()
    close(o.detach(), ref.detach(), dtype, scale=4)
    for got, want in ((q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        close(got, want, dtype, scale=8 * math.sqrt(max(lq, lk)))
