"""`long_softmax(x, dim=-1)`: day015's multi-block softmax for very long rows, as a torch op.

Registered as `gpu_days::long_softmax(x, dim, pipeline)`. Day 009's op gives a row one
block, which is right for many short rows; here each row is spread over many blocks, for
a few rows of millions of elements (a 2^28 vector, or 8 x 2^22). `pipeline` picks the
Mojo pipeline at compile time (one graph each): "fused" (2 launches, 2 reads + 1 write)
or "four_stage" (max, exp + partial sums, sum, normalize: 3 reads + 2 writes).

The Mojo op also takes a float64 workspace for the per-block partials, allocated here
(torch's caching allocator, on the stream the kernels run on) and checked by the bridge
like any other tensor. It is scratch: the torch op returns only the softmax.

On CUDA (since day016) the kernels are launched from here: `_long_softmax_gpu` plans the
launches (block counts from the SM count, the reduction passes, vector or scalar loads),
which used to be Mojo host code. MAX runs the op's CPU branch.
"""

from __future__ import annotations

import dataclasses

import torch

from . import direct, eager, programs, softmax
from .contract import FLOAT_DTYPES, OpSpec, TensorArg, as_int
from .gpu_kernels import KernelFamily
from .mojo_op import MojoOp
from .softmax import _as_rows, _from_rows, check_softmax_args

PIPELINES = ("fused", "four_stage")
# Layout of a workspace row, as the kernels index it (days/day015/long_softmax.mojo owns
# these three numbers; test_day015_long_softmax.py checks that they match): the row max
# and the row sum of exp in slots 0 and 1, then from slot PARTIALS two regions of `cap`
# partials. At most `cap` blocks work on a row, so `cap` bounds the parallelism: 1024 is
# more than an H100 uses for one row (132 SMs x 4), and a block never gets less than
# MIN_BLOCK_ELEMS elements, so short rows get a small workspace (6 slots, one block:
# day009's regime).
MAX_SLOT, SUM_SLOT, PARTIALS = 0, 1, 4
MAX_BLOCKS_PER_ROW = 1024
MIN_BLOCK_ELEMS = 4096  # one fp32 tile: BLOCK threads x UNROLL (4) vectors of 4
BLOCK = 256  # threads per block: a compile-time parameter of every kernel (and of the CPU branch)
# Blocks resident per SM for a one-wave grid: 4 x 256 threads fit even at 64 registers a
# thread. 4 x 256 x UNROLL x 16 B = 64 KiB of loads in flight per SM covers the H100's
# bandwidth-latency product (~25 KiB per SM) with room to spare.
BLOCKS_PER_SM = 4

LONG_SOFTMAX = OpSpec(
    name="long_softmax",
    outputs=(
        TensorArg("output", ("rows", "cols")),
        TensorArg("workspace", ("rows", "slots"), dtype=torch.float64),
    ),
    inputs=(TensorArg("x", ("rows", "cols")),),
    params={"PIPELINE": "fused", "BLOCK": BLOCK},
)


