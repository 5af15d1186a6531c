"""`add_layer_norm(x, delta, normalized_shape, weight, bias, eps, out_dtype)`: a pre-LN
residual stream's add and the LayerNorm after it, in one pass (day 020), and
`MojoAddLayerNorm`, the module a transformer block calls as `x, h = ln(x, delta)`.

    s = x + delta            (delta may be None: s is x)
    y = layer_norm(s) in out_dtype
    returns (s, y)

Why: in a GPT trained under autocast the residual stream is float32 and the matrix
products read and write bfloat16. Composed from torch ops, each LayerNorm costs an add
kernel (bf16 + fp32), the LayerNorm, and a cast of its float32 output to bfloat16; its
backward a cast of the incoming bf16 gradient, the LayerNorm backward, an add of the
residual gradient and a cast back for delta. torch.compile fuses all of that; day 013's
kernels now do it too, with `ldtype` (y's dtype) beside `dtype` (x's) and flags for the
add (see `layer_norm.mojo`). Per call that is one read of x and delta and one write of s
and y forward; one read of dy, s and the residual gradient and one write of each
gradient backward.

Dtypes: s has x's dtype. y has `out_dtype`: by default the autocast dtype under autocast
and x's dtype otherwise; it may be x's dtype, or bfloat16/float16 when x is float32.
delta may have x's dtype or y's (a bf16 product next to a float32 stream); it may not be
wider than x. weight and bias have x's dtype (cast to it under autocast, as torch casts
a LayerNorm's to float32). Statistics are computed in float32 (float64 for float64) and
stored as float32, as in day 013.

On CUDA the fused kernels run (strict mode: no torch fallback). On the CPU the op is the
composition of torch's add and cast with day 013's LayerNorm ops (MAX on the CPU), the
same numbers by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import direct, eager, programs
from .contract import OpSpec, TensorArg, check_float_tensor
from .layer_norm import (
    DTYPE_PAIRS,
    LN_BWD,
    LN_BWD_ONE,
    LN_BWD_STREAM,
    LN_FWD,
    LN_FWD_STREAM,
    LN_SUM_PARTIALS,
    _layer_norm_backward_eager,
    _layer_norm_eager,
    _param,
    _split,
    _torch_backward,
    _torch_forward,
    backward_launches,
    check_layer_norm_args,
    forward_launches,
)
from .mojo_op import MojoOp, device_constant

_LOW = (torch.bfloat16, torch.float16)


# -- the CUDA ops: one fixed-dtype spec per (dtype, ldtype) and form ----------------------
def _rc(name, dtype):
    return TensorArg(name, ("rows", "cols"), dtype)


def _forward_spec(dtype, ldtype, add: bool, stats: bool) -> OpSpec:
    """`stats` False: no mean and rstd (a call without autograd, the kernels' NO_STATS)."""
    stat_args = (TensorArg("mean", ("rows",), torch.float32), TensorArg("rstd", ("rows",), torch.float32))
    return OpSpec(
        name="add_layer_norm",
        outputs=(_rc("y", ldtype), *(stat_args if stats else ())) + ((_rc("x_sum", dtype),) if add else ()),
        inputs=(
            _rc("x", dtype),
            TensorArg("weight", ("cols",), dtype),
            TensorArg("bias", ("cols",), dtype),
            TensorArg("eps", (1,), torch.float32),
        )
        + ((_rc("delta", ldtype),) if add else ()),
        dtypes=(dtype,),
    )


def _backward_spec(dtype, ldtype, add_grad: bool, low: bool) -> OpSpec:
    return OpSpec(
        name="add_layer_norm_backward",
        outputs=(
            _rc("grad_x", dtype),
            TensorArg("grad_weight", ("cols",), dtype),
            TensorArg("grad_bias", ("cols",), dtype),
        )
        + ((_rc("grad_low", ldtype),) if low else ()),
        inputs=(
            _rc("grad_out", ldtype),
            _rc("x", dtype),
            TensorArg("weight", ("cols",), dtype),
            TensorArg("mean", ("rows",), torch.float32),
            TensorArg("rstd", ("rows",), torch.float32),
        )
        + ((_rc("grad_resid", dtype),) if add_grad else ()),
        dtypes=(dtype,),
    )


@direct.plan(LN_FWD, LN_FWD_STREAM)
def _forward_gpu(outputs, inputs, params):
    y, mean, rstd, *x_sum = outputs
    x, weight, bias, eps, *delta = inputs
    return forward_launches(y, mean, rstd, x, weight, bias, eps, *delta, *x_sum)


@direct.plan(LN_FWD, LN_FWD_STREAM)
def _forward_y_gpu(outputs, inputs, params):
    y, *x_sum = outputs
    x, weight, bias, eps, *delta = inputs
    return forward_launches(y, None, None, x, weight, bias, eps, *delta, *x_sum)


@direct.plan(LN_BWD, LN_BWD_STREAM, LN_SUM_PARTIALS, LN_BWD_ONE)
def _backward_gpu(outputs, inputs, params):
    grad_x, grad_weight, grad_bias, *grad_low = outputs
    grad_out, x, weight, mean, rstd, *grad_resid = inputs
    return backward_launches(
        grad_x, grad_weight, grad_bias, grad_out, x, weight, mean, rstd, *(grad_resid or [None]), *grad_low
    )


FORWARD_OPS = {  # (dtype, ldtype, add, stats)
    (d, ld, add, stats): MojoOp(_forward_spec(d, ld, add, stats), gpu=_forward_gpu if stats else _forward_y_gpu)
    for d, ld in DTYPE_PAIRS
    for add in (False, True)
    for stats in (False, True)
}
BACKWARD_OPS = {
    (d, ld, add, low): MojoOp(_backward_spec(d, ld, add, low), gpu=_backward_gpu)
    for d, ld in DTYPE_PAIRS
    for add in (False, True)
    for low in (False, True)
    if ld != d or not low  # grad_low exists only where delta is narrower than x
}


# -- argument checks ----------------------------------------------------------------------
def resolve_out_dtype(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    """y's dtype: `out_dtype`, else the autocast dtype under autocast (for a float32 x), else x's."""
    if out_dtype is None:
        ac = eager.autocast_dtype(x)
        out_dtype = ac if ac is not None and x.dtype == torch.float32 else x.dtype
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"add_layer_norm: out_dtype must be a torch.dtype or None, got {type(out_dtype).__name__}")
    if out_dtype != x.dtype and not (x.dtype == torch.float32 and out_dtype in _LOW):
        raise TypeError(
            f"add_layer_norm: out_dtype {out_dtype} is not supported for a {x.dtype} input "
            "(x's dtype, or bfloat16/float16 for a float32 x)"
        )
    return out_dtype


def check_delta(x: torch.Tensor, delta: torch.Tensor | None) -> None:
    if delta is None:
        return
    if not isinstance(delta, torch.Tensor):
        raise TypeError(f"add_layer_norm: delta must be a torch.Tensor or None, got {type(delta).__name__}")
    check_float_tensor("add_layer_norm", delta)
    if delta.shape != x.shape:
        raise ValueError(f"add_layer_norm: delta {tuple(delta.shape)} must have x's shape {tuple(x.shape)}")
    if delta.device != x.device:
        raise ValueError(f"add_layer_norm: delta is on {delta.device} but x is on {x.device}")
    if delta.dtype != x.dtype and not (x.dtype == torch.float32 and delta.dtype in _LOW):
        raise TypeError(
            f"add_layer_norm: delta is {delta.dtype} but x is {x.dtype}: delta may have x's dtype, or "
            "bfloat16/float16 next to a float32 x (the residual stream keeps x's dtype)"
        )


# -- forward ------------------------------------------------------------------------------
def _shaped(t: torch.Tensor, shape) -> torch.Tensor:
    """t viewed as `shape`, t itself where it has it (a replayed view costs the host ~0.5 us)."""
    return t if t.shape == shape else t.view(shape)


def _forward(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    out_dtype: torch.dtype,
    stats: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(y, x_sum, mean, rstd); x_sum is None when delta is None (the sum is x), and on
    CUDA mean and rstd are None without `stats` (the kernels skip them). No tensor is made
    outside the op calls, so that the calls replay as a program (programs.py)."""
    shape = check_layer_norm_args("add_layer_norm", x, normalized_shape, weight, bias, eps)
    check_delta(x, delta)
    out_dtype = resolve_out_dtype(x, out_dtype)
    if not x.is_cuda:  # the CPU: torch's add and cast around day 013's CPU ops
        s = x if delta is None else x + delta
        y, mean, rstd = _layer_norm_eager(s, shape, weight, bias, eps)
        return y.to(out_dtype), (None if delta is None else s), mean, rstd
    lead, rows, cols = _split(x, shape)
    if rows == 0 or cols == 0:
        y, mean, rstd = _layer_norm_eager(x, shape, weight, bias, eps)
        return y.to(out_dtype), (None if delta is None else x + delta), mean, rstd
    if delta is not None and delta.dtype != out_dtype:  # the kernels read delta in y's dtype: add first
        s = x + delta
        y, _, mean, rstd = _forward(s, None, shape, weight, bias, eps, out_dtype, stats)
        return y, s, mean, rstd
    x2 = programs.contiguous(x).view(rows, cols)
    d2 = None if delta is None else programs.contiguous(delta).view(rows, cols)
    w, b = _param(weight, x, cols, 1.0), _param(bias, x, cols, 0.0)
    eps_t = device_constant((float(eps),), torch.float32, x.device)
    op = FORWARD_OPS[(x.dtype, out_dtype, d2 is not None, stats)]

    def torch_impl():
        s = x2 if d2 is None else (x2 + d2)
        y, mean, rstd = _torch_forward(s, w, b, float(eps))
        return [y.to(out_dtype)] + ([mean, rstd] if stats else []) + ([] if d2 is None else [s])

    outs = op([x2, w, b, eps_t] + ([] if d2 is None else [d2]), torch_impl=torch_impl)
    mean, rstd = (_shaped(outs[1], lead), _shaped(outs[2], lead)) if stats else (None, None)
    x_sum = None if d2 is None else _shaped(outs[-1], x.shape)
    return _shaped(outs[0], x.shape), x_sum, mean, rstd


def _forward_eager(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registered op (its schema below): (y, x_sum, mean, rstd), x_sum empty when delta
    is None."""
    y, x_sum, mean, rstd = _forward(*args, True)
    return y, (args[0].new_empty(0) if x_sum is None else x_sum), mean, rstd


def _forward_graded(x, delta, normalized_shape, weight, bias, eps, out_dtype):
    """The autograd.Function's forward: (y, x_sum or None, mean, rstd)."""
    return _forward(x, delta, normalized_shape, weight, bias, eps, out_dtype, True)


def _forward_y(x, delta, normalized_shape, weight, bias, eps, out_dtype):
    """Without autograd: (s, y), no statistics."""
    y, x_sum, _, _ = _forward(x, delta, normalized_shape, weight, bias, eps, out_dtype, False)
    return (x if x_sum is None else x_sum), y


def _split_call(x, delta, normalized_shape, weight, bias, eps, out_dtype):
    """A call's tensors and other arguments, as a program's key (programs.py)."""
    tensors, absent = programs.present(x, delta, weight, bias)
    return tensors, (normalized_shape, eps, eps.__class__, out_dtype, absent)


_y_replayed = programs.replayed_forward("add_layer_norm_y", _forward_y, _split_call, single=False)
_graded_replayed = programs.replayed_forward("add_layer_norm", _forward_graded, _split_call, single=False)


_forward_op = torch.library.custom_op(
    "gpu_days::add_layer_norm",
    _forward_eager,
    mutates_args=(),
    schema="(Tensor x, Tensor? delta, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps, "
    "ScalarType out_dtype) -> (Tensor, Tensor, Tensor, Tensor)",
)


@_forward_op.register_fake
def _(x, delta, normalized_shape, weight, bias, eps, out_dtype):
    shape = check_layer_norm_args("add_layer_norm", x, normalized_shape, weight, bias, eps)
    check_delta(x, delta)
    out_dtype = resolve_out_dtype(x, out_dtype)
    stats = torch.empty(x.shape[: x.dim() - len(shape)], dtype=torch.float32, device=x.device)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    x_sum = x.new_empty(0) if delta is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, x_sum, stats, torch.empty_like(stats)


# -- backward -----------------------------------------------------------------------------
def _backward_grads(
    grad_y: torch.Tensor,
    grad_sum: torch.Tensor | None,
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    write_low: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_low, grad_weight, grad_bias) for the LayerNorm of x (the sum s):
    grad_x = grad_sum + LayerNorm's input gradient, in x's dtype; grad_low is grad_x in
    grad_y's dtype when `write_low` (delta's gradient), else None. No tensor is made
    outside the op calls: a backward replays them as a program."""
    shape = check_layer_norm_args("add_layer_norm_backward", x, normalized_shape, weight, None, 0.0)
    if grad_y.shape != x.shape or (grad_sum is not None and grad_sum.shape != x.shape):
        raise ValueError(f"add_layer_norm_backward: gradients must have x's shape {tuple(x.shape)}")
    if grad_sum is not None and grad_sum.dtype != x.dtype:
        raise TypeError(f"add_layer_norm_backward: grad_sum is {grad_sum.dtype} but x is {x.dtype}")
    if grad_y.dtype != x.dtype and not (x.dtype == torch.float32 and grad_y.dtype in _LOW):
        raise TypeError(
            f"add_layer_norm_backward: grad_y is {grad_y.dtype} but x is {x.dtype}: grad_y has y's dtype, "
            "x's or bfloat16/float16 next to a float32 x"
        )
    if write_low and grad_y.dtype == x.dtype:
        raise ValueError("add_layer_norm_backward: write_low needs grad_y narrower than x")
    lead, rows, cols = _split(x, shape)
    if not x.is_cuda or rows == 0 or cols == 0:  # day 013's ops, torch's add and cast
        gx, gw, gb = _layer_norm_backward_eager(grad_y.to(x.dtype), x, shape, weight, mean, rstd)
        if grad_sum is not None:
            gx = gx + grad_sum
        return gx, (gx.to(grad_y.dtype) if write_low else None), gw, gb
    x2 = programs.contiguous(x).view(rows, cols)
    gy2 = programs.contiguous(grad_y).view(rows, cols)
    gs2 = None if grad_sum is None else programs.contiguous(grad_sum).view(rows, cols)
    w = _param(weight, x, cols, 1.0)
    m, r = mean.to(torch.float32).contiguous().view(rows), rstd.to(torch.float32).contiguous().view(rows)
    op = BACKWARD_OPS[(x.dtype, grad_y.dtype, gs2 is not None, bool(write_low))]

    def torch_impl():
        gx, gw, gb = _torch_backward(gy2, x2, w, m, r)
        if gs2 is not None:
            gx = gx + gs2
        return [gx, gw, gb] + ([gx.to(grad_y.dtype)] if write_low else [])

    outs = op([gy2, x2, w, m, r] + ([] if gs2 is None else [gs2]), torch_impl=torch_impl)
    gx, gw, gb = _shaped(outs[0], x.shape), _shaped(outs[1], shape), _shaped(outs[2], shape)
    return gx, (_shaped(outs[3], x.shape) if write_low else None), gw, gb


def _backward_eager(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registered op (its schema below): `_backward_grads` with an empty grad_low where
    `write_low` is False."""
    gx, low, gw, gb = _backward_grads(*args)
    return gx, (args[2].new_empty(0, dtype=args[0].dtype) if low is None else low), gw, gb


_backward_op = torch.library.custom_op(
    "gpu_days::add_layer_norm_backward",
    _backward_eager,
    mutates_args=(),
    schema="(Tensor grad_y, Tensor? grad_sum, Tensor x, SymInt[] normalized_shape, Tensor? weight, Tensor mean, "
    "Tensor rstd, bool write_low) -> (Tensor, Tensor, Tensor, Tensor)",
)


@_backward_op.register_fake
def _(grad_y, grad_sum, x, normalized_shape, weight, mean, rstd, write_low):
    shape = check_layer_norm_args("add_layer_norm_backward", x, normalized_shape, weight, None, 0.0)
    gx = torch.empty_like(x, memory_format=torch.contiguous_format)
    low = torch.empty(x.shape if write_low else (0,), dtype=grad_y.dtype, device=x.device)
    return gx, low, x.new_empty(shape), x.new_empty(shape)


def _setup_context(ctx, inputs, output):
    x, delta, normalized_shape, weight, bias, _eps, _out_dtype = inputs
    _y, x_sum, mean, rstd = output
    ctx.normalized_shape = normalized_shape
    ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
    ctx.delta_dtype = None if delta is None else delta.dtype
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x if delta is None else x_sum, weight, mean, rstd)


