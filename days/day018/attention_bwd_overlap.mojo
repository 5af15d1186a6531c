# Day 018, backward version 5: the dQ pass overlaps dQ += dS_{j-1} K_{j-1} with its own
# elementwise step of tile j (FlashAttention-3's intra-warpgroup overlap, as the forward's
# version 2 does with P V). Per tile j, in one turn (the consumers take turns):
#   issue tile j's S and dP, then dQ's product of tile j - 1 from the dS fragments kept in
#   registers;
#   wait for S and dP only (wgmma groups retire in order), and build tile j's dS while
#   the tensor cores run tile j - 1's product;
#   wait for it (`pv_wait` holds its registers), and free tile j - 1's stage.
# The kept fragments cost 16 registers. The dK/dV pass would keep 32 (P^T and dS^T) beside
# dK and dV: measured at head_dim 64 it spilled (62 LDL/STL in its loop) and ran 54-88%
# slower, and at 128 dK and dV alone take 128 registers. It does not overlap.

from max.gpu import lane_id
from max.gpu.compute.mma import wgmma_wait_group_sync
from max.gpu.sync import mbarrier_arrive

from days.day014.gemm_v3_tma import ring_slot
from days.day018.attention_bwd_dq import (
    BK,
    TURN_BAR,
    ds_fragments,
    open_turns,
    pass_turn,
    take_turn,
)
from days.day018.attention_common import (
    CONSUMERS,
    pv_issue,
    pv_wait,
    s_wgmma,
    v_descs,
)
from days.day018.attention_v2_overlap import pass_tiles, wait_stage


@always_inline
def free_stage[
    STAGES: Int
](
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    j: Int,
):
    """Free the block's j-th streamed tile: `release_s1[STAGES, False]` on its stage,
    written with the barrier's address in one offset. Through `release_s1` (two offsets)
    ptxas scheduled version 5's head_dim 128 dQ loop without the mask with 11 more
    uniform instructions (499 -> 510 in `sass_kloop.py`, 2026-11-29), so it stays.
    """
    if lane_id() == 0:
        _ = mbarrier_arrive(
            bars.unsafe_offset(1 + 2 * STAGES + ring_slot[STAGES](j)[0])
        )


# --8<-- [start:dq]
@always_inline
def consume_dq_overlapped[
    dtype: DType,
    D: Int,
    STAGES: Int,
    CAUSAL: Bool,
    NC: Int = CONSUMERS,
    PERSISTENT: Bool = False,
](
    sq: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    sdo: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    stream: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    n_tiles: Int,
    n_mine: Int,
    row0: Int,
    my_row: Int,
    Lk: Int,
    lse_r: SIMD[DType.float32, 2],
    delta_r: SIMD[DType.float32, 2],
    scale_log2: Float32,
    mut dq: SIMD[DType.float32, D // 2],
    cw: Int,
    it0: Int = 0,
    first: Bool = True,
):
    """`consume_dq` with dQ += dS_{j-1} K_{j-1} running beside tile j's dS, on this
    consumer's own tiles 0 <= j < n_mine (n_mine <= n_tiles: none past Lq, and with the
    mask none after its rows' diagonal); the block's later tiles it only passes
    (the forward's `pass_tiles`). Every consumer takes n_tiles + 1 turns.

    PERSISTENT (version 8): the block streams on across its work tiles, so tile j is
    its (it0 + j)-th, and only its first work tile opens the turns (`first`): the last
    consumer's last turn of a work tile opens consumer 0's first of the next. There the
    previous tile's stage is recomputed each iteration: carried over as a pointer, it
    landed in vector registers (8 `R2UR` in the loop; sass_kloop.py)."""
    if first:
        open_turns[True, NC](cw)
    if n_tiles == 0:
        return
    # rows past Lq: the last turn is the one its dQ product would take
    if n_mine == 0:
        pass_tiles[STAGES, True, NC, False, TURN_BAR](
            bars, cw, it0, n_tiles, False
        )
        take_turn[True](cw)
        pass_turn[True, NC](cw)
        return
    var sk = stream.unsafe_offset(
        ring_slot[STAGES](it0)[0] * 2 * BK * D if PERSISTENT else 0
    )
    wait_stage[STAGES](bars, it0)
    take_turn[True](cw)
    var sc = s_wgmma[dtype, D, BK](sq, sk)
    var dp = s_wgmma[dtype, D, BK](sdo, sk.unsafe_offset(BK * D))
    pass_turn[True, NC](cw)
    wgmma_wait_group_sync[0]()
    var dsf = ds_fragments[dtype, BK, CAUSAL](
        sc, dp, lse_r, delta_r, scale_log2, row0, my_row, 0, Lk
    )
    for j in range(1, n_mine):
        var sk_prev = sk
        comptime if PERSISTENT:
            sk_prev = stream.unsafe_offset(
                ring_slot[STAGES](it0 + j - 1)[0] * 2 * BK * D
            )
        sk = stream.unsafe_offset(ring_slot[STAGES](it0 + j)[0] * 2 * BK * D)
        wait_stage[STAGES](bars, it0 + j)
        take_turn[True](cw)
        sc = s_wgmma[dtype, D, BK](sq, sk)
        dp = s_wgmma[dtype, D, BK](sdo, sk.unsafe_offset(BK * D))
        dq = pv_issue[dtype, D, BK](dsf, v_descs[dtype, D, BK](sk_prev), dq)
        pass_turn[True, NC](cw)
        # S and dP of tile j are done; dQ's product of tile j - 1 may run on
        wgmma_wait_group_sync[1]()
        var next = ds_fragments[dtype, BK, CAUSAL](
            sc, dp, lse_r, delta_r, scale_log2, row0, my_row, j * BK, Lk
        )
        dq = pv_wait[D, BK](dsf, dq)
        free_stage[STAGES](bars, it0 + j - 1)
        dsf = next
    take_turn[True](cw)
    dq = pv_issue[dtype, D, BK](dsf, v_descs[dtype, D, BK](sk), dq)
    pass_turn[True, NC](cw)
    dq = pv_wait[D, BK](dsf, dq)
    free_stage[STAGES](bars, it0 + n_mine - 1)
    pass_tiles[STAGES, True, NC, False, TURN_BAR](
        bars, cw, it0 + n_mine, n_tiles - n_mine, False
    )


# --8<-- [end:dq]
