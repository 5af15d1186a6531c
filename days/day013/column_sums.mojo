# Day 013, later part: the column sums of a (rows, cols) matrix, a linear layer's bias
# gradient (sum over the tokens of the output's gradient).
#
# The layer norm's backward already sums columns in two stages: per-worker partial
# rows in float32, then `sum_partials_kernel` (layer_norm.mojo) adds them in a fixed
# order. This is the first stage on its own, for any matrix: cuBLAS's matrix-vector
# product g^T 1, which torch uses for it, read 16384 x 768 bf16 gradients at ~1.3 TB/s
# on the H100 (day 020); a column sum is a pure read, so it should run near the copy
# bandwidth.
#
# Layout: a warp reads one row's 32 consecutive vectors (16-byte loads: 256 columns
# of a bf16 row, 512 bytes); the block's COL_ROW_LANES warps take rows r, r + 8, ...,
# each keeping 8 rows' loads in flight, then add their sums in shared memory (warp
# order, so the bits do not depend on timing). Block (x, y) writes partial row y for
# its 32 VEC columns.

from max.gpu import (
    MAX_THREADS_PER_BLOCK_METADATA,
    barrier,
    block_idx,
    lane_id,
    warp_id,
    WARP_SIZE,
)
from std.memory import stack_allocation
from std.sys import size_of
from std.utils import StaticTuple

comptime COL_ROW_LANES = 8  # warps of a block, each on its own rows
comptime COL_UNROLL = 8  # rows a warp loads before it adds them (a0..a7 in the kernel)


# --8<-- [start:column_partials]
comptime ColumnSmem[acc: DType] = Pointer[
    Scalar[acc], MutUntrackedOrigin, address_space=AddressSpace.SHARED
]


@always_inline
def column_smem[acc: DType, VEC: Int]() -> ColumnSmem[acc]:
    """The block's shared memory for `column_slice_sum`: a sum per warp and column.
    """
    return stack_allocation[
        COL_ROW_LANES * WARP_SIZE * VEC,
        Scalar[acc],
        address_space=AddressSpace.SHARED,
    ]()


@always_inline
def column_slice_sum[
    dtype: DType, acc: DType, VEC: Int
](
    g: Pointer[Scalar[dtype], MutAnyOrigin],
    n: Int,
    stride: Int,
    r0: Int,
    r1: Int,
    cx: Int,
    sh: ColumnSmem[acc],
) -> SIMD[acc, VEC]:
    """The sums over rows [r0, r1) of g (row stride `stride`, unit column stride) of
    the 32 VEC columns from cx 32 VEC on, by a block of COL_ROW_LANES warps: warp 0's
    lane l gets columns cx 32 VEC + l VEC onwards (what it returns; the other warps
    get their own part). Every thread must call it (a barrier). VEC > 1: n and stride
    are multiples of VEC and g is VEC-aligned, so a vector is wholly inside or
    outside the matrix.
    """
    comptime ALIGN = VEC * size_of[dtype]()
    comptime WIDTH = WARP_SIZE * VEC  # the block's columns
    var c = cx * WIDTH + lane_id() * VEC  # this lane's first column
    var r = r0 + warp_id()
    # two sums; each step loads 8 rows (r, r + 8, ..., r + 56) before adding any
    var s0 = SIMD[acc, VEC](0)
    var s1 = SIMD[acc, VEC](0)
    if c < n:
        var at = g.unsafe_offset(c)
        comptime L = COL_ROW_LANES
        while r + (COL_UNROLL - 1) * L < r1:
            var a0 = at.unsafe_load[width=VEC, alignment=ALIGN](r * stride)
            var a1 = at.unsafe_load[width=VEC, alignment=ALIGN](
                (r + L) * stride
            )
            var a2 = at.unsafe_load[width=VEC, alignment=ALIGN](
                (r + 2 * L) * stride
            )
            var a3 = at.unsafe_load[width=VEC, alignment=ALIGN](
                (r + 3 * L) * stride
            )
            var a4 = at.unsafe_load[width=VEC, alignment=ALIGN](
                (r + 4 * L) * stride
            )
            var a5 = at.unsafe_load[width=VEC, alignment=ALIGN](
                (r + 5 * L) * stride
            )
            var a6 = at.unsafe_load[width=VEC, alignment=ALIGN](
                (r + 6 * L) * stride
            )
            var a7 = at.unsafe_load[width=VEC, alignment=ALIGN](
                (r + 7 * L) * stride
            )
            s0 += (a0.cast[acc]() + a1.cast[acc]()) + (
                a2.cast[acc]() + a3.cast[acc]()
            )
            s1 += (a4.cast[acc]() + a5.cast[acc]()) + (
                a6.cast[acc]() + a7.cast[acc]()
            )
            r += COL_UNROLL * L
        while r < r1:
            s0 += at.unsafe_load[width=VEC, alignment=ALIGN](r * stride).cast[
                acc
            ]()
            r += L
    var mine = s0 + s1
    sh.unsafe_store(warp_id() * WIDTH + lane_id() * VEC, mine)
    barrier()
    if warp_id() == 0 and c < n:
        var total = sh.unsafe_load[width=VEC](lane_id() * VEC)
        comptime for w in range(1, COL_ROW_LANES):
            total += sh.unsafe_load[width=VEC](w * WIDTH + lane_id() * VEC)
        return total
    return mine


@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](
        Int32(COL_ROW_LANES * WARP_SIZE)
    )
)
@__name(t"column_partials_{dtype}_v{VEC}")
def column_partials_kernel[
    dtype: DType, VEC: Int
](
    partials: Pointer[Float32, MutAnyOrigin],
    g: Pointer[Scalar[dtype], MutAnyOrigin],
    rows: Int64,
    cols: Int64,
    ld: Int64,
    rows_per_part: Int64,
):
    """Launch with grid (ceil(cols / (32 VEC)), parts) and 32 COL_ROW_LANES threads.
    Block (x, y) sums rows [y rows_per_part, (y + 1) rows_per_part) of g (row stride
    `ld`, unit column stride) over its 32 VEC columns into partials[y, :] (float32,
    (parts, cols)): `column_slice_sum`. VEC > 1: cols and ld are multiples of VEC
    and g is 16-byte aligned (the launch plan checks).
    """
    var n = Int(cols)
    var r0 = block_idx.y * Int(rows_per_part)
    var r1 = min(Int(rows), r0 + Int(rows_per_part))
    var total = column_slice_sum[dtype, DType.float32, VEC](
        g, n, Int(ld), r0, r1, block_idx.x, column_smem[DType.float32, VEC]()
    )
    var c = block_idx.x * WARP_SIZE * VEC + lane_id() * VEC
    if warp_id() == 0 and c < n:
        partials.unsafe_store(block_idx.y * n + c, total)


# --8<-- [end:column_partials]
