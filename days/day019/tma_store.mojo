# Day 019, part 10: the epilogue through shared memory and TMA stores.
#
# Why: in the cooperative schedule both consumers write their tile from registers
# (day 014's wg_store_acc) while the tensor cores wait. The stores themselves are
# fire-and-forget, but a tile is 64 KB (twice that with GELU's saved input), and the
# warps issue the next tile's wgmma only after every store, at the rate the memory
# system takes them. Here a consumer writes each 64 x 64 piece of its tile into a
# shared-memory box laid out the way TMA reads it (128-byte swizzle), and one thread
# hands the box to the TMA unit (cp.async.bulk.tensor ... global.shared::cta), which
# writes it to global memory while the warps go on to the next piece and the next
# tile's k-loop.
#
# Two boxes per consumer take turns: piece i goes to box i % 2, which piece i - 2 used.
# Before the warpgroup barrier that publishes piece i, the storing thread waits until
# every store it issued has been *read* out of shared memory (wait_group.read 0: piece
# i - 1's), so that after the barrier box (i + 1) % 2 is free for the next piece.
# Bulk groups belong to the thread that committed them, so one thread per consumer
# issues every store and does every wait.

from max.gpu import lane_id, warp_id
from max.gpu.host.nvidia.tma import TMADescriptor
from std.sys._assembly import inlined_assembly

from days.day014.gemm_common import (
    epilogue_pair,
    load_c_pairs,
    scaled_with_bias,
    _packed,
)

comptime STORE_BOX = 64  # a box is STORE_BOX x STORE_BOX elements: 128 bytes a row
comptime STORE_BOX_ELEMS = STORE_BOX * STORE_BOX
comptime STORE_BOXES = 2  # per consumer, taking turns


@always_inline
def tma_store_box[
    dtype: DType
](
    tma_map: OpaquePointer[mut=False, _],
    src: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    c0: Int,
    c1: Int,
    c2: Int,
):
    """Copy one box from shared memory to global memory at (c0, c1, c2), innermost
    first; the parts of the box outside the tensor are not written."""
    inlined_assembly[
        (
            "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group"
            " [$0, {$2, $3, $4}], [$1];"
        ),
        NoneType,
        constraints="l,r,r,r,r",
    ](tma_map, Int32(Int(src)), Int32(c0), Int32(c1), Int32(c2))


@always_inline
def bulk_commit():
    """Close this thread's bulk async-group (the stores issued since the last one).
    """
    inlined_assembly["cp.async.bulk.commit_group;", NoneType, constraints=""]()


@always_inline
def bulk_wait_read():
    """Wait until every bulk store this thread committed has read its shared memory.
    """
    inlined_assembly[
        "cp.async.bulk.wait_group.read 0;", NoneType, constraints=""
    ]()


@always_inline
def bulk_wait_all():
    """Wait until every bulk store this thread committed is complete (before exit).
    """
    inlined_assembly["cp.async.bulk.wait_group 0;", NoneType, constraints=""]()


@always_inline
def fence_async_shared():
    """Order this thread's generic shared-memory writes before the async proxy's
    (TMA's) reads of them."""
    inlined_assembly[
        "fence.proxy.async.shared::cta;", NoneType, constraints=""
    ]()


@always_inline
def warpgroup_sync(bar_id: Int):
    """A named barrier over the 128 threads of one warpgroup."""
    inlined_assembly["bar.sync $0, 128;", NoneType, constraints="r"](
        Int32(bar_id)
    )


# --8<-- [start:publish]
@always_inline
def publish_box[
    dtype: DType
](
    tma_map: OpaquePointer[mut=False, _],
    box: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    col: Int,
    row: Int,
    bt: Int,
    storer: Bool,
    bar_id: Int,
):
    """Hand the box every thread of the warpgroup just wrote to the TMA unit. After the
    barrier the other box is free again (see the top of the file)."""
    fence_async_shared()
    if storer:
        bulk_wait_read()
    warpgroup_sync(bar_id)
    if storer:
        tma_store_box[dtype](tma_map, box, col, row, bt)
        bulk_commit()


