"""`layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5)`: day013's Mojo
LayerNorm as torch ops, and `MojoLayerNorm`, a drop-in for `torch.nn.LayerNorm`.

Two ops are registered with torch.library:
- `gpu_days::layer_norm(x, normalized_shape, weight, bias, eps) -> (y, mean, rstd)`
- `gpu_days::layer_norm_backward(grad_out, x, normalized_shape, weight, mean, rstd)
  -> (grad_x, grad_weight, grad_bias)`
The first is differentiable through the second (the Mojo backward kernels), and both
have fake implementations for torch.compile. mean and rstd are float32 for every input
dtype and have the shape of the leading (not normalized) dims of x; rstd is
1 / sqrt(var + eps), which is what the backward needs. grad_weight and grad_bias come
back in the input dtype (summed in float32, float64 for float64 inputs).

The Mojo kernels see a contiguous (rows, cols) tensor: the normalized dims are flattened
into cols, the others into rows. A missing weight or bias becomes ones or zeros.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .contract import OpSpec, TensorArg, check_float_tensor
from .mojo_op import MojoOp

LAYER_NORM = OpSpec(
    name="layer_norm",
    outputs=(
        TensorArg("y", ("rows", "cols")),
        TensorArg("mean", ("rows",), dtype=torch.float32),
        TensorArg("rstd", ("rows",), dtype=torch.float32),
    ),
    inputs=(
        TensorArg("x", ("rows", "cols")),
        TensorArg("weight", ("cols",)),
        TensorArg("bias", ("cols",)),
        TensorArg("eps", (1,), dtype=torch.float32),  # a runtime value: no recompile per eps
    ),
)
LAYER_NORM_BACKWARD = OpSpec(
    name="layer_norm_backward",
    outputs=(
        TensorArg("grad_x", ("rows", "cols")),
        TensorArg("grad_weight", ("cols",)),
        TensorArg("grad_bias", ("cols",)),
    ),
    inputs=(
        TensorArg("grad_out", ("rows", "cols")),
        TensorArg("x", ("rows", "cols")),
        TensorArg("weight", ("cols",)),
        TensorArg("mean", ("rows",), dtype=torch.float32),
        TensorArg("rstd", ("rows",), dtype=torch.float32),
    ),
)
layer_norm_kernel = MojoOp(LAYER_NORM)
layer_norm_backward_kernel = MojoOp(LAYER_NORM_BACKWARD)


# -- argument checks: torch's rules, with messages that name the op ----------------------
def normalized_shape_tuple(name: str, normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
        normalized_shape = (normalized_shape,)
    if not isinstance(normalized_shape, Sequence) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in normalized_shape
    ):
        raise TypeError(f"{name}: normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}")
    shape = tuple(int(d) for d in normalized_shape)
    if not shape:
        raise ValueError(f"{name}: normalized_shape must have at least one dim, got ()")
    if any(d < 0 for d in shape):
        raise ValueError(f"{name}: normalized_shape {shape} has a negative size")
    return shape


def check_layer_norm_args(name: str, x, normalized_shape, weight, bias, eps) -> tuple[int, ...]:
    """Validate like torch does; return normalized_shape as a tuple."""
    check_float_tensor(name, x)
    shape = normalized_shape_tuple(name, normalized_shape)
    if x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape) :]) != shape:
        raise ValueError(
            f"{name}: normalized_shape {shape} does not match the last {len(shape)} dim(s) "
            f"of the input, whose shape is {tuple(x.shape)}"
        )
    for pname, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name}: {pname} must be a torch.Tensor or None, got {type(p).__name__}")
        if tuple(p.shape) != shape:
            raise ValueError(f"{name}: {pname} must have shape {shape} (normalized_shape), got {tuple(p.shape)}")
        if p.dtype != x.dtype:
            raise TypeError(f"{name}: {pname} is {p.dtype} but the input is {x.dtype}; they must match")
        if p.device != x.device:
            raise ValueError(f"{name}: {pname} is on {p.device} but the input is on {x.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{name}: eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{name}: eps must be finite and >= 0, got {eps}")
    return shape


def _split(x: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Size, int, int]:
    """(leading dims, rows, cols) of x normalized over its trailing `shape`."""
    lead = x.shape[: x.dim() - len(shape)]
    return lead, math.prod(lead), math.prod(shape)


def _param(p: torch.Tensor | None, x: torch.Tensor, cols: int, fill: float) -> torch.Tensor:
    if p is None:
        return torch.full((cols,), fill, dtype=x.dtype, device=x.device)
    return p.contiguous().view(cols)


# -- forward ------------------------------------------------------------------------------
def _torch_forward(x2, w, b, eps):
    """The fallback (and the meaning of the outputs): statistics in float32 or float64,
    stored as float32."""
    acc = torch.float64 if x2.dtype == torch.float64 else torch.float32
    xa = x2.to(acc)
    var, mu = torch.var_mean(xa, dim=1, unbiased=False)
    r = torch.rsqrt(var + eps)
    y = (xa - mu[:, None]) * r[:, None] * w.to(acc) + b.to(acc)
    return [y.to(x2.dtype), mu.float(), r.float()]


def _layer_norm_eager(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = check_layer_norm_args("layer_norm", x, normalized_shape, weight, bias, eps)
    lead, rows, cols = _split(x, shape)
    x2 = x.contiguous().view(rows, cols)
    if rows == 0 or cols == 0:
        y = torch.empty_like(x2)
        # what torch.native_layer_norm gives for an empty normalized shape
        mean = torch.zeros(rows, dtype=torch.float32, device=x.device)
        rstd = torch.full((rows,), math.nan, dtype=torch.float32, device=x.device)
    else:
        w, b = _param(weight, x, cols, 1.0), _param(bias, x, cols, 0.0)
        eps_t = torch.full((1,), float(eps), dtype=torch.float32, device=x.device)
        y, mean, rstd = layer_norm_kernel([x2, w, b, eps_t], torch_impl=lambda: _torch_forward(x2, w, b, float(eps)))
    return y.view(x.shape), mean.view(lead), rstd.view(lead)


_layer_norm_op = torch.library.custom_op("gpu_days::layer_norm", _layer_norm_eager, mutates_args=())


@_layer_norm_op.register_fake
def _(x, normalized_shape, weight, bias, eps):
    shape = check_layer_norm_args("layer_norm", x, normalized_shape, weight, bias, eps)
    lead = x.shape[: x.dim() - len(shape)]
    stats = torch.empty(lead, dtype=torch.float32, device=x.device)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


# -- backward -----------------------------------------------------------------------------
def _torch_backward(go2, x2, w, mean, rstd):
    acc = torch.float64 if x2.dtype == torch.float64 else torch.float32
    dy = go2.to(acc)
    xhat = (x2.to(acc) - mean.to(acc)[:, None]) * rstd.to(acc)[:, None]
    g = dy * w.to(acc)
    a = g.mean(dim=1, keepdim=True)
    b = (g * xhat).mean(dim=1, keepdim=True)
    gx = rstd.to(acc)[:, None] * (g - a - xhat * b)
    return [t.to(x2.dtype) for t in (gx, (dy * xhat).sum(0), dy.sum(0))]


def _layer_norm_backward_eager(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = check_layer_norm_args("layer_norm_backward", x, normalized_shape, weight, None, 0.0)
    if grad_out.shape != x.shape:
        raise ValueError(f"layer_norm_backward: grad_out {tuple(grad_out.shape)} must match x {tuple(x.shape)}")
    lead, rows, cols = _split(x, shape)
    go2 = grad_out.to(x.dtype).contiguous().view(rows, cols)
    x2 = x.contiguous().view(rows, cols)
    if rows == 0 or cols == 0:
        gx = torch.empty_like(x2)
        gw = torch.zeros(cols, dtype=x.dtype, device=x.device)
        gb = torch.zeros(cols, dtype=x.dtype, device=x.device)
    else:
        w = _param(weight, x, cols, 1.0)
        m = mean.to(torch.float32).contiguous().view(rows)
        r = rstd.to(torch.float32).contiguous().view(rows)
        gx, gw, gb = layer_norm_backward_kernel(
            [go2, x2, w, m, r], torch_impl=lambda: _torch_backward(go2, x2, w, m, r)
        )
    return gx.view(x.shape), gw.view(shape), gb.view(shape)


_layer_norm_backward_op = torch.library.custom_op(
    "gpu_days::layer_norm_backward", _layer_norm_backward_eager, mutates_args=()
)


@_layer_norm_backward_op.register_fake
def _(grad_out, x, normalized_shape, weight, mean, rstd):
    shape = check_layer_norm_args("layer_norm_backward", x, normalized_shape, weight, None, 0.0)
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    return grad_x, x.new_empty(shape), x.new_empty(shape)


def _setup_context(ctx, inputs, output):
    x, normalized_shape, weight, bias, _eps = inputs
    _y, mean, rstd = output
    ctx.normalized_shape = normalized_shape
    ctx.has_weight = weight is not None
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)


def _backward(ctx, grad_y, _grad_mean, _grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    grad_x, grad_w, grad_b = torch.ops.gpu_days.layer_norm_backward(grad_y, x, ctx.normalized_shape, weight, mean, rstd)
    return grad_x, None, grad_w if ctx.has_weight else None, grad_b if ctx.has_bias else None, None


_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


# -- public API ---------------------------------------------------------------------------
def layer_norm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """`torch.nn.functional.layer_norm`, computed by day013's Mojo kernels (forward and
    backward). normalized_shape may span several trailing dims, or be an int."""
    if _needs_dispatcher(x, weight, bias):
        shape = check_layer_norm_args("layer_norm", x, normalized_shape, weight, bias, eps)
        return torch.ops.gpu_days.layer_norm(x, list(shape), weight, bias, float(eps))[0]
    return _layer_norm_eager(x, normalized_shape, weight, bias, eps)[0]


def layer_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight, grad_bias) of `layer_norm` from the mean and rstd that
    `torch.ops.gpu_days.layer_norm` returned (the Mojo backward kernels)."""
    if _needs_dispatcher(grad_out, x, weight, mean, rstd):
        shape = check_layer_norm_args("layer_norm_backward", x, normalized_shape, weight, None, 0.0)
        return torch.ops.gpu_days.layer_norm_backward(grad_out, x, list(shape), weight, mean, rstd)
    return _layer_norm_backward_eager(grad_out, x, normalized_shape, weight, mean, rstd)


def _needs_dispatcher(*tensors) -> bool:
    """Autograd, torch.compile tracing and tensor subclasses (fake tensors...) need the
    registered op; a plain eager call skips the dispatcher (see softmax.py)."""
    if torch.compiler.is_compiling():
        return True
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor or (grad and t.requires_grad):
            return True
    return False


class MojoLayerNorm(torch.nn.LayerNorm):
    """Drop-in for `torch.nn.LayerNorm` backed by day013's Mojo kernels.

    Same constructor (normalized_shape, eps, elementwise_affine, bias, device, dtype),
    same parameters and state_dict keys: an `nn.LayerNorm`'s state loads as is."""

    @property
    def use_mojo(self) -> bool:
        return layer_norm_kernel.ready() and layer_norm_backward_kernel.ready()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
