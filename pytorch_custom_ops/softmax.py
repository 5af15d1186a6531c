"""`online_softmax(x, dim=-1)`: day009's Mojo kernel as a real torch op.

Registered with torch.library as `gpu_days::online_softmax`, so it has a fake (meta)
implementation for torch.compile, passes `torch.library.opcheck`, and is differentiable.
The Mojo kernel works on a contiguous (rows, cols) tensor; this file moves `dim` last,
flattens the rest into rows, and moves the result back.
"""

from __future__ import annotations

import math

import torch

from . import direct, eager, programs
from .contract import FLOAT_DTYPES, OpSpec, TensorArg, as_int, check_float_tensor
from .gpu_kernels import KernelFamily
from .mojo_op import MojoOp

ONLINE_SOFTMAX = OpSpec(
    name="online_softmax",
    outputs=(TensorArg("output", ("rows", "cols")),),
    inputs=(TensorArg("x", ("rows", "cols")),),
    params={"BLOCK": 256},  # threads per row; one compiled graph serves every shape
)

# --8<-- [start:gpu_plan]
ONLINE_SOFTMAX_KERNEL = KernelFamily(
    "days.day009.online_softmax",
    "online_softmax_kernel",
    args=("ptr", "ptr", "i64"),  # dst, src, cols
    variants=tuple((dtype, 256) for dtype in FLOAT_DTYPES),  # (dtype, BLOCK)
)


@direct.plan(ONLINE_SOFTMAX_KERNEL)
def _online_softmax_gpu(outputs, inputs, params) -> list[direct.Launch]:
    """One block of BLOCK threads per row."""
    (out,), (x,) = outputs, inputs
    rows, cols = x.shape
    block = params["BLOCK"]
    kernel = ONLINE_SOFTMAX_KERNEL[x.dtype, block]
    return [direct.Launch(kernel, grid=rows, block=block, args=(out.data_ptr(), x.data_ptr(), cols))]


# --8<-- [end:gpu_plan]
online_softmax_kernel = MojoOp(ONLINE_SOFTMAX, gpu=_online_softmax_gpu)


def check_softmax_args(name: str, x: torch.Tensor, dim: int) -> int:
    """Validate like torch does, with messages that name the op; return dim >= 0."""
    check_float_tensor(name, x)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name}: dim must be an int, got {type(dim).__name__}")
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"{name}: dim {dim} is out of range for a tensor of rank {x.dim()}")
    return dim % ndim


def _as_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """(…, n, …) -> contiguous (rows, n) with `dim` last; copies only when needed."""
    ndim = x.dim()
    if ndim == 2 and dim == 1 and x.is_contiguous():  # already rows: the common case costs no call
        return x
    if ndim == 0:
        return x.reshape(1, 1)
    moved = x if dim == x.dim() - 1 else x.movedim(dim, -1)  # the common case costs no call
    n = moved.shape[-1]
    return programs.contiguous(moved).view(math.prod(moved.shape[:-1]), n)  # not -1: ambiguous when n == 0


def _from_rows(out2d: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    ndim = x.dim()
    if ndim == 2 and dim == 1:
        return out2d
    if ndim == 0:
        return out2d.reshape(())
    if dim == ndim - 1:
        return out2d.view(x.shape)
    shape = list(x.movedim(dim, -1).shape)
    return programs.contiguous(out2d.view(shape).movedim(-1, dim))


def _online_softmax_eager(x: torch.Tensor, dim: int) -> torch.Tensor:
    dim = check_softmax_args("online_softmax", x, dim)
    rows = _as_rows(x, dim)
    (out,) = online_softmax_kernel([rows], torch_impl=lambda: [torch.softmax(rows, dim=-1)])
    return _from_rows(out, x, dim)


_online_softmax = torch.library.custom_op("gpu_days::online_softmax", _online_softmax_eager, mutates_args=())


@_online_softmax.register_fake
def _(x: torch.Tensor, dim: int) -> torch.Tensor:
    check_softmax_args("online_softmax", x, dim)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _setup_context(ctx, inputs, output):
    ctx.dim = inputs[1]
    ctx.save_for_backward(output)


def _backward(ctx, grad):
    # d softmax: y * (g - sum(g * y)), by day012's Mojo kernel
    from .softmax_family import softmax_backward

    (y,) = ctx.saved_tensors
    return softmax_backward(programs.contiguous(grad), y, ctx.dim), None


_online_softmax.register_autograd(_backward, setup_context=_setup_context)
_online_softmax_replayed = programs.replayed_forward("online_softmax", _online_softmax_eager, programs.split_one)
_online_softmax_autograd = eager.function(
    "OnlineSoftmax", _online_softmax_replayed, _setup_context, _backward, programs=True
)


def online_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax of `x` along `dim`, computed by day009's one-pass (online) Mojo kernel."""
    dim = as_int(dim)  # numpy's ints, as torch takes them
    return eager.call(
        (x,),
        (x, dim),
        eager=_online_softmax_replayed,
        autograd=_online_softmax_autograd,
        op=torch.ops.gpu_days.online_softmax,
        check=_check_online_softmax,
    )


def _check_online_softmax(x, dim) -> None:
    check_softmax_args("online_softmax", x, dim)
