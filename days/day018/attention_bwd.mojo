# Day 018: the FlashAttention backward for Hopper, two passes of one kernel frame (the
# forward's: a TMA producer warpgroup and two consumer warpgroups of 64 rows):
#   DQ = False  attention_bwd_dkdv.mojo: a block owns 128 keys (K, V fixed in shared
#               memory) and streams Q, dO tiles of every query head in the kv head's
#               group; it writes dK and dV once, so grouped-query heads need no atomics.
#   DQ = True   attention_bwd_dq.mojo: a block owns 128 queries (Q, dO fixed) and
#               streams K, V tiles; it writes dQ once.
# Recomputing S and dP in both passes costs two extra products of the seven, but no
# float32 atomics or dQ accumulator in global memory (FlashAttention-2/3 use one
# pass with atomic dQ). delta = rowsum(dO * O) is computed by the dQ pass, which
# therefore runs first, and read by the dK/dV pass.
#
# Streamed tiles are 64 rows, so a stage's two tiles have the same layout whether a
# product reads them k-major (as the B of S^T = K Q^T) or mn-major (as the B of
# dK += dS^T Q): one TMA copy serves both.

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
from std.memory import bitcast
from std.sys import size_of
from std.utils import StaticTuple

from days.day014.gemm_common import quad_transpose
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
    CONSUMERS,
    block_first_row,
    heavy_first,
    kv_tiles,
    produce,
    row_bound,
    store_rows,
)
from days.day018.attention_bwd_dkdv import consume_dkdv
from days.day018.attention_bwd_tiles import DQ_ATOMIC, DQ_TILES, PIECE
from days.day018.attention_bwd_dq import consume_dq, row_delta
from days.day018.attention_bwd_overlap import consume_dq_overlapped
from days.day018.attention_bwd_pairs import PAIR_FLOATS, produce_pairs

comptime BT = 64  # rows of a streamed tile