def _backward(ctx, grad_y, grad_sum, _grad_mean, _grad_rstd):
    s, weight, mean, rstd = ctx.saved_tensors
    if ctx.delta_dtype is None:  # x_sum was the empty placeholder (tracing may hand it zeros)
        grad_sum = None
    if grad_y is None:  # y unused: s's gradient passes through the add
        gx = grad_sum
        gd = None if gx is None or ctx.delta_dtype is None else gx.to(ctx.delta_dtype)
        return gx, gd, None, None, None, None, None
    eager.refuse_double_backward("add_layer_norm")  # (the pass-through above stays differentiable)
    write_low = ctx.delta_dtype is not None and ctx.delta_dtype == grad_y.dtype != s.dtype
    args = (grad_y, grad_sum, s, ctx.normalized_shape, weight, mean, rstd, write_low)
    eager_call = eager.route(grad_y, grad_sum, s, weight, mean, rstd) is eager.EAGER  # no empty grad_low made
    gx, low, gw, gb = (_backward_grads if eager_call else add_layer_norm_backward)(*args)
    gd = None if ctx.delta_dtype is None else (low if write_low else gx.to(ctx.delta_dtype))
    return gx, gd, None, gw if ctx.has_weight else None, gb if ctx.has_bias else None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)
_autograd = eager.function("AddLayerNorm", _graded_replayed, _setup_context, _backward, programs=True)


