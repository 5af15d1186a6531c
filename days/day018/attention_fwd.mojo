# Day 018: the FlashAttention forward kernel for Hopper. The block's frame is the same
# for every version: a producer warpgroup (TMA, attention_common.produce) and two
# consumer warpgroups of 64 query rows each; the versions differ in the consumers'
# loop, one file each (the ladder of the day's journal):
#   attention_v1_serial.mojo   S, softmax, P V one after another
#   attention_v2_overlap.mojo  the softmax of tile j overlaps P V of tile j-1 and S_j;
#                              version 3 adds the ping-pong between the two consumers
# Version 4 is version 3 in a persistent grid (one block per SM, each walking work
# tiles, `work_tile`): the K/V stream and the mbarrier phases go on across a block's
# tiles. Where shared memory holds two Qs (head_dim 64: attention_gpu.q_buffers), the
# next tile's Q loads while the consumers still work on this one; else once they are
# done with it.
#
# Builds on day 014's version 3 (TMA into 128-byte swizzled tiles, mbarrier phases,
# setmaxnreg, the tile descriptors): its helpers are imported, not copied.
#
# Shared memory, 1024-byte aligned pieces (16-bit elements; a 128-byte swizzle span
# is 64 elements):
#   Q      NC consumers x D/64 boxes of 64 rows x 64         (k-major A operand),
#          version 4: attention_gpu.q_buffers of them
#   stage  K: D/64 boxes of BN keys x 64                      (k-major B operand)
#          V: BN/64 key slices x D/64 boxes of 64 keys x 64   (mn-major B operand)
#   barriers  q_full, full_k[STAGES], full_v[STAGES], empty[STAGES], q_empty,
#             with SPLIT empty_v[STAGES] (then empty[] frees K only),
#             with a second Q its q_full and q_empty (`q_bars`)

from max.gpu import (
    MAX_THREADS_PER_BLOCK_METADATA,
    thread_idx,
    block_idx,
    grid_dim,
    barrier,
    lane_id,
    warp_id,
)
from max.gpu.host.nvidia.tma import TMADescriptor
from max.gpu.memory import external_memory
from max.gpu.sync import mbarrier_arrive, mbarrier_init
from std.math import ceildiv
from std.sys import size_of
from std.utils import StaticTuple

from days.day014.gemm_v2_wgmma import WG_THREADS
from days.day014.gemm_v3_tma import (
    TMA_BK,
    TMA_CONSUMER_REGS,
    TMA_PRODUCER_REGS,
    TMA3_CONSUMER_REGS,
    TMA3_PRODUCER_REGS,
    consumer_index,
    fence_mbarrier_init,
    mbar_wait,
    set_max_registers,
)
from days.day018.attention_common import (
    BOX,
    NEG_INF,
    block_first_row,
    kv_tiles,
    produce,
    produce_fixed,
    produce_stream,
    row_bound,
    store_o_lse,
)
from days.day018.attention_v1_serial import consume_v1
from days.day018.attention_v2_overlap import consume_v2, pass_tiles


