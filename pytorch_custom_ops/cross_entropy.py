"""`cross_entropy(logits, targets)`: day020's Mojo kernels as a torch op.

    loss = pco.cross_entropy(logits, targets, ignore_index=-100, reduction="mean")

Like `F.cross_entropy` for (N, C) logits and (N,) int64 class indices. The forward reads
each row of logits once and writes per row the loss and the log-sum-exp; the backward
reads the row again with its lse and writes the gradient, scaled by the incoming gradient
inside the kernel (no extra pass). Two ops are registered:
`gpu_days::cross_entropy` -> (loss, lse) and `gpu_days::cross_entropy_backward` -> grad.

One pass (day020 part 11): in eager mode and under CUDA graphs, when the logits need a
gradient and the loss is a mean or a sum, the forward writes the gradient too (for
grad_loss = 1), from a copy of the row in shared memory, and the backward only scales it
in place by grad_loss: a kernel that returns at once when grad_loss is 1, as it is for
`loss.backward()`. 2 N C bytes move instead of 3 N C. A second backward through the same
graph (retain_graph=True) or a double backward goes the two-pass way, from the saved logits.
torch.compile traces the registered two-pass ops.

On CUDA the small work around the kernels is two one-block kernels (part 12): before them
the targets' count (the mean's scale) and range check, after them the loss's sum.

Targets outside [0, C) that are not `ignore_index` raise ValueError (a check that reads the
targets on the host; inside a CUDA-graph capture, where the host cannot read them, such a
row's loss and gradient are NaN instead).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import direct, eager
from .contract import FLOAT_DTYPES, OpSpec, TensorArg, as_int, check_float_tensor
from .gemm_gpu import sm_count
from .gpu_kernels import KernelFamily
from .mojo_op import MojoOp
from .softmax_family import (
    CACHE_BYTES,
    CLUSTER_SHARED_SM_BYTES,
    LOOPED_BLOCK,
    MAX_GRID,
    VEC_BYTES,
    cached_count,
)

REDUCTIONS = ("mean", "sum", "none")
_LOGITS = TensorArg("logits", ("rows", "cols"))
_TARGETS = TensorArg("targets", ("rows",), torch.int64)
_PER_ROW = ("rows",)

CROSS_ENTROPY = OpSpec(
    name="cross_entropy",
    # per row, float64: the losses are summed in float64, then cast
    outputs=(TensorArg("loss", _PER_ROW, torch.float64), TensorArg("lse", _PER_ROW, torch.float64)),
    inputs=(_LOGITS, _TARGETS),
    params={"IGNORE_INDEX": -100},
)
CROSS_ENTROPY_BACKWARD = OpSpec(
    name="cross_entropy_backward",
    outputs=(TensorArg("grad", ("rows", "cols")),),
    inputs=(
        _LOGITS,
        _TARGETS,
        TensorArg("lse", _PER_ROW, torch.float64),
        TensorArg("factor", ("factors",), torch.float64),  # 1 value, or 1 per row
    ),
    params={"IGNORE_INDEX": -100},
)
CROSS_ENTROPY_WITH_GRAD = OpSpec(
    name="cross_entropy_with_grad",
    outputs=(*CROSS_ENTROPY.outputs, TensorArg("grad", ("rows", "cols"))),
    inputs=(_LOGITS, _TARGETS, TensorArg("factor", (1,), torch.float64)),
    params={"IGNORE_INDEX": -100},
)

# --8<-- [start:gpu_plan]
# Threads per row, measured on the H100 (kernel time, 256 vs 1024 threads): the forward is
# faster with 256 at every vocabulary tried (bf16 8192 x 50304: 0.283 vs 0.378 ms; more
# blocks per SM keep more loads in flight); the backward wants 1024 past 8192 columns
# (within 5% either way).
FORWARD_BLOCK = 256
SMALL_ROW = 8192  # columns up to which 256 threads per row are enough in the backward


def _variants(blocks: tuple[int, ...]) -> tuple:
    widths = lambda dtype: (VEC_BYTES // dtype.itemsize, 1)  # noqa: E731
    return tuple((dtype, w, block) for dtype in FLOAT_DTYPES for w in widths(dtype) for block in blocks)


CE_KERNEL = KernelFamily(
    "days.day020.cross_entropy",
    "cross_entropy_kernel",
    args=("ptr",) * 4 + ("i64",) * 2,  # loss, lse, logits, targets, cols, ignore_index
    variants=_variants((FORWARD_BLOCK,)),
)
CE_BACKWARD_KERNEL = KernelFamily(
    "days.day020.cross_entropy",
    "cross_entropy_backward_kernel",
    # grad, logits, targets, lse, factor, factor_stride, cols, ignore_index
    args=("ptr",) * 5 + ("i64",) * 3,
    variants=_variants((256, 1024)),
)


# The one-pass kernel's threads per row and row cache (shared memory per block). The cache
# bounds the blocks per SM (two of 112 KB, four of 56 KB); what is not cached, the row's
# tail, is read again (read last in the first pass: likely from L2). Measured on the H100
# (days/day020/time_one_pass.py, kernel time, % of a copy's bandwidth): a row that fits
# 112 KB runs best whole in the cache of a 512-thread block (bf16 x 50304: 84%, 16384 x
# 32000: 91%; 1024 threads: 77%); a longer row best with 1024 threads and a 200 KB cache
# (bf16 x 128256: 79%, float32 x 50304: 87%; 512 threads and 100 KB: 69% and 80%).
# Caching less to fit more blocks per SM, or nothing (L2 only), was slower at every shape.
WHOLE_ROW_BYTES = CLUSTER_SHARED_SM_BYTES
WHOLE_ROW_BLOCK = 512


def one_pass_shape(cols: int, elem_bytes: int) -> tuple[int, int]:
    """(threads per row, row-cache bytes per block) for the one-pass kernel."""
    if cols * elem_bytes <= WHOLE_ROW_BYTES:
        return WHOLE_ROW_BLOCK, cols * elem_bytes
    return LOOPED_BLOCK, CACHE_BYTES


CE_WITH_GRAD_KERNEL = KernelFamily(
    "days.day020.cross_entropy",
    "cross_entropy_with_grad_kernel",
    # loss, lse, grad, logits, targets, factor, cols, ignore_index, cached
    args=("ptr",) * 6 + ("i64",) * 3,
    variants=_variants((256, 512, 1024)),
)
SCALE_BLOCK = 256
SCALE_BLOCKS_PER_SM = 8  # a grid-stride loop: enough blocks to fill every SM, no more
SCALE_KERNEL = KernelFamily(
    "days.day020.cross_entropy",
    "scale_unless_one_kernel",
    args=("ptr", "ptr", "i64"),  # data, factor, count
    # the factor (grad_loss) comes in the loss's dtype: the logits' or float32 (autocast)
    variants=tuple((*v, f) for v in _variants((SCALE_BLOCK,)) for f in dict.fromkeys((v[0], torch.float32))),
)
# One block does the small work around the kernels (part 12): the targets' count and check
# before them, the sum of the per-row losses after.
SMALL_BLOCK = 1024
TARGET_STATS_KERNEL = KernelFamily(
    "days.day020.cross_entropy",
    "target_stats_kernel",
    args=("ptr",) * 3 + ("i64",) * 4,  # scale, bad, targets, rows, classes, ignore_index, mean
    variants=((SMALL_BLOCK,),),
)
SUM_ROWS_KERNEL = KernelFamily(
    "days.day020.cross_entropy",
    "sum_rows_kernel",
    args=("ptr",) * 3 + ("i64",),  # loss, rows, scale, n
    variants=tuple((dtype, SMALL_BLOCK) for dtype in FLOAT_DTYPES),
)


def _row_launch(logits: torch.Tensor, *row_tensors: torch.Tensor) -> tuple[int, int, int]:
    """(rows, vector width, backward block) for one block per row of `logits`: 16-byte
    vectors when every row of these tensors starts 16-byte aligned."""
    rows, cols = logits.shape
    if rows > MAX_GRID:
        raise ValueError(f"cross_entropy: {rows} rows are more than one launch can have")
    vec = VEC_BYTES // logits.element_size()
    aligned = cols % vec == 0 and all(t.data_ptr() % VEC_BYTES == 0 for t in (logits, *row_tensors))
    return rows, vec if aligned else 1, 256 if cols <= SMALL_ROW else 1024


@direct.plan(CE_KERNEL)
def _forward_plan(outputs, inputs, params) -> list[direct.Launch]:
    (loss, lse), (logits, targets) = outputs, inputs
    rows, w, _ = _row_launch(logits)
    block = FORWARD_BLOCK
    args = (loss.data_ptr(), lse.data_ptr(), logits.data_ptr(), targets.data_ptr(), logits.shape[1])
    kernel = CE_KERNEL[logits.dtype, w, block]
    return [direct.Launch(kernel, grid=rows, block=block, args=(*args, params["IGNORE_INDEX"]))]


@direct.plan(CE_BACKWARD_KERNEL)
def _backward_plan(outputs, inputs, params) -> list[direct.Launch]:
    (grad,), (logits, targets, lse, factor) = outputs, inputs
    rows, w, block = _row_launch(logits, grad)
    if factor.shape[0] not in (1, rows):
        raise ValueError(f"cross_entropy_backward: {factor.shape[0]} factors for {rows} rows")
    stride = 0 if factor.shape[0] == 1 else 1
    ptrs = (grad, logits, targets, lse, factor)
    args = (*(t.data_ptr() for t in ptrs), stride, logits.shape[1], params["IGNORE_INDEX"])
    kernel = CE_BACKWARD_KERNEL[logits.dtype, w, block]
    return [direct.Launch(kernel, grid=rows, block=block, args=args)]


@direct.plan(CE_WITH_GRAD_KERNEL)
def _with_grad_plan(outputs, inputs, params) -> list[direct.Launch]:
    """Day 012's looped softmax layout: one block per row, as much of the row as
    `one_pass_shape` gives room for cached in shared memory, the rest read again."""
    (loss, lse, grad), (logits, targets, factor) = outputs, inputs
    rows, w, _ = _row_launch(logits, grad)
    cols = logits.shape[1]
    block, budget = one_pass_shape(cols, logits.element_size())
    cached = cached_count(cols, 1, logits.element_size(), w, budget)
    ptrs = (loss, lse, grad, logits, targets, factor)
    args = (*(t.data_ptr() for t in ptrs), cols, params["IGNORE_INDEX"], cached)
    kernel = CE_WITH_GRAD_KERNEL[logits.dtype, w, block]
    smem = cached * logits.element_size()
    return [direct.Launch(kernel, grid=rows, block=block, args=args, smem=smem)]


def scale_launch(data: torch.Tensor, factor: torch.Tensor) -> direct.Launch:
    """The launch that multiplies contiguous `data` by `factor[0]` (in data's dtype or
    float32) in place, unless it is 1 (see scale_unless_one_kernel), a grid sized to
    `data`'s GPU."""
    count = data.numel()
    sms = sm_count(data.get_device())
    vec = VEC_BYTES // data.element_size()
    w = vec if count % vec == 0 and data.data_ptr() % VEC_BYTES == 0 else 1
    blocks = max(1, min(-(-count // (w * SCALE_BLOCK)), sms * SCALE_BLOCKS_PER_SM))
    return direct.Launch(
        SCALE_KERNEL[data.dtype, w, SCALE_BLOCK, factor.dtype],
        grid=blocks,
        block=SCALE_BLOCK,
        args=(data.data_ptr(), factor.data_ptr(), count),
    )


def target_stats_launch(
    scale: torch.Tensor, bad: torch.Tensor, targets: torch.Tensor, classes: int, ignore_index: int, mean: bool
) -> direct.Launch:
    """scale[0] = 1 / counted rows (mean) or 1, bad[0] = out-of-range targets: one block."""
    args = (scale.data_ptr(), bad.data_ptr(), targets.data_ptr(), targets.shape[0], classes, ignore_index, int(mean))
    return direct.Launch(TARGET_STATS_KERNEL[SMALL_BLOCK], grid=1, block=SMALL_BLOCK, args=args)


def sum_rows_launch(loss: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor) -> direct.Launch:
    """loss[0] = sum(rows) * scale[0] in loss's dtype: one block."""
    args = (loss.data_ptr(), rows.data_ptr(), scale.data_ptr(), rows.shape[0])
    return direct.Launch(SUM_ROWS_KERNEL[loss.dtype, SMALL_BLOCK], grid=1, block=SMALL_BLOCK, args=args)


# --8<-- [end:gpu_plan]
cross_entropy_kernel = MojoOp(CROSS_ENTROPY, gpu=_forward_plan)
cross_entropy_backward_kernel = MojoOp(CROSS_ENTROPY_BACKWARD, gpu=_backward_plan)
cross_entropy_with_grad_kernel = MojoOp(CROSS_ENTROPY_WITH_GRAD, gpu=_with_grad_plan)


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
    if not -(2**63) <= ignore_index < 2**63:  # the targets are int64
        raise ValueError(f"{name}: ignore_index {ignore_index} is outside int64's range")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _start_target_check(logits, targets, counted) -> Callable[[], None]:
    """Check the targets' values where the host can read them (not while a graph is
    captured), and return a function that raises if one is out of range.

    On CUDA the check is only enqueued here (see _check_later). An invalid target can only
    make NaNs in the kernels: they read no logit out of range, and neither does the torch
    fallback. `counted`: targets != ignore_index."""
    if targets.numel() == 0 or (targets.is_cuda and torch.cuda.is_current_stream_capturing()):
        return _no_check
    bad = _bad_targets(targets, logits.shape[1], counted)
    if not targets.is_cuda:
        if bad.any():
            _raise_bad_target(targets, bad, logits.shape[1])
        return _no_check
    return _check_later(bad.any(), targets, lambda: bad, logits.shape[1])


def _check_later(flag: torch.Tensor, targets, bad: Callable[[], torch.Tensor], classes: int) -> Callable[[], None]:
    """Copy the device scalar `flag` (nonzero: a target is out of range) to pinned memory
    behind an event; the returned function waits for that event alone and raises. The
    caller enqueues its kernels before calling it, so the GPU is computing while the host
    waits (a check that synchronised first left the GPU idle until the host had launched
    the next kernel). `bad` gives the mask of bad targets (called on the error path only)."""
    found = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
    found.copy_(flag, non_blocking=True)
    checked = torch.cuda.Event()
    checked.record(torch.cuda.current_stream(targets.device))

    def finish() -> None:
        checked.synchronize()
        if found.item():
            _raise_bad_target(targets, bad(), classes)

    return finish


def _no_check() -> None:
    return None


# False does the small work around the kernels with torch's ops (to compare both in one run)
SMALL_KERNELS = True


def _small_kernels(t: torch.Tensor) -> bool:
    return SMALL_KERNELS and t.is_cuda and cross_entropy_with_grad_kernel.ready(t.device)


def _targets_pass(logits, targets, ignore_index, reduction) -> tuple[torch.Tensor, Callable[[], None]]:
    """(scale, finish): what the loss sums are multiplied by ((1,) float64, on the logits'
    device: 1 / the rows whose target is not ignore_index for a mean, 1 otherwise), and a
    function that raises if a target is out of range, called after the kernels are
    enqueued. On CUDA one block does both (target_stats_kernel) instead of ~8 small torch
    ops, and its count of bad targets goes the way of _start_target_check's answer."""
    if not (_small_kernels(targets) and targets.numel()):
        counted = targets != ignore_index
        return _scale(counted, reduction), _start_target_check(logits, targets, counted)
    classes = logits.shape[1]
    scale = torch.empty(1, dtype=torch.float64, device=targets.device)
    bad = torch.empty(1, dtype=torch.int64, device=targets.device)
    launch = target_stats_launch(scale, bad, targets, classes, ignore_index, reduction == "mean")
    direct.run([launch], targets.get_device())
    if torch.cuda.is_current_stream_capturing():  # the host cannot read it: NaN rows instead
        return scale, _no_check
    return scale, _check_later(bad, targets, lambda: _bad_targets(targets, classes, targets != ignore_index), classes)


def _bad_targets(targets, classes: int, counted) -> torch.Tensor:
    """The mask of counted targets outside [0, classes) (3 small kernels, not 5)."""
    return (targets.clamp(0, classes - 1) != targets) & counted


def _raise_bad_target(targets, bad, classes: int) -> None:
    value = targets[bad][0].item()
    raise ValueError(f"cross_entropy: target {value} is out of range for {classes} classes")


# -- eager implementations ---------------------------------------------------------------------
def _scale(counted, reduction) -> torch.Tensor:
    """What the loss sums are multiplied by, as a (1,) float64 device tensor: 1 / the
    counted rows (`counted`: targets != ignore_index) for a mean (no host sync), 1
    otherwise."""
    if reduction != "mean":
        return torch.ones(1, dtype=torch.float64, device=counted.device)
    return counted.sum(dtype=torch.float64).reciprocal().reshape(1)


def _reduce(rows: torch.Tensor, scale: torch.Tensor, reduction: str, dtype: torch.dtype) -> torch.Tensor:
    if reduction == "none":
        return rows.to(dtype)
    if _small_kernels(rows) and rows.numel():
        loss = torch.empty((), dtype=dtype, device=rows.device)  # one kernel, not sum, mul, cast
        direct.run([sum_rows_launch(loss, rows, scale)], rows.get_device())
        return loss
    total = rows.sum()
    return (total * scale[0] if reduction == "mean" else total).to(dtype)


def _acc(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _torch_forward(logits, targets, ignore_index):
    """The fallback's (per-row losses, lse), computed by torch."""
    x = logits.to(_acc(logits))
    lse = torch.logsumexp(x, -1)
    counted = targets != ignore_index
    # an invalid target reads column 0 (the check raises after): no out-of-range gather
    safe = torch.where(counted & (targets >= 0) & (targets < x.shape[1]), targets, 0)
    rows = torch.where(counted, lse - x.gather(1, safe[:, None])[:, 0], 0)
    return [rows.double(), torch.where(counted, lse, 0).double()]


def _torch_backward(logits, targets, factor, ignore_index):
    """The gradient by torch ops: the fallback, and the differentiable gradient a double
    backward needs (softmax of the logits, not exp(x - lse): lse depends on x too)."""
    x = logits.to(_acc(logits))
    counted = targets != ignore_index
    f = factor.to(x.dtype).expand(targets.shape[0])
    onehot = torch.zeros_like(x).scatter_(1, torch.where(counted, targets, 0)[:, None], 1.0)
    return [((torch.softmax(x, -1) - onehot) * torch.where(counted, f, 0)[:, None]).to(logits.dtype)]


def _cross_entropy_eager(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str, float_loss: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, per-row lse, scale): what the backward needs besides the logits."""
    check_cross_entropy_args(logits, targets, ignore_index, reduction)
    logits2, targets2 = logits.contiguous(), targets.contiguous()
    scale, checked = _targets_pass(logits2, targets2, ignore_index, reduction)
    rows, lse = cross_entropy_kernel(
        [logits2, targets2],
        params={"IGNORE_INDEX": ignore_index},
        torch_impl=lambda: _torch_forward(logits2, targets2, ignore_index),
    )
    loss = _reduce(rows, scale, reduction, torch.float32 if float_loss else logits.dtype)
    checked()  # waits for the check only: the kernels above are running
    return loss, lse, scale


def _cross_entropy_backward_eager(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, factor: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    logits2, targets2 = logits.contiguous(), targets.contiguous()
    (grad,) = cross_entropy_backward_kernel(
        [logits2, targets2, lse, factor],
        params={"IGNORE_INDEX": ignore_index},
        torch_impl=lambda: _torch_backward(logits2, targets2, factor, ignore_index),
    )
    return grad


# -- torch.library registration ----------------------------------------------------------------
_op = torch.library.custom_op("gpu_days::cross_entropy", _cross_entropy_eager, mutates_args=())
_backward_op = torch.library.custom_op(
    "gpu_days::cross_entropy_backward", _cross_entropy_backward_eager, mutates_args=()
)


@_op.register_fake
def _(logits, targets, ignore_index, reduction, float_loss=False):
    check_cross_entropy_args(logits, targets, ignore_index, reduction)
    shape = (logits.shape[0],) if reduction == "none" else ()
    loss = logits.new_empty(shape, dtype=torch.float32 if float_loss else logits.dtype)
    per_row = logits.new_empty(logits.shape[:1], dtype=torch.float64)
    return loss, per_row, logits.new_empty((1,), dtype=torch.float64)


@_backward_op.register_fake
def _(logits, targets, lse, factor, ignore_index):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits, targets, ignore_index, reduction, _ = inputs
    _loss, lse, scale = output
    ctx.ignore_index, ctx.reduction = ignore_index, reduction
    ctx.set_materialize_grads(False)  # no zero-filled gradients for lse and scale
    ctx.mark_non_differentiable(lse, scale)
    ctx.save_for_backward(logits, targets, lse, scale)


def _grad_logits(ctx, grad_loss, run):
    if grad_loss is None:
        return None, None, None, None, None
    logits, targets, lse, scale = ctx.saved_tensors
    # the kernel multiplies by this: grad_loss (per row for "none") times 1/counted for a mean
    factor = grad_loss.to(torch.float64).reshape(-1)
    if ctx.reduction == "mean":
        factor = factor * scale
    if torch.is_grad_enabled():  # create_graph=True: the gradient must be differentiable itself
        (grad,) = _torch_backward(logits, targets, factor, ctx.ignore_index)
    else:
        grad = run(logits, targets, lse, factor, ctx.ignore_index)
    return grad, None, None, None, None


def _backward(ctx, grad_loss, _grad_lse, _grad_scale):
    return _grad_logits(ctx, grad_loss, torch.ops.gpu_days.cross_entropy_backward)


def _backward_eager(ctx, grad_loss, _grad_lse, _grad_scale):
    return _grad_logits(ctx, grad_loss, _cross_entropy_backward_eager)


_op.register_autograd(_backward, setup_context=_setup_context)
_autograd = eager.function("CrossEntropy", _cross_entropy_eager, _setup_context, _backward_eager)


# -- one pass: the forward writes the gradient (the autograd route, mean and sum) ----------------
def _cross_entropy_with_grad_eager(logits, targets, ignore_index, reduction, float_loss=False):
    """(loss, per-row lse, scale, the gradient of the logits for grad_loss = 1)."""
    check_cross_entropy_args(logits, targets, ignore_index, reduction)
    logits2, targets2 = logits.contiguous(), targets.contiguous()
    scale, checked = _targets_pass(logits2, targets2, ignore_index, reduction)

    def torch_impl():
        return [
            *_torch_forward(logits2, targets2, ignore_index),
            *_torch_backward(logits2, targets2, scale, ignore_index),
        ]

    rows, lse, grad = cross_entropy_with_grad_kernel(
        [logits2, targets2, scale], params={"IGNORE_INDEX": ignore_index}, torch_impl=torch_impl
    )
    loss = _reduce(rows, scale, reduction, torch.float32 if float_loss else logits.dtype)
    checked()
    return loss, lse, scale, grad


def _setup_with_grad(ctx, inputs, output):
    _setup_context(ctx, inputs, output[:3])
    ctx.mark_non_differentiable(output[1], output[2], output[3])
    ctx.grad = output[3]  # not saved_tensors: it is not an input, and the backward changes it


def _backward_with_grad(ctx, grad_loss, _grad_lse, _grad_scale, _grad_grad):
    grad, ctx.grad = ctx.grad, None  # the first backward takes it
    if grad_loss is None or grad is None or torch.is_grad_enabled():
        # a second backward (retain_graph=True), or a double backward: the two passes
        return _backward_eager(ctx, grad_loss, None, None)
    scale_unless_one_(grad, grad_loss.reshape(1))
    return grad, None, None, None, None


def scale_unless_one_(data: torch.Tensor, factor: torch.Tensor) -> None:
    """data *= factor (one value), in place, without reading the factor on the host (so
    that graphs capture it): on CUDA a kernel that returns at once for a factor of 1."""
    if not data.is_cuda:  # reading the factor costs nothing on the CPU
        if factor.item() != 1:
            data.mul_(factor.to(data.dtype))
    elif cross_entropy_with_grad_kernel.ready(data.device):
        if factor.dtype not in (data.dtype, torch.float32):  # the kernel reads these two
            factor = factor.to(torch.float32)
        direct.run([scale_launch(data, factor.contiguous())], data.get_device())
    else:  # the torch fallback (not strict), which the forward has already warned of
        data.mul_(factor.to(data.dtype))


_autograd_with_grad = eager.function(
    "CrossEntropyWithGrad", _cross_entropy_with_grad_eager, _setup_with_grad, _backward_with_grad
)


# False sends every call with autograd the two-pass way (to compare both in one run)
ONE_PASS = True


def _autograd_pick(logits, targets, ignore_index, reduction, float_loss):
    """The one-pass Function for a mean or a sum; one gradient per row ("none") is known
    only in the backward, so it keeps the two passes."""
    if reduction == "none" or not ONE_PASS:
        return _autograd(logits, targets, ignore_index, reduction, float_loss)
    return _autograd_with_grad(logits, targets, ignore_index, reduction, float_loss)


def _op_call(*args):
    return torch.ops.gpu_days.cross_entropy(*args)


def _check(logits, targets, ignore_index, reduction, _float_loss):
    check_cross_entropy_args(logits, targets, ignore_index, reduction)


_ROUTES = {"eager": _cross_entropy_eager, "autograd": _autograd_pick, "op": _op_call, "check": _check}


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """`F.cross_entropy(logits, targets, ignore_index=..., reduction=...)` for (N, C)
    logits, computed by day020's Mojo kernels. Under torch.autocast the logits are read as
    they are (the kernels accumulate in float32 anyway: no float32 copy of them) and the
    loss is float32, as torch's (float64 logits keep a float64 loss, as autocast leaves them)."""
    float_loss = eager.autocast_dtype(logits) is not None and logits.dtype != torch.float64
    args = (logits, targets, as_int(ignore_index), reduction, float_loss)
    return eager.call((logits, targets), args, **_ROUTES)[0]
