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

from functools import partial
from typing import NamedTuple

import torch

from . import direct, eager, programs
from .contract import FLOAT_DTYPES, OpSpec, TensorArg, as_int
from .gpu_kernels import KernelFamily
from .mojo_op import MojoOp
from .softmax import _as_rows, _from_rows, check_softmax_args

_ROWS = ("rows", "cols")


def _forward_spec(name: str) -> OpSpec:
    return OpSpec(name=name, outputs=(TensorArg("output", _ROWS),), inputs=(TensorArg("x", _ROWS),))


def _backward_spec(name: str) -> OpSpec:
    return OpSpec(
        name=name,
        outputs=(TensorArg("grad_input", _ROWS),),
        inputs=(TensorArg("grad_output", _ROWS), TensorArg("output", _ROWS)),
    )


# -- the GPU launch plan (day 016: the dispatch that days/day012/softmax_family.mojo had) -----
# --8<-- [start:dispatch]
VEC_BYTES = 16  # one LDG.128 / STG.128 per vector
WARP = 32
WARP_ROWS_BLOCK = 128  # threads per block when a warp or part of one owns a row (4+ rows a block)
# Register layouts, smallest first: G threads per row x E elements per thread. E stays
# <= 32 values per thread (64 for a backward): beyond that ptxas spills or the block
# cannot launch (seen on the H100 with 64 per thread at 512 threads), so longer rows
# go to the looped or the cluster kernel. G = 8 and 16 share a warp between 4 or 2 rows:
# a 16-bit row of 128 (attention scores at s = 128) filled half a warp at G = 32, one
# 16-byte load a lane in flight and five shuffle stages for every row (day 016, part ten).
# (32 x 4 went: 16 x 8 holds the same 128 elements for every vector width.)
ROW_CONFIGS = ((8, 8), (16, 8), (32, 8), (32, 16), (32, 32), (128, 16), (256, 16), (512, 16), (512, 32))
LOOPED_BLOCK = 1024
CACHE_BYTES = 200 * 1024  # the looped kernel's row cache, of the 227 KiB a block may have
CLUSTER_BLOCK = 512  # threads per CTA of a cluster
CLUSTER_SIZES = (2, 4, 8)  # 8 is the largest portable cluster
CLUSTER_CACHE_BYTES = 224 * 1024  # shared memory per CTA for its slice of the row, at most
CLUSTER_SHARED_SM_BYTES = 112 * 1024  # slices up to this size let two CTAs share an SM
# The (C, BLOCK) pairs the plan can pick: 1024 threads only when even 8 CTAs' slices
# are over CLUSTER_SHARED_SM_BYTES, and then 2 or 4 CTAs' slices would not fit at all
# (test_plan_picks_every_declared_kernel in days/day012 sweeps row lengths to prove it)
CLUSTER_SHAPES = ((2, CLUSTER_BLOCK), (4, CLUSTER_BLOCK), (8, CLUSTER_BLOCK), (8, LOOPED_BLOCK))
# the cluster kernels merge 32-bit partials through distributed shared memory, so
# float64 (float64 accumulators) keeps the looped kernel
CLUSTER_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Long rows: the cluster kernel when the row does not fit one block's cache but fits
# 8 CTAs; False keeps the looped kernel everywhere (to compare both on the GPU)
USE_CLUSTERS = True
MAX_GRID = 2**31 - 1


