# Day 018, version 2: intra-warpgroup overlap (FlashAttention-3's second trick). While
# the tensor cores compute O += P_{j-1} V_{j-1} and S_j = Q K_j^T, the warpgroup runs
# the softmax of S_j: each iteration issues both products, waits only for S_j
# (wait_group 1: groups retire in order), does the softmax, then waits for the P V
# product before rescaling O. P_{j-1} and O stay in registers the hardware still reads
# or writes across the softmax; `pv_wait` and `hold` keep the compiler off them.
#
# Version 3 is this loop with PINGPONG (FlashAttention-3's inter-warpgroup schedule):
# the two consumers take turns to issue their products, through two named barriers, so
# that one warpgroup's softmax always runs while the other's products keep the tensor
# cores busy, instead of both softmaxes landing at the same time.

from max.gpu.compute.mma import wgmma_wait_group_sync
from std.sys._assembly import inlined_assembly

from days.day014.gemm_v3_tma import mbar_wait, ring_slot
from days.day018.attention_common import (
    hold,
    mask_tile,
    needs_mask,
    online_softmax,
    p_fragments,
    pv_issue,
    pv_wait,
    release_s0,
    release_s1,
    rescale,
    s_wgmma,
    v_descs,
)


comptime SCHED_BAR = 1  # named barriers 1 .. NC (0 is the block barrier)


@always_inline
def sched_sync(id: Int):
    """Wait at named barrier `id` for 256 threads: this consumer and the one before it.
    """
    inlined_assembly["bar.sync $0, 256;", NoneType, constraints="r"](Int32(id))


@always_inline
def sched_arrive(id: Int):
    inlined_assembly["bar.arrive $0, 256;", NoneType, constraints="r"](
        Int32(id)
    )


@always_inline
def next_consumer[NC: Int](cw: Int) -> Int:
    """The consumer whose turn comes after cw's, in a ring (no `%`: on a signed 64-bit
    Int it is a dozen instructions, and the backward's dQ pass measured 2% slower at
    head_dim 128 with it)."""
    comptime if NC == 2:
        return 1 - cw
    else:
        return 0 if cw == NC - 1 else cw + 1


@always_inline
def wait_stage[
    STAGES: Int
](
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    j: Int,
):
    """Wait until both streams of the block's j-th streamed tile have landed."""
    var slot = ring_slot[STAGES](j)
    mbar_wait(bars.unsafe_offset(1 + slot[0]), slot[1])
    mbar_wait(bars.unsafe_offset(1 + STAGES + slot[0]), slot[1])


@always_inline
def pass_tiles[
    STAGES: Int,
    PINGPONG: Bool,
    NC: Int,
    SPLIT: Bool,
    BAR: Int = SCHED_BAR,
    TURNS: Int = 1,
](
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    cw: Int,
    it0: Int,
    n: Int,
    open_turns: Bool,
):
    """Consumer cw's part in the block's streamed tiles it0 .. it0 + n - 1, which its
    rows do not need: it takes its turns (PINGPONG), so that the others' stay in order,
    and frees each tile once it has landed; a release before that could count toward
    the stage's previous phase. open_turns: as `consume_v2`'s, when that did not run.
    BAR: the first of the NC turn barriers (the backward's are TURN_BAR's); TURNS: turns
    a tile (the backward's loops that do not overlap take two).
    """
    var mine = BAR + cw
    var other = BAR + next_consumer[NC](cw)
    comptime if PINGPONG:
        if open_turns and cw == NC - 1:
            sched_arrive(other)
    for j in range(n):
        wait_stage[STAGES](bars, it0 + j)
        comptime if PINGPONG:
            comptime for _ in range(TURNS):
                sched_sync(mine)
                sched_arrive(other)
        var s = ring_slot[STAGES](it0 + j)[0]
        release_s0[STAGES, SPLIT](bars, s)
        release_s1[STAGES, SPLIT](bars, s)


