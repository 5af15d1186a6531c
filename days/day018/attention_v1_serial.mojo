# Day 018, version 1: each consumer warpgroup runs its three steps one after another
# per kv tile: S = Q K^T (wgmma from shared memory, waited for), the online softmax in
# registers, O += P V (P from registers, waited for). Tensor cores sit idle while a
# warpgroup does its softmax unless the other consumer happens to be multiplying.

from max.gpu.compute.mma import wgmma_wait_group_sync

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


# --8<-- [start:consume]
@always_inline
def consume_v1[
    dtype: DType, D: Int, BN: Int, STAGES: Int, CAUSAL: Bool, SPLIT: Bool
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
):
    var full_k = bars.unsafe_offset(1)
    var full_v = bars.unsafe_offset(1 + STAGES)
    for j in range(n_tiles):
        var slot = ring_slot[STAGES](j)
        var s = slot[0]
        var phase = slot[1]
        var sk = skv.unsafe_offset(s * 2 * BN * D)
        mbar_wait(full_k.unsafe_offset(s), phase)
        var sc = s_wgmma[dtype, D, BN](sq, sk)
        wgmma_wait_group_sync[0]()
        release_s0[STAGES, SPLIT](bars, s)
        sc = hold(sc)
        if needs_mask[BN, CAUSAL](j * BN, row0, Lk):
            mask_tile[BN, CAUSAL](sc, my_row, j * BN, Lk)
        rescale[D](o, online_softmax[BN](sc, m, l, scale_log2))
        var p = p_fragments[dtype, BN](sc)
        mbar_wait(full_v.unsafe_offset(s), phase)
        o = pv_issue[dtype, D, BN](
            p, v_descs[dtype, D, BN](sk.unsafe_offset(BN * D)), o
        )
        o = pv_wait[D, BN](p, o)
        release_s1[STAGES, SPLIT](bars, s)


# --8<-- [end:consume]
