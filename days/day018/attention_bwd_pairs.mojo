# Day 018's dK/dV pass: each query tile's (lse2, delta) pairs through shared memory.
#
# The pass needs lse2 and delta of the 64 queries of every streamed tile. Each consumer
# thread used to load its 32 of them from global memory before the tile's first wait
# and keep them in registers across it. Here a second producer thread (warp 1 of the
# producer warpgroup) copies the tile's 64 pairs (512 bytes) into the stage with one
# bulk copy, on a barrier of its own, and the consumers read them from shared memory
# when they need them. The pairs live in a (batch, q heads, ceil(Lq / 64) 64, 2)
# float32 buffer that the dQ pass (or `attention_delta_kernel`) writes, padded with
# (+inf, 0) past Lq, so the copy is whole and 16-byte aligned.

from max.gpu.sync import mbarrier_arrive_expect_tx_shared
from std.sys._assembly import inlined_assembly

from days.day014.gemm_v3_tma import mbar_wait, ring_slot

comptime PAIR_FLOATS = 2 * 64  # one tile's pairs


@always_inline
def bulk_load(
    dst: Pointer[
        Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    src: Pointer[Float32, MutAnyOrigin],
    bytes: Int,
    bar: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
):
    """A plain (not tensor) bulk copy global -> shared, completing on `bar`."""
    inlined_assembly[
        (
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [$0], [$1], $2, [$3];"
        ),
        NoneType,
        constraints="r,l,r,r,~{memory}",
    ](Int32(Int(dst)), src, Int32(bytes), Int32(Int(bar)))


@always_inline
def produce_pairs[
    STAGES: Int
](
    slots: Pointer[
        Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    pairs: Pointer[Float32, MutAnyOrigin],
    n_tiles: Int,
    per_head: Int,
    s_start: Int,
    lq_pad: Int,
):
    """Tile j's pairs into slot j % STAGES once the consumers have released the stage;
    `pairs` points at the group's first query head; barriers full_2 follow empty.
    """
    var empty = bars.unsafe_offset(1 + 2 * STAGES)
    var full2 = bars.unsafe_offset(1 + 3 * STAGES)
    for j in range(n_tiles):
        var s = ring_slot[STAGES](j)[0]
        if j >= STAGES:
            mbar_wait(empty.unsafe_offset(s), ring_slot[STAGES](j - STAGES)[1])
        var row = (j // per_head) * lq_pad + s_start + (j % per_head) * 64
        mbarrier_arrive_expect_tx_shared(
            full2.unsafe_offset(s), Int32(PAIR_FLOATS * 4)
        )
        bulk_load(
            slots.unsafe_offset(s * PAIR_FLOATS),
            pairs.unsafe_offset(row * 2),
            PAIR_FLOATS * 4,
            full2.unsafe_offset(s),
        )
