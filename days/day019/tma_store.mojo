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
from max.gpu.primitives import warp
from std.sys._assembly import inlined_assembly

from days.day014.gemm_common import (
    epilogue_pair,
    load_c_blocks,
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


# --8<-- [start:column_sums]
# A bias's gradient is the column sum of the gradient a layer's output gets. In the MLP's
# backward that gradient is GELU_GRAD's output, dH = (dY W2) * GELU'; summed by its own
# kernel it was read again from memory, 32 MB at 4096 x 4096 (cuBLAS's g^T 1: 14.8 us of
# day 016's step). Here the epilogue adds up the values it already holds. Each lane
# sums its two rows (g, g + 8) of a box's 8 column pairs; `reduce_scatter_rows` then sums
# over the warp's 16 rows and leaves one column pair a lane; the pairs add up over the
# consumer's row blocks in registers, and each warp stores one row of float32 partial
# sums. Day 013's sum_partials_kernel adds those rows up, always in the same order.
@always_inline
def reduce_scatter_rows(v: SIMD[DType.float32, 16]) -> SIMD[DType.float32, 2]:
    """Sum 8 column pairs (pair jc at v[2 jc], v[2 jc + 1]) over the 8 lanes g = lane
    // 4 that hold the same columns (the same t), leaving lane g with pair jc = g. Stage
    b swaps half of what a lane still holds with the lane 4 * 2^b away: where bit b of
    g is set, a lane keeps the pairs with bit b of jc set, and stores its sum where the
    pair with that bit clear was. 14 shuffles, not the 48 of three full butterflies.
    Every lane of the warp must take part."""
    var g = lane_id() // 4
    var s = v
    comptime for b in range(3):
        comptime m = 1 << b
        var hi = (g >> b) & 1 == 1
        comptime for e0 in range(
            0, 8, 2 * m
        ):  # the pairs still held: bits < b clear
            comptime e1 = e0 + m
            comptime for f in range(2):
                var send = s[2 * e0 + f] if hi else s[2 * e1 + f]
                var keep = s[2 * e1 + f] if hi else s[2 * e0 + f]
                s[2 * e0 + f] = keep + warp.shuffle_xor(send, UInt32(4 * m))
    return s.slice[2, offset=0]()


@always_inline
def store_column_sums[
    BN: Int
](
    partials: Pointer[Float32, MutAnyOrigin],
    col_sums: SIMD[DType.float32, BN // 32],
    prow: Int,
    n0: Int,
    N: Int,
):
    """Store a warp's column sums of its BN columns from n0 (pair h of a lane: box h,
    columns 8 g + 2 t, + 1) as row `prow` of the (parts, N) float32 `partials`: 256
    contiguous bytes a box. N % 8 == 0, so a pair is all in or all out."""
    var g = lane_id() // 4
    var t = lane_id() % 4
    comptime for h in range(BN // STORE_BOX):
        var col = n0 + h * STORE_BOX + 8 * g + 2 * t
        if col < N:
            partials.unsafe_store[alignment=8](
                prow * N + col, col_sums.slice[2, offset=2 * h]()
            )


# --8<-- [end:column_sums]


# --8<-- [start:smem_epilogue]
@always_inline
def wg_store_acc_tma[
    dtype: DType,
    BN: Int,
    BIAS: Bool,
    GELU: Bool,
    GELU_GRAD: Bool,
    C_BLOCKS: Bool = False,
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
    mut col_sums: SIMD[DType.float32, BN // 32],
):
    """wg_store_acc's epilogue (the same values: alpha, bias, GELU and aux, beta c or
    GELU_GRAD's * c; C_BLOCKS as there) for one warpgroup's 64 x BN accumulator at
    (row0, n0) of matrix `bt`, stored by TMA through this consumer's STORE_BOXES boxes
    at `boxes`, 64 x 64 at a time. `piece` counts the boxes this consumer has published
    (it picks the box); `storer` is one thread of the warpgroup, the same every call;
    `bar_id` a named barrier of the warpgroup's own. Every thread of the warpgroup
    calls it.

    GELU_GRAD with `aux` != 0 also adds the column sums of the warp's 16 rows of out
    (rows below M; float32, before rounding) to `col_sums`, a pair per 64-column box
    (reduce_scatter_rows' layout), for store_column_sums.

    Rows past M and columns past N are written to the box but never to memory (TMA
    clips the box), so unlike wg_store_acc no store needs a condition; N % 8 == 0 for
    the tensor maps' row pitch."""
    comptime assert BN % STORE_BOX == 0, "whole 64-column boxes"
    comptime assert not (
        GELU_GRAD and (BIAS or GELU)
    ), "GELU_GRAD is an epilogue of its own"
    var g = lane_id() // 4
    var wrow = row0 + (warp_id() % 4) * 16 + g

    # beta == 0 (a plain product) compiles without c: a per-pair `if beta != 0`
    # still unpacked c's zeros and kept the selects, about a fifth of the epilogue's
    # instructions, run by one warp per SM sub-partition after the last k-step
    # (day 019, part 29)
    @always_inline
    @__parameter
    def epilogue[WITH_C: Bool]():
        var out = scaled_with_bias[dtype, BN, BIAS](acc, alpha, bias, n0, N)
        var with_c = WITH_C and beta != 0
        # C_BLOCKS: every box's c first, so that one wait covers them all (loads issued
        # between the boxes' stores made a trip to memory per box and half)
        var c_all = SIMD[DType.uint32, BN // 4]()
        comptime if C_BLOCKS:
            if with_c:  # beta: the same in every lane
                comptime for h in range(BN // STORE_BOX):
                    comptime for half in range(2):
                        c_all = c_all.insert[offset=(2 * h + half) * 8](
                            load_c_blocks[dtype, 8](
                                c_t,
                                wrow + half * 8,
                                n0 + h * STORE_BOX,
                                M,
                                N,
                                c_rs,
                            )
                        )
        comptime for h in range(BN // STORE_BOX):
            comptime J0 = h * (STORE_BOX // 8)  # the box's first column block
            var res = SIMD[DType.uint32, 16]()
            # GELU's input (or derivative), for aux
            var pre = SIMD[DType.uint32, 16]()
            var cs = SIMD[
                DType.float32, 16
            ]()  # GELU_GRAD: its column sums, by pair
            comptime for half in range(2):
                var row_in = wrow + half * 8 < M
                var cq: SIMD[DType.uint32, 8]
                comptime if C_BLOCKS:  # c in 16-byte blocks (gemm_common's load_c_blocks)
                    cq = c_all.slice[8, offset=(2 * h + half) * 8]()
                else:
                    cq = load_c_pairs[dtype, 8, GELU_GRAD](
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
                    comptime if GELU_GRAD:
                        cs[2 * jc] += v[0] if row_in else 0
                        cs[2 * jc + 1] += v[1] if row_in else 0
            comptime if GELU_GRAD:
                if aux != 0:  # a kernel argument: the same in every lane
                    col_sums = col_sums.insert[offset=2 * h](
                        col_sums.slice[2, offset=2 * h]()
                        + reduce_scatter_rows(cs)
                    )
            var box = boxes.unsafe_offset(
                (piece % STORE_BOXES) * STORE_BOX_ELEMS
            )
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
                        aux_map,
                        box,
                        n0 + h * STORE_BOX,
                        row0,
                        bt,
                        storer,
                        bar_id,
                    )
                    piece += 1

    # the fused epilogues keep one body that tests beta per pair: two bodies of theirs
    # spilled (GELU's: 1072 local loads and stores, the training MLP's forward)
    comptime if BIAS or GELU or GELU_GRAD:
        epilogue[True]()
    else:
        if beta != 0:  # a kernel argument: the same in every lane
            epilogue[True]()
        else:
            epilogue[False]()


# --8<-- [end:smem_epilogue]