# -- public API ---------------------------------------------------------------------------
def add_layer_norm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y): s = x + delta (x when delta is None), y = layer_norm(s) in `out_dtype`
    (see the module's docstring for the dtypes), differentiable in x, delta, weight and
    bias."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"add_layer_norm: x must be a torch.Tensor, got {type(x).__name__}")
    out_dtype = resolve_out_dtype(x, out_dtype)
    if eager.autocast_dtype(x) is not None:  # weight and bias follow x, as torch's follow float32
        weight, bias = eager.cast_floats(x.dtype, weight, bias)
    way = eager.route(x, delta, weight, bias)
    args = (x, delta, normalized_shape, weight, bias, eps, out_dtype)
    if way is eager.EAGER:  # no autograd: no statistics, and a program replays the call
        return _y_replayed(*args)
    if way is eager.AUTOGRAD:
        y, s = _autograd(*args)[:2]
    else:
        shape = check_layer_norm_args("add_layer_norm", x, normalized_shape, weight, bias, eps)
        check_delta(x, delta)  # (torch.compile's path: the op, whose x_sum is a tensor)
        op = torch.ops.gpu_days.add_layer_norm
        y, s = eager.run_op("add_layer_norm", op, x, delta, list(shape), weight, bias, float(eps), out_dtype)[:2]
    return (x if delta is None else s), y


def add_layer_norm_backward(grad_y, grad_sum, x, normalized_shape, weight, mean, rstd, write_low=False):
    """(grad_x, grad_low, grad_weight, grad_bias) of `add_layer_norm` (the Mojo backward
    kernels): x is the normalised sum s, grad_sum the gradient that reached s otherwise."""
    if eager.route(grad_y, grad_sum, x, weight, mean, rstd) is eager.EAGER:
        return _backward_eager(grad_y, grad_sum, x, normalized_shape, weight, mean, rstd, write_low)
    shape = check_layer_norm_args("add_layer_norm_backward", x, normalized_shape, weight, None, 0.0)
    return torch.ops.gpu_days.add_layer_norm_backward(grad_y, grad_sum, x, list(shape), weight, mean, rstd, write_low)


class MojoAddLayerNorm(torch.nn.LayerNorm):
    """A LayerNorm that first adds a residual branch: `s, y = ln(x, delta)`. Same
    constructor, parameters and state_dict keys as `torch.nn.LayerNorm`. `out_dtype` as in
    `add_layer_norm` (None: the autocast dtype under autocast, else x's)."""

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
        return add_layer_norm(x, delta, self.normalized_shape, self.weight, self.bias, self.eps, out_dtype)
