"""Day 012's softmax family as torch ops: softmax, log_softmax and their backwards.

    y = softmax(x, dim)                    # torch.ops.gpu_days.softmax
    y = log_softmax(x, dim)                # torch.ops.gpu_days.log_softmax
    dx = softmax_backward(dy, y, dim)      # what autograd calls for softmax
    dx = log_softmax_backward(dy, y, dim)

Autograd runs the Mojo backward kernels; the backwards are differentiable too (in torch
math), so double backward and gradgradcheck work. Like day009's op, a plain eager call
skips the dispatcher; autograd, torch.compile and fake tensors go through it.
"""

from __future__ import annotations

import torch

from .contract import OpSpec, TensorArg
from .mojo_op import MojoOp
from .softmax import _as_rows, _from_rows, _needs_dispatcher, check_softmax_args

_ROWS = ("rows", "cols")


def _forward_spec(name: str) -> OpSpec:
    return OpSpec(name=name, outputs=(TensorArg("output", _ROWS),), inputs=(TensorArg("x", _ROWS),))


def _backward_spec(name: str) -> OpSpec:
    return OpSpec(
        name=name,
        outputs=(TensorArg("grad_input", _ROWS),),
        inputs=(TensorArg("grad_output", _ROWS), TensorArg("output", _ROWS)),
    )


softmax_kernel = MojoOp(_forward_spec("softmax"))
log_softmax_kernel = MojoOp(_forward_spec("log_softmax"))
softmax_backward_kernel = MojoOp(_backward_spec("softmax_backward"))
log_softmax_backward_kernel = MojoOp(_backward_spec("log_softmax_backward"))


# -- eager implementations: (…, n, …) -> rows -> Mojo -> back --------------------------------
def _forward(kernel: MojoOp, torch_fn, x: torch.Tensor, dim: int) -> torch.Tensor:
    name = kernel.spec.name
    dim = check_softmax_args(name, x, dim)
    rows = _as_rows(x, dim)
    (out,) = kernel([rows], torch_impl=lambda: [torch_fn(rows, dim=-1)])
    return _from_rows(out, x, dim)


def _check_backward_args(name: str, grad: torch.Tensor, out: torch.Tensor, dim: int) -> int:
    dim = check_softmax_args(name, grad, dim)
    check_softmax_args(name, out, dim)
    if grad.shape != out.shape:
        raise ValueError(f"{name}: grad_output has shape {tuple(grad.shape)} but output has {tuple(out.shape)}")
    if grad.dtype != out.dtype:
        raise TypeError(f"{name}: grad_output is {grad.dtype} but output is {out.dtype}")
    if grad.device != out.device:
        raise ValueError(f"{name}: grad_output is on {grad.device} but output is on {out.device}")
    return dim


def _torch_softmax_backward(g, y):
    return y * (g - (g * y).sum(-1, keepdim=True))


def _torch_log_softmax_backward(g, y):
    return g - torch.exp(y) * g.sum(-1, keepdim=True)


def _backward(kernel: MojoOp, torch_fn, grad: torch.Tensor, out: torch.Tensor, dim: int) -> torch.Tensor:
    name = kernel.spec.name
    dim = _check_backward_args(name, grad, out, dim)
    g_rows = _as_rows(grad, dim)
    y_rows = _as_rows(out, dim)
    (dx,) = kernel([g_rows, y_rows], torch_impl=lambda: [torch_fn(g_rows, y_rows)])
    return _from_rows(dx, grad, dim)