# --8<-- [start:kernel]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](
        Int32(WG_THREADS * (1 + NC))
    )
)
@__llvm_arg_metadata(f0_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(f1_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(s0_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(s1_map, `nvvm.grid_constant`)
def attention_bwd_kernel[
    dtype: DType,
    D: Int,
    STAGES: Int,
    CAUSAL: Bool,
    DQ: Bool,
    FUSED: Int,
    TURNS: Bool,
    OVERLAP: Bool,
    NC: Int,
    SMEM: Int,
](
    f0_map: TMADescriptor,
    f1_map: TMADescriptor,
    s0_map: TMADescriptor,
    s1_map: TMADescriptor,
    dst0: Pointer[Scalar[dtype], MutAnyOrigin],
    dst1: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    pairs: Pointer[Float32, MutAnyOrigin],
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    do: Pointer[Scalar[dtype], MutAnyOrigin],
    dq32: Pointer[Float32, MutAnyOrigin],
    lq: Int64,
    lk: Int64,
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
    """DQ = False: grid (ceil(Lk / 128), kv heads, batch); f0/f1 = K/V, s0/s1 = Q/dO;
    dst0 = dK, dst1 = dV, (batch, kv heads, Lk, D) by d_bs/d_hs/d_rs.
    DQ = True: grid (ceil(Lq / (64 NC)), q heads, batch); f0/f1 = Q/dO, s0/s1 = K/V;
    dst0 = dQ (batch, q heads, Lq, D) by the same strides; dst1 unused. Both passes
    store in 16-byte blocks (`store_rows`'s BLOCKS): dst0, dst1 and d_rs 16-byte aligned.
    lse (the forward's lse2): (batch, q heads, Lq) float32, contiguous. pairs: (batch,
    q heads, ceil(Lq / 64) 64, 2) float32, (lse2, delta) per row and (+inf, 0) past Lq:
    the dQ pass writes it, with delta = rowsum(dO * O) from o and do ((batch, q heads,
    Lq, D) by their strides, 16-byte aligned rows); the dK/dV pass's producer copies
    each streamed tile's pairs into its stage (attention_bwd_pairs.mojo).
    FUSED (versions 2 and 6, with DQ = False): the dK/dV pass also adds scale * dS K
    into dq32 (float32, zeroed), and the pairs come from `attention_delta_kernel`; there is
    no dQ pass. Version 2 (DQ_ATOMIC): dq32 is (batch, q heads, Lq, D) contiguous.
    Version 6 (DQ_TILES): (batch, q heads, ceil(Lq / 64) 64, D), each 64 x 64 piece in
    the order of attention_bwd_tiles.mojo.
    TURNS (versions 3 to 5 and 7, either pass): the consumers take turns to issue each
    batch of products. OVERLAP (versions 5 and 7, the dQ pass, with TURNS): tile j - 1's
    dQ product runs beside tile j's elementwise step (attention_bwd_overlap.mojo).
    NC: consumer warpgroups of 64 fixed rows each, 2, or 3 in version 7's passes at
    head_dim 64 (512 threads: more warps for the scheduler to pick from; the build adds
    `.minnctapersm 1`, so that `setmaxnreg` gives each consumer 160 registers; the
    journal's "The backward, parts 8 and 9"); the grid's x counts blocks of 64 NC rows.
    In the dQ pass each consumer multiplies only the key tiles its rows need, as in
    version 7's dK/dV pass the query tiles; it passes the others (the forward's
    `pass_tiles`).
    Maps: 4-D views (head_dim, seq, heads, batch), boxes of 64 x 64."""
    comptime DB = D // TMA_BK
    comptime F_ELEMS = NC * DB * BOX
    comptime BMF = 64 * NC  # fixed rows per block
    comptime T_ELEMS = BT * D
    # dS^T boxes (version 6: two pairs taking turns, then a float32 piece per consumer)
    comptime DS_ELEMS = CONSUMERS * BOX if FUSED == DQ_ATOMIC else (
        2 * CONSUMERS * BOX + CONSUMERS * PIECE * 4 // size_of[dtype]()
    ) if FUSED == DQ_TILES else 0
    comptime assert D == 64 or D == 128, "head dim 64 or 128"
    comptime assert NC == CONSUMERS or (
        NC == 3 and D == 64
    ), "three consumers: head_dim 64"
    comptime assert not (FUSED != 0 and DQ), "versions 2 and 6 have no dQ pass"
    comptime assert not OVERLAP or (
        TURNS and DQ
    ), "version 5: the dQ pass, in turns"
    # the dK/dV pass: each stage's (lse2, delta) pairs, on barriers full_2
    comptime PAIR_BYTES = 0 if DQ else STAGES * PAIR_FLOATS * 4
    comptime N_BARS = 1 + 3 * STAGES + (0 if DQ else STAGES)
    comptime assert (
        SMEM
        == (2 * F_ELEMS + STAGES * 2 * T_ELEMS + DS_ELEMS) * size_of[dtype]()
        + PAIR_BYTES
        + 8 * N_BARS
    ), "tiles, stages, dS, pairs, barriers"

    var Lq = Int(lq)
    var Lk = Int(lk)
    var G = Int(group)
    var n_heads = Int(grid_dim.y)
    var fixed_block = Int(block_idx.x)  # its fixed rows: a key or a query block
    var h = Int(block_idx.y)  # a kv head (DQ = False) or a q head
    var b = Int(block_idx.z)
    # measured (day018_backward_onepass.txt, section 4): the dQ passes and head_dim 128's
    # dK/dV passes gain 2-5%; head_dim 64's dK/dV pass lost 4%, and 1.5-2% with three
    # consumers (version 7; day018_backward_skip_ab.txt, section 3)
    comptime if CAUSAL and (DQ or D == 128):
        fixed_block, h, b = heavy_first[DQ](n_heads)
    # the block's first fixed row. With the mask, the dQ pass's query blocks end at the
    # last row, so its part-full block is the cheapest (`block_first_row`); the dK/dV
    # pass's part-full key block is already: the last, which the fewest queries see
    var r0 = block_first_row[BMF, CAUSAL and DQ](
        fixed_block, Int(grid_dim.x), Lq
    )
    var n_tiles: Int
    var per_head: Int
    var s_start: Int
    comptime if DQ:
        n_tiles = kv_tiles[BMF, BT, CAUSAL](r0, Lk)
        per_head = max(n_tiles, 1)
        s_start = 0
    else:
        s_start = r0 if CAUSAL else 0  # earlier queries see none of these keys
        per_head = ceildiv(max(Lq - s_start, 0), BT)
        n_tiles = G * per_head

    var smem = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=1024
    ]()
    var stream = smem.unsafe_offset(2 * F_ELEMS)
    var ds_boxes = stream.unsafe_offset(STAGES * 2 * T_ELEMS)
    var pair_slots = ds_boxes.unsafe_offset(DS_ELEMS).unsafe_bitcast[Float32]()
    var bars = pair_slots.unsafe_offset(PAIR_BYTES // 4).unsafe_bitcast[Int64]()
    if thread_idx.x == 0:
        mbarrier_init(bars, 1)
        comptime for s in range(STAGES):
            mbarrier_init(bars.unsafe_offset(1 + s), 1)
            mbarrier_init(bars.unsafe_offset(1 + STAGES + s), 1)
            mbarrier_init(bars.unsafe_offset(1 + 2 * STAGES + s), Int32(NC * 4))
            comptime if not DQ:
                mbarrier_init(bars.unsafe_offset(1 + 3 * STAGES + s), 1)
        fence_mbarrier_init()
    barrier()

    var Lq_pad = ceildiv(Lq, 64) * 64  # rows per head of the pairs buffer
    var wg = thread_idx.x // WG_THREADS
    if wg == 0:
        set_max_registers[
            False, TMA3_PRODUCER_REGS if NC == 3 else TMA_PRODUCER_REGS
        ]()
        comptime if not DQ:
            if thread_idx.x == 32:  # warp 1: the pairs of each streamed tile
                produce_pairs[STAGES](
                    pair_slots,
                    bars,
                    pairs.unsafe_offset((b * n_heads * G + h * G) * Lq_pad * 2),
                    n_tiles,
                    per_head,
                    s_start,
                    Lq_pad,
                )
        if thread_idx.x == 0:
            produce[dtype, D, BT, STAGES, 2, NC](
                Pointer(to=f0_map).unsafe_bitcast[NoneType](),
                Pointer(to=f1_map).unsafe_bitcast[NoneType](),
                Pointer(to=s0_map).unsafe_bitcast[NoneType](),
                Pointer(to=s1_map).unsafe_bitcast[NoneType](),
                smem,
                stream,
                bars,
                r0,
                h,
                b,
                n_tiles,
                h // G if DQ else h * G,
                s_start,
                per_head,
            )
    else:
        set_max_registers[
            True, TMA3_CONSUMER_REGS if NC == 3 else TMA_CONSUMER_REGS
        ]()
        var cw = consumer_index(wg)
        var row0 = r0 + cw * 64
        var my_row = row0 + (warp_id() % 4) * 16 + lane_id() // 4
        var f0 = smem.unsafe_offset(cw * DB * BOX)
        var f1 = smem.unsafe_offset(F_ELEMS + cw * DB * BOX)
        var out0 = dst0.unsafe_offset(b * Int(d_bs) + h * Int(d_hs))
        var ones = SIMD[DType.float32, 2](scale)
        comptime if DQ:
            var base = (b * n_heads + h) * Lq
            var rows = row_bound[CAUSAL](row0, Lq)  # none before row 0
            # while the fixed Q and dO tiles land
            var delta_r = row_delta[dtype, D](
                o.unsafe_offset(b * Int(o_bs) + h * Int(o_hs)),
                do.unsafe_offset(b * Int(do_bs) + h * Int(do_hs)),
                Int(o_rs),
                Int(do_rs),
                my_row,
                rows,
            )
            var lse_r = SIMD[DType.float32, 2](Float32.MAX)
            var pair_base = (b * n_heads + h) * Lq_pad
            var pair_rows = row_bound[CAUSAL](row0, Lq_pad)
            comptime for half in range(2):
                var row = my_row + 8 * half
                if row < rows:
                    lse_r[half] = lse[unsafe_offset=base + row]
                if row < pair_rows and lane_id() % 4 == 0:  # for the dK/dV pass
                    pairs.unsafe_store[alignment=8](
                        (pair_base + row) * 2,
                        SIMD[DType.float32, 2](lse_r[half], delta_r[half]),
                    )
            mbar_wait(bars, 0)
            var dq = SIMD[DType.float32, D // 2](0)
            # its own key tiles (the forward's `pass_tiles`): none past Lq and, with the
            # mask, none after its last row's diagonal
            var n_mine = 0 if row0 >= rows else kv_tiles[64, BT, CAUSAL](
                row0, Lk
            )
            comptime if OVERLAP:
                consume_dq_overlapped[dtype, D, STAGES, CAUSAL, NC](
                    f0,
                    f1,
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
                    dq,
                    cw,
                )
            else:
                consume_dq[dtype, D, STAGES, CAUSAL, TURNS, NC](
                    f0,
                    f1,
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
                    dq,
                    cw,
                )
            store_rows[dtype, D, True](dq, ones, out0, row0, rows, Int(d_rs))
        else:
            mbar_wait(bars, 0)
            var first_head = b * n_heads * G + h * G  # the group's first q head
            var base = first_head * Lq
            # version 6's dq32 has whole 64-row tiles per head
            var dq_rows = Lq_pad if FUSED == DQ_TILES else Lq
            var staged = ds_boxes.unsafe_offset(
                2 * CONSUMERS * BOX
            ).unsafe_bitcast[Float32]()
            var dk = SIMD[DType.float32, D // 2](0)
            var dv = SIMD[DType.float32, D // 2](0)
            consume_dkdv[dtype, D, STAGES, CAUSAL, FUSED, TURNS, NC](
                f0,
                f1,
                stream,
                bars,
                n_tiles,
                per_head,
                s_start,
                row0,
                my_row,
                Lq,
                Lk,
                pair_slots,
                scale_log2,
                dk,
                dv,
                ds_boxes,
                staged.unsafe_offset(cw * PIECE),
                dq32.unsafe_offset(first_head * dq_rows * D),
                dq_rows,
                scale,
                cw,
            )
            store_rows[dtype, D, True](dk, ones, out0, row0, Lk, Int(d_rs))
            var out1 = dst1.unsafe_offset(b * Int(d_bs) + h * Int(d_hs))
            store_rows[dtype, D, True](
                dv, SIMD[DType.float32, 2](1), out1, row0, Lk, Int(d_rs)
            )


# --8<-- [end:kernel]


@always_inline
def dq32_tile[D: Int](dq32: Pointer[Float32, MutAnyOrigin]) -> type_of(dq32):
    """This block's 64-row tile of version 6's dq32 (batch, q heads, whole 64-row
    tiles, D), in a grid (ceil(Lq / 64), q heads, batch): the tile the delta kernel
    zeroes and the rows kernel reads."""
    return dq32.unsafe_offset(
        (
            (block_idx.z * Int(grid_dim.y) + block_idx.y) * Int(grid_dim.x)
            + block_idx.x
        )
        * 64
        * D
    )


# --8<-- [start:delta]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(WG_THREADS))
)
def attention_delta_kernel[
    dtype: DType, D: Int, ZERO: Bool
](
    pairs: Pointer[Float32, MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    do: Pointer[Scalar[dtype], MutAnyOrigin],
    dq32: Pointer[Float32, MutAnyOrigin],
    lq: Int64,
    o_bs: Int64,
    o_hs: Int64,
    o_rs: Int64,
    do_bs: Int64,
    do_hs: Int64,
    do_rs: Int64,
):
    """Backward versions 2 and 6's first launch: the dK/dV pass's pairs (lse2, delta =
    rowsum(dO * O)) as `attention_bwd_kernel` describes them; grid (ceil(Lq / 64),
    q heads, batch), 128 threads, the dQ pass's `row_delta` on 64 rows a block.
    ZERO (version 6): also zero this block's 64-row tile of dq32 (batch, q heads,
    whole 64-row tiles, D), which the pass then adds into: one launch fewer than a
    fill, and its stores overlap the loads of O and dO.
    """
    var Lq = Int(lq)
    var h = block_idx.y
    var b = block_idx.z
    comptime if ZERO:
        comptime VECS = 64 * D // 4 // WG_THREADS  # float4 stores a thread
        var tile = dq32_tile[D](dq32)
        comptime for i in range(VECS):
            tile.unsafe_store[alignment=16](
                (i * WG_THREADS + thread_idx.x) * 4, SIMD[DType.float32, 4](0)
            )
    var my_row = block_idx.x * 64 + warp_id() * 16 + lane_id() // 4
    var d = row_delta[dtype, D](
        o.unsafe_offset(b * Int(o_bs) + h * Int(o_hs)),
        do.unsafe_offset(b * Int(do_bs) + h * Int(do_hs)),
        Int(o_rs),
        Int(do_rs),
        my_row,
        Lq,
    )
    if lane_id() % 4 == 0:
        var head = b * Int(grid_dim.y) + h
        comptime for half in range(2):
            var row = my_row + 8 * half
            var l = (
                lse[unsafe_offset=head * Lq + row] if row < Lq else Float32.MAX
            )
            pairs.unsafe_store[alignment=8](
                (head * Int(grid_dim.x) * 64 + row) * 2,
                SIMD[DType.float32, 2](l, d[half]),
            )


# --8<-- [end:delta]


# --8<-- [start:dq_rows]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(WG_THREADS))
)
def attention_dq_rows_kernel[
    dtype: DType, D: Int
](
    dq: Pointer[Scalar[dtype], MutAnyOrigin],
    dq32: Pointer[Float32, MutAnyOrigin],
    lq: Int64,
    dq_bs: Int64,
    dq_hs: Int64,
    dq_rs: Int64,
):
    """Backward version 6's last launch: dq32's pieces back into rows, cast to dtype.
    Grid (ceil(Lq / 64), q heads, batch), 128 threads, one 64-row tile a block. Float4
    i of a tile (read in order: a warp reads 512 contiguous bytes) holds the values
    of consumer thread tid = i % 128's float4 jj = (i / 128) % 8 of piece i / 1024
    (`dq_from_pieces` in attention_gpu.py): rows 16 w + g and 16 w + 8 + g, columns
    64 piece + 8 jj + 2 t + (0, 1), where tid = 32 w + 4 g + t. So thread tid keeps
    w, g, t for every i it reads; its quad then trades pairs so that each lane
    stores whole 8-column blocks (16 bytes)."""
    comptime VECS = 64 * D // 4 // WG_THREADS
    var Lq = Int(lq)
    var h = block_idx.y
    var b = block_idx.z
    var row0 = block_idx.x * 64
    var tile = dq32_tile[D](dq32)
    var out = dq.unsafe_offset(b * Int(dq_bs) + h * Int(dq_hs))
    var tid = thread_idx.x
    var t = tid % 4
    var g = (tid // 4) % 8
    var w = tid // 32
    # Every load before the first store: the compiler cannot prove that dq and
    # dq32 do not overlap, so a load placed after a store waits for it (one float4
    # in flight a thread, 1.2 TB/s on the H200).
    var vals = SIMD[DType.float32, 4 * VECS](0)
    comptime for i in range(VECS):
        vals = vals.insert[offset=4 * i](
            tile.unsafe_load[width=4, alignment=16]((i * WG_THREADS + tid) * 4)
        )
    # Then 16-byte stores: a quad's 4 lanes hold a row's pairs of 4 column blocks
    # (lane t: columns 8 jj + 2 t, + 1); transposed, lane t holds block 4 jq + t
    # whole. (4-byte stores, 32 a thread, throttled the store pipe: Nsight Compute's
    # lg_throttle, 117 cycles an instruction.)
    comptime for piece in range(D // 64):
        comptime for half in range(2):
            var row = row0 + 16 * w + 8 * half + g
            comptime for jq in range(2):
                var p = SIMD[DType.uint32, 4]()
                comptime for e in range(4):
                    comptime i = 8 * piece + 4 * jq + e  # float4 i: jj = i % 8
                    var pair = vals.slice[2, offset=4 * i + 2 * half]()
                    p[e] = bitcast[DType.uint32, 1](pair.cast[dtype]())[0]
                quad_transpose(p, t)  # every lane: shuffles
                if row < Lq:
                    out.unsafe_store[alignment=16](
                        row * Int(dq_rs) + 64 * piece + 8 * (4 * jq + t),
                        bitcast[dtype, 8](p),
                    )


# --8<-- [end:dq_rows]