# --8<-- [start:consume]
@always_inline
def consume_v2[
    dtype: DType,
    D: Int,
    BN: Int,
    STAGES: Int,
    CAUSAL: Bool,
    PINGPONG: Bool,
    NC: Int,
    SPLIT: Bool,
](
    sq: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    skv: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    n_tiles: Int,
    row0: Int,
    my_row: Int,
    Lk: Int,
    scale_log2: Float32,
    mut o: SIMD[DType.float32, D // 2],
    mut m: SIMD[DType.float32, 2],
    mut l: SIMD[DType.float32, 2],
    cw: Int,
    it0: Int = 0,
    open_turns: Bool = True,
):
    """cw: this consumer (of NC); with PINGPONG the consumers issue in turn, 0 first:
    each waits at its own barrier and then opens the next one's. it0: the block's
    streamed tiles before this work tile (a persistent block's stages and phases go
    on). open_turns: the last consumer opens consumer 0's first turn (once a block:
    after that, its last turn of a work tile opens the next tile's first)."""
    var mine = SCHED_BAR + cw
    var other = SCHED_BAR + next_consumer[NC](cw)
    comptime if PINGPONG:
        if open_turns and cw == NC - 1:
            sched_arrive(other)
    var full_k = bars.unsafe_offset(1)
    var full_v = bars.unsafe_offset(1 + STAGES)
    # tile 0: S alone, softmax (O is 0: nothing to rescale)
    var first = ring_slot[STAGES](it0)
    mbar_wait(full_k.unsafe_offset(first[0]), first[1])
    comptime if PINGPONG:
        sched_sync(mine)
    var sc = s_wgmma[dtype, D, BN](sq, skv.unsafe_offset(first[0] * 2 * BN * D))
    comptime if PINGPONG:
        sched_arrive(other)
    wgmma_wait_group_sync[0]()
    release_s0[STAGES, SPLIT](bars, first[0])
    sc = hold(sc)
    if needs_mask[BN, CAUSAL](0, row0, Lk):
        mask_tile[BN, CAUSAL](sc, my_row, 0, Lk)
    _ = online_softmax[BN](sc, m, l, scale_log2)
    var p = p_fragments[dtype, BN](sc)
    for j in range(1, n_tiles):
        var g = it0 + j
        var before = ring_slot[STAGES](g - 1)
        var now = ring_slot[STAGES](g)
        var prev = before[0]
        var s = now[0]
        var sk = skv.unsafe_offset(s * 2 * BN * D)
        mbar_wait(full_k.unsafe_offset(s), now[1])
        mbar_wait(full_v.unsafe_offset(prev), before[1])
        comptime if PINGPONG:
            sched_sync(mine)
        sc = s_wgmma[dtype, D, BN](sq, sk)
        var sv_prev = skv.unsafe_offset(prev * 2 * BN * D + BN * D)
        o = pv_issue[dtype, D, BN](p, v_descs[dtype, D, BN](sv_prev), o)
        comptime if PINGPONG:
            sched_arrive(other)
        wgmma_wait_group_sync[1]()  # S_j is done; P_{j-1} V_{j-1} may still run
        release_s0[STAGES, SPLIT](bars, s)
        sc = hold(sc)
        if needs_mask[BN, CAUSAL](j * BN, row0, Lk):
            mask_tile[BN, CAUSAL](sc, my_row, j * BN, Lk)
        var alpha = online_softmax[BN](sc, m, l, scale_log2)
        o = pv_wait[D, BN](p, o)
        rescale[D](o, alpha)
        release_s1[STAGES, SPLIT](bars, prev)
        p = p_fragments[dtype, BN](sc)
    var end = ring_slot[STAGES](it0 + n_tiles - 1)
    var last = end[0]
    mbar_wait(full_v.unsafe_offset(last), end[1])
    var sv_last = skv.unsafe_offset(last * 2 * BN * D + BN * D)
    o = pv_issue[dtype, D, BN](p, v_descs[dtype, D, BN](sv_last), o)
    o = pv_wait[D, BN](p, o)
    release_s1[STAGES, SPLIT](bars, last)


# --8<-- [end:consume]