def _softmax_eager(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _forward(softmax_kernel, torch.softmax, x, dim)


def _log_softmax_eager(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _forward(log_softmax_kernel, torch.log_softmax, x, dim)


def _softmax_backward_eager(grad_output: torch.Tensor, output: torch.Tensor, dim: int) -> torch.Tensor:
    return _backward(softmax_backward_kernel, _torch_softmax_backward, grad_output, output, dim)


def _log_softmax_backward_eager(grad_output: torch.Tensor, output: torch.Tensor, dim: int) -> torch.Tensor:
    return _backward(log_softmax_backward_kernel, _torch_log_softmax_backward, grad_output, output, dim)


# -- torch.library registration -------------------------------------------------------------
_softmax_op = torch.library.custom_op("gpu_days::softmax", _softmax_eager, mutates_args=())
_log_softmax_op = torch.library.custom_op("gpu_days::log_softmax", _log_softmax_eager, mutates_args=())
_softmax_backward_op = torch.library.custom_op("gpu_days::softmax_backward", _softmax_backward_eager, mutates_args=())
_log_softmax_backward_op = torch.library.custom_op(
    "gpu_days::log_softmax_backward", _log_softmax_backward_eager, mutates_args=()
)


@_softmax_op.register_fake
def _(x, dim):
    check_softmax_args("softmax", x, dim)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_log_softmax_op.register_fake
def _(x, dim):
    check_softmax_args("log_softmax", x, dim)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_softmax_backward_op.register_fake
def _(grad_output, output, dim):
    _check_backward_args("softmax_backward", grad_output, output, dim)
    return torch.empty_like(grad_output, memory_format=torch.contiguous_format)


@_log_softmax_backward_op.register_fake
def _(grad_output, output, dim):
    _check_backward_args("log_softmax_backward", grad_output, output, dim)
    return torch.empty_like(grad_output, memory_format=torch.contiguous_format)


def _save_output(ctx, inputs, output):
    ctx.dim = inputs[1]
    ctx.save_for_backward(output)


def _save_grad_and_output(ctx, inputs, output):
    ctx.dim = inputs[2]
    ctx.save_for_backward(inputs[0], inputs[1])


# --8<-- [start:autograd]
def _softmax_grad(ctx, grad):
    (y,) = ctx.saved_tensors
    return torch.ops.gpu_days.softmax_backward(grad.contiguous(), y, ctx.dim), None


def _log_softmax_grad(ctx, grad):
    (y,) = ctx.saved_tensors
    return torch.ops.gpu_days.log_softmax_backward(grad.contiguous(), y, ctx.dim), None


def _softmax_backward_grad(ctx, h):
    # dx = y * (g - sum(g*y)). As a function of g it is the same map: grad_g = softmax_backward(h, y);
    # as a function of y: grad_y = h * (g - sum(g*y)) - g * sum(h*y).
    g, y = ctx.saved_tensors
    d = ctx.dim
    grad_g = torch.ops.gpu_days.softmax_backward(h.contiguous(), y, d)
    grad_y = h * (g - (g * y).sum(d, keepdim=True)) - g * (h * y).sum(d, keepdim=True)
    return grad_g, grad_y, None


def _log_softmax_backward_grad(ctx, h):
    # dx = g - exp(y) * sum(g): grad_g = h - sum(h * exp(y)), grad_y = -h * exp(y) * sum(g)
    g, y = ctx.saved_tensors
    d = ctx.dim
    p = torch.exp(y)
    grad_g = h - (h * p).sum(d, keepdim=True)
    grad_y = -h * p * g.sum(d, keepdim=True)
    return grad_g, grad_y, None


# --8<-- [end:autograd]

_softmax_op.register_autograd(_softmax_grad, setup_context=_save_output)
_log_softmax_op.register_autograd(_log_softmax_grad, setup_context=_save_output)
_softmax_backward_op.register_autograd(_softmax_backward_grad, setup_context=_save_grad_and_output)
_log_softmax_backward_op.register_autograd(_log_softmax_backward_grad, setup_context=_save_grad_and_output)


# -- the public functions ---------------------------------------------------------------------
def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax of `x` along `dim` (day012 Mojo kernels; any dim, float32/16, bfloat16, float64)."""
    if _needs_dispatcher(x):
        check_softmax_args("softmax", x, dim)
        return torch.ops.gpu_days.softmax(x, dim)
    return _softmax_eager(x, dim)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log(softmax(x)) along `dim`, computed as x - max - log(sum(exp(x - max)))."""
    if _needs_dispatcher(x):
        check_softmax_args("log_softmax", x, dim)
        return torch.ops.gpu_days.log_softmax(x, dim)
    return _log_softmax_eager(x, dim)


def softmax_backward(grad_output: torch.Tensor, output: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The gradient of softmax: output * (grad_output - sum(grad_output * output, dim))."""
    if _needs_dispatcher(grad_output) or _needs_dispatcher(output):
        _check_backward_args("softmax_backward", grad_output, output, dim)
        return torch.ops.gpu_days.softmax_backward(grad_output, output, dim)
    return _softmax_backward_eager(grad_output, output, dim)


def log_softmax_backward(grad_output: torch.Tensor, output: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The gradient of log_softmax: grad_output - exp(output) * sum(grad_output, dim)."""
    if _needs_dispatcher(grad_output) or _needs_dispatcher(output):
        _check_backward_args("log_softmax_backward", grad_output, output, dim)
        return torch.ops.gpu_days.log_softmax_backward(grad_output, output, dim)
    return _log_softmax_backward_eager(grad_output, output, dim)


class MojoSoftmax(torch.nn.Module):
    """Drop-in for `torch.nn.Softmax(dim)` backed by the day012 kernels."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    @property
    def use_mojo(self) -> bool:
        return softmax_kernel.ready() and softmax_backward_kernel.ready()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class MojoLogSoftmax(torch.nn.Module):
    """Drop-in for `torch.nn.LogSoftmax(dim)` backed by the day012 kernels."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    @property
    def use_mojo(self) -> bool:
        return log_softmax_kernel.ready() and log_softmax_backward_kernel.ready()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return log_softmax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


KERNELS = (softmax_kernel, log_softmax_kernel, softmax_backward_kernel, log_softmax_backward_kernel)
