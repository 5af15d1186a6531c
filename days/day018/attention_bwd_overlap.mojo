# Day 018, backward version 5: each pass overlaps its last product of tile j - 1 with its
# own elementwise step of tile j (FlashAttention-3's intra-warpgroup overlap, as the
# forward's version 2 does with P V). Per tile j, in one turn (the consumers take turns):
#   issue tile j's score-shaped pair (S, dP or S^T, dP^T), then tile j - 1's last
#   product(s) (dQ += dS K, or dV += P^T dO and dK += dS^T Q) from the fragments kept
#   in registers;
#   wait for the pair only (wgmma groups retire in order), and build tile j's fragments
#   while the tensor cores run tile j - 1's products;
#   wait for those (`pv_wait` holds their registers), and free tile j - 1's stage.
# The fragments of tile j - 1 stay live across tile j's elementwise step: 16 registers
# more in the dQ pass, 32 in the dK/dV pass (which therefore runs it at head_dim 64
# only: at 128 its dK and dV take 128 registers already).

from max.gpu import lane_id
from max.gpu.compute.mma import wgmma_wait_group_sync
from max.gpu.sync import mbarrier_arrive

from days.day014.gemm_v3_tma import mbar_wait, ring_slot
from days.day018.attention_bwd_dkdv import (
    BQ,
    ds_t_fragments,
    load_columns,
    p_t_fragments,
)
from days.day018.attention_bwd_dq import (
    BK,
    ds_fragments,
    open_turns,
    pass_turn,
    take_turn,
)
from days.day018.attention_common import (
    hold,
    pv_issue,
    pv_wait,
    s_wgmma,
    v_descs,
)


@always_inline
def wait_stage[
    STAGES: Int
](
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    j: Int,
):
    """Wait until both streamed tiles of the j-th stage have landed."""
    var slot = ring_slot[STAGES](j)
    mbar_wait(bars.unsafe_offset(1 + slot[0]), slot[1])
    mbar_wait(bars.unsafe_offset(1 + STAGES + slot[0]), slot[1])


@always_inline
def free_stage[
    STAGES: Int
](
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    j: Int,
):
    if lane_id() == 0:
        _ = mbarrier_arrive(
            bars.unsafe_offset(1 + 2 * STAGES + ring_slot[STAGES](j)[0])
        )