@always_inline
def write_box_pairs[
    dtype: DType
](
    box: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    pairs: SIMD[DType.uint32, 16],
):
    """Write a lane's 16 packed pairs of one 64 x 64 piece (pair 8 half + jc: row
    16 warp + g + 8 half, columns 8 jc + 2 t, + 1) into the box, 128-byte swizzled:
    the 16-byte chunk jc of row r sits at chunk jc ^ (r % 8), and r % 8 = g. A warp's
    4-byte store covers 8 rows x 4 words of 8 different chunks: 32 banks, no conflict.
    """
    var g = lane_id() // 4
    var t = lane_id() % 4
    var base = Int32(Int(box)) + Int32(((warp_id() % 4) * 16 + g) * 128 + t * 4)
    comptime for half in range(2):
        comptime for jc in range(8):
            var addr = base + Int32(half * 8 * 128 + ((jc ^ g) * 16))
            inlined_assembly[
                "st.shared.u32 [$0], $1;", NoneType, constraints="r,r"
            ](addr, pairs[half * 8 + jc])


# --8<-- [end:publish]


# --8<-- [start:smem_epilogue]
@always_inline
def wg_store_acc_tma[
    dtype: DType,
    BN: Int,
    BIAS: Bool,
    GELU: Bool,
    GELU_GRAD: Bool,
](
    acc: SIMD[DType.float32, BN // 2],
    boxes: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    out_map: OpaquePointer[mut=False, _],
    aux_map: OpaquePointer[mut=False, _],
    c_t: Pointer[Scalar[dtype], MutAnyOrigin],
    alpha: Float32,
    beta: Float32,
    row0: Int,
    n0: Int,
    bt: Int,
    M: Int,
    N: Int,
    c_rs: Int,
    c_cs: Int,
    bias: Pointer[Scalar[dtype], MutAnyOrigin],
    aux: Int,
    mut piece: Int,
    storer: Bool,
    bar_id: Int,
):
    """wg_store_acc's epilogue (the same values: alpha, bias, GELU and aux, beta c or
    GELU_GRAD's * c) for one warpgroup's 64 x BN accumulator at (row0, n0) of matrix
    `bt`, stored by TMA through this consumer's STORE_BOXES boxes at `boxes`, 64 x 64
    at a time. `piece` counts the boxes this consumer has published (it picks the box);
    `storer` is one thread of the warpgroup, the same every call; `bar_id` a named
    barrier of the warpgroup's own. Every thread of the warpgroup calls it.

    Rows past M and columns past N are written to the box but never to memory (TMA
    clips the box), so unlike wg_store_acc no store needs a condition; N % 8 == 0 for
    the tensor maps' row pitch."""
    comptime assert BN % STORE_BOX == 0, "whole 64-column boxes"
    comptime assert not (
        GELU_GRAD and (BIAS or GELU)
    ), "GELU_GRAD is an epilogue of its own"
    var g = lane_id() // 4
    var wrow = row0 + (warp_id() % 4) * 16 + g
    var out = scaled_with_bias[dtype, BN, BIAS](acc, alpha, bias, n0, N)
    var with_c = beta != 0
    comptime for h in range(BN // STORE_BOX):
        comptime J0 = h * (STORE_BOX // 8)  # the box's first column block
        var res = SIMD[DType.uint32, 16]()
        # GELU's input (or derivative), for aux
        var pre = SIMD[DType.uint32, 16]()
        comptime for half in range(2):
            var cq = load_c_pairs[dtype, 8, GELU_GRAD](
                c_t,
                wrow + half * 8,
                n0 + h * STORE_BOX,
                M,
                N,
                c_rs,
                c_cs,
                with_c,
            )
            comptime for jc in range(8):
                comptime j = J0 + jc
                var kept = UInt32(0)
                var v = epilogue_pair[dtype, GELU, GELU_GRAD](
                    out.slice[2, offset=4 * j + 2 * half](),
                    cq[jc],
                    beta,
                    with_c,
                    aux,
                    kept,
                )
                res[half * 8 + jc] = _packed[dtype](v)
                pre[half * 8 + jc] = kept
        var box = boxes.unsafe_offset((piece % STORE_BOXES) * STORE_BOX_ELEMS)
        write_box_pairs[dtype](box, res)
        publish_box[dtype](
            out_map, box, n0 + h * STORE_BOX, row0, bt, storer, bar_id
        )
        piece += 1
        comptime if GELU:
            if aux != 0:  # a kernel argument: the same in every lane
                box = boxes.unsafe_offset(
                    (piece % STORE_BOXES) * STORE_BOX_ELEMS
                )
                write_box_pairs[dtype](box, pre)
                publish_box[dtype](
                    aux_map, box, n0 + h * STORE_BOX, row0, bt, storer, bar_id
                )
                piece += 1


# --8<-- [end:smem_epilogue]
