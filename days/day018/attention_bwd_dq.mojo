# Day 018, backward pass 2: dQ for one block of queries (64 per consumer warpgroup),
# walking the key tiles as the forward does. Per tile:
#   S  = Q K^T,  dP = dO V^T     two wgmma from shared memory, waited for together
#   dS = exp2(S * scale log2 e - lse2[row]) (dP - delta[row])
#   dQ += dS K                   wgmma, dS from registers (the forward's P V form)
# Before the loop each block computes delta = rowsum(dO * O) of its rows (`row_delta`)
# and stores it for the dK/dV pass, which runs after this one.

from max.gpu import lane_id, warp_id
from max.gpu.compute.mma import (
    wgmma_async,
    wgmma_commit_group_sync,
    wgmma_fence_aligned,
    wgmma_wait_group_sync,
)
from max.gpu.sync import mbarrier_arrive
from std.math import exp2
from std.sys._assembly import inlined_assembly

from days.day014.gemm_v3_tma import TMA_BK, mbar_wait, ring_slot, tma_desc
from days.day018.attention_v2_overlap import (
    next_consumer,
    pass_tiles,
    sched_arrive,
    sched_sync,
)
from days.day018.attention_common import (
    CONSUMERS,
    hold,
    needs_mask,
    quad_sum,
    p_fragments,
    pv_issue,
    pv_wait,
    s_wgmma,
    v_descs,
)

comptime BK = 64  # keys per streamed tile


# The backward's turns (TURNS, versions 3 to 5 and 7, both passes): the consumers take
# turns to issue each batch of products, so one warpgroup's elementwise step runs beside
# another's products (two consumers swap; version 7's three go round a ring: the forward's
# `next_consumer`). Named barriers 4 and 5 (version 2 uses 2, 3); with three consumers
# (version 7's passes) 4 to 6, which version 6's pass, another kernel, uses as
# CONSUMERS_BAR.
comptime TURN_BAR = 4


@always_inline
def open_turns[ON: Bool, NC: Int = CONSUMERS](cw: Int):
    """The last consumer opens consumer 0's first turn (its last arrive, at the end,
    meets no sync: harmless at block exit)."""
    comptime if ON:
        if cw == NC - 1:
            sched_arrive(TURN_BAR)


@always_inline
def take_turn[ON: Bool](cw: Int):
    comptime if ON:
        sched_sync(TURN_BAR + cw)


@always_inline
def pass_turn[ON: Bool, NC: Int = CONSUMERS](cw: Int):
    """Open the next consumer's turn: a ring over the NC consumers."""
    comptime if ON:
        sched_arrive(TURN_BAR + next_consumer[NC](cw))