# --8<-- [start:work_tile]
@always_inline
def work_tile[
    CAUSAL: Bool, PERSISTENT: Bool
](w: Int, n_qblocks: Int, heads: Int, batch: Int) -> Tuple[Int, Int, Int]:
    """(query block, head, batch) of the block's work tile w. One tile a block: from the
    grid (w unused). Persistent: tile w of the block's walk over all of them, query
    blocks fastest (the blocks at work together read the same head's K and V) or,
    causal, the longest rows first over every head, so that a round of the grid runs
    tiles of one length and the short ones come last."""
    comptime if not PERSISTENT:
        var qb = n_qblocks - 1 - block_idx.x if CAUSAL else block_idx.x
        return (qb, block_idx.y, block_idx.z)
    comptime if CAUSAL:
        var hb = w % (heads * batch)
        return (n_qblocks - 1 - w // (heads * batch), hb % heads, hb // heads)
    var hb = w // n_qblocks
    return (w % n_qblocks, hb % heads, hb // heads)


# --8<-- [end:work_tile]


# --8<-- [start:kernel]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](
        Int32(WG_THREADS * (1 + NC))
    )
)
@__llvm_arg_metadata(q_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(k_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(v_map, `nvvm.grid_constant`)
def attention_fwd_kernel[
    dtype: DType,
    D: Int,
    BN: Int,
    STAGES: Int,
    CAUSAL: Bool,
    VERSION: Int,
    NC: Int,
    SPLIT: Bool,
    SMEM: Int,
](
    q_map: TMADescriptor,
    k_map: TMADescriptor,
    v_map: TMADescriptor,
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    lq: Int64,
    lk: Int64,
    heads: Int64,
    batch: Int64,
    group: Int64,
    o_bs: Int64,
    o_hs: Int64,
    o_rs: Int64,
    scale_log2: Float32,
):
    """Grid (ceil(Lq / (64 NC)), q heads, batch), or for version 4 (persistent) up to
    one block per SM walking the work tiles; 128 (1 + NC) threads (NC consumer
    warpgroups of 64 query rows: 2 at head_dim 128, 3 at 64), SMEM bytes of dynamic
    shared memory. q/k/v maps: 4-D views (head_dim, seq, heads, batch) with boxes of
    64 x 64 (q, v) and 64 x BN (k). dst: (batch, q heads, Lq, D) by the strides given
    (last one 1); lse: (batch, q heads, Lq) float32, contiguous."""
    comptime DB = D // TMA_BK  # 64-wide boxes per row of head_dim
    comptime BM = 64 * NC  # query rows per block
    comptime Q_ELEMS = NC * DB * BOX
    comptime KV_ELEMS = 2 * BN * D
    comptime PERSISTENT = VERSION == 4
    # Qs in shared memory: the host sizes SMEM for two where they fit in version 4
    # (attention_gpu.q_buffers: head_dim 64), else for one
    comptime QBUF = 2 if PERSISTENT and SMEM == fwd_smem_bytes[
        dtype, D, BN, STAGES, NC, SPLIT, 2
    ]() else 1
    comptime assert D == 64 or D == 128, "head dim 64 or 128"
    comptime assert BN == 128 or (
        BN == 192 and D == 128
    ), "kv tile 128 (192 at D 128)"
    comptime assert STAGES >= 2, "at least two stages"
    comptime assert VERSION >= 1 and VERSION <= 4, "versions 1 to 4"
    comptime assert (
        SMEM == fwd_smem_bytes[dtype, D, BN, STAGES, NC, SPLIT, QBUF]()
    ), "Qs, stages, barriers"
    comptime assert TMA_BK * size_of[dtype]() == 128, "16-bit elements"

    var Lq = Int(lq)
    var Lk = Int(lk)
    var H = Int(heads)
    var n_qblocks = ceildiv(Lq, BM)

    var smem = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=1024
    ]()
    var skv = smem.unsafe_offset(QBUF * Q_ELEMS)
    # q_full, full_k[STAGES], full_v[STAGES], empty[STAGES], q_empty (all consumer
    # threads), with SPLIT empty_v[STAGES], with QBUF 2 the second Q's pair
    var bars = smem.unsafe_offset(
        QBUF * Q_ELEMS + STAGES * KV_ELEMS
    ).unsafe_bitcast[Int64]()
    if thread_idx.x == 0:
        mbarrier_init(bars, 1)
        comptime for s in range(STAGES):
            mbarrier_init(bars.unsafe_offset(1 + s), 1)
            mbarrier_init(bars.unsafe_offset(1 + STAGES + s), 1)
            mbarrier_init(bars.unsafe_offset(1 + 2 * STAGES + s), Int32(NC * 4))
        mbarrier_init(
            bars.unsafe_offset(1 + 3 * STAGES), Int32(NC * WG_THREADS)
        )
        comptime if SPLIT:  # V's own empty barriers (release_s1)
            comptime for s in range(STAGES):
                mbarrier_init(
                    bars.unsafe_offset(2 + 3 * STAGES + s), Int32(NC * 4)
                )
        comptime if QBUF == 2:
            var second = q_bars[STAGES, SPLIT](bars, 1)
            mbarrier_init(second[0], 1)
            mbarrier_init(second[1], Int32(NC * WG_THREADS))
        fence_mbarrier_init()
    barrier()

    var wg = thread_idx.x // WG_THREADS
    # 2 consumers: day 014's split (40 / 232); 3: what 512 threads x 128 registers allow
    # (the persistent producer keeps its walk's state too: 24 spill in its loop).
    # 192-key tiles: 96 scores, 48 P registers and 64 of O a thread: 24 / 240
    comptime PRODUCER_REGS = (
        24 if BN == 192 else TMA_PRODUCER_REGS
    ) if NC == 2 else (32 if PERSISTENT else TMA3_PRODUCER_REGS)
    comptime CONSUMER_REGS = (
        240 if BN == 192 else TMA_CONSUMER_REGS
    ) if NC == 2 else TMA3_CONSUMER_REGS
    comptime assert WG_THREADS * (PRODUCER_REGS + NC * CONSUMER_REGS) <= 65536
    if wg == 0:
        set_max_registers[False, PRODUCER_REGS]()
        if thread_idx.x == 0:
            var qmap = Pointer(to=q_map).unsafe_bitcast[NoneType]()
            var kmap = Pointer(to=k_map).unsafe_bitcast[NoneType]()
            var vmap = Pointer(to=v_map).unsafe_bitcast[NoneType]()
            comptime if PERSISTENT:
                var it = 0  # K/V tiles streamed so far
                var t = 0  # work tiles so far
                for w in range(
                    block_idx.x, n_qblocks * H * Int(batch), grid_dim.x
                ):
                    var tile = work_tile[CAUSAL, True](
                        w, n_qblocks, H, Int(batch)
                    )
                    var q0 = block_first_row[BM, CAUSAL](tile[0], n_qblocks, Lq)
                    var n_tiles = kv_tiles[BM, BN, CAUSAL](q0, Lk)
                    var qb = q_bars[STAGES, SPLIT](bars, t % QBUF)
                    var uses = t // QBUF  # this Q buffer's earlier tiles
                    if uses > 0:  # the consumers are done with its last Q
                        mbar_wait(qb[1], (uses - 1) % 2)
                    produce_fixed[dtype, D, 1, NC](
                        qmap,
                        qmap,
                        smem.unsafe_offset((t % QBUF) * Q_ELEMS),
                        qb[0],
                        q0,
                        tile[1],
                        tile[2],
                    )
                    produce_stream[dtype, D, BN, STAGES, SPLIT](
                        kmap,
                        vmap,
                        skv,
                        bars,
                        tile[2],
                        tile[1] // Int(group),
                        0,
                        n_tiles,
                        it,
                        n_tiles,
                    )
                    it += n_tiles
                    t += 1
            else:
                var tile = work_tile[CAUSAL, False](0, n_qblocks, H, Int(batch))
                var q0 = block_first_row[BM, CAUSAL](tile[0], n_qblocks, Lq)
                var n_tiles = kv_tiles[BM, BN, CAUSAL](q0, Lk)
                produce[dtype, D, BN, STAGES, 1, NC, SPLIT](
                    qmap,
                    qmap,
                    kmap,
                    vmap,
                    smem,
                    skv,
                    bars,
                    q0,
                    tile[1],
                    tile[2],
                    n_tiles,
                    tile[1] // Int(group),
                    0,
                    max(n_tiles, 1),
                )
    else:
        set_max_registers[True, CONSUMER_REGS]()
        var cw = consumer_index(wg)
        comptime if PERSISTENT:
            var it = 0
            var t = 0
            for w in range(block_idx.x, n_qblocks * H * Int(batch), grid_dim.x):
                it += consume_tile[
                    dtype,
                    D,
                    BN,
                    STAGES,
                    CAUSAL,
                    VERSION,
                    NC,
                    PERSISTENT,
                    SPLIT,
                    QBUF,
                ](
                    smem,
                    bars,
                    cw,
                    w,
                    it,
                    t,
                    n_qblocks,
                    Lq,
                    Lk,
                    H,
                    Int(batch),
                    scale_log2,
                    dst,
                    lse,
                    Int(o_bs),
                    Int(o_hs),
                    Int(o_rs),
                )
                t += 1
        else:
            _ = consume_tile[
                dtype,
                D,
                BN,
                STAGES,
                CAUSAL,
                VERSION,
                NC,
                PERSISTENT,
                SPLIT,
                QBUF,
            ](
                smem,
                bars,
                cw,
                0,
                0,
                0,
                n_qblocks,
                Lq,
                Lk,
                H,
                Int(batch),
                scale_log2,
                dst,
                lse,
                Int(o_bs),
                Int(o_hs),
                Int(o_rs),
            )


def fwd_smem_bytes[
    dtype: DType,
    D: Int,
    BN: Int,
    STAGES: Int,
    NC: Int,
    SPLIT: Bool,
    QBUF: Int,
]() -> Int:
    """QBUF Qs, the K/V stages, the barriers (as `attention_gpu.smem_bytes`)."""
    comptime q_elems = QBUF * NC * (D // TMA_BK) * BOX
    return (q_elems + STAGES * 2 * BN * D) * size_of[dtype]() + 8 * (
        2 * QBUF + (4 if SPLIT else 3) * STAGES
    )


@always_inline
def q_bars[
    STAGES: Int, SPLIT: Bool
](
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    buf: Int,
) -> Tuple[
    Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
]:
    """(q_full, q_empty) of Q buffer `buf`: the first pair around the stages' barriers,
    the second after them."""
    comptime END = 2 + (4 if SPLIT else 3) * STAGES
    if buf == 0:
        return (bars, bars.unsafe_offset(1 + 3 * STAGES))
    return (bars.unsafe_offset(END), bars.unsafe_offset(END + 1))


@always_inline
def consume_tile[
    dtype: DType,
    D: Int,
    BN: Int,
    STAGES: Int,
    CAUSAL: Bool,
    VERSION: Int,
    NC: Int,
    PERSISTENT: Bool,
    SPLIT: Bool,
    QBUF: Int,
](
    smem: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    cw: Int,
    w: Int,
    it: Int,
    t: Int,
    n_qblocks: Int,
    Lq: Int,
    Lk: Int,
    H: Int,
    batch: Int,
    scale_log2: Float32,
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    o_bs: Int,
    o_hs: Int,
    o_rs: Int,
) -> Int:
    """Consumer cw's part of work tile w, the block's t-th, after `it` streamed K/V
    tiles: its 64 query rows' output and log-sum-exp. Returns the tile's K/V tiles.
    """
    comptime DB = D // TMA_BK
    comptime BM = 64 * NC
    var tile = work_tile[CAUSAL, PERSISTENT](w, n_qblocks, H, batch)
    var q0 = block_first_row[BM, CAUSAL](tile[0], n_qblocks, Lq)
    var h = tile[1]
    var b = tile[2]
    var n_tiles = kv_tiles[BM, BN, CAUSAL](q0, Lk)
    var row0 = q0 + cw * 64  # this consumer's first query row
    var rows = row_bound[CAUSAL](row0, Lq)
    # The block streams the tiles its last rows need; this consumer's rows may need
    # fewer (causal: keys up to its own last row) or none (all past Lq, or before row
    # 0). It multiplies only its own and passes on the rest (`pass_tiles`).
    var n_mine = kv_tiles[64, BN, CAUSAL](row0, Lk) if row0 < rows else 0
    var my_row = row0 + (warp_id() % 4) * 16 + lane_id() // 4
    var sq = smem.unsafe_offset(((t % QBUF) * NC + cw) * DB * BOX)
    var skv = smem.unsafe_offset(QBUF * NC * DB * BOX)
    var qb = q_bars[STAGES, SPLIT](bars, t % QBUF)
    var o = SIMD[DType.float32, D // 2](0)
    var m = SIMD[DType.float32, 2](NEG_INF)
    var l = SIMD[DType.float32, 2](0)
    mbar_wait(qb[0], (t // QBUF) % 2)
    comptime PINGPONG = VERSION >= 3
    if n_mine > 0:
        comptime if VERSION == 1:
            consume_v1[dtype, D, BN, STAGES, CAUSAL, SPLIT](
                sq, skv, bars, n_mine, row0, my_row, Lk, scale_log2, o, m, l
            )
        else:
            consume_v2[dtype, D, BN, STAGES, CAUSAL, PINGPONG, NC, SPLIT](
                sq,
                skv,
                bars,
                n_mine,
                row0,
                my_row,
                Lk,
                scale_log2,
                o,
                m,
                l,
                cw,
                it,
                t == 0,
            )
    pass_tiles[STAGES, PINGPONG, NC, SPLIT](
        bars, cw, it + n_mine, n_tiles - n_mine, t == 0 and n_mine == 0
    )
    # this Q is read: the producer may load the next one. Every thread arrives: a
    # lane-0 branch here, in the walk's loop, moved the k-loop's stage and descriptor
    # arithmetic off the uniform datapath (ptxas), which cost ~10% of the forward.
    comptime if PERSISTENT:
        _ = mbarrier_arrive(qb[1])
    store_o_lse[dtype, D](
        o,
        l,
        m,
        dst.unsafe_offset(b * o_bs + h * o_hs),
        lse.unsafe_offset((b * H + h) * Lq),
        row0,
        rows,
        o_rs,
    )
    return n_tiles


# --8<-- [end:kernel]
