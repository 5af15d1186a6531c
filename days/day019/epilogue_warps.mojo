# Day 019, part 22: GELU on the producer warpgroup's idle warps (EPI_WARPS).
#
# Why: in the cooperative schedule the tensor cores wait while both consumers run the
# epilogue. For the MLP's first layer that epilogue is GELU: a tanh on the SFU and about
# ten other instructions per value, 32 K values a 256 x 128 tile. On the H200 the fused
# layer took ~15 us more than the plain GEMM under it (part 21), while three warps of
# the producer warpgroup sat idle: only one thread there issues the TMA loads.
#
# So here the consumers only write alpha * acc + bias, rounded to the output's dtype,
# into a shared-memory copy of the whole tile (64 x 64 boxes, 128-byte swizzled, as TMA
# reads them), arrive on the mbarrier `epi_full`, and go on to the next tile's k-loop.
# Warps 1-3 of the producer warpgroup then apply GELU to the tile in place, box by box,
# and one of their threads stores each box by TMA. The saved second output (the
# pre-activation, or GELU's derivative there) goes through one of two scratch boxes.
# When every store has read its box, that thread arrives on `epi_empty`, and the
# consumers may write the next tile.
#
# GELU now reads the pre-activation rounded to the output's dtype, as torch's
# F.gelu(F.linear(...)) does; the register epilogue read it in float32.

from std.sys import size_of
from std.sys._assembly import inlined_assembly

from days.day014.gemm_common import (
    _gelu_sigmoid,
    _packed,
    gelu_tanh_grad,
    scaled_with_bias,
)
from days.day019.tma_store import (
    STORE_BOX,
    STORE_BOX_ELEMS,
    bulk_commit,
    fence_async_shared,
    tma_store_box,
    write_box_pairs,
)

comptime EPI_THREADS = 96  # warps 1-3 of the producer warpgroup
comptime EPI_BAR = 3  # their named barrier (0 is the block's; the consumers' boxes use 1, 2)
comptime EPI_SCRATCH_BOXES = 2  # for the second output, taking turns


@always_inline
def epi_sync():
    """A named barrier over the three epilogue warps."""
    inlined_assembly["bar.sync $0, $1;", NoneType, constraints="r,r"](
        Int32(EPI_BAR), Int32(EPI_THREADS)
    )


@always_inline
def bulk_wait_read_but_one():
    """Wait until every bulk store this thread committed, except the newest group, has
    read its shared memory."""
    inlined_assembly[
        "cp.async.bulk.wait_group.read 1;", NoneType, constraints=""
    ]()


# --8<-- [start:stage]
@always_inline
def stage_row_block[
    dtype: DType, BN: Int, BIAS: Bool
](
    acc: SIMD[DType.float32, BN // 2],
    boxes: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    alpha: Float32,
    bias: Pointer[Scalar[dtype], MutAnyOrigin],
    n0: Int,
    N: Int,
):
    """A consumer's part of the hand-off: one m64 row block's alpha * acc + bias,
    rounded to dtype, into its BN / 64 boxes from `boxes` (tma_store.mojo's
    write_box_pairs layout). No barrier: the caller arrives on `epi_full` after all of
    its row blocks."""
    var out = scaled_with_bias[dtype, BN, BIAS](acc, alpha, bias, n0, N)
    comptime for h in range(BN // STORE_BOX):
        var pairs = SIMD[DType.uint32, 16]()
        comptime for half in range(2):
            comptime for jc in range(8):
                comptime j = h * (STORE_BOX // 8) + jc
                pairs[half * 8 + jc] = _packed[dtype](
                    out.slice[2, offset=4 * j + 2 * half]()
                )
        write_box_pairs[dtype](boxes.unsafe_offset(h * STORE_BOX_ELEMS), pairs)


# --8<-- [end:stage]


# --8<-- [start:gelu_tile]
@always_inline
def gelu_tile[
    dtype: DType, BM: Int, BN: Int
](
    tile_boxes: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    scratch: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    out_map: OpaquePointer[mut=False, _],
    aux_map: OpaquePointer[mut=False, _],
    row0: Int,
    n0: Int,
    bt: Int,
    aux: Int,
    etid: Int,
):
    """The epilogue warps' part: GELU over one staged BM x BN tile, in place, box by box;
    thread `etid` == 0 stores each box by TMA (out_map at (n0 + 64 h, row0 + 64 r, bt))
    and, with aux (1: the pre-activation, 2: GELU's derivative), the second output from
    a scratch box through aux_map. On return every store is issued; the caller's thread
    0 waits for their reads before it hands the tile back."""
    comptime BOXES_N = BN // STORE_BOX
    comptime CHUNK = 16 // size_of[dtype]()  # values per 16-byte chunk
    comptime CHUNKS = STORE_BOX_ELEMS // CHUNK
    var storer = etid == 0
    for b in range((BM // STORE_BOX) * BOXES_N):
        var box = tile_boxes.unsafe_offset(b * STORE_BOX_ELEMS)
        var sbox = scratch.unsafe_offset(
            (b % EPI_SCRATCH_BOXES) * STORE_BOX_ELEMS
        )
        if aux != 0 and b >= EPI_SCRATCH_BOXES:
            # box b - 2's stores (one group) have read this scratch box
            if storer:
                bulk_wait_read_but_one()
            epi_sync()
        for c in range(etid, CHUNKS, EPI_THREADS):
            var x = box.unsafe_load[width=CHUNK, alignment=16](c * CHUNK).cast[
                DType.float32
            ]()
            var s = _gelu_sigmoid(x)
            box.unsafe_store[alignment=16](c * CHUNK, (x * s).cast[dtype]())
            if aux == 2:  # a kernel argument: the same in every thread
                sbox.unsafe_store[alignment=16](
                    c * CHUNK, gelu_tanh_grad(x, s).cast[dtype]()
                )
            elif aux != 0:
                sbox.unsafe_store[alignment=16](c * CHUNK, x.cast[dtype]())
        fence_async_shared()  # the generic writes, before TMA reads them
        epi_sync()
        if storer:
            var col = n0 + (b % BOXES_N) * STORE_BOX
            var row = row0 + (b // BOXES_N) * STORE_BOX
            tma_store_box[dtype](out_map, box, col, row, bt)
            if aux != 0:
                tma_store_box[dtype](aux_map, sbox, col, row, bt)
            bulk_commit()


# --8<-- [end:gelu_tile]
