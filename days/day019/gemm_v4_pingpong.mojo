# Day 019, version 4: a persistent kernel whose two consumer warpgroups take turns
# ("ping-pong"), with the fused linear-layer epilogue (bias, GELU, residual).
# Builds on day 014's version 3: its TMA loads, swizzled descriptors, mbarrier helpers
# and register hand-off are imported, not copied.

from max.gpu import (
    MAX_THREADS_PER_BLOCK_METADATA,
    thread_idx,
    block_idx,
    grid_dim,
    barrier,
    lane_id,
    warp_id,
    WARP_SIZE,
)
from max.gpu.compute.mma import (
    WGMMADescriptor,
    wgmma_async,
    wgmma_fence_aligned,
    wgmma_commit_group_sync,
    wgmma_wait_group_sync,
)
from max.gpu.memory import external_memory
from max.gpu.host.nvidia.tma import TMADescriptor
from max.gpu.sync import (
    mbarrier_init,
    mbarrier_arrive,
    mbarrier_arrive_expect_tx_shared,
)
from max.gpu.primitives.cluster import block_rank_in_cluster, cluster_sync
from std.math import ceildiv
from std.sys import size_of
from std.utils import StaticTuple

from days.day014.gemm_common import (
    prefetch_l2_rows,
    tile_coords,
    wg_store_acc,
)
from days.day019.cluster_tma import mbar_arrive_cta, tma_multicast_box
from days.day019.cluster_split import reduce_in_cluster
from days.day019.stream_k import Units, finish_piece, iter_start, store_piece
from days.day019.epilogue_warps import (
    EPI_CONSUMER_REGS,
    EPI_GRAD_CONSUMER_REGS,
    EPI_GRAD_PRODUCER_REGS,
    EPI_PRODUCER_REGS,
    EPI_THREADS,
    gelu_grad_tile,
    gelu_tile,
    stage_row_block,
)
from days.day019.tma_store import (
    STORE_BOXES,
    STORE_BOX_ELEMS,
    bulk_wait_all,
    store_column_sums,
    wg_store_acc_tma,
)
from days.day014.gemm_v2_wgmma import WG_THREADS
from days.day014.gemm_v3_tma import (
    TMA_BK,
    TMA_BOX,
    TMA_PRODUCER_REGS,
    TMA_CONSUMER_REGS,
    fence_mbarrier_init,
    RingCursor,
    mbar_wait,
    set_max_registers,
    tma_desc,
    tma_load_operand,
)


# ---------------------------------------------------------------------------
# Why: at GPT-2's shapes (K = 768) version 3 spends a third of each block's life
# outside the tensor cores. A block loads its first stage (latency, nothing to
# multiply yet), runs 12 k-steps, then writes 128 x 256 results from registers while
# its tensor cores idle; the next block on that SM starts from scratch.
#
# Version 4 keeps every block alive for the whole GEMM (one block per SM, tiles
# t = block, block + grid, ...) and gives it three warpgroups:
#   * warpgroup 0, the producer: one thread streams the TMA loads of all the block's
#     tiles, one after the other, through the STAGES shared buffers. It never waits
#     for an epilogue, so the next tile's first stages are loaded while the last
#     tile's results are still being written.
#   * warpgroups 1 and 2, the consumers: each owns a whole BM x BN output tile, and
#     they alternate: the block's tiles 0, 2, 4, ... go to consumer 0, tiles 1, 3, 5,
#     ... to consumer 1. While one runs its epilogue, the other runs its main loop, so
#     the tensor cores always have one warpgroup feeding them.
#
# The turn: a consumer starts its main loop only when the other one has issued all of
# its wgmma for the previous tile (mbarriers `turn`). That order is what keeps the
# `full` barriers safe: an mbarrier phase is recognised by its parity only, so a
# consumer that waited for stage s two rounds early would mistake an old phase (the
# other consumer's data) for its own. With the turn, every wait is at most one phase
# ahead.
#
# Stage bookkeeping: the producer numbers the stage iterations it fills (it = 0, 1,
# ...): stage it % STAGES, round it // STAGES. In ping-pong every tile has num_k
# k-steps, so a consumer's i-th tile of the block starts at i * num_k; the cooperative
# consumers see every unit (and stream-K's units differ in length), so they count the
# iterations they consumed. Producer and consumers agree without talking.

comptime PP_GROUP_ROWS = 1024  # output rows walked together (tile_coords), as version 3's 8 x 128


