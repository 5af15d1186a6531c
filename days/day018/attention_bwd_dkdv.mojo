# Day 018, backward pass 1: dK and dV for one block of keys (64 per consumer warpgroup),
# walking every query tile of every query head of the kv head's group. Per tile:
#   S^T  = K Q^T                 wgmma, shared x shared (keys are the rows)
#   P^T  = exp2(S^T * scale log2 e - lse2[query])    rebuilt from the forward's lse2
#   dV  += P^T dO                wgmma, P^T from registers (the forward's P V form)
#   dP^T = V dO^T                wgmma, shared x shared (issued with S^T)
#   dS^T = P^T (dP^T - delta[query])                 delta = rowsum(dO * O)
#   dK  += dS^T Q                wgmma, dS^T from registers
# Everything is computed with keys as rows, so no product needs a transpose of a
# register tile: the forward's two wgmma forms cover all four. (dQ is pass 2.)
# FUSED (backward versions 2 and 6): also dQ += scale dS K, through shared memory, into a
# float32 dQ: version 2 with atomics per thread (attention_bwd_dq.mojo), version 6 with dS
# shared and whole pieces added by the TMA unit (attention_bwd_tiles.mojo); there is no
# pass 2.
# TURNS (backward versions 3 to 5): the two consumers take turns to issue each pair of
# products, so one warpgroup's elementwise step runs beside the other's products (without
# turns both wait for the same streamed tile, issue together, then both do their
# elementwise step while the tensor cores idle).

from max.gpu import lane_id, warp_id
from max.gpu.compute.mma import wgmma_wait_group_sync
from max.gpu.sync import mbarrier_arrive
from std.math import exp2

from days.day014.gemm_v2_wgmma import fence_async_shared
from days.day014.gemm_v3_tma import mbar_wait, ring_slot
from days.day018.attention_bwd_pairs import PAIR_FLOATS
from days.day018.attention_bwd_dq import (
    dq_red_add,
    dq_wgmma,
    ds_store,
    open_turns,
    TURN_BAR,
    pass_turn,
    take_turn,
    warpgroup_sync,
)
from days.day018.attention_bwd_tiles import (
    CONSUMERS_BAR,
    DQ_ATOMIC,
    DQ_TILES,
    PIECE,
    bulk_reduce_add,
    dq_piece_wgmma,
    shares_ds,
    stage_piece,
)
from days.day018.attention_common import (
    BOX,
    CONSUMERS,
    hold,
    opaque_zero,
    p_fragments,
    pv_issue,
    pv_wait,
    s_wgmma,
    v_descs,
)
from days.day018.attention_v2_overlap import pass_tiles, sched_sync
from days.day019.tma_store import (
    bulk_commit,
    bulk_wait_all,
    bulk_wait_read,
)

comptime BQ = 64  # queries per streamed tile