def vec_width(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector: 4 for float32, 8 for bf16/fp16, 2 for float64."""
    return VEC_BYTES // dtype.itemsize


def cached_count(n: int, tensors: int, elem_bytes: int, w: int, budget: int = CACHE_BYTES) -> int:
    """How many leading elements of a row fit the looped kernel's shared-memory cache
    of `budget` bytes (a multiple of w). The kernel gets this count as an argument and
    the launch sizes the shared memory from it: the one place that decides both."""
    fit = budget // (tensors * elem_bytes)
    return min(n, fit - fit % w)


def cluster_slice(n: int, c: int, w: int) -> int:
    """Elements per CTA when c CTAs split a row of n: ceil(n / c), rounded up to a
    multiple of w so that every slice starts on a vector boundary."""
    per = -(-n // c)
    return -(-per // w) * w


def smallest_cluster(n: int, tensors: int, elem_bytes: int, w: int, budget: int) -> int:
    """The fewest CTAs whose slices of `tensors` rows of n elements fit `budget` bytes
    each; 0 if none do."""
    for c in CLUSTER_SIZES:
        if cluster_slice(n, c, w) * tensors * elem_bytes <= budget:
            return c
    return 0


def cluster_size_for(n: int, tensors: int, elem_bytes: int, w: int) -> int:
    """The cluster that keeps a whole row on chip: the fewest CTAs whose slices leave
    room for two CTAs per SM, else the fewest whose slices fit at all; 0 when even 8
    CTAs cannot hold the row (the looped kernel takes it)."""
    return smallest_cluster(n, tensors, elem_bytes, w, CLUSTER_SHARED_SM_BYTES) or smallest_cluster(
        n, tensors, elem_bytes, w, CLUSTER_CACHE_BYTES
    )


class Families(NamedTuple):
    rows: KernelFamily  # a row in registers: (dtype, LOG, W, NV, G, BLOCK)
    looped: KernelFamily  # one block per row, its head cached: (dtype, LOG, W, BLOCK)
    cluster: KernelFamily  # a row over a cluster of C CTAs: (dtype, LOG, W, BLOCK, C)


def _declare(prefix: str, tensors: int) -> Families:
    """Every kernel the plan below can pick, for the forward (`softmax_*`, one input)
    or the backward (`softmax_backward_*`, two inputs)."""
    module = "days.day012.softmax_family"
    io = ("ptr",) * (1 + tensors)  # dst, then src (forward) or grad, fwd_out (backward)
    widths = {dtype: (vec_width(dtype), 1) for dtype in FLOAT_DTYPES}
    rows = tuple(
        (dtype, log, w, e // w, g, WARP_ROWS_BLOCK if g <= WARP else g)
        for dtype in FLOAT_DTYPES
        for log in (False, True)
        for w in widths[dtype]
        for g, e in ROW_CONFIGS
        if e % w == 0
    )
    looped = tuple(
        (dtype, log, w, LOOPED_BLOCK) for dtype in FLOAT_DTYPES for log in (False, True) for w in widths[dtype]
    )
    cluster = tuple(
        (dtype, log, w, block, c)
        for dtype in CLUSTER_DTYPES
        for log in (False, True)
        for w in widths[dtype]
        for c, block in CLUSTER_SHAPES
    )
    return Families(
        KernelFamily(module, f"{prefix}_rows_kernel", args=(*io, "i64", "i64"), variants=rows),  # rows, cols
        KernelFamily(module, f"{prefix}_looped_kernel", args=(*io, "i64", "i64"), variants=looped),  # cols, cached
        KernelFamily(module, f"{prefix}_cluster_kernel", args=(*io, "i64", "i64"), variants=cluster),  # cols, slice_len
    )


FORWARD_KERNELS = _declare("softmax", 1)
BACKWARD_KERNELS = _declare("softmax_backward", 2)


def plan_launch(name: str, families: Families, log: bool, out: torch.Tensor, inputs) -> direct.Launch:
    """The one launch that computes `out` (rows, cols) from `inputs` (x, or grad_output
    and output): the smallest register layout that holds a row, else the cluster
    kernel, else the looped kernel. 16-byte vectors (W = vec_width) when every row of
    every tensor starts on a 16-byte boundary, else scalars (W = 1)."""
    rows, cols = out.shape
    dtype, elem = out.dtype, out.element_size()
    ptrs = (out.data_ptr(), *(t.data_ptr() for t in inputs))
    tensors = len(inputs)
    vw = VEC_BYTES // elem
    w = vw if cols % vw == 0 and all(p % VEC_BYTES == 0 for p in ptrs) else 1
    for g, e in ROW_CONFIGS:
        if e % w == 0 and cols <= g * e:
            block = WARP_ROWS_BLOCK if g <= WARP else g
            grid = -(-rows // (block // g))
            launch = direct.Launch(families.rows[dtype, log, w, e // w, g, block], grid, block, (*ptrs, rows, cols))
            break
    else:
        c = cluster_size_for(cols, tensors, elem, w) if USE_CLUSTERS and dtype in CLUSTER_DTYPES else 0
        if c and tensors * cols * elem > CACHE_BYTES:
            slice_len = cluster_slice(cols, c, w)
            smem = tensors * slice_len * elem
            # a slice too large for two CTAs per SM gets 1024 threads, so that the SM
            # still has 32 warps to hide the latency of the write pass
            block = LOOPED_BLOCK if smem > CLUSTER_SHARED_SM_BYTES else CLUSTER_BLOCK
            kernel = families.cluster[dtype, log, w, block, c]
            launch = direct.Launch(kernel, rows * c, block, (*ptrs, cols, slice_len), smem=smem, cluster=c)
        else:
            cached = cached_count(cols, tensors, elem, w)
            kernel = families.looped[dtype, log, w, LOOPED_BLOCK]
            launch = direct.Launch(kernel, rows, LOOPED_BLOCK, (*ptrs, cols, cached), smem=tensors * cached * elem)
    if launch.grid > MAX_GRID:
        raise ValueError(f"{name}: {rows} rows of {cols} need {launch.grid} blocks, more than one launch can have")
    return launch


def _gpu_plan(name: str, families: Families, log: bool):
    @direct.plan(*families)
    def plan(outputs, inputs, params) -> list[direct.Launch]:
        return [plan_launch(name, families, log, outputs[0], inputs)]

    return plan


# --8<-- [end:dispatch]
softmax_kernel = MojoOp(_forward_spec("softmax"), gpu=_gpu_plan("softmax", FORWARD_KERNELS, False))
log_softmax_kernel = MojoOp(_forward_spec("log_softmax"), gpu=_gpu_plan("log_softmax", FORWARD_KERNELS, True))
softmax_backward_kernel = MojoOp(
    _backward_spec("softmax_backward"), gpu=_gpu_plan("softmax_backward", BACKWARD_KERNELS, False)
)
log_softmax_backward_kernel = MojoOp(
    _backward_spec("log_softmax_backward"), gpu=_gpu_plan("log_softmax_backward", BACKWARD_KERNELS, True)
)


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
    return softmax_backward(programs.contiguous(grad), y, ctx.dim), None


def _log_softmax_grad(ctx, grad):
    (y,) = ctx.saved_tensors
    return log_softmax_backward(programs.contiguous(grad), y, ctx.dim), None


def _softmax_backward_grad(ctx, h):
    # dx = y * (g - sum(g*y)). As a function of g it is the same map: grad_g = softmax_backward(h, y);
    # as a function of y: grad_y = h * (g - sum(g*y)) - g * sum(h*y).
    g, y = ctx.saved_tensors
    d = ctx.dim
    grad_g = softmax_backward(h.contiguous(), y, d)
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


_softmax_replayed = programs.replayed_forward("softmax", _softmax_eager, programs.split_one)
_log_softmax_replayed = programs.replayed_forward("log_softmax", _log_softmax_eager, programs.split_one)
_softmax_autograd = eager.function("Softmax", _softmax_replayed, _save_output, _softmax_grad, programs=True)
_log_softmax_autograd = eager.function(
    "LogSoftmax", _log_softmax_replayed, _save_output, _log_softmax_grad, programs=True
)
_softmax_backward_replayed = programs.replayed_forward(
    "softmax_backward", _softmax_backward_eager, lambda g, y, dim: ([g, y], (dim, dim.__class__))
)
_log_softmax_backward_replayed = programs.replayed_forward(
    "log_softmax_backward", _log_softmax_backward_eager, lambda g, y, dim: ([g, y], (dim, dim.__class__))
)
_softmax_backward_autograd = eager.function(
    "SoftmaxBackward", _softmax_backward_eager, _save_grad_and_output, _softmax_backward_grad
)
_log_softmax_backward_autograd = eager.function(
    "LogSoftmaxBackward", _log_softmax_backward_eager, _save_grad_and_output, _log_softmax_backward_grad
)


_CHECKS = {
    "softmax": partial(check_softmax_args, "softmax"),
    "log_softmax": partial(check_softmax_args, "log_softmax"),
    "softmax_backward": partial(_check_backward_args, "softmax_backward"),
    "log_softmax_backward": partial(_check_backward_args, "log_softmax_backward"),
}


# -- the public functions (eager.call: the registered op only where torch needs it) ----------
def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax of `x` along `dim` (day012 Mojo kernels; any dim, float32/16, bfloat16, float64).
    Under torch.autocast it runs in float32 (torch's CUDA policy)."""
    dim = as_int(dim)  # numpy's ints, as torch takes them
    if eager.autocast_dtype(x) is not None:
        (x,) = eager.cast_floats(torch.float32, x)
    return eager.call(
        (x,),
        (x, dim),
        eager=_softmax_replayed,
        autograd=_softmax_autograd,
        op=torch.ops.gpu_days.softmax,
        check=_CHECKS["softmax"],
    )


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log(softmax(x)) along `dim`, computed as x - max - log(sum(exp(x - max)))."""
    dim = as_int(dim)  # numpy's ints, as torch takes them
    if eager.autocast_dtype(x) is not None:  # float32 under torch.autocast, as softmax
        (x,) = eager.cast_floats(torch.float32, x)
    return eager.call(
        (x,),
        (x, dim),
        eager=_log_softmax_replayed,
        autograd=_log_softmax_autograd,
        op=torch.ops.gpu_days.log_softmax,
        check=_CHECKS["log_softmax"],
    )


def softmax_backward(grad_output: torch.Tensor, output: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The gradient of softmax: output * (grad_output - sum(grad_output * output, dim))."""
    dim = as_int(dim)  # numpy's ints, as torch takes them
    return eager.call(
        (grad_output, output),
        (grad_output, output, dim),
        eager=_softmax_backward_replayed,
        autograd=_softmax_backward_autograd,
        op=torch.ops.gpu_days.softmax_backward,
        check=_CHECKS["softmax_backward"],
    )


def log_softmax_backward(grad_output: torch.Tensor, output: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The gradient of log_softmax: grad_output - exp(output) * sum(grad_output, dim)."""
    dim = as_int(dim)  # numpy's ints, as torch takes them
    return eager.call(
        (grad_output, output),
        (grad_output, output, dim),
        eager=_log_softmax_backward_replayed,
        autograd=_log_softmax_backward_autograd,
        op=torch.ops.gpu_days.log_softmax_backward,
        check=_CHECKS["log_softmax_backward"],
    )


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