# --8<-- [start:pingpong_kernel]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(3 * WG_THREADS)),
    `nvvm.cluster_dim`=StaticTuple[Int32, 3](Int32(CLUSTER), 1, 1),
)
@__llvm_arg_metadata(a_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(b_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(out_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(aux_map, `nvvm.grid_constant`)
def gemm_pingpong_kernel[
    dtype: DType,
    TA: Bool,
    TB: Bool,
    BM: Int,
    BN: Int,
    STAGES: Int,
    SMEM: Int,
    BIAS: Bool,
    GELU: Bool,
    GELU_GRAD: Bool,
    CLUSTER: Int,
    COOP: Bool,
    SPLIT: Int,
    F32_OUT: Bool,
    TMA_STORE: Bool,
    C_BLOCKS: Bool,
    EPI_WARPS: Bool,
](
    a_map: TMADescriptor,
    b_map: TMADescriptor,
    out_map: TMADescriptor,
    aux_map: TMADescriptor,
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    c: Pointer[Scalar[dtype], MutAnyOrigin],
    alpha_beta: Pointer[Float32, MutAnyOrigin],
    bias: Pointer[Scalar[dtype], MutAnyOrigin],
    aux: Pointer[Scalar[dtype], MutAnyOrigin],
    partials: Pointer[Float32, MutAnyOrigin],
    counters: Pointer[Int32, MutAnyOrigin],
    m: Int64,
    n: Int64,
    k: Int64,
    batch: Int64,
    c_bs: Int64,
    c_rs: Int64,
    c_cs: Int64,
    store_aux: Int64,
):
    """out[bt] = act(alpha * op(A[bt]) @ op(B[bt]) + bias) + beta * c[bt].

    Each consumer's tile is BM x BN (BM/64 m64 wgmma row blocks). Launch with grid
    (min(tiles, SMs), 1, 1), 384 threads and SMEM bytes of dynamic shared memory:
    STAGES stage buffers (BM x 64 of A, BN x 64 of B), a `full` and an
    `empty` mbarrier per stage, then the two `turn` mbarriers. `aux` (the GELU input,
    laid out like out) is written when GELU and store_aux != 0: 1 writes the pre-activation,
    2 GELU's derivative there. GELU_GRAD (neither BIAS nor GELU): out = alpha * op(A) @ op(B)
    * c, the MLP backward's gradient of GELU's input, c the derivative saved (day 020).
    With TMA_STORE and store_aux != 0 it also writes out's column sums in parts: row
    (bt ceil(M / WG_ROWS) + i) 4 + w of `partials`, float32 (batch ceil(M / WG_ROWS) 4,
    N), sums rows 16 w .. 16 w + 15 of each 64-row block of the i-th WG_ROWS rows of
    matrix bt (tma_store.mojo); their sum over the rows is the bias gradient.

    COOP: the two consumers split every tile by rows instead (BM/2 each), as version 3
    does, without the turn; the persistent schedule and the early loads stay.

    CLUSTER = 2: launch in clusters of 2 along x (grid even). The two CTAs of a cluster
    take the two column halves of a BM x 2BN unit: they share A's tile, and each loads
    half of it (BM/2 rows, in 64-row boxes) and multicasts it to both, so A crosses L2
    once for both.

    SPLIT (with COOP, CLUSTER = 1; days/day019/stream_k.mojo): 1, stream-K: the blocks
    share the tiles' k-steps evenly instead of whole tiles, and the last piece of a
    split tile sums them (`partials`: a float32 workspace of grid x 2 x BM x BN,
    `counters`: tiles x 8 int32 zeros). 2, split-K: launched on tiles x S blocks, each
    stores its piece as float32 in slice s of `partials`, (S, batch, M, N), for
    split_k_sum_kernel; `counters` unused. 0: neither is touched (but GELU_GRAD's
    column sums, above, write `partials`).

    SPLIT = 3, split-K in a cluster (part 28; ping-pong, plain epilogue, one column
    part, 2 <= CLUSTER <= 4): the CLUSTER CTAs of a cluster take the same tile, CTA r
    the k-steps [r num_k / CLUSTER, (r + 1) num_k / CLUSTER), with no multicast. After
    the k-loop each CTA sends the parts of its accumulator that others own into their
    shared memory (after the epilogue's boxes, before the mbarriers: (CLUSTER - 1) x
    ceil(units / CLUSTER) x 8 KB), units of 64 rows x 32 columns, unit u owned by CTA
    u % CLUSTER; each owner adds what it received and stores its units. No workspace,
    no second kernel. Launch with grid tiles x CLUSTER in clusters of CLUSTER: one tile
    a cluster (the receiving area is used once).

    F32_OUT: dst holds float32 (passed as a pointer like the others), the plain
    epilogue only: a weight gradient written in its float32 master weight's dtype, so
    that no kernel converts it afterwards (day 020). Split-K pieces are float32 anyway:
    there the sum kernel writes dst, so this kernel takes F32_OUT = False.

    TMA_STORE (day 019, part 10; days/day019/tma_store.mojo): the epilogue writes each
    64 x 64 piece of a consumer's tile into one of its two shared-memory boxes (after
    the stages, before the mbarriers) and one thread stores it with TMA through
    `out_map` (and `aux_map` for aux): tensor maps of dst and aux as (N, M, batch),
    64 x 64 boxes, 128-byte swizzle. Unused without TMA_STORE (pass any map).

    C_BLOCKS (day 019, part 16): c is read, full (c_rs >= N) or one row (c_rs == 0),
    row-major (c_cs == 1), 16-byte aligned (c and c_rs): the epilogue reads it in
    16-byte blocks (gemm_common's load_c_blocks), and each consumer asks L2 for its part
    of a tile before the tile's k-loop, as GELU_GRAD does.

    EPI_WARPS (part 22, epilogue_warps.mojo; TMA_STORE's COOP GELU tiles, beta 0, maps
    unused): the consumers write alpha * acc + bias into a shared-memory copy of the
    whole tile and go on; warps 1-3 of the producer warpgroup apply GELU to it and store
    it (and aux) with 16-byte stores, while the tensor cores run the next tile.
    With GELU_GRAD (part 23; c full rows, c_rs == N, 16-byte aligned) the warps store
    alpha * acc, rounded, times c, or with store_aux & 2 times gelu'(c): c is then the
    pre-activation. Its column sums (store_aux & 1) go to `partials` as EPI_THREADS /
    (BN / 8) rows a tile (bf16 and fp16: 6), row (bt ceil(M / BM) + tile row) 6 + group
    (gelu_grad_tile).
    Shared memory: the stages, the tile's copy, then the mbarriers with two more:
    `epi_full` (the consumers' 256 threads) and `epi_empty` (the epilogue warps' 96).
    """
    # COOP: both consumers work on every tile, one BM/2-row half each (version 3's
    # cooperative split, kept persistent); else each consumer owns whole tiles (ping-pong)
    comptime SHARERS = 2 if COOP else 1
    comptime K_CLUSTER = SPLIT == 3  # the CTAs of a cluster split each tile's K
    comptime N_SHARE = 1 if K_CLUSTER else CLUSTER  # CTAs side by side in n, sharing A
    comptime WG_ROWS = BM // SHARERS  # rows of one consumer's accumulator
    comptime ROW_BLOCKS = WG_ROWS // 64
    # BN in column parts of power-of-two widths (SIMD widths): 192 = 128 + 64
    comptime BN0 = 256 if BN >= 256 else (128 if BN >= 128 else 64)
    comptime BN1 = BN - BN0  # 0 when BN is a power of two
    comptime FRAG0 = BN0 // 2  # fp32 accumulators a thread holds per m64 row block
    comptime FRAG1 = BN1 // 2 if BN1 > 0 else 1  # (a 1-wide placeholder when unused)
    comptime GROUP_M = PP_GROUP_ROWS // BM
    comptime A_KC = not TA  # A is k-contiguous when stored (M, K)
    comptime B_KC = TB  # B is k-contiguous when stored (N, K)
    comptime A_ELEMS = BM * TMA_BK
    comptime B_ELEMS = BN * TMA_BK
    comptime STAGE_BYTES = (A_ELEMS + B_ELEMS) * size_of[dtype]()
    # the epilogue's boxes: STORE_BOXES per consumer (TMA_STORE), or the whole tile
    # (EPI_WARPS)
    comptime CONSUMER_BOXES = 2 * STORE_BOXES * STORE_BOX_ELEMS
    comptime EPI_ELEMS = BM * BN if EPI_WARPS else (
        CONSUMER_BOXES if TMA_STORE else 0
    )
    comptime EPI_BARS = 2 if EPI_WARPS else 0  # epi_full, epi_empty
    # K_CLUSTER: what a CTA receives, (CLUSTER - 1) senders x RED_PER_OWNER units x 4
    # chunks of WG_THREADS x 16 bytes (conflict-free v4 stores); `red_full` counts them
    comptime RED_UNITS = (WG_ROWS // 64) * (BN // 32)
    comptime RED_PER_OWNER = (RED_UNITS + CLUSTER - 1) // CLUSTER
    comptime RED_BYTES = (
        (CLUSTER - 1) * RED_PER_OWNER * 16 * WG_THREADS * 4 if K_CLUSTER else 0
    )
    comptime RED_BARS = 1 if K_CLUSTER else 0
    comptime assert (
        WG_ROWS % 64 == 0 and BN % 64 == 0 and BN <= 256
    ), "tile shape"
    comptime assert BN1 == 0 or BN1 == 64, "column parts of 128 + 64"
    comptime assert (
        WG_ROWS * BN <= 64 * 384
    ), "a consumer holds at most 192 fp32 accumulators a thread"
    comptime assert STAGES >= 2, "at least two stages"
    comptime assert (
        SMEM
        == STAGES * (STAGE_BYTES + 16)
        + EPI_ELEMS * size_of[dtype]()
        + RED_BYTES
        + 16
        + 8 * EPI_BARS
        + 8 * RED_BARS
    ), (
        "stages + the epilogue's boxes + what a cluster's split sends +"
        " mbarriers"
    )
    comptime assert not TMA_STORE or (
        SPLIT == 0 and BN1 == 0 and not F32_OUT
    ), "TMA stores: whole tiles, one column part, 16-bit outputs"
    comptime assert (
        TMA_BK * size_of[dtype]() == 128
    ), "one 128-byte swizzle span"
    comptime assert not EPI_WARPS or (
        COOP
        and TMA_STORE
        and (GELU or GELU_GRAD)
        and not C_BLOCKS
        and CLUSTER == 1
        and BM % 64 == 0
    ), (
        "epilogue warps: GELU (or its gradient) of cooperative tiles through"
        " TMA stores"
    )
    comptime A_PART = BM // N_SHARE  # rows of A's tile this CTA loads for the cluster
    comptime assert N_SHARE == 1 or (
        N_SHARE == 2 and A_PART % 64 == 0
    ), "clusters of 2 split A's tile into halves of whole 64-row boxes"
    comptime STREAM_K = SPLIT == 1 or SPLIT == 2  # the Units walk k-step ranges
    comptime assert not K_CLUSTER or (
        CLUSTER >= 2
        and CLUSTER <= 4
        and not COOP
        and BN1 == 0
        and not BIAS
        and not GELU
        and not GELU_GRAD
        and not C_BLOCKS
        and not EPI_WARPS
    ), (
        "split-K in a cluster: clusters of 2-4, the ping-pong schedule, one"
        " column part, the plain epilogue from registers"
    )
    comptime assert (
        SPLIT == 0
        or K_CLUSTER
        or (
            COOP
            and CLUSTER == 1
            and BN1 == 0
            and not BIAS
            and not GELU
            and not GELU_GRAD
        )
    ), (
        "split tiles: the cooperative schedule, no cluster, one column part,"
        " plain epilogue"
    )
    comptime assert not (
        F32_OUT and SPLIT == 2
    ), "split-K: the sum kernel writes the float32 output"
    comptime assert not C_BLOCKS or (
        SPLIT == 0 and not F32_OUT and not GELU_GRAD
    ), "c in 16-byte blocks: beta's c, 16-bit, whole tiles"

    var M = Int(m)
    var N = Int(n)
    var num_m = ceildiv(M, BM)
    # the schedule's unit: CLUSTER tiles side by side in n, one per CTA of a cluster
    var num_n = ceildiv(ceildiv(N, BN), N_SHARE)
    var per_batch = num_m * num_n
    var tiles = per_batch * Int(batch)
    var num_k = ceildiv(Int(k), TMA_BK)
    var rank = 0
    comptime if CLUSTER > 1:
        rank = Int(block_rank_in_cluster())
    var n_rank = rank  # the CTA's tile in its cluster's unit, along n
    # the k-steps this CTA walks in each of its tiles: [k_first, k_first + my_k)
    var k_first = 0
    var my_k = num_k
    comptime if K_CLUSTER:
        n_rank = 0
        k_first = rank * num_k // CLUSTER
        my_k = (rank + 1) * num_k // CLUSTER - k_first
    var first = block_idx.x // CLUSTER  # this cluster's first unit
    var stride = grid_dim.x // CLUSTER  # clusters in the grid
    # what the block walks: whole tiles first, first + stride, ... or, stream-K, an
    # even share of all tiles' k-steps (Units)
    var total = tiles * num_k
    var begin = first
    var end = tiles
    comptime if STREAM_K:
        begin = iter_start(block_idx.x, total, grid_dim.x)
        end = iter_start(block_idx.x + 1, total, grid_dim.x)

    var smem = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=1024
    ]()
    var sa = smem
    var sb = smem.unsafe_offset(STAGES * A_ELEMS)
    var boxes = smem.unsafe_offset(STAGES * (A_ELEMS + B_ELEMS))
    var red = boxes.unsafe_offset(EPI_ELEMS).unsafe_bitcast[Float32]()
    var full = red.unsafe_offset(RED_BYTES // 4).unsafe_bitcast[Int64]()
    var empty = full.unsafe_offset(STAGES)
    var turn = empty.unsafe_offset(STAGES)  # turn[w]: consumer w may start
    # EPI_WARPS: the tile's staged copy is written (epi_full) / stored (epi_empty)
    var epi_full = turn.unsafe_offset(2)
    var epi_empty = turn.unsafe_offset(3)
    # K_CLUSTER: the other CTAs' parts have landed
    var red_full = turn.unsafe_offset(2 + EPI_BARS)
    if thread_idx.x == 0:
        comptime for s in range(STAGES):
            mbarrier_init(full.unsafe_offset(s), 1)
            # the 4 warps of one consumer, in every CTA of the cluster: a stage's A
            # half is written into both CTAs, so both must have released it
            mbarrier_init(empty.unsafe_offset(s), Int32(4 * SHARERS * N_SHARE))
        mbarrier_init(turn, 4)
        mbarrier_init(turn.unsafe_offset(1), 4)
        comptime if EPI_WARPS:
            mbarrier_init(epi_full, Int32(2 * WG_THREADS))
            mbarrier_init(epi_empty, Int32(EPI_THREADS))
        comptime if K_CLUSTER:
            # the owner's expect_tx; the st.async stores count bytes
            mbarrier_init(red_full, 1)
        fence_mbarrier_init()
    comptime if CLUSTER > 1:
        cluster_sync()  # the peer's barriers exist before anything lands in them
    else:
        barrier()

    # setmaxnreg: the epilogue warps take more of the pool (epilogue_warps.mojo)
    comptime producer_regs = (
        EPI_GRAD_PRODUCER_REGS if GELU_GRAD else EPI_PRODUCER_REGS
    ) if EPI_WARPS else TMA_PRODUCER_REGS
    comptime consumer_regs = (
        EPI_GRAD_CONSUMER_REGS if GELU_GRAD else EPI_CONSUMER_REGS
    ) if EPI_WARPS else TMA_CONSUMER_REGS
    var wg = thread_idx.x // WG_THREADS
    if wg == 0:
        set_max_registers[False, producer_regs]()
        if thread_idx.x == 0:
            var a_ptr = Pointer(to=a_map).unsafe_bitcast[NoneType]()
            var b_ptr = Pointer(to=b_map).unsafe_bitcast[NoneType]()
            var it = 0
            var ring = RingCursor[STAGES](0)
            var units = Units[STREAM_K](begin, end, stride, my_k)
            while units.next():  # k-steps [kb, ke) of tile t
                var t = units.t
                var bt = t // per_batch
                var tile = tile_coords[GROUP_M](t % per_batch, num_m, num_n)
                var tn = tile[1] * N_SHARE + n_rank
                for kt in range(units.kb, units.ke):
                    var s = ring.stage
                    if it >= STAGES:  # the consumers released round r-1
                        mbar_wait(empty.unsafe_offset(s), ring.phase ^ 1)
                    mbarrier_arrive_expect_tx_shared(
                        full.unsafe_offset(s), Int32(STAGE_BYTES)
                    )
                    comptime if N_SHARE == 1:
                        tma_load_operand[dtype, A_KC, BM](
                            a_ptr,
                            sa.unsafe_offset(s * A_ELEMS),
                            full.unsafe_offset(s),
                            tile[0] * BM,
                            (k_first + kt) * TMA_BK,
                            bt,
                        )
                    else:
                        # rows [A_PART rank, A_PART (rank + 1)) of A's tile, to both
                        # CTAs, in 64 x 64 boxes at the same place in either layout
                        var k0 = kt * TMA_BK
                        comptime for j in range(A_PART // 64):
                            var row = tile[0] * BM + rank * A_PART + j * 64
                            tma_multicast_box[dtype](
                                a_ptr,
                                sa.unsafe_offset(
                                    s * A_ELEMS
                                    + (rank * A_PART + j * 64) * TMA_BK
                                ),
                                full.unsafe_offset(s),
                                k0 if A_KC else row,
                                row if A_KC else k0,
                                bt,
                                UInt16((1 << CLUSTER) - 1),
                            )
                    tma_load_operand[dtype, B_KC, BN](
                        b_ptr,
                        sb.unsafe_offset(s * B_ELEMS),
                        full.unsafe_offset(s),
                        tn * BN,
                        (k_first + kt) * TMA_BK,
                        bt,
                    )
                    it += 1
                    ring.advance()
        comptime if EPI_WARPS:
            if thread_idx.x >= WARP_SIZE:  # warps 1-3: GELU and the stores
                var etid = thread_idx.x - WARP_SIZE
                var epi_round = 0
                var units = Units[False](begin, end, stride, num_k)
                while units.next():
                    var t = units.t
                    var tile = tile_coords[GROUP_M](t % per_batch, num_m, num_n)
                    mbar_wait(epi_full, epi_round % 2)
                    var bt = t // per_batch
                    comptime if GELU_GRAD:  # c: full rows
                        var saved = c.unsafe_offset(bt * Int(c_bs))
                        var tile_row = bt * num_m + tile[0]
                        var sums = (store_aux & 1) != 0
                        if (store_aux & 2) != 0:  # c is GELU's input
                            gelu_grad_tile[dtype, BM, BN, True](
                                boxes,
                                dst.unsafe_offset(bt * M * N),
                                saved,
                                partials,
                                tile[0] * BM,
                                tile[1] * BN,
                                M,
                                N,
                                tile_row,
                                sums,
                                etid,
                            )
                        else:
                            gelu_grad_tile[dtype, BM, BN, False](
                                boxes,
                                dst.unsafe_offset(bt * M * N),
                                saved,
                                partials,
                                tile[0] * BM,
                                tile[1] * BN,
                                M,
                                N,
                                tile_row,
                                sums,
                                etid,
                            )
                    else:
                        gelu_tile[dtype, BM, BN](
                            boxes,
                            dst.unsafe_offset(bt * M * N),
                            aux.unsafe_offset(bt * M * N),
                            tile[0] * BM,
                            tile[1] * BN,
                            M,
                            N,
                            Int(store_aux),
                            etid,
                        )
                    # its chunks are read: the consumers may refill the copy
                    _ = mbarrier_arrive(epi_empty)
                    epi_round += 1
    else:
        set_max_registers[True, consumer_regs]()
        # read once, long before the first epilogue needs them
        var alpha = alpha_beta[unsafe_offset=0]
        var beta = alpha_beta[unsafe_offset=1]
        var me = wg - 1
        var round = 0  # how many tiles this consumer has done
        # TMA_STORE: this consumer's boxes, how many it has published, who stores them
        var my_boxes = boxes.unsafe_offset(me * STORE_BOXES * STORE_BOX_ELEMS)
        var piece = 0
        var storer = thread_idx.x % WG_THREADS == 0
        var done = 0  # stream-K: the stage iterations it has consumed
        # this consumer's first row in a tile
        var row_off = me * WG_ROWS if COOP else 0
        # ping-pong: every other tile of the block's
        var units = Units[STREAM_K](
            begin if COOP else begin + me * stride,
            end,
            stride if COOP else 2 * stride,
            my_k,
        )
        while units.next():
            var t = units.t
            var kb = units.kb
            var ke = units.ke
            var bt = t // per_batch
            var tile = tile_coords[GROUP_M](t % per_batch, num_m, num_n)
            var tn = tile[1] * N_SHARE + n_rank
            # --8<-- [start:turn]
            # wait for the turn: consumer 1's round r follows consumer 0's round r,
            # consumer 0's round r follows consumer 1's round r - 1
            comptime if not COOP:
                if me == 1:
                    mbar_wait(turn.unsafe_offset(1), round % 2)
                elif round > 0:
                    mbar_wait(turn, (round - 1) % 2)
            # --8<-- [end:turn]
            var it0 = (round if COOP else 2 * round + me) * my_k
            comptime if STREAM_K:
                it0 = done
            # Mojo's SIMD widths are powers of two, so a BN of 192 is two column parts
            # (BN0 = 128, then BN1 = 64), each its own wgmma and accumulator; in each,
            # the row blocks' m64 accumulators sit side by side (block r at r * FRAG0)
            comptime if GELU_GRAD or C_BLOCKS:  # the epilogue reads a tile of c: to L2 now
                prefetch_l2_rows[dtype, WG_ROWS, BN](
                    c.unsafe_offset(bt * Int(c_bs)),
                    tile[0] * BM + row_off,
                    tn * BN,
                    M,
                    N,
                    Int(c_rs),
                    thread_idx.x % WG_THREADS,
                )
            var acc0 = SIMD[DType.float32, ROW_BLOCKS * FRAG0](0)
            var acc1 = SIMD[DType.float32, ROW_BLOCKS * FRAG1](0)
            var ring = RingCursor[STAGES](it0)
            for kt in range(kb, ke):
                var s = ring.stage
                mbar_wait(full.unsafe_offset(s), ring.phase)
                var sa_k = sa.unsafe_offset(s * A_ELEMS)
                var sb_k = sb.unsafe_offset(s * B_ELEMS)
                # one descriptor per operand and k-step; each wgmma adds a constant
                var a_desc = tma_desc[dtype, A_KC](sa_k, row_off, 0)
                var b_desc = tma_desc[dtype, B_KC](sb_k, 0, 0)
                wgmma_fence_aligned()
                comptime for ks in range(TMA_BK // 16):
                    acc0 = mma_rows[dtype, A_KC, B_KC, ROW_BLOCKS, BN0](
                        acc0, a_desc, b_desc, 0, ks
                    )
                    comptime if BN1 > 0:
                        acc1 = mma_rows[dtype, A_KC, B_KC, ROW_BLOCKS, BN1](
                            acc1, a_desc, b_desc, BN0, ks
                        )
                wgmma_commit_group_sync()
                wgmma_wait_group_sync[1]()
                if kt > kb and lane_id() == 0:
                    release[N_SHARE](empty.unsafe_offset(ring.before()))
                ring.advance()
            # every wgmma of this tile is issued: the other consumer may start
            comptime if not COOP:
                if lane_id() == 0:
                    _ = mbarrier_arrive(turn.unsafe_offset(1 - me))
            wgmma_wait_group_sync[0]()
            var any_k = True
            comptime if K_CLUSTER:
                # a cluster wider than K's steps leaves a CTA none
                any_k = ke > kb
            if lane_id() == 0 and any_k:
                release[N_SHARE](empty.unsafe_offset(ring.before()))
            round += 1
            comptime if STREAM_K:
                done += ke - kb
            comptime if SPLIT == 2:  # block t S + s holds piece s of tile t
                var piece = block_idx.x % (grid_dim.x // tiles)
                store_piece[BN0](
                    acc0,
                    partials.unsafe_offset((piece * Int(batch) + bt) * M * N),
                    tile[0] * BM + row_off,
                    tn * BN,
                    M,
                    N,
                )
                continue
            comptime if SPLIT == 1:
                if not units.whole() and not finish_piece[SHARERS](
                    acc0, partials, counters, t, me, num_k, total, grid_dim.x
                ):
                    continue  # another warp finishes this tile
            # this matrix of the batch: offsets count elements of dst's own dtype
            var out_t = dst.unsafe_offset(bt * M * N)
            comptime if F32_OUT:
                out_t = (
                    dst.unsafe_bitcast[Float32]()
                    .unsafe_offset(bt * M * N)
                    .unsafe_bitcast[Scalar[dtype]]()
                )
            comptime if K_CLUSTER:
                reduce_in_cluster[
                    dtype, BN, F32_OUT, CLUSTER, RED_UNITS, RED_PER_OWNER, 32
                ](
                    acc0,
                    red,
                    red_full,
                    rank,
                    out_t,
                    c.unsafe_offset(bt * Int(c_bs)),
                    alpha,
                    beta,
                    tile[0] * BM,
                    tn * BN,
                    M,
                    N,
                    Int(c_rs),
                    Int(c_cs),
                    bias,
                    aux,
                )
                continue
            comptime if EPI_WARPS:
                # hand the tile to the epilogue warps once they have stored the last
                if round > 1:
                    mbar_wait(epi_empty, (round - 2) % 2)
                comptime for r in range(ROW_BLOCKS):
                    stage_row_block[dtype, BN0, BIAS](
                        acc0.slice[FRAG0, offset=r * FRAG0](),
                        boxes.unsafe_offset(
                            (me * ROW_BLOCKS + r) * (BN // 64) * STORE_BOX_ELEMS
                        ),
                        alpha,
                        bias,
                        tn * BN,
                        N,
                    )
                _ = mbarrier_arrive(epi_full)
                continue
            comptime if TMA_STORE:
                # GELU_GRAD's column sums (store_aux != 0), over the row blocks
                var col_sums = SIMD[DType.float32, BN0 // 32](0)
                comptime for r in range(ROW_BLOCKS):
                    wg_store_acc_tma[
                        dtype, BN0, BIAS, GELU, GELU_GRAD, C_BLOCKS
                    ](
                        acc0.slice[FRAG0, offset=r * FRAG0](),
                        my_boxes,
                        Pointer(to=out_map).unsafe_bitcast[NoneType](),
                        Pointer(to=aux_map).unsafe_bitcast[NoneType](),
                        c.unsafe_offset(bt * Int(c_bs)),
                        alpha,
                        beta,
                        tile[0] * BM + row_off + r * 64,
                        tn * BN,
                        bt,
                        M,
                        N,
                        Int(c_rs),
                        Int(c_cs),
                        bias,
                        Int(store_aux),
                        piece,
                        storer,
                        1 + me,  # named barrier 0 is the block's
                        col_sums,
                    )
                comptime if GELU_GRAD:
                    # one row of partials per warp of each consumer's rows: 4 per
                    # WG_ROWS rows of each matrix (rows past M sum to 0, and are stored)
                    var row_base = tile[0] * BM + row_off
                    if store_aux != 0 and row_base < M:
                        var prow = (
                            bt * ceildiv(M, WG_ROWS) + row_base // WG_ROWS
                        ) * 4 + warp_id() % 4
                        store_column_sums[BN0](
                            partials, col_sums, prow, tn * BN, N
                        )
                continue
            comptime for r in range(ROW_BLOCKS):
                wg_store_acc[
                    dtype, BN0, BIAS, GELU, GELU_GRAD, F32_OUT, C_BLOCKS
                ](
                    acc0.slice[FRAG0, offset=r * FRAG0](),
                    out_t,
                    c.unsafe_offset(bt * Int(c_bs)),
                    alpha,
                    beta,
                    tile[0] * BM + row_off + r * 64,
                    tn * BN,
                    M,
                    N,
                    Int(c_rs),
                    Int(c_cs),
                    bias,
                    aux.unsafe_offset(bt * M * N),
                    Int(store_aux),
                )
                comptime if BN1 > 0:
                    wg_store_acc[
                        dtype, BN1, BIAS, GELU, GELU_GRAD, F32_OUT, C_BLOCKS
                    ](
                        rebind[SIMD[DType.float32, BN1 // 2]](
                            acc1.slice[FRAG1, offset=r * FRAG1]()
                        ),
                        out_t,
                        c.unsafe_offset(bt * Int(c_bs)),
                        alpha,
                        beta,
                        tile[0] * BM + row_off + r * 64,
                        tn * BN + BN0,
                        M,
                        N,
                        Int(c_rs),
                        Int(c_cs),
                        bias,
                        aux.unsafe_offset(bt * M * N),
                        Int(store_aux),
                    )
        comptime if TMA_STORE and not EPI_WARPS:
            if storer:  # its boxes stay allocated until TMA is done with them
                bulk_wait_all()
    comptime if CLUSTER > 1:
        cluster_sync()  # no CTA leaves while its peer may still write into it


@always_inline
def slice_bytes[dtype: DType, K_CONTIG: Bool](mn: Int, ks: Int) -> Int:
    """Byte offset of `tma_desc`'s slice (mn, ks) from slice (0, 0) of the same tile.
    With comptime arguments it is a constant, and `WGMMADescriptor + bytes` adds it to
    the address field: one add per wgmma instead of a descriptor built from a pointer
    (about a dozen instructions each, measured in SASS: part 4 of the journal).
    """
    comptime if K_CONTIG:
        return (mn * TMA_BK + ks * 16) * size_of[dtype]()
    return ((mn // TMA_BOX) * TMA_BOX * TMA_BK + ks * 16 * TMA_BOX) * size_of[
        dtype
    ]()


@always_inline
def mma_rows[
    dtype: DType, A_KC: Bool, B_KC: Bool, ROW_BLOCKS: Int, BNP: Int, N: Int
](
    acc: SIMD[DType.float32, N],
    a_desc: WGMMADescriptor[dtype],
    b_desc: WGMMADescriptor[dtype],
    col0: Int,
    ks: Int,
) -> type_of(acc):
    """One k16 step of a consumer's ROW_BLOCKS m64 row blocks against columns
    [col0, col0 + BNP) of the stage's B tile: m64nBNPk16 wgmma each, issued async.
    `a_desc` describes the consumer's first row of A's stage tile, `b_desc` B's stage
    tile, both at k step 0.
    """
    comptime FRAGP = BNP // 2
    comptime assert (
        N == ROW_BLOCKS * FRAGP
    ), "one m64 x BNP accumulator per row block"
    var out = acc
    var b = b_desc + slice_bytes[dtype, B_KC](col0, ks)
    comptime for r in range(ROW_BLOCKS):
        out = out.insert[offset=r * FRAGP](
            wgmma_async[
                64,
                BNP,
                16,
                a_type=dtype,
                b_type=dtype,
                layout_a="row" if A_KC else "col",
                layout_b="col" if B_KC else "row",
            ](
                a_desc + slice_bytes[dtype, A_KC](r * 64, ks),
                b,
                out.slice[FRAGP, offset=r * FRAGP](),
            )
        )
    return out


@always_inline
def release[
    CLUSTER: Int
](bar: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED]):
    """A consumer warp gives a stage back: to its own CTA's producer, and with clusters
    to every CTA's, since each of them multicasts into this stage."""
    comptime if CLUSTER == 1:
        _ = mbarrier_arrive(bar)
    else:
        comptime for cta in range(CLUSTER):
            mbar_arrive_cta(bar, cta)


# --8<-- [end:pingpong_kernel]
