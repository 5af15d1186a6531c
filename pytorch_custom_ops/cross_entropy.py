"""`cross_entropy(logits, targets)`: day020's fused Mojo kernel as a torch op.

    loss = pco.cross_entropy(logits, targets, ignore_index=-100, reduction="mean")

Like `F.cross_entropy` for (N, C) logits and (N,) int64 class indices. The forward reads
each row of logits once and, when autograd needs it, writes the gradient of the logits in
the same pass (day020's kernel): the backward only multiplies that gradient by the
incoming one. Without autograd only the loss is computed. Two ops are registered:
`gpu_days::cross_entropy` -> (loss, grad_logits) and `gpu_days::cross_entropy_loss` -> loss.

Targets outside [0, C) that are not `ignore_index` raise ValueError (a check that reads the
targets on the host; inside a CUDA-graph capture, where the host cannot read them, such a
row's loss and gradient are NaN instead).
"""

from __future__ import annotations

import torch

from . import direct, eager
from .contract import FLOAT_DTYPES, OpSpec, TensorArg, check_float_tensor
from .gpu_kernels import KernelFamily
from .mojo_op import MojoOp
from .softmax_family import MAX_GRID, VEC_BYTES, cached_count

REDUCTIONS = ("mean", "sum", "none")
_LOGITS = TensorArg("logits", ("rows", "cols"))
_TARGETS = TensorArg("targets", ("rows",), torch.int64)
_LOSS = TensorArg("loss", ("rows",), torch.float64)  # per row; summed in float64, then cast

CROSS_ENTROPY = OpSpec(
    name="cross_entropy",
    outputs=(TensorArg("grad", ("rows", "cols")), _LOSS),
    inputs=(_LOGITS, _TARGETS, TensorArg("scale", (1,), torch.float64)),
    params={"IGNORE_INDEX": -100},
)
CROSS_ENTROPY_LOSS = OpSpec(
    name="cross_entropy_loss", outputs=(_LOSS,), inputs=(_LOGITS, _TARGETS), params={"IGNORE_INDEX": -100}
)