@always_inline
def probs_t[
    NS: Int, //, NL: Int, MASK: Bool
](
    mut st: SIMD[DType.float32, NS],
    lc: SIMD[DType.float32, NL],
    my_key: Int,
    q0: Int,
):
    """P^T = exp2(S^T scale log2 e - lse2[query]) in place (st already scaled); MASK
    (causal, a tile at the diagonal): 0 where the key (row) comes after the query.
    """
    comptime assert NS == 2 * NL, "a tile's scores, its columns' lse2"
    var t = lane_id() % 4
    # masked where my_key + 8 half > q0 + 8 jj + 2 t + e: one 32-bit register against
    # a constant per score (64-bit columns per score spilled the causal loops)
    var rel = Int32(my_key - q0) - 2 * Int32(t)
    comptime for jj in range(NL // 2):
        comptime for e in range(2):
            var lse_c = lc[2 * jj + e]
            comptime for half in range(2):
                var i = 4 * jj + 2 * half + e
                var p = exp2(st[i] - lse_c)
                comptime if MASK:
                    if rel > Int32(8 * jj + e - 8 * half):
                        p = 0
                st[i] = p


# --8<-- [start:consume]
@always_inline
def consume_dkdv[
    dtype: DType,
    D: Int,
    STAGES: Int,
    CAUSAL: Bool,
    FUSED: Int = 0,
    TURNS: Bool = False,
    NC: Int = CONSUMERS,
](
    sk: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    sv: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    stream: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    n_tiles: Int,
    per_head: Int,
    q_start: Int,
    key0: Int,
    my_key: Int,
    Lq: Int,
    Lk: Int,
    pair_slots: Pointer[
        Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    scale_log2: Float32,
    mut dk: SIMD[DType.float32, D // 2],
    mut dv: SIMD[DType.float32, D // 2],
    ds_boxes: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    staged: Pointer[
        Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    dq: Pointer[Float32, MutAnyOrigin],
    dq_rows: Int,
    scale: Float32,
    cw: Int,
):
    """cw: this consumer (0 to NC - 1), key0 its first key; my_key is this thread's row
    g (g + 8 is the other); sk is this consumer's 64 keys; NC consumers (3 in version
    7 at head_dim 64, which pass the tiles their keys never see: none past Lk; with the
    mask, a query tile that ends before key0). pair_slots: each stage's (lse2,
    delta) pairs (attention_bwd_pairs.mojo). FUSED: `dq` points at the group's first
    query head (row 0), its heads dq_rows rows apart (version 6; version 2: Lq);
    ds_boxes are the 64 x 64 dS^T boxes (version 2: one per consumer; version 6: two
    pairs taking turns), staged (version 6) this consumer's float32 piece."""
    var full0 = bars.unsafe_offset(1)
    var full1 = bars.unsafe_offset(1 + STAGES)
    var empty = bars.unsafe_offset(1 + 2 * STAGES)
    var full2 = bars.unsafe_offset(1 + 3 * STAGES)
    var t = lane_id() % 4
    comptime assert not (FUSED != 0 and TURNS), "versions 2 and 6 take no turns"
    # version 6: the fixed tiles' descriptors are made in the loop (`opaque_zero`);
    # hoisted out of it, they held registers across it and spilled (ptxas -v: 52-60
    # bytes of spill stores at head_dim 128, 12-20 with this)
    comptime OPAQUE = FUSED == DQ_TILES
    # both consumers' keys (version 6's shared dS reads them all)
    var sk_block = sk.unsafe_offset(-cw * (D // 64) * BOX)
    comptime assert NC == CONSUMERS or (
        FUSED == 0 and TURNS
    ), "three consumers: in turns"
    open_turns[TURNS, NC](cw)
    for j in range(n_tiles):
        var slot = ring_slot[STAGES](j)
        var s = slot[0]
        var phase = slot[1]
        var sq = stream.unsafe_offset(s * 2 * BQ * D)
        var sdo = sq.unsafe_offset(BQ * D)
        var q0 = q_start + (j % per_head) * BQ
        var head_off = (j // per_head) * Lq
        comptime if NC == 3:
            # a tile none of its keys sees: only passed (its two turns, the stage freed
            # once it has landed; consumer 0, whose keys see every streamed tile, waits
            # for the pairs before the stage can be refilled). With two consumers the
            # branch cost more than it saved (2-3% at head_dim 128; at 64 without the
            # mask it spilled, +15%; the journal's "The backward, part 9")
            if key0 >= Lk or (CAUSAL and q0 + BQ <= key0):
                pass_tiles[STAGES, TURNS, NC, False, TURN_BAR, 2](
                    bars, cw, j, 1, False
                )
                continue
        # both score-shaped products first, back to back: dP^T = V dO^T does not
        # need P^T, so the tensor cores run two products between the waits
        mbar_wait(full0.unsafe_offset(s), phase)
        comptime if TURNS:
            mbar_wait(full1.unsafe_offset(s), phase)
            take_turn[TURNS](cw)
        var z = opaque_zero() if OPAQUE else 0
        var st = s_wgmma[dtype, D, BQ](sk.unsafe_offset(z), sq)
        comptime if not TURNS:
            mbar_wait(full1.unsafe_offset(s), phase)
        var dpt = s_wgmma[dtype, D, BQ](sv.unsafe_offset(z), sdo)
        pass_turn[TURNS, NC](cw)
        wgmma_wait_group_sync[0]()
        st = hold(st) * scale_log2
        dpt = hold(dpt)
        # P^T: column c (a query) uses lse2[c] (+inf past Lq: P^T = 0 there), dS^T
        # delta[c]; the tile's pairs came with it (its own barrier, full_2)
        mbar_wait(full2.unsafe_offset(s), phase)
        var lc = SIMD[DType.float32, BQ // 4]()  # lse2 per column
        var dl = SIMD[DType.float32, BQ // 4]()  # delta per column, same order
        var my_pairs = pair_slots.unsafe_offset(s * PAIR_FLOATS + 4 * Int(t))
        comptime for jj in range(BQ // 8):
            comptime for e in range(2):
                var pr = my_pairs.unsafe_load[width=2, alignment=8](
                    16 * jj + 2 * e
                )
                lc[2 * jj + e] = pr[0]
                dl[2 * jj + e] = pr[1]
        # only a tile that reaches the diagonal has a query before one of these keys:
        # the others skip the mask (a uniform branch)
        var masked: Bool
        comptime if CAUSAL:
            masked = key0 + 63 > q0
        else:
            # never true (Lq >= 0), but ptxas cannot know: without a branch in the
            # loop's body, ptxas serialized every wgmma of version 6's loop (C7512,
            # "insufficient register resources"; one wait per product) and spilled
            # 244-384 bytes; with it, neither (journal, "The backward, part 6")
            masked = FUSED == DQ_TILES and Lq < 0
        if masked:
            probs_t[BQ // 4, True](st, lc, my_key, q0)
        else:
            probs_t[BQ // 4, False](st, lc, my_key, q0)
        var pf = p_fragments[dtype, BQ](st)
        comptime for jj in range(BQ // 8):
            comptime for e in range(4):
                var i = 4 * jj + e
                st[i] = st[i] * (dpt[i] - dl[2 * jj + e % 2])
        var dsf = p_fragments[dtype, BQ](st)
        # then the two register-A products, back to back
        take_turn[TURNS](cw)
        dv = pv_issue[dtype, D, BQ](pf, v_descs[dtype, D, BQ](sdo), dv)
        dk = pv_issue[dtype, D, BQ](dsf, v_descs[dtype, D, BQ](sq), dk)
        pass_turn[TURNS, NC](cw)
        comptime if FUSED == DQ_ATOMIC:
            # dS^T to shared memory while dV and dK run (the box's last reader, the
            # previous tile's dQ product, has retired), then dQ's share from it
            var ds_box = ds_boxes.unsafe_offset(cw * BOX)
            ds_store(
                rebind[SIMD[DType.uint32, 16]](dsf),
                ds_box.unsafe_bitcast[UInt32](),
            )
            fence_async_shared()
            warpgroup_sync(
                1 + Int(warp_id()) // 4
            )  # barrier 2 or 3: my warpgroup
            var dqt = dq_wgmma[dtype, D](ds_box, sk)
            dv = pv_wait[D, BQ](pf, dv)  # wait_group 0: all three products
            dk = pv_wait[D, BQ](dsf, dk)
            dqt = hold(dqt)
            dq_red_add[D](dqt, scale, dq.unsafe_offset(head_off * D), q0, Lq)
        elif FUSED == DQ_TILES:
            # dS^T into this tile's pair of boxes (attention_bwd_tiles.mojo)
            var pair = ds_boxes.unsafe_offset((j % 2) * 2 * BOX)
            ds_store(
                rebind[SIMD[DType.uint32, 16]](dsf),
                pair.unsafe_offset(cw * BOX).unsafe_bitcast[UInt32](),
            )
            fence_async_shared()
            var storer = Int(warp_id()) % 4 == 0 and lane_id() == 0
            if storer:
                bulk_wait_read()  # the last piece has left `staged`
            comptime if shares_ds[D]():
                # both boxes written, both pieces free
                sched_sync(CONSUMERS_BAR)
            else:
                warpgroup_sync(1 + Int(warp_id()) // 4)
            var dqt = dq_piece_wgmma[dtype, D](
                pair, sk_block.unsafe_offset(z), cw
            )
            dv = pv_wait[D, BQ](pf, dv)  # wait_group 0: all three products
            dk = pv_wait[D, BQ](dsf, dk)
            dqt = hold[32](dqt)
            stage_piece(dqt, scale, staged)
            fence_async_shared()
            warpgroup_sync(1 + Int(warp_id()) // 4)
            if storer:
                var col = cw if shares_ds[D]() else 0
                var at = (((j // per_head) * dq_rows + q0) * D) + col * PIECE
                bulk_reduce_add(dq.unsafe_offset(at), staged)
                bulk_commit()
        else:
            dv = pv_wait[D, BQ](pf, dv)  # wait_group 0: dK is done too
            dk = pv_wait[D, BQ](dsf, dk)
        if lane_id() == 0:
            _ = mbarrier_arrive(empty.unsafe_offset(s))
    comptime if FUSED == DQ_TILES:
        if Int(warp_id()) % 4 == 0 and lane_id() == 0:
            bulk_wait_all()  # the last piece is added before the block exits


# --8<-- [end:consume]
