# Day 020, part 6: column sums of a (rows, cols) 16-bit gradient, a linear layer's bias
# gradient, in float32.
#
# cuBLAS's matrix-vector product (what `column_sum` ran before) read GPT-2's 16384-row
# gradients at ~2.2 TB/s on the H100, as a split-K GEMM and a reduction: 48 of them, about
# 1.2 ms of a 124M training step. A column sum needs no tensor core: each warp reads whole
# rows (32 lanes x 16 bytes = 256 contiguous columns), 8 warps take every 8th row of the
# block's slab of rows, and 4 rows are in flight per lane. A block's float32 partial sums
# (one per column) go to a workspace; day 013's second stage (the LayerNorm's
# `sum_partials_kernel`, which sums the weight and bias partials of its backward) adds the
# slabs up, always in the same order: the result does not depend on timing.

from max.gpu import (
    MAX_THREADS_PER_BLOCK_METADATA,
    barrier,
    block_idx,
    thread_idx,
)
from std.memory import stack_allocation
from std.sys import size_of
from std.utils.static_tuple import StaticTuple

comptime CS_THREADS = 256
comptime CS_VEC = 8  # 16-bit values per 16-byte load
comptime CS_GROUPS = 32  # a warp's lanes: 32 x 8 = 256 columns of a row
comptime CS_WARPS = CS_THREADS // CS_GROUPS  # warps, each on its own rows
comptime CS_COLS = CS_GROUPS * CS_VEC  # columns per block
comptime CS_UNROLL = 4  # rows in flight per lane (a0..a3 below)


# --8<-- [start:kernel]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(CS_THREADS))
)
def column_partials_kernel[
    dtype: DType
](
    partials: Pointer[Float32, MutAnyOrigin],
    g: Pointer[Scalar[dtype], MutAnyOrigin],
    rows: Int64,
    cols: Int64,
    slab: Int64,
):
    """partials[s, c] = sum of g[r, c] over the rows r of slab s, [s slab, (s + 1) slab).

    Grid (ceil(cols / 256), slabs), 256 threads; cols % 8 == 0 and g 16-byte aligned
    (the plan's promise). Float32 accumulation, a fixed order."""
    comptime assert (
        size_of[dtype]() == 2
    ), "16-bit gradients: 8 per 16-byte load"
    var C = Int(cols)
    var lane = thread_idx.x % CS_GROUPS
    var w = thread_idx.x // CS_GROUPS
    var col = block_idx.x * CS_COLS + lane * CS_VEC
    var r0 = block_idx.y * Int(slab)
    var r1 = min(r0 + Int(slab), Int(rows))
    var a0 = SIMD[DType.float32, CS_VEC](0)
    var a1 = SIMD[DType.float32, CS_VEC](0)
    var a2 = SIMD[DType.float32, CS_VEC](0)
    var a3 = SIMD[DType.float32, CS_VEC](0)
    if col < C:
        var p = g.unsafe_offset(col)
        var r = r0 + w
        while r + 3 * CS_WARPS < r1:  # four independent loads in flight
            a0 += p.unsafe_load[width=CS_VEC, alignment=16](r * C).cast[
                DType.float32
            ]()
            a1 += p.unsafe_load[width=CS_VEC, alignment=16](
                (r + CS_WARPS) * C
            ).cast[DType.float32]()
            a2 += p.unsafe_load[width=CS_VEC, alignment=16](
                (r + 2 * CS_WARPS) * C
            ).cast[DType.float32]()
            a3 += p.unsafe_load[width=CS_VEC, alignment=16](
                (r + 3 * CS_WARPS) * C
            ).cast[DType.float32]()
            r += CS_UNROLL * CS_WARPS
        while r < r1:
            a0 += p.unsafe_load[width=CS_VEC, alignment=16](r * C).cast[
                DType.float32
            ]()
            r += CS_WARPS
    var mine = (a0 + a1) + (a2 + a3)
    # the 8 warps' sums of each column meet in shared memory; thread t adds column t's
    var sh = stack_allocation[
        CS_WARPS * CS_COLS, Float32, address_space=AddressSpace.SHARED
    ]()
    sh.unsafe_store[alignment=32](w * CS_COLS + lane * CS_VEC, mine)
    barrier()
    var k = block_idx.x * CS_COLS + thread_idx.x
    if k < C:
        var total = sh[unsafe_offset=thread_idx.x]
        comptime for v in range(1, CS_WARPS):
            total += sh[unsafe_offset=v * CS_COLS + thread_idx.x]
        partials[unsafe_offset=block_idx.y * C + k] = total


# --8<-- [end:kernel]
