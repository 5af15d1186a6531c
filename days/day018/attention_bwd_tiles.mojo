# Day 018, backward version 6: one pass, dQ added by whole tiles through the TMA unit.
#
# Version 2 (attention_bwd_dq.mojo's second half) adds dQ with `red.global.add`, two
# floats per instruction, each consumer its own 64 keys' share: two 64 x D float32
# tiles per (key block, query tile), and ~3.6 ms of an 11 ms backward. Here:
#
# - **dS is shared.** Both consumers store their dS^T box (keys 0-63, 64-127 of the
#   block); after a barrier over both, consumer cw computes columns 64 cw .. 64 cw + 63
#   of dS K over all 128 keys (head_dim 128). One float32 tile per (key block, query
#   tile) instead of two. At head_dim 64 the N = 32 halves would start inside a
#   128-byte swizzle row, so there each consumer keeps its own keys' 64 x 64 share, and
#   both add into the same tile.
# - **The TMA unit adds whole 16 KB pieces.** A consumer writes its 64 x 64 float32
#   accumulator into shared memory in the accumulator's own order (float4 jj of thread
#   tid at (128 jj + tid) 16 bytes: every warp store covers 512 contiguous bytes), and
#   one thread issues a single `cp.reduce.async.bulk ... add.f32` of 16 KB. The global
#   float32 dQ keeps that order: 64-row tiles, 64-column pieces, each piece permuted
#   like the shared copy; `attention.py` puts the rows back in order while it casts.
#
# The dS boxes take turns (tile j uses pair j % 2): the barrier before tile j's dQ
# product means both consumers are past tile j - 1's, whose pair tile j + 1 rewrites.

from max.gpu import lane_id, warp_id
from max.gpu.compute.mma import (
    wgmma_async,
    wgmma_commit_group_sync,
    wgmma_fence_aligned,
)
from std.sys._assembly import inlined_assembly

from days.day014.gemm_v3_tma import TMA_BK, tma_desc
from days.day018.attention_common import BOX

comptime DQ_ATOMIC = 1  # version 2: red.global.add.v2.f32 per thread
comptime DQ_TILES = 2  # version 6: dS shared, 16 KB pieces through the TMA unit
comptime PIECE = 64 * 64  # floats of one staged piece (a 64 x 64 float32 tile)
comptime CONSUMERS_BAR = 6  # named barrier over both consumers (turns use 4 and 5)


@always_inline
def shares_ds[D: Int]() -> Bool:
    """head_dim 128: the consumers split dQ's columns over all 128 keys."""
    return D == 128


@always_inline
def dq_piece_wgmma[
    dtype: DType, D: Int
](
    ds_pair: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    sk_block: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    cw: Int,
) -> SIMD[DType.float32, 32]:
    """Issue and commit this consumer's 64 x 64 piece of dS K: ds_pair holds the dS^T
    boxes of keys 0-63 and 64-127 (mn-major A), sk_block the block's fixed K tile
    (consumer c's keys at c (D / 64) boxes; mn-major B). head_dim 128: columns
    64 cw .. + 63 over all 128 keys; head_dim 64: all columns over the consumer's keys.
    """
    comptime DB = D // TMA_BK
    var acc = SIMD[DType.float32, 32](0)
    wgmma_fence_aligned()
    comptime for kh in range(2 if shares_ds[D]() else 1):
        var half = kh if shares_ds[D]() else cw  # the keys' half of the block
        var col = cw if shares_ds[D]() else 0  # the piece's 64 columns
        var a = ds_pair.unsafe_offset(half * BOX)
        var b = sk_block.unsafe_offset((half * DB + col) * BOX)
        comptime for ks in range(TMA_BK // 16):
            acc = wgmma_async[
                64,
                64,
                16,
                a_type=dtype,
                b_type=dtype,
                layout_a="col",
                layout_b="row",
            ](
                tma_desc[dtype, False](a, 0, ks),
                tma_desc[dtype, False](b, 0, ks),
                acc,
            )
    wgmma_commit_group_sync()
    return acc


@always_inline
def stage_piece(
    acc: SIMD[DType.float32, 32],
    scale: Float32,
    piece: Pointer[
        Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
):
    """scale * acc into the shared piece in the accumulator's order: float4 jj of thread
    tid (of the warpgroup) at float 4 (128 jj + tid); its four floats are rows g and
    g + 8, columns 8 jj + 2 t and + 1, in the accumulator's order."""
    var tid = (Int(warp_id()) % 4) * 32 + Int(lane_id())
    comptime for jj in range(8):
        var v = SIMD[DType.float32, 4](
            acc[4 * jj], acc[4 * jj + 1], acc[4 * jj + 2], acc[4 * jj + 3]
        )
        piece.unsafe_store[alignment=16](4 * (128 * jj + tid), v * scale)


@always_inline
def bulk_reduce_add(
    dst: Pointer[Float32, MutAnyOrigin],
    src: Pointer[
        Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
):
    """dst[i] += src[i] for one PIECE, by the TMA unit (element-wise atomic adds in
    L2); the caller commits the bulk group and waits before reusing src."""
    inlined_assembly[
        (
            "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"
            " [$0], [$1], $2;"
        ),
        NoneType,
        constraints="l,r,r,~{memory}",
    ](dst, Int32(Int(src)), Int32(PIECE * 4))
