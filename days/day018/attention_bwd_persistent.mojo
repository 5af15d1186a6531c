# Day 018, backward version 8: version 7's dQ pass in a persistent grid. One block per SM
# (at most one per work tile) takes work tiles from a tile scheduler until none is left;
# a work tile is 64 NC query rows of one (batch, head).
#
# Why: a dQ block at GPT-2's shape (head_dim 64, causal, seq 1024) lives ~12 us, and
# only one fits an SM (512 threads at 160 registers), so nothing hides what every block
# pays once (its launch, the first loads of Q, dO, K and V, delta's loads, the
# pipeline's fill and drain). Here the producer loads the next work tile's Q and dO
# into a second buffer, its first K/V tiles into the ring and its rows of O into L2
# (for delta), while the consumers still work on this one; the consumers' dQ stores
# overlap those loads. Measured: that pass 4-5% faster at 512 and 1024 keys with the
# mask, slower from 4096 (the journal's "The backward, part 10"; a fit over version
# 7's lengths had promised more).
#
# The scheduler: a block's first tile is its own index, every later one the next of a
# counter in global memory (an atomic add by the producer), in version 7's order (query
# blocks fastest; with the mask the heaviest first, HEAD_GROUP heads at a time:
# `heavy_first_at`). A static walk (tile blockIdx.x + k gridDim.x) read 33% more from
# DRAM without the mask and 87% more with it (its L2 hit rate 46% and 17% against 58%
# and 45%): its blocks drift apart, so more heads' K and V are in use at once, and with
# the mask it ran the longest rows of every head first. The producer hands each tile's
# index to the consumers in shared memory, next to the fixed buffer it loads, and -1
# when the counter has run out.
#
# The pieces are the dQ pass's (attention_bwd.mojo): the same producer calls, the same
# consumer loop (`consume_dq_overlapped`, its stages and turns counted over the block's
# whole walk), delta and the (lse2, delta) pairs per work tile (`row_delta`).
#
# Shared memory (16-bit elements, 1024-byte aligned pieces):
#   fixed  FBUF buffers x (Q, dO): NC consumers x D/64 boxes of 64 rows x 64 each
#   stage  K, V: 64 keys x D each (the dQ pass's stream)
#   barriers  fixed_full 0, full_0[STAGES], full_1[STAGES], empty[STAGES],
#             fixed_empty 0, (fixed_full 1, fixed_empty 1), then a work slot per buffer

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
from std.atomic import Atomic, Ordering
from std.math import ceildiv
from std.sys import size_of
from std.sys._assembly import inlined_assembly
from std.utils import StaticTuple

from days.day014.gemm_v2_wgmma import WG_THREADS
from days.day014.gemm_v3_tma import (
    TMA_BK,
    TMA_CONSUMER_REGS,
    TMA_PRODUCER_REGS,
    TMA3_CONSUMER_REGS,
    consumer_index,
    fence_mbarrier_init,
    mbar_wait,
    set_max_registers,
)
from days.day018.attention_common import (
    BOX,
    block_first_row,
    heavy_first_at,
    kv_tiles,
    produce_fixed,
    produce_stream,
    row_bound,
    store_rows,
)
from days.day018.attention_bwd import BT
from days.day018.attention_bwd_dq import row_delta
from days.day018.attention_bwd_overlap import consume_dq_overlapped

# buffers of the fixed Q and dO (one, tried with the static walk only: level without
# the mask, 4% faster with it; the journal's "The backward, part 10")
comptime FBUF = 2


