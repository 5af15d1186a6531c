# Day 018: the FlashAttention forward kernel for Hopper. The block's frame is the same
# for every version: a producer warpgroup (TMA, attention_common.produce) and two
# consumer warpgroups of 64 query rows each; the versions differ in the consumers'
# loop, one file each (the ladder of the day's journal):
#   attention_v1_serial.mojo   S, softmax, P V one after another
#   attention_v2_overlap.mojo  the softmax of tile j overlaps P V of tile j-1 and S_j;
#                              version 3 adds the ping-pong between the two consumers
#
# Builds on day 014's version 3 (TMA into 128-byte swizzled tiles, mbarrier phases,
# setmaxnreg, the tile descriptors): its helpers are imported, not copied.
#
# Shared memory, 1024-byte aligned pieces (16-bit elements; a 128-byte swizzle span
# is 64 elements):
#   Q      2 consumers x D/64 boxes of 64 rows x 64          (k-major A operand)
#   stage  K: D/64 boxes of BN keys x 64                      (k-major B operand)
#          V: BN/64 key slices x D/64 boxes of 64 keys x 64   (mn-major B operand)
#   barriers  q_full, full_k[STAGES], full_v[STAGES], empty[STAGES]

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
from max.gpu.sync import mbarrier_init
from std.math import ceildiv
from std.sys import size_of
from std.utils import StaticTuple

from days.day014.gemm_v2_wgmma import WG_THREADS
from days.day014.gemm_v3_tma import (
    TMA_BK,
    TMA_CONSUMER_REGS,
    TMA_PRODUCER_REGS,
    fence_mbarrier_init,
    mbar_wait,
    set_max_registers,
)
from days.day018.attention_common import (
    BOX,
    NEG_INF,
    produce,
    store_o_lse,
)
from days.day018.attention_v1_serial import consume_v1
from days.day018.attention_v2_overlap import consume_v2


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
    SMEM: Int,
](
    q_map: TMADescriptor,
    k_map: TMADescriptor,
    v_map: TMADescriptor,
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    lq: Int64,
    lk: Int64,
    group: Int64,
    o_bs: Int64,
    o_hs: Int64,
    o_rs: Int64,
    scale_log2: Float32,
):
    """Grid (ceil(Lq / (64 NC)), q heads, batch), 128 (1 + NC) threads (NC consumer
    warpgroups of 64 query rows: 2 at head_dim 128, 3 at 64), SMEM bytes of dynamic
    shared memory. q/k/v maps: 4-D views (head_dim, seq, heads, batch) with boxes of
    64 x 64 (q, v) and 64 x BN (k). dst: (batch, q heads, Lq, D) by the strides given
    (last one 1); lse: (batch, q heads, Lq) float32, contiguous."""
    comptime DB = D // TMA_BK  # 64-wide boxes per row of head_dim
    comptime BM = 64 * NC  # query rows per block
    comptime Q_ELEMS = NC * DB * BOX
    comptime KV_ELEMS = 2 * BN * D
    comptime assert D == 64 or D == 128, "head dim 64 or 128"
    comptime assert BN == 128, "kv tile 128"
    comptime assert STAGES >= 2, "at least two stages"
    comptime assert VERSION >= 1 and VERSION <= 3, "versions 1 to 3"
    comptime assert SMEM == (Q_ELEMS + STAGES * KV_ELEMS) * size_of[
        dtype
    ]() + 8 * (1 + 3 * STAGES), "Q, stages, barriers"
    comptime assert TMA_BK * size_of[dtype]() == 128, "16-bit elements"

    var Lq = Int(lq)
    var Lk = Int(lk)
    var n_qblocks = ceildiv(Lq, BM)
    # causal: the longest rows first, so the last wave is short blocks
    var qb = n_qblocks - 1 - block_idx.x if CAUSAL else block_idx.x
    var q0 = qb * BM
    var h = block_idx.y
    var b = block_idx.z
    var kv_end = min(Lk, q0 + BM) if CAUSAL else Lk
    var n_tiles = ceildiv(kv_end, BN)

    var smem = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=1024
    ]()
    var skv = smem.unsafe_offset(Q_ELEMS)
    var bars = smem.unsafe_offset(Q_ELEMS + STAGES * KV_ELEMS).unsafe_bitcast[
        Int64
    ]()
    if thread_idx.x == 0:
        mbarrier_init(bars, 1)
        comptime for s in range(STAGES):
            mbarrier_init(bars.unsafe_offset(1 + s), 1)
            mbarrier_init(bars.unsafe_offset(1 + STAGES + s), 1)
            mbarrier_init(bars.unsafe_offset(1 + 2 * STAGES + s), Int32(NC * 4))
        fence_mbarrier_init()
    barrier()

    var wg = thread_idx.x // WG_THREADS
    # 2 consumers: day 014's split (40 / 232); 3: what 512 threads x 128 registers allow
    comptime PRODUCER_REGS = TMA_PRODUCER_REGS if NC == 2 else 24
    comptime CONSUMER_REGS = TMA_CONSUMER_REGS if NC == 2 else 160
    comptime assert WG_THREADS * (PRODUCER_REGS + NC * CONSUMER_REGS) <= 65536
    if wg == 0:
        set_max_registers[False, PRODUCER_REGS]()
        if thread_idx.x == 0:
            var qmap = Pointer(to=q_map).unsafe_bitcast[NoneType]()
            produce[dtype, D, BN, STAGES, 1, NC](
                qmap,
                qmap,
                Pointer(to=k_map).unsafe_bitcast[NoneType](),
                Pointer(to=v_map).unsafe_bitcast[NoneType](),
                smem,
                skv,
                bars,
                q0,
                h,
                b,
                n_tiles,
                h // Int(group),
                0,
                max(n_tiles, 1),
            )
    else:
        set_max_registers[True, CONSUMER_REGS]()
        var cw = wg - 1
        var row0 = q0 + cw * 64  # this consumer's first query row
        var my_row = row0 + (warp_id() % 4) * 16 + lane_id() // 4
        var sq = smem.unsafe_offset(cw * DB * BOX)
        var o = SIMD[DType.float32, D // 2](0)
        var m = SIMD[DType.float32, 2](NEG_INF)
        var l = SIMD[DType.float32, 2](0)
        mbar_wait(bars, 0)
        comptime if VERSION == 1:
            consume_v1[dtype, D, BN, STAGES, CAUSAL](
                sq, skv, bars, n_tiles, row0, my_row, Lk, scale_log2, o, m, l
            )
        else:
            consume_v2[dtype, D, BN, STAGES, CAUSAL, VERSION == 3, NC](
                sq,
                skv,
                bars,
                n_tiles,
                row0,
                my_row,
                Lk,
                scale_log2,
                o,
                m,
                l,
                cw,
            )
        store_o_lse[dtype, D](
            o,
            l,
            m,
            dst.unsafe_offset(b * Int(o_bs) + h * Int(o_hs)),
            lse.unsafe_offset((b * grid_dim.y + h) * Lq),
            row0,
            Lq,
            Int(o_rs),
        )


# --8<-- [end:kernel]