# --8<-- [start:gpu_plan]
SMALL_ROW = 8192  # columns up to which 256 threads per row are enough
CE_KERNEL = KernelFamily(
    "days.day020.cross_entropy",
    "cross_entropy_kernel",
    # grad, loss, logits, targets, scale, cols, cached, ignore_index
    args=("ptr",) * 5 + ("i64",) * 3,
    variants=tuple(
        (dtype, w, block, grad)
        for dtype in FLOAT_DTYPES
        for w in (VEC_BYTES // dtype.itemsize, 1)
        for block in (256, 1024)
        for grad in (False, True)
    ),
)


def _plan(grad_wanted: bool):
    @direct.plan(CE_KERNEL)
    def plan(outputs, inputs, params) -> list[direct.Launch]:
        """One block per row; with a gradient, the row cached in shared memory (as much
        as CACHE_BYTES holds: day012's looped-kernel budget)."""
        if grad_wanted:
            (grad, loss), (logits, targets, scale) = outputs, inputs
        else:
            ((loss,), (logits, targets)), grad = (outputs, inputs), None
        rows, cols = logits.shape
        if rows > MAX_GRID:
            raise ValueError(f"cross_entropy: {rows} rows are more than one launch can have")
        dtype, elem = logits.dtype, logits.element_size()
        vec = VEC_BYTES // elem
        rows_ptrs = [logits.data_ptr()] + ([grad.data_ptr()] if grad is not None else [])
        w = vec if cols % vec == 0 and all(p % VEC_BYTES == 0 for p in rows_ptrs) else 1
        block = 256 if cols <= SMALL_ROW else 1024
        cached = cached_count(cols, 1, elem, w) if grad_wanted else 0
        unused = logits.data_ptr()  # the grad and scale of a loss-only launch are never read
        args = (
            grad.data_ptr() if grad is not None else unused,
            loss.data_ptr(),
            logits.data_ptr(),
            targets.data_ptr(),
            scale.data_ptr() if grad_wanted else unused,
            cols,
            cached,
            params["IGNORE_INDEX"],
        )
        kernel = CE_KERNEL[dtype, w, block, grad_wanted]
        return [direct.Launch(kernel, grid=rows, block=block, args=args, smem=cached * elem)]

    return plan


# --8<-- [end:gpu_plan]
cross_entropy_kernel = MojoOp(CROSS_ENTROPY, gpu=_plan(True))
cross_entropy_loss_kernel = MojoOp(CROSS_ENTROPY_LOSS, gpu=_plan(False))


# -- checks ----------------------------------------------------------------------------------
def check_cross_entropy_args(logits, targets, ignore_index, reduction) -> None:
    name = "cross_entropy"
    check_float_tensor(name, logits)
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"{name}: targets must be a torch.Tensor, got {type(targets).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"{name}: logits must be (N, C), got shape {tuple(logits.shape)}")
    if targets.dtype != torch.int64:
        raise TypeError(f"{name}: targets must be int64 class indices, got {targets.dtype}")
    if targets.shape != logits.shape[:1]:
        raise ValueError(
            f"{name}: targets must be ({logits.shape[0]},) for logits {tuple(logits.shape)}, got {tuple(targets.shape)}"
        )
    if targets.device != logits.device:
        raise ValueError(f"{name}: targets are on {targets.device} but logits on {logits.device}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{name}: ignore_index must be an int, got {type(ignore_index).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _check_target_values(logits, targets, ignore_index) -> None:
    """Out-of-range targets, where the host can read them (not while capturing a graph):
    one synchronisation on CUDA."""
    if targets.numel() == 0 or (targets.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    bad = ((targets < 0) | (targets >= logits.shape[1])) & (targets != ignore_index)
    if bool(bad.any()):
        value = targets[bad][0].item()
        raise ValueError(f"cross_entropy: target {value} is out of range for {logits.shape[1]} classes")


# -- eager implementations ---------------------------------------------------------------------
def _scale(targets, ignore_index, reduction) -> torch.Tensor:
    """What each row's gradient is multiplied by, as a (1,) float64 device tensor: 1 / the
    counted rows for a mean (no host sync), 1 otherwise."""
    if reduction != "mean":
        return torch.ones(1, dtype=torch.float64, device=targets.device)
    return (targets != ignore_index).sum().to(torch.float64).reciprocal().reshape(1)


def _reduce(rows: torch.Tensor, scale: torch.Tensor, reduction: str, dtype: torch.dtype) -> torch.Tensor:
    if reduction == "none":
        return rows.to(dtype)
    total = rows.sum()
    return (total * scale[0] if reduction == "mean" else total).to(dtype)


def _torch_rows(logits, targets, ignore_index, with_grad: bool, scale=None):
    """The fallback: per-row losses (and the gradient) computed by torch."""
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(acc)
    logp = torch.log_softmax(x, -1)
    counted = targets != ignore_index
    safe = torch.where(counted, targets, 0)
    rows = torch.where(counted, -logp.gather(1, safe[:, None])[:, 0], 0).double()
    if not with_grad:
        return [rows]
    grad = logp.exp()
    grad.scatter_add_(1, safe[:, None], -torch.ones_like(grad[:, :1]))
    grad = (grad * counted[:, None] * scale[0]).to(logits.dtype)
    return [grad, rows]


def _cross_entropy_eager(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str, float_loss: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, gradient of the loss with respect to the logits, for a grad_output of 1)."""
    check_cross_entropy_args(logits, targets, ignore_index, reduction)
    _check_target_values(logits, targets, ignore_index)
    scale = _scale(targets, ignore_index, reduction)
    logits2, targets2 = logits.contiguous(), targets.contiguous()
    grad, rows = cross_entropy_kernel(
        [logits2, targets2, scale],
        params={"IGNORE_INDEX": ignore_index},
        torch_impl=lambda: _torch_rows(logits2, targets2, ignore_index, True, scale),
    )
    return _reduce(rows, scale, reduction, torch.float32 if float_loss else logits.dtype), grad


def _cross_entropy_loss_eager(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str, float_loss: bool = False
) -> torch.Tensor:
    check_cross_entropy_args(logits, targets, ignore_index, reduction)
    _check_target_values(logits, targets, ignore_index)
    logits2, targets2 = logits.contiguous(), targets.contiguous()
    (rows,) = cross_entropy_loss_kernel(
        [logits2, targets2],
        params={"IGNORE_INDEX": ignore_index},
        torch_impl=lambda: _torch_rows(logits2, targets2, ignore_index, False),
    )
    dtype = torch.float32 if float_loss else logits.dtype
    return _reduce(rows, _scale(targets, ignore_index, reduction), reduction, dtype)


# -- torch.library registration ----------------------------------------------------------------
_op = torch.library.custom_op("gpu_days::cross_entropy", _cross_entropy_eager, mutates_args=())
_loss_op = torch.library.custom_op("gpu_days::cross_entropy_loss", _cross_entropy_loss_eager, mutates_args=())


def _fake_loss(logits, targets, reduction, float_loss):
    shape = (logits.shape[0],) if reduction == "none" else ()
    return logits.new_empty(shape, dtype=torch.float32 if float_loss else logits.dtype)


@_op.register_fake
def _(logits, targets, ignore_index, reduction, float_loss=False):
    check_cross_entropy_args(logits, targets, ignore_index, reduction)
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    return _fake_loss(logits, targets, reduction, float_loss), grad


@_loss_op.register_fake
def _(logits, targets, ignore_index, reduction, float_loss=False):
    check_cross_entropy_args(logits, targets, ignore_index, reduction)
    return _fake_loss(logits, targets, reduction, float_loss)


def _setup_context(ctx, inputs, output):
    _loss, grad = output
    ctx.reduction = inputs[3]
    ctx.mark_non_differentiable(grad)
    ctx.save_for_backward(grad)


def _backward(ctx, grad_loss, _grad_grad):
    (grad,) = ctx.saved_tensors
    scale = grad_loss[:, None] if ctx.reduction == "none" else grad_loss
    return grad * scale.to(grad.dtype), None, None, None, None


_op.register_autograd(_backward, setup_context=_setup_context)
_autograd = eager.function("CrossEntropy", _cross_entropy_eager, _setup_context, _backward)


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """`F.cross_entropy(logits, targets, ignore_index=..., reduction=...)` for (N, C)
    logits, computed by day020's fused Mojo kernel. Under torch.autocast the logits are
    read as they are (the kernel accumulates in float32 anyway: no float32 copy of them)
    and the loss is float32, as torch's."""
    float_loss = eager.autocast_dtype(logits) is not None
    args = (logits, targets, ignore_index, reduction, float_loss)
    way = eager.route(logits, targets)
    if way is eager.EAGER:
        return _cross_entropy_loss_eager(*args)
    if way is eager.AUTOGRAD:
        return _autograd(*args)[0]
    check_cross_entropy_args(logits, targets, ignore_index, reduction)
    if logits.requires_grad and torch.is_grad_enabled():
        return torch.ops.gpu_days.cross_entropy(*args)[0]
    return torch.ops.gpu_days.cross_entropy_loss(*args)