# --8<-- [start:row_delta]
@always_inline
def row_delta[
    dtype: DType, D: Int
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    do: Pointer[Scalar[dtype], MutAnyOrigin],
    o_rs: Int,
    do_rs: Int,
    my_row: Int,
    Lq: Int,
) -> SIMD[DType.float32, 2]:
    """delta = rowsum(dO * O) in float32 for this thread's rows (my_row, my_row + 8),
    0 past Lq; o and do point at the head's row 0, rows o_rs / do_rs apart.

    The 4 threads of a quad hold the same two rows (the wgmma accumulator layout), so
    they split each row: thread t reads 16-byte chunks t, t + 4, ..., and two shuffles
    add the four parts. Torch's `(do.float() * out.float()).sum(-1)` took 4 kernels and
    four float32 copies of the whole tensor: ~10% of the backward at head_dim 128.
    """
    comptime CHUNKS = D // 8  # 16-byte chunks of a row
    var t = lane_id() % 4
    var out = SIMD[DType.float32, 2](0)
    comptime for half in range(2):
        var row = my_row + 8 * half
        var acc = SIMD[DType.float32, 8](0)
        if row < Lq:
            comptime for i in range(CHUNKS // 4):
                var col = (4 * i + t) * 8
                var x = o.unsafe_load[width=8, alignment=16](row * o_rs + col)
                var g = do.unsafe_load[width=8, alignment=16](row * do_rs + col)
                acc += x.cast[DType.float32]() * g.cast[DType.float32]()
        out[half] = quad_sum(acc.reduce_add())  # every lane: outside the `if`
    return out


# --8<-- [end:row_delta]


@always_inline
def grads_s[
    N: Int, //, CAUSAL: Bool, MASK: Bool
](
    mut sc: SIMD[DType.float32, N],
    dp: SIMD[DType.float32, N],
    lse_r: SIMD[DType.float32, 2],
    delta_r: SIMD[DType.float32, 2],
    my_row: Int,
    k0: Int,
    Lk: Int,
):
    """dS = P (dP - delta) in place, P = exp2(S scale log2 e - lse2[row]) (sc already
    scaled); MASK: P = 0 for keys past Lk and, causal, after the row."""
    var t = lane_id() % 4
    comptime for jj in range(N // 4):
        comptime for e in range(4):
            var i = 4 * jj + e
            var p = exp2(sc[i] - lse_r[e // 2])
            comptime if MASK:
                var key = k0 + 8 * jj + 2 * t + e % 2
                var masked = key >= Lk
                comptime if CAUSAL:
                    masked = masked or key > my_row + 8 * (e // 2)
                if masked:
                    p = 0
            sc[i] = p * (dp[i] - delta_r[e // 2])


@always_inline
def ds_fragments[
    N: Int, //, dtype: DType, BK: Int, CAUSAL: Bool
](
    sc: SIMD[DType.float32, N],
    dp: SIMD[DType.float32, N],
    lse_r: SIMD[DType.float32, 2],
    delta_r: SIMD[DType.float32, 2],
    scale_log2: Float32,
    row0: Int,
    my_row: Int,
    k0: Int,
    Lk: Int,
) -> SIMD[DType.uint32, BK // 4]:
    """From the waited S and dP of the key tile at k0: dS's register-A fragments for
    dQ += dS K."""
    var s = hold(sc) * scale_log2
    var d = hold(dp)
    # only a tile past Lk or at the diagonal is masked (a uniform branch)
    if needs_mask[BK, CAUSAL](k0, row0, Lk):
        grads_s[CAUSAL, True](s, d, lse_r, delta_r, my_row, k0, Lk)
    else:
        grads_s[CAUSAL, False](s, d, lse_r, delta_r, my_row, k0, Lk)
    return rebind[SIMD[DType.uint32, BK // 4]](
        p_fragments[dtype, BK](rebind[SIMD[DType.float32, BK // 2]](s))
    )


# --8<-- [start:consume]
@always_inline
def consume_dq[
    dtype: DType,
    D: Int,
    STAGES: Int,
    CAUSAL: Bool,
    TURNS: Bool = False,
    NC: Int = CONSUMERS,
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
):
    """row0: this consumer's first query; lse_r / delta_r: this thread's rows (g,
    g + 8), +inf / 0 past Lq; cw: this consumer (0 to NC - 1), whose turns TURNS
    takes as the dK/dV pass does. It multiplies its own key tiles 0 <= j < n_mine
    (none past Lq, and with the mask none after its rows' diagonal) and passes the
    block's later ones (the forward's `pass_tiles`)."""
    var full0 = bars.unsafe_offset(1)
    var full1 = bars.unsafe_offset(1 + STAGES)
    var empty = bars.unsafe_offset(1 + 2 * STAGES)
    open_turns[TURNS, NC](cw)
    for j in range(n_mine):
        var slot = ring_slot[STAGES](j)
        var s = slot[0]
        var phase = slot[1]
        var sk = stream.unsafe_offset(s * 2 * BK * D)
        var sv = sk.unsafe_offset(BK * D)
        var k0 = j * BK
        mbar_wait(full0.unsafe_offset(s), phase)
        comptime if TURNS:
            mbar_wait(full1.unsafe_offset(s), phase)
            take_turn[TURNS](cw)
        var sc = s_wgmma[dtype, D, BK](sq, sk)
        comptime if not TURNS:
            mbar_wait(full1.unsafe_offset(s), phase)
        var dp = s_wgmma[dtype, D, BK](sdo, sv)
        pass_turn[TURNS, NC](cw)
        wgmma_wait_group_sync[0]()
        var dsf = ds_fragments[dtype, BK, CAUSAL](
            sc, dp, lse_r, delta_r, scale_log2, row0, my_row, k0, Lk
        )
        take_turn[TURNS](cw)
        dq = pv_issue[dtype, D, BK](dsf, v_descs[dtype, D, BK](sk), dq)
        pass_turn[TURNS, NC](cw)
        dq = pv_wait[D, BK](dsf, dq)
        if lane_id() == 0:
            _ = mbarrier_arrive(empty.unsafe_offset(s))
    pass_tiles[STAGES, TURNS, NC, False, TURN_BAR, 2](
        bars, cw, n_mine, n_tiles - n_mine, False
    )


# --8<-- [end:consume]


# -- backward version 2: dQ inside the dK/dV pass (attention_bwd_dkdv.mojo, FUSED) ---------
# Each consumer adds its 64 keys' share of dQ for the query tile it just did,
#   dQ[q0:q0+64] += scale * dS K,   dS = (dS^T)^T: 64 queries x the consumer's 64 keys,
# into a float32 dQ in global memory (red.global.add: every key block adds to the same
# rows). wgmma reads A only from registers in the accumulator's row order (queries here,
# keys in dS^T) or from shared memory, so dS^T goes through a 64 x 64 shared box, stored
# as an mn-major A (rows = keys, 128 bytes of queries, 128-byte swizzle: what TMA would
# write), and K is the fixed tile as an mn-major B (keys x head_dim), as V is in P V.


@always_inline
def ds_store(
    dsf: SIMD[DType.uint32, 16],
    box: Pointer[UInt32, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
):
    """dS^T (bf16 pairs as `p_fragments` packs them: element 2 j + half holds row
    g + 8 half, columns 8 j + 2 t, + 1) into a 64 x 64 box: row r at 128 r bytes,
    16-byte chunk c at c ^ (r % 8). One warp store covers 8 rows, each in another
    chunk: all 32 banks once."""
    var g = lane_id() // 4
    var t = lane_id() % 4
    comptime for j in range(8):
        comptime for half in range(2):
            var r = (warp_id() % 4) * 16 + g + 8 * half  # r % 8 == g
            box[unsafe_offset=r * 32 + (j ^ g) * 4 + t] = dsf[2 * j + half]


@always_inline
def warpgroup_sync(id: Int):
    """Named barrier `id` for one warpgroup's 128 threads."""
    inlined_assembly["bar.sync $0, 128;", NoneType, constraints="r"](Int32(id))


@always_inline
def dq_wgmma[
    dtype: DType, D: Int
](
    ds_box: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    sk: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
) -> SIMD[DType.float32, D // 2]:
    """Issue dS K (64 queries x D; 4 k steps over the consumer's 64 keys; A and B both
    mn-major from shared memory) and commit it; the caller waits and `hold`s it.
    """
    var acc = SIMD[DType.float32, D // 2](0)
    wgmma_fence_aligned()
    comptime for ks in range(TMA_BK // 16):
        acc = wgmma_async[
            64,
            D,
            16,
            a_type=dtype,
            b_type=dtype,
            layout_a="col",
            layout_b="row",
        ](
            tma_desc[dtype, False](ds_box, 0, ks),
            tma_desc[dtype, False](sk, 0, ks),
            acc,
        )
    wgmma_commit_group_sync()
    return acc


@always_inline
def dq_red_add[
    D: Int
](
    acc: SIMD[DType.float32, D // 2],
    scale: Float32,
    dq: Pointer[Float32, MutAnyOrigin],
    row0: Int,
    rows: Int,
):
    """dq[row] += scale * acc for this thread's rows (row0 = the tile's first row,
    relative to `dq`, rows of D floats; rows at or past `rows` are skipped), two
    adjacent columns per `red.global.add.v2.f32`."""
    var g = lane_id() // 4
    var t = lane_id() % 4
    comptime for half in range(2):
        var row = row0 + (warp_id() % 4) * 16 + g + 8 * half
        if row < rows:
            var p = dq.unsafe_offset(row * D + 2 * t)
            comptime for j in range(D // 8):
                inlined_assembly[
                    "red.global.add.v2.f32 [$0], {$1, $2};",
                    NoneType,
                    constraints="l,f,f,~{memory}",
                ](
                    p.unsafe_offset(8 * j),
                    acc[4 * j + 2 * half] * scale,
                    acc[4 * j + 2 * half + 1] * scale,
                )
