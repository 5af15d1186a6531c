"""`column_sums(g)`: g.sum(0) of a (rows, cols) bf16/fp16 CUDA matrix by day 013's kernels,
a linear layer's bias gradient.

Two launches, the layer norm backward's scheme (days/day013/column_sums.mojo):
`column_partials_kernel` sums slices of rows into float32 partial rows, then day 013's
`sum_partials_kernel` adds those up in a fixed order (the same bits on every run) and
writes g's dtype or float32 (a float32 master bias, master_weights.py).

The path it replaces, cuBLAS's matrix-vector product gᵀ 1 (`gemm.column_sum`), read the
bias gradients of day 016's block and day 020's GPT-2 step at 1.4-2.9 TB/s on the H100;
these kernels take 1.0-1.3x less time (days/day013/time_column_sums.py).

Only the CUDA path exists (no MAX CPU kernel): callers use it where `usable` says so and
torch's sum elsewhere.
"""

from __future__ import annotations

import torch

from . import direct, eager
from .contract import OpSpec, TensorArg
from .gpu_kernels import KernelFamily
from .layer_norm import LN_SUM_PARTIALS, sm_count, sum_partials_launch
from .mojo_op import MojoOp

ROW_LANES, WARP = 8, 32  # COL_ROW_LANES in days/day013/column_sums.mojo: warps of a block
VECTOR_BYTES = 16
BLOCKS_PER_SM = 4  # the first stage's grid: about this many blocks per SM, all resident at once
MIN_ROWS_PER_PART = 8  # a part keeps each warp on at least one row
DTYPES = (torch.bfloat16, torch.float16)

COLUMN_PARTIALS_KERNEL = KernelFamily(
    "days.day013.column_sums",
    "column_partials_kernel",
    args=("ptr", "ptr", "i64", "i64", "i64", "i64"),  # partials, g, rows, cols, ld, rows_per_part
    variants=tuple((d, vec) for d in DTYPES for vec in (1, VECTOR_BYTES // d.itemsize)),
)


def partition(rows: int, cols: int, vec: int, sms: int) -> tuple[int, int, int]:
    """(column blocks, parts, rows per part) of the first stage: 32 vec columns a block,
    and rows cut into parts so that the grid has at most BLOCKS_PER_SM blocks per SM, all
    resident at once (the kernel's 256 threads x 64 registers allow 4 an SM). A grid of
    531 blocks for 528 places ran its last 3 alone: 16384 x 2304 took 42.2 us (28.4 once
    the grid fit, with 8 rows in flight a warp)."""
    col_blocks = -(-cols // (WARP * vec))
    parts = max(1, min(BLOCKS_PER_SM * sms // col_blocks, -(-rows // MIN_ROWS_PER_PART)))
    per_part = -(-rows // parts)
    return col_blocks, -(-rows // per_part), per_part


# --8<-- [start:plan]
@direct.plan(COLUMN_PARTIALS_KERNEL, LN_SUM_PARTIALS)
def column_sums_gpu(outputs, inputs, params) -> list[direct.Launch]:
    (sums,), (g,) = outputs, inputs
    rows, cols = g.shape
    vec = VECTOR_BYTES // g.element_size()
    if cols % vec or g.stride(0) % vec or g.data_ptr() % VECTOR_BYTES:
        vec = 1  # element loads: the same kernel, one column a lane
    col_blocks, parts, per_part = partition(rows, cols, vec, sm_count(g.device))
    partials = direct.scratch((parts, cols), torch.float32, g.device)
    args = (partials.data_ptr(), g.data_ptr(), rows, cols, g.stride(0), per_part)
    first = direct.Launch(COLUMN_PARTIALS_KERNEL[g.dtype, vec], (col_blocks, parts), ROW_LANES * WARP, args)
    return [first, sum_partials_launch(partials, sums)]


# --8<-- [end:plan]
def _spec(dtype: torch.dtype | None) -> OpSpec:
    return OpSpec(
        name="column_sums",
        outputs=(TensorArg("sums", ("cols",), dtype),),
        inputs=(TensorArg("g", ("rows", "cols")),),
    )


_ops = {dtype: MojoOp(_spec(dtype), gpu=column_sums_gpu) for dtype in (None, torch.float32)}


def usable(g: torch.Tensor) -> bool:
    """The kernels serve this call: a plain (not traced) contiguous 2-D bf16/fp16 CUDA
    tensor with at least one row and column, outside torch.compile, and no autograd graph
    to record (the op has no backward: a double backward keeps torch's differentiable
    sum)."""
    return (
        g.is_cuda
        and g.dtype in DTYPES
        and g.dim() == 2
        and g.is_contiguous()  # the op's contract (contract.py): no views with gaps
        and g.shape[0] > 0
        and g.shape[1] > 0
        and eager.route(g) is eager.EAGER  # not traced, and no graph to record (double backward)
    )


def column_sums(g: torch.Tensor, float32: bool = False) -> torch.Tensor:
    """g.sum(0) (accumulated in float32, as torch's), in g's dtype or with `float32` in
    float32. For tensors `usable` accepts; the torch sum is the warned fallback where the
    kernels cannot load (an error in strict mode)."""
    if not usable(g):
        raise ValueError(
            "column_sums: g must be a contiguous 2-D bfloat16/float16 CUDA tensor "
            f"with no empty dim, got {tuple(g.shape)} {g.dtype} on {g.device} with strides {g.stride()}"
        )
    dtype = torch.float32 if float32 else g.dtype
    (sums,) = _ops[torch.float32 if float32 else None](
        [g], torch_impl=lambda: [g.sum(0, dtype=torch.float32).to(dtype)]
    )
    return sums
