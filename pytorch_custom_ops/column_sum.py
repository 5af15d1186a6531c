"""`column_sum`: g.sum(0) of a 2-D gradient, a linear layer's bias gradient, in g's dtype or
float32 (a float32 master bias, master_weights.py).

On CUDA for 16-bit g (columns a multiple of 8, 16-byte aligned) it is day 020's two
launches: `column_partials_kernel` sums slabs of rows into a float32 workspace, and day
013's `sum_partials_kernel` (the LayerNorm backward's second stage) adds the slabs in a
fixed order and writes the result. Elsewhere it is torch's sum, float32 accumulation
for 16-bit inputs either way.
"""

from __future__ import annotations

import torch

from . import direct
from .contract import OpSpec, TensorArg
from .gpu_kernels import KernelFamily
from .layer_norm import LN_SUM_PARTIALS, SUM_COLS, SUM_LANES
from .mojo_op import MojoOp

CS_COLS, CS_THREADS = 256, 256  # columns and threads per block (days/day020/column_sum.mojo)
CS_ROWS_PER_SLAB = 64  # at least: fewer rows per block, more partials for the second stage
CS_BLOCKS_PER_SM = 8  # blocks the grid aims for (8 warps each, loads in flight)
TC_DTYPES = (torch.bfloat16, torch.float16)

COLUMN_PARTIALS = KernelFamily(
    "days.day020.column_sum",
    "column_partials_kernel",
    args=("ptr", "ptr", "i64", "i64", "i64"),  # partials, g, rows, cols, slab
    variants=tuple((d,) for d in TC_DTYPES),
)


def _spec(out_dtype: torch.dtype | None) -> OpSpec:
    return OpSpec(
        name="column_sum",
        outputs=(TensorArg("sums", ("cols",), dtype=out_dtype),),
        inputs=(TensorArg("g", ("rows", "cols")),),
        dtypes=TC_DTYPES,
    )


def slabs(rows: int, cols: int, sms: int) -> tuple[int, int]:
    """(rows per slab, slabs): enough blocks for CS_BLOCKS_PER_SM per SM, each slab a
    multiple of 8 rows (one per warp) and at least CS_ROWS_PER_SLAB."""
    col_blocks = -(-cols // CS_COLS)
    wanted = max(1, -(-CS_BLOCKS_PER_SM * sms // col_blocks))
    slab = max(CS_ROWS_PER_SLAB, -(-rows // wanted))
    slab = -(-slab // 8) * 8
    return slab, -(-rows // slab)


@direct.plan(COLUMN_PARTIALS, LN_SUM_PARTIALS)
def column_sum_gpu(outputs, inputs, params) -> list[direct.Launch]:
    (out,), (g,) = outputs, inputs
    rows, cols = g.shape
    if cols % 8 or g.data_ptr() % 16:
        raise ValueError(
            f"column_sum: {cols} columns at address {g.data_ptr():#x} (needs cols % 8 == 0, 16-byte aligned)"
        )
    index = out.get_device()
    sms = torch.cuda.get_device_properties(index).multi_processor_count if index >= 0 else 132
    slab, parts = slabs(rows, cols, sms)
    partials = direct.scratch((parts, cols), torch.float32, out.device)
    half = cols // 2  # the second stage writes (weight, bias) halves: here both halves of out
    return [
        direct.Launch(
            COLUMN_PARTIALS[g.dtype],
            (-(-cols // CS_COLS), parts),
            CS_THREADS,
            (partials.data_ptr(), g.data_ptr(), rows, cols, slab),
        ),
        direct.Launch(
            LN_SUM_PARTIALS[out.dtype, torch.float32, SUM_COLS, SUM_LANES],
            -(-cols // SUM_COLS),
            SUM_COLS * SUM_LANES,
            (out.data_ptr(), out.data_ptr() + half * out.element_size(), partials.data_ptr(), parts, half),
        ),
    ]


_OPS = {dtype: MojoOp(_spec(dtype), gpu=column_sum_gpu) for dtype in (None, torch.float32)}


def column_sum(g: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """g.sum(0) of a 2-D g, in `dtype` (default g's): float32 accumulation."""
    if torch.is_grad_enabled() and g.requires_grad:  # create_graph: differentiable
        return g.sum(0, dtype=dtype)
    if g.is_cuda and g.dtype in TC_DTYPES and g.shape[0] > 0 and g.shape[1] % 8 == 0 and g.__class__ is torch.Tensor:
        g = g if g.is_contiguous() and g.data_ptr() % 16 == 0 else g.clone(memory_format=torch.contiguous_format)
        (sums,) = _OPS[dtype if dtype == torch.float32 else None]([g])
        return sums if dtype is None or sums.dtype == dtype else sums.to(dtype)
    return g.sum(0, dtype=dtype)