# --8<-- [start:dq]
@always_inline
def consume_dq_overlapped[
    dtype: DType, D: Int, STAGES: Int, CAUSAL: Bool
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
    row0: Int,
    my_row: Int,
    Lk: Int,
    lse_r: SIMD[DType.float32, 2],
    delta_r: SIMD[DType.float32, 2],
    scale_log2: Float32,
    mut dq: SIMD[DType.float32, D // 2],
    cw: Int,
):
    """`consume_dq` with dQ += dS_{j-1} K_{j-1} running beside tile j's dS."""
    open_turns[True](cw)
    if n_tiles == 0:
        return
    var sk = stream
    wait_stage[STAGES](bars, 0)
    take_turn[True](cw)
    var sc = s_wgmma[dtype, D, BK](sq, sk)
    var dp = s_wgmma[dtype, D, BK](sdo, sk.unsafe_offset(BK * D))
    pass_turn[True](cw)
    wgmma_wait_group_sync[0]()
    var dsf = ds_fragments[dtype, BK, CAUSAL](
        sc, dp, lse_r, delta_r, scale_log2, row0, my_row, 0, Lk
    )
    for j in range(1, n_tiles):
        var sk_prev = sk
        sk = stream.unsafe_offset(ring_slot[STAGES](j)[0] * 2 * BK * D)
        wait_stage[STAGES](bars, j)
        take_turn[True](cw)
        sc = s_wgmma[dtype, D, BK](sq, sk)
        dp = s_wgmma[dtype, D, BK](sdo, sk.unsafe_offset(BK * D))
        dq = pv_issue[dtype, D, BK](dsf, v_descs[dtype, D, BK](sk_prev), dq)
        pass_turn[True](cw)
        wgmma_wait_group_sync[
            1
        ]()  # S and dP of tile j; dQ's product may run on
        var next = ds_fragments[dtype, BK, CAUSAL](
            sc, dp, lse_r, delta_r, scale_log2, row0, my_row, j * BK, Lk
        )
        dq = pv_wait[D, BK](dsf, dq)
        free_stage[STAGES](bars, j - 1)
        dsf = next
    take_turn[True](cw)
    dq = pv_issue[dtype, D, BK](dsf, v_descs[dtype, D, BK](sk), dq)
    pass_turn[True](cw)
    dq = pv_wait[D, BK](dsf, dq)
    free_stage[STAGES](bars, n_tiles - 1)


# --8<-- [end:dq]


# --8<-- [start:dkdv]
@always_inline
def consume_dkdv_overlapped[
    dtype: DType, D: Int, STAGES: Int, CAUSAL: Bool
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
    lse: Pointer[Float32, MutAnyOrigin],
    delta: Pointer[Float32, MutAnyOrigin],
    scale_log2: Float32,
    mut dk: SIMD[DType.float32, D // 2],
    mut dv: SIMD[DType.float32, D // 2],
    cw: Int,
):
    """`consume_dkdv` (not FUSED) with dV += P^T_{j-1} dO_{j-1} and dK += dS^T_{j-1}
    Q_{j-1} running beside tile j's P^T and dS^T."""
    comptime assert D == 64, "at head_dim 128 the kept fragments would spill"
    open_turns[True](cw)
    if n_tiles == 0:
        return
    var sq = stream
    var lc = SIMD[DType.float32, BQ // 4](Float32.MAX)
    var dl = SIMD[DType.float32, BQ // 4](0)
    load_columns[BQ // 4](lc, dl, lse, delta, 0, q_start, Lq)
    wait_stage[STAGES](bars, 0)
    take_turn[True](cw)
    var st = s_wgmma[dtype, D, BQ](sk, sq)
    var dpt = s_wgmma[dtype, D, BQ](sv, sq.unsafe_offset(BQ * D))
    pass_turn[True](cw)
    wgmma_wait_group_sync[0]()
    st = hold(st) * scale_log2
    dpt = hold(dpt)
    var pf = p_t_fragments[dtype, BQ, BQ // 4, CAUSAL](
        st, lc, key0, my_key, q_start
    )
    var dsf = ds_t_fragments[dtype, BQ, BQ // 4](st, dpt, dl)
    for j in range(1, n_tiles):
        var sq_prev = sq
        sq = stream.unsafe_offset(ring_slot[STAGES](j)[0] * 2 * BQ * D)
        var q0 = q_start + (j % per_head) * BQ
        lc = SIMD[DType.float32, BQ // 4](Float32.MAX)
        dl = SIMD[DType.float32, BQ // 4](0)
        load_columns[BQ // 4](lc, dl, lse, delta, (j // per_head) * Lq, q0, Lq)
        wait_stage[STAGES](bars, j)
        take_turn[True](cw)
        st = s_wgmma[dtype, D, BQ](sk, sq)
        dpt = s_wgmma[dtype, D, BQ](sv, sq.unsafe_offset(BQ * D))
        var sdo_prev = sq_prev.unsafe_offset(BQ * D)
        dv = pv_issue[dtype, D, BQ](pf, v_descs[dtype, D, BQ](sdo_prev), dv)
        dk = pv_issue[dtype, D, BQ](dsf, v_descs[dtype, D, BQ](sq_prev), dk)
        pass_turn[True](cw)
        wgmma_wait_group_sync[2]()  # S^T and dP^T of tile j; dV, dK may run on
        st = hold(st) * scale_log2
        dpt = hold(dpt)
        var pf_next = p_t_fragments[dtype, BQ, BQ // 4, CAUSAL](
            st, lc, key0, my_key, q0
        )
        var dsf_next = ds_t_fragments[dtype, BQ, BQ // 4](st, dpt, dl)
        dv = pv_wait[D, BQ](pf, dv)
        dk = pv_wait[D, BQ](dsf, dk)
        free_stage[STAGES](bars, j - 1)
        pf = pf_next
        dsf = dsf_next
    take_turn[True](cw)
    dv = pv_issue[dtype, D, BQ](
        pf, v_descs[dtype, D, BQ](sq.unsafe_offset(BQ * D)), dv
    )
    dk = pv_issue[dtype, D, BQ](dsf, v_descs[dtype, D, BQ](sq), dk)
    pass_turn[True](cw)
    dv = pv_wait[D, BQ](pf, dv)
    dk = pv_wait[D, BQ](dsf, dk)
    free_stage[STAGES](bars, n_tiles - 1)


# --8<-- [end:dkdv]