def workspace_slots(n: int) -> int:
    """Slots a workspace row needs for a row of n elements (an even count, so that each
    region of float64 partials starts on a 16-byte boundary)."""
    cap = min(MAX_BLOCKS_PER_ROW, max(1, -(-n // MIN_BLOCK_ELEMS)))
    return PARTIALS + 2 * (cap + cap % 2)


def workspace_cap(slots: int) -> int:
    """Partials per region in a workspace row of `slots` values (the kernels' workspace_cap):
    the most blocks a row may get."""
    return (slots - PARTIALS) // 2


# -- the CUDA launch plan (day016: it used to be Mojo host code) ----------------------------
MODULE = "days.day015.long_softmax"
REDUCE_MODULE = "days.day015.multiblock_reduce"
PARTIAL = torch.float64  # the workspace's dtype


def _vec_variants(dtypes, *extra):
    """(dtype, VEC, *extra, BLOCK) for 16-byte loads and for scalar loads (VEC = 1)."""
    return tuple((d, v, *extra, BLOCK) for d in dtypes for v in sorted({16 // d.itemsize, 1}))


_PTR_ROWS = ("ptr", "i64")  # a pointer and its row stride (elements)
ONLINE_PARTIALS_KERNEL = KernelFamily(  # ws, ws_stride, cap, x, n, blocks
    MODULE, "online_partials_kernel", ("ptr", "i64", "i64", "ptr", "i64", "i64"), _vec_variants(FLOAT_DTYPES)
)
NORMALIZE_KERNEL = KernelFamily(  # y, x, ws, ws_stride, cap, n, blocks  (REVERSE = True)
    MODULE, "normalize_kernel", ("ptr", "ptr", "ptr", "i64", "i64", "i64", "i64"), _vec_variants(FLOAT_DTYPES, True)
)
REDUCE_MAX_KERNEL = KernelFamily(  # dst, dst_stride, src, src_stride, n, blocks: x, then float64 partials
    REDUCE_MODULE, "reduce_max_kernel", (*_PTR_ROWS, *_PTR_ROWS, "i64", "i64"), _vec_variants(FLOAT_DTYPES)
)
REDUCE_SUM_KERNEL = KernelFamily(  # the same, on float64 partials only
    REDUCE_MODULE, "reduce_sum_kernel", (*_PTR_ROWS, *_PTR_ROWS, "i64", "i64"), _vec_variants((PARTIAL,))
)
EXP_SUM_KERNEL = KernelFamily(  # y, x, ws, ws_stride, n, blocks
    MODULE, "exp_sum_kernel", ("ptr", "ptr", "ptr", "i64", "i64", "i64"), _vec_variants(FLOAT_DTYPES)
)
SCALE_KERNEL = KernelFamily(  # y, ws, ws_stride, n, blocks  (REVERSE = True)
    MODULE, "scale_kernel", ("ptr", "ptr", "i64", "i64", "i64"), _vec_variants(FLOAT_DTYPES, True)
)
# day 016, part eighteen: the fused pipeline in one launch where a row gets one block
ONE_BLOCK_SOFTMAX_KERNEL = KernelFamily(  # y, x, n
    "days.day016.one_launch", "one_block_softmax_kernel", ("ptr", "ptr", "i64"), _vec_variants(FLOAT_DTYPES)
)
ONE_BLOCK = direct.PlanSetting(True)  # False: the two launches even then (an A/B, a test)

_SM_COUNT: dict[int | None, int] = {}  # per device index: a property query costs ~10 us


def device_blocks(device: torch.device) -> int:
    """Blocks that fill `device` in one wave."""
    sms = _SM_COUNT.get(device.index)
    if sms is None:
        sms = _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return sms * BLOCKS_PER_SM


def blocks_per_row(n: int, rows: int, cap: int, fill: int) -> int:
    """Enough blocks to fill the device, none with less than MIN_BLOCK_ELEMS, at most
    `cap` (the partials' room in the workspace)."""
    return max(1, min(-(-n // MIN_BLOCK_ELEMS), fill // rows, cap))


def _vec(ptr: int, row_stride: int, rows: int, dtype: torch.dtype) -> int:
    """VEC: 16-byte loads when every row starts on a 16-byte boundary, else 1."""
    vec = 16 // dtype.itemsize
    return vec if ptr % 16 == 0 and (rows == 1 or row_stride % vec == 0) else 1


def _pass(family, dtype, dst, dst_stride, src, src_stride, n, rows, blocks, block) -> direct.Launch:
    """One reduction pass of `blocks` blocks a row (pointers are byte addresses)."""
    kernel = family[dtype, _vec(src, src_stride, rows, dtype), block]
    return direct.Launch(kernel, rows * blocks, block, (dst, dst_stride, src, src_stride, n, blocks))


# --8<-- [start:reduce_rows]
def _reduce_rows(
    launches, family, dtype, src, src_stride, n, rows, ws, ws_stride, result, first, second, cap, fill, block
):
    """Reduce each row of `src` to one value, written to workspace slot `result`.

    Pass 1 writes one partial per block; every later pass reduces the float64 partials
    of the pass before, ping-ponging between two workspace regions (`first`, `second`:
    slots) of `cap` values a row, until one block per row is left and it writes the
    result. With at most 1024 blocks a row that is two passes; the loop takes more.
    """
    blocks = blocks_per_row(n, rows, cap, fill)
    out = result if blocks == 1 else first
    launches.append(_pass(family, dtype, ws + 8 * out, ws_stride, src, src_stride, n, rows, blocks, block))
    current, spare, m = first, second, blocks
    while m > 1:
        next_blocks = blocks_per_row(m, rows, cap, fill)
        out = result if next_blocks == 1 else spare
        launches.append(
            _pass(family, PARTIAL, ws + 8 * out, ws_stride, ws + 8 * current, ws_stride, m, rows, next_blocks, block)
        )
        m, spare, current = next_blocks, current, out


# --8<-- [end:reduce_rows]


# --8<-- [start:gpu_plan]
@direct.plan(
    ONLINE_PARTIALS_KERNEL, NORMALIZE_KERNEL, REDUCE_MAX_KERNEL, REDUCE_SUM_KERNEL, EXP_SUM_KERNEL, SCALE_KERNEL
)
def _long_softmax_gpu(outputs, inputs, params) -> list[direct.Launch]:
    """Fused: 2 launches. 4-stage: max passes, exp + partial sums, sum passes, scale.
    Every kernel gets `blocks` blocks of BLOCK threads per row (grid rows * blocks) and
    16-byte loads when its rows allow; the launches run in order on one stream."""
    (y, ws), (x,) = outputs, inputs
    rows, n = x.shape
    slots = ws.shape[1]  # the workspace is contiguous (the contract checks): its row stride
    if slots < PARTIALS + 2:
        raise ValueError(
            f"long_softmax: workspace must be (rows, >= {PARTIALS + 2}), got {tuple(ws.shape)} for {rows} rows"
        )
    block, dtype = params["BLOCK"], x.dtype
    cap = workspace_cap(slots)
    fill = device_blocks(x.device)
    blocks = blocks_per_row(n, rows, cap, fill)
    grid = rows * blocks
    if grid >= 2**31:
        raise ValueError(f"long_softmax: {rows} rows need a grid of {grid} blocks, over CUDA's 2^31 - 1")
    yp, xp, wp = y.data_ptr(), x.data_ptr(), ws.data_ptr()
    vec = min(_vec(xp, n, rows, dtype), _vec(yp, n, rows, dtype))
    if params["PIPELINE"] == "fused":
        return [
            direct.Launch(ONLINE_PARTIALS_KERNEL[dtype, vec, block], grid, block, (wp, slots, cap, xp, n, blocks)),
            direct.Launch(NORMALIZE_KERNEL[dtype, vec, True, block], grid, block, (yp, xp, wp, slots, cap, n, blocks)),
        ]
    launches: list[direct.Launch] = []
    region_a, region_b = PARTIALS, PARTIALS + cap
    # 1. m = reduce[max](x): one partial per block into A, then A -> MAX_SLOT
    _reduce_rows(
        launches, REDUCE_MAX_KERNEL, dtype, xp, n, n, rows, wp, slots, MAX_SLOT, region_a, region_b, cap, fill, block
    )
    # 2. y = exp(x - m); one partial sum per block into A (the same blocks as pass 1)
    launches.append(direct.Launch(EXP_SUM_KERNEL[dtype, vec, block], grid, block, (yp, xp, wp, slots, n, blocks)))
    # 3. s = reduce[sum](A) -> SUM_SLOT
    a = wp + 8 * region_a
    _reduce_rows(
        launches,
        REDUCE_SUM_KERNEL,
        PARTIAL,
        a,
        slots,
        blocks,
        rows,
        wp,
        slots,
        SUM_SLOT,
        region_b,
        region_a,
        cap,
        fill,
        block,
    )
    # 4. y *= 1 / s, in place
    scale = SCALE_KERNEL[dtype, _vec(yp, n, rows, dtype), True, block]
    launches.append(direct.Launch(scale, grid, block, (yp, wp, slots, n, blocks)))
    return launches


# --8<-- [end:gpu_plan]
long_softmax_kernel = MojoOp(LONG_SOFTMAX, gpu=_long_softmax_gpu)


@direct.plan(*_long_softmax_gpu.families, ONE_BLOCK_SOFTMAX_KERNEL)
def _long_softmax_rows_gpu(outputs, inputs, params) -> list[direct.Launch]:
    """The public function's CUDA plan: `long_softmax_kernel`'s plan with a workspace of its
    own (`direct.scratch`), which a replay allocates in C++, instead of one the caller makes
    and passes as a destination: a torch.empty, a key and an overlap check less per call.
    Where the fused pipeline would give a row one block (rows of at most MIN_BLOCK_ELEMS, or
    more rows than a wave of blocks), day 016's one launch, without a workspace: the same
    output bit for bit, one launch and one tensor less."""
    (y,), (x,) = outputs, inputs
    rows, n = x.shape
    cap = workspace_cap(workspace_slots(n))  # what _long_softmax_gpu's blocks_per_row gets
    if params["PIPELINE"] == "fused" and ONE_BLOCK.value and blocks_per_row(n, rows, cap, device_blocks(x.device)) == 1:
        if rows >= 2**31:
            raise ValueError(f"long_softmax: {rows} rows need a grid of {rows} blocks, over CUDA's 2^31 - 1")
        vec = min(_vec(x.data_ptr(), n, rows, x.dtype), _vec(y.data_ptr(), n, rows, x.dtype))
        kernel = ONE_BLOCK_SOFTMAX_KERNEL[x.dtype, vec, params["BLOCK"]]
        return [direct.Launch(kernel, rows, params["BLOCK"], (y.data_ptr(), x.data_ptr(), n))]
    workspace = direct.scratch((x.shape[0], workspace_slots(x.shape[1])), torch.float64, x.device)
    return long_softmax_kernel.gpu([y, workspace], inputs, params)


# the same op with the workspace left to the plan: CUDA only (MAX's CPU op takes it as an output)
long_softmax_rows_kernel = MojoOp(
    dataclasses.replace(LONG_SOFTMAX, outputs=LONG_SOFTMAX.outputs[:1]), gpu=_long_softmax_rows_gpu
)


def _check_pipeline(pipeline) -> None:
    if not isinstance(pipeline, str):
        raise TypeError(f"long_softmax: pipeline must be a str, got {type(pipeline).__name__}")
    if pipeline not in PIPELINES:
        raise ValueError(f"long_softmax: pipeline must be one of {PIPELINES}, got {pipeline!r}")


def _long_softmax_eager(x: torch.Tensor, dim: int, pipeline: str = "fused") -> torch.Tensor:
    dim = check_softmax_args("long_softmax", x, dim)
    _check_pipeline(pipeline)
    rows = _as_rows(x, dim)
    if rows.is_cuda:
        (out,) = long_softmax_rows_kernel(
            [rows], torch_impl=lambda: [torch.softmax(rows, dim=-1)], params={"PIPELINE": pipeline}
        )
        return _from_rows(out, x, dim)
    workspace = torch.empty(rows.shape[0], workspace_slots(rows.shape[1]), dtype=torch.float64, device=rows.device)
    out, _ = long_softmax_kernel(
        [rows],
        out=[workspace],
        torch_impl=lambda: [torch.softmax(rows, dim=-1), workspace],
        params={"PIPELINE": pipeline},
    )
    return _from_rows(out, x, dim)


_long_softmax = torch.library.custom_op("gpu_days::long_softmax", _long_softmax_eager, mutates_args=())


@_long_softmax.register_fake
def _(x: torch.Tensor, dim: int, pipeline: str = "fused") -> torch.Tensor:
    check_softmax_args("long_softmax", x, dim)
    _check_pipeline(pipeline)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _backward(ctx, grad):
    # softmax's backward in plain torch (y * (g - sum(g * y))): a reduction and an
    # elementwise pass that torch already runs near bandwidth; the day is about the forward.
    return (*softmax._backward(ctx, grad), None)


_long_softmax.register_autograd(_backward, setup_context=softmax._setup_context)
_long_softmax_replayed = programs.replayed_forward(
    "long_softmax", _long_softmax_eager, lambda x, dim, pipeline="fused": ([x], (dim, dim.__class__, pipeline))
)
_long_softmax_autograd = eager.function(
    "LongSoftmax", _long_softmax_replayed, softmax._setup_context, _backward, programs=True
)


def long_softmax(x: torch.Tensor, dim: int = -1, pipeline: str = "fused") -> torch.Tensor:
    """Softmax of `x` along `dim`, each row spread over many blocks (day015's Mojo kernels).
    Under torch.autocast it runs in float32, as `softmax` (torch's CUDA policy)."""
    dim = as_int(dim)  # numpy's ints, as torch takes them
    if eager.autocast_dtype(x) is not None:
        (x,) = eager.cast_floats(torch.float32, x)
    return eager.call(
        (x,),
        (x, dim, pipeline),
        eager=_long_softmax_replayed,
        autograd=_long_softmax_autograd,
        op=torch.ops.gpu_days.long_softmax,
        check=_check_long_softmax,
    )


def _check_long_softmax(x, dim, pipeline) -> None:
    check_softmax_args("long_softmax", x, dim)
    _check_pipeline(pipeline)


class MojoLongSoftmax(torch.nn.Module):
    """`torch.nn.Softmax(dim)` for very long rows, backed by the multi-block Mojo kernels."""

    def __init__(self, dim: int = -1, pipeline: str = "fused"):
        super().__init__()
        _check_pipeline(pipeline)
        self.dim = dim
        self.pipeline = pipeline

    @property
    def use_mojo(self) -> bool:
        return long_softmax_kernel.ready()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return long_softmax(x, self.dim, self.pipeline)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, pipeline={self.pipeline!r}"