def dq_persistent_smem_bytes[
    dtype: DType, D: Int, STAGES: Int, NC: Int
]() -> Int:
    """FBUF x (Q, dO), the K/V stages, the barriers and a work slot per buffer (as
    `attention_gpu.dq_persistent_smem_bytes`)."""
    comptime fixed = FBUF * 2 * NC * (D // TMA_BK) * BOX
    return (fixed + STAGES * 2 * BT * D) * size_of[dtype]() + 8 * (
        3 * FBUF + 3 * STAGES
    )


@always_inline
def work_tile_at[
    CAUSAL: Bool
](w: Int, n_qblocks: Int, heads: Int, batch: Int) -> Tuple[Int, Int, Int]:
    """(query block, head, batch) of work tile w, in version 7's order: query blocks
    fastest, or with the mask the heaviest first, HEAD_GROUP heads at a time."""
    comptime if CAUSAL:
        return heavy_first_at[True](w, n_qblocks, heads, heads * batch)
    var hb = w // n_qblocks
    return (w % n_qblocks, hb % heads, hb // heads)


@always_inline
def prefetch_box(
    tma_map: OpaquePointer[mut=False, _],
    col: Int,
    row: Int,
    head: Int,
    batch: Int,
):
    """Ask for one TMA box of a (batch, head, seq, head_dim) tensor in L2 (`load_box`'s
    coordinates), with no shared memory and no barrier: a hint."""
    inlined_assembly[
        "cp.async.bulk.prefetch.tensor.4d.L2.global.tile [$0, {$1,$2,$3,$4}];",
        NoneType,
        constraints="l,r,r,r,r",
    ](
        Int64(Int(tma_map)),
        Int32(col),
        Int32(row),
        Int32(head),
        Int32(batch),
    )


@always_inline
def fixed_bars[
    STAGES: Int
](
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    buf: Int,
) -> Tuple[
    Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
]:
    """(fixed_full, fixed_empty) of fixed buffer `buf`: buffer 0's full barrier is
    the dQ pass's (bars[0], before the stages' barriers), the rest come after them.
    """
    comptime END = 1 + 3 * STAGES
    if buf == 0:
        return (bars, bars.unsafe_offset(END))
    return (bars.unsafe_offset(END + 1), bars.unsafe_offset(END + 2))


# --8<-- [start:kernel]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](
        Int32(WG_THREADS * (1 + NC))
    )
)
@__llvm_arg_metadata(q_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(do_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(k_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(v_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(o_map, `nvvm.grid_constant`)
def attention_dq_persistent_kernel[
    dtype: DType,
    D: Int,
    STAGES: Int,
    CAUSAL: Bool,
    NC: Int,
    SMEM: Int,
](
    q_map: TMADescriptor,
    do_map: TMADescriptor,
    k_map: TMADescriptor,
    v_map: TMADescriptor,
    o_map: TMADescriptor,
    dq: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    pairs: Pointer[Float32, MutAnyOrigin],
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    do: Pointer[Scalar[dtype], MutAnyOrigin],
    work: Pointer[Int32, MutAnyOrigin],
    lq: Int64,
    lk: Int64,
    heads: Int64,
    batch: Int64,
    group: Int64,
    d_bs: Int64,
    d_hs: Int64,
    d_rs: Int64,
    o_bs: Int64,
    o_hs: Int64,
    o_rs: Int64,
    do_bs: Int64,
    do_hs: Int64,
    do_rs: Int64,
    scale_log2: Float32,
    scale: Float32,
):
    """Up to one block per SM, 128 (1 + NC) threads, SMEM bytes of dynamic shared
    memory; the blocks share ceil(Lq / (64 NC)) x q heads x batch work tiles through
    `work`, an int32 counter that is 0 at launch (`work_tile_at` orders them).
    Arguments as the dQ pass's (`attention_bwd_kernel` with DQ): maps of Q, dO (fixed),
    K, V (streamed) and O (prefetched into L2 for delta), 4-D views (head_dim, seq,
    heads, batch) with boxes of 64 x 64; dq (batch, q heads, Lq, D) by d_bs/d_hs/d_rs,
    16-byte aligned rows; lse (the forward's lse2) (batch, q heads, Lq) float32,
    contiguous; pairs (batch, q heads, ceil(Lq / 64) 64, 2) float32, written here for
    the dK/dV pass: (lse2, delta) per row, (+inf, 0) past Lq; o and do by their
    strides, 16-byte aligned rows."""
    comptime DB = D // TMA_BK
    comptime F_ELEMS = NC * DB * BOX
    comptime BMF = 64 * NC
    comptime assert D == 64 or D == 128, "head dim 64 or 128"
    comptime assert NC == 2 or (NC == 3 and D == 64), "3 consumers: head_dim 64"
    comptime assert STAGES >= 2, "at least two stages"
    comptime assert (
        SMEM == dq_persistent_smem_bytes[dtype, D, STAGES, NC]()
    ), "fixed buffers, stages, barriers"
    comptime assert TMA_BK * size_of[dtype]() == 128, "16-bit elements"
    # 3 consumers: the forward's version 4 split (its producer walks too); 2: day 014's
    comptime PRODUCER_REGS = 32 if NC == 3 else TMA_PRODUCER_REGS
    comptime CONSUMER_REGS = TMA3_CONSUMER_REGS if NC == 3 else TMA_CONSUMER_REGS
    comptime assert WG_THREADS * (PRODUCER_REGS + NC * CONSUMER_REGS) <= 65536

    var Lq = Int(lq)
    var Lk = Int(lk)
    var H = Int(heads)
    var B = Int(batch)
    var n_qblocks = ceildiv(Lq, BMF)
    var n_work = n_qblocks * H * B

    var smem = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=1024
    ]()
    var stream = smem.unsafe_offset(FBUF * 2 * F_ELEMS)
    var bars = stream.unsafe_offset(STAGES * 2 * BT * D).unsafe_bitcast[Int64]()
    # each fixed buffer's work tile, written by the producer before its loads arrive on
    # the buffer's fixed_full barrier (release), read by the consumers after it (acquire)
    var slots = bars.unsafe_offset(2 * FBUF + 3 * STAGES)
    if thread_idx.x == 0:
        comptime for buf in range(FBUF):
            var fb = fixed_bars[STAGES](bars, buf)
            mbarrier_init(fb[0], 1)
            mbarrier_init(fb[1], Int32(NC * WG_THREADS))
        comptime for s in range(STAGES):
            mbarrier_init(bars.unsafe_offset(1 + s), 1)
            mbarrier_init(bars.unsafe_offset(1 + STAGES + s), 1)
            mbarrier_init(bars.unsafe_offset(1 + 2 * STAGES + s), Int32(NC * 4))
        fence_mbarrier_init()
    barrier()

    var wg = thread_idx.x // WG_THREADS
    if wg == 0:
        set_max_registers[False, PRODUCER_REGS]()
        if thread_idx.x == 0:
            var it = 0  # K/V tiles streamed so far
            var t = 0  # work tiles so far
            var w = Int(block_idx.x)
            while True:
                var fb = fixed_bars[STAGES](bars, t % FBUF)
                var uses = t // FBUF  # this buffer's earlier work tiles
                if uses > 0:  # the consumers are done with its last Q and dO
                    mbar_wait(fb[1], (uses - 1) % 2)
                var slot = slots.unsafe_offset(t % FBUF)
                # no tile left: -1 completes the phase, no bytes
                if w >= n_work:
                    slot[] = -1
                    _ = mbarrier_arrive(fb[0])
                    break
                slot[] = Int64(w)
                var tile = work_tile_at[CAUSAL](w, n_qblocks, H, B)
                var r0 = block_first_row[BMF, CAUSAL](tile[0], n_qblocks, Lq)
                var n_tiles = kv_tiles[BMF, BT, CAUSAL](r0, Lk)
                # delta's rows of O into L2 while this tile's stream waits for stages:
                # the consumers' loads then miss only to L2
                comptime for c in range(NC):
                    comptime for db in range(DB):
                        prefetch_box(
                            Pointer(to=o_map).unsafe_bitcast[NoneType](),
                            db * TMA_BK,
                            max(r0 + c * 64, 0),
                            tile[1],
                            tile[2],
                        )
                produce_fixed[dtype, D, 2, NC](
                    Pointer(to=q_map).unsafe_bitcast[NoneType](),
                    Pointer(to=do_map).unsafe_bitcast[NoneType](),
                    smem.unsafe_offset((t % FBUF) * 2 * F_ELEMS),
                    fb[0],
                    r0,
                    tile[1],
                    tile[2],
                )
                produce_stream[dtype, D, BT, STAGES](
                    Pointer(to=k_map).unsafe_bitcast[NoneType](),
                    Pointer(to=v_map).unsafe_bitcast[NoneType](),
                    stream,
                    bars,
                    tile[2],
                    tile[1] // Int(group),
                    0,
                    max(n_tiles, 1),
                    it,
                    n_tiles,
                )
                it += n_tiles
                t += 1
                w = Int(grid_dim.x) + Int(
                    Atomic.fetch_add[ordering=Ordering.RELAXED](work, 1)
                )
    else:
        set_max_registers[True, CONSUMER_REGS]()
        var cw = consumer_index(wg)
        var it = 0
        var t = 0
        while True:
            var fb = fixed_bars[STAGES](bars, t % FBUF)
            mbar_wait(fb[0], (t // FBUF) % 2)
            var w = Int(slots[t % FBUF])
            if w < 0:
                break
            var tile = work_tile_at[CAUSAL](w, n_qblocks, H, B)
            var r0 = block_first_row[BMF, CAUSAL](tile[0], n_qblocks, Lq)
            var n_tiles = kv_tiles[BMF, BT, CAUSAL](r0, Lk)
            var h = tile[1]
            var b = tile[2]
            var row0 = r0 + cw * 64
            var my_row = row0 + (warp_id() % 4) * 16 + lane_id() // 4
            var rows = row_bound[CAUSAL](row0, Lq)  # none before row 0
            # lse first: its loads and delta's are then in flight together
            var lse_r = SIMD[DType.float32, 2](Float32.MAX)
            var base = (b * H + h) * Lq
            comptime for half in range(2):
                if my_row + 8 * half < rows:
                    lse_r[half] = lse[unsafe_offset=base + my_row + 8 * half]
            var delta_r = row_delta[dtype, D](
                o.unsafe_offset(b * Int(o_bs) + h * Int(o_hs)),
                do.unsafe_offset(b * Int(do_bs) + h * Int(do_hs)),
                Int(o_rs),
                Int(do_rs),
                my_row,
                rows,
            )
            var Lq_pad = ceildiv(Lq, 64) * 64
            var pair_base = (b * H + h) * Lq_pad
            var pair_rows = row_bound[CAUSAL](row0, Lq_pad)
            comptime for half in range(2):
                var row = my_row + 8 * half
                # the quad's 4 lanes store the same pair: no branch on the lane in
                # the walk's loop (the forward's version 4 lost its uniform datapath
                # to one)
                if row < pair_rows:
                    pairs.unsafe_store[alignment=8](
                        (pair_base + row) * 2,
                        SIMD[DType.float32, 2](lse_r[half], delta_r[half]),
                    )
            var sq = smem.unsafe_offset(((t % FBUF) * 2 * NC + cw) * DB * BOX)
            var dqa = SIMD[DType.float32, D // 2](0)
            var n_mine = 0 if row0 >= rows else kv_tiles[64, BT, CAUSAL](
                row0, Lk
            )
            consume_dq_overlapped[dtype, D, STAGES, CAUSAL, NC, True](
                sq,
                sq.unsafe_offset(F_ELEMS),
                stream,
                bars,
                n_tiles,
                n_mine,
                row0,
                my_row,
                Lk,
                lse_r,
                delta_r,
                scale_log2,
                dqa,
                cw,
                it,
                t == 0,
            )
            # this buffer's Q, dO and work slot are read: the producer may reuse them
            _ = mbarrier_arrive(fb[1])
            store_rows[dtype, D, True](
                dqa,
                SIMD[DType.float32, 2](scale),
                dq.unsafe_offset(b * Int(d_bs) + h * Int(d_hs)),
                row0,
                rows,
                Int(d_rs),
            )
            it += n_tiles
            t += 1


# --8<-- [end:kernel]
