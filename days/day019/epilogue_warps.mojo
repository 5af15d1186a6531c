# Day 019, part 22: GELU on the producer warpgroup's idle warps (EPI_WARPS).
#
# Why: in the cooperative schedule the tensor cores wait while both consumers run the
# epilogue. For the MLP's first layer that epilogue is GELU: a tanh on the SFU and about
# ten other instructions per value, 32 K values a 256 x 128 tile. On the H200 the fused
# layer took ~10 us more than the plain layer under it, while three warps of the
# producer warpgroup sat idle: only one thread there issues the TMA loads.
#
# So here the consumers only write alpha * acc + bias, rounded to the output's dtype,
# into a shared-memory copy of the whole tile (64 x 64 boxes, 128-byte swizzled: tma_store
# .mojo's write_box_pairs), arrive on the mbarrier `epi_full`, and go on to the next
# tile's k-loop. Warps 1-3 of the producer warpgroup then read the copy 16 bytes at a
# time, apply GELU, and store the output (and the saved second output: the
# pre-activation, or GELU's derivative there) to global memory, 16 bytes a store. When
# every thread has read its last chunk it arrives on `epi_empty`, and the consumers may
# write the next tile.
#
# GELU now reads the pre-activation rounded to the output's dtype, as torch's
# F.gelu(F.linear(...)) does; the register epilogue read it in float32.
#
# Part 23 gives the MLP's backward product the same hand-off (gelu_grad_tile): the
# consumers stage dH = dY W2, rounded, and the warps multiply it by GELU's derivative,
# saved by the forward (AUTO's form), or computed here from the pre-activation the
# forward saved instead. The latter is what torch's composition (a GEMM, then
# gelu_backward) computes; it measured slower, and only gelu_on_epilogue_warps asks
# for it.

from std.sys import size_of

from days.day014.gemm_common import (
    _gelu_sigmoid,
    _packed,
    gelu_tanh_grad,
    scaled_with_bias,
    tanh_approx,
)
from days.day019.tma_store import STORE_BOX, STORE_BOX_ELEMS, write_box_pairs

comptime EPI_THREADS = 96  # warps 1-3 of the producer warpgroup
# setmaxnreg with epilogue warps: 16 more registers for the producer warpgroup (its GELU
# loop spilled its addresses at 40), 8 fewer for the consumers, who no longer run GELU.
# The pool is the launch's 168 x 384: 128 x (168 - 56) = 256 x (224 - 168).
comptime EPI_PRODUCER_REGS = 56
comptime EPI_CONSUMER_REGS = 224
# gelu_grad_tile (part 23): rows of `saved` in flight a thread, in registers (one in
# flight and 56 registers, which spilled an address into every row's load: 157 us at
# GPT-2's MLP shape; four and 88 registers, no spill: 109; eight spilled again and lost),
# and 32 more registers for the epilogue warps, 16 fewer for the consumers, who only stage
comptime EPI_GRAD_AHEAD = 4
comptime EPI_GRAD_PRODUCER_REGS = 88
comptime EPI_GRAD_CONSUMER_REGS = 208


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
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    second: Pointer[Scalar[dtype], MutAnyOrigin],
    row0: Int,
    n0: Int,
    M: Int,
    N: Int,
    aux: Int,
    etid: Int,
):
    """The epilogue warps' part: GELU over one staged BM x BN tile at (row0, n0) of the
    row-major M x N `dst`; with aux (1: the pre-activation, 2: GELU's derivative) the
    second output to `second`, laid out alike. Thread `etid` of EPI_THREADS takes every
    EPI_THREADS-th 16-byte chunk; each chunk's load is issued one chunk ahead, since
    shared memory is busy with the k-loop's wgmma. N % 8 == 0: a chunk is all in or
    all out."""
    comptime BOXES_N = BN // STORE_BOX
    comptime CHUNK = 16 // size_of[dtype]()  # values per 16-byte chunk
    comptime ROW_CHUNKS = STORE_BOX // CHUNK  # a box row's chunks: 8, as the swizzle's
    comptime BOX_CHUNKS = STORE_BOX_ELEMS // CHUNK
    comptime TILE_CHUNKS = (BM // STORE_BOX) * BOXES_N * BOX_CHUNKS
    comptime assert ROW_CHUNKS == 8, "a box row is one 128-byte swizzle span"
    # 32-bit offsets inside the tile (the plan keeps BM * N below 2^31), from the tile's
    # corner: fewer registers than 64-bit indices
    var corner = row0 * N + n0
    var tile_dst = dst.unsafe_offset(corner)
    var tile_second = second.unsafe_offset(corner)
    var rows = UInt32(max(0, min(BM, M - row0)))
    var cols = UInt32(min(BN, N - n0))
    var pitch = UInt32(N)
    comptime U = DType.uint32
    comptime END = Scalar[U](TILE_CHUNKS)
    comptime STEP = Scalar[U](EPI_THREADS)
    comptime PER_BOX = Scalar[U](BOX_CHUNKS)
    comptime PER_ROW = Scalar[U](ROW_CHUNKS)
    comptime SIDE = Scalar[U](STORE_BOX)
    comptime ACROSS = Scalar[U](BOXES_N)
    var c = Scalar[U](etid)
    var raw = tile_boxes.unsafe_load[width=CHUNK, alignment=16](Int(c) * CHUNK)
    while c < END:
        var nxt = c + STEP
        var ahead = raw
        if nxt < END:
            ahead = tile_boxes.unsafe_load[width=CHUNK, alignment=16](
                Int(nxt) * CHUNK
            )
        # chunk c: box b, row r of it, swizzled position p, which holds column chunk
        # p ^ (r % 8) (write_box_pairs)
        var b = c // PER_BOX
        var r = (c % PER_BOX) // PER_ROW
        var j = (c % PER_ROW) ^ (r % 8)
        var tr = (b // ACROSS) * SIDE + r
        var tc = (b % ACROSS) * SIDE + j * Scalar[U](CHUNK)
        if tr < rows and tc < cols:
            var x = raw.cast[DType.float32]()
            var s = _gelu_sigmoid(x)
            var at = Int(tr * pitch + tc)
            tile_dst.unsafe_store[alignment=16](at, (x * s).cast[dtype]())
            if aux == 2:  # a kernel argument: the same in every thread
                tile_second.unsafe_store[alignment=16](
                    at, gelu_tanh_grad(x, s).cast[dtype]()
                )
            elif aux != 0:
                tile_second.unsafe_store[alignment=16](at, raw)
        raw = ahead
        c = nxt


# --8<-- [end:gelu_tile]


@always_inline
def staged_chunk[BN: Int, CHUNK: Int](row: UInt32, col_chunk: UInt32) -> UInt32:
    """Where column chunk `col_chunk` (CHUNK values) of tile row `row` sits in the staged
    copy, in elements: box (row / 64, col_chunk / 8), row row % 64 of it, at the swizzled
    position (col_chunk % 8) ^ (row % 8) (write_box_pairs)."""
    comptime BOX_ROW = Scalar[DType.uint32](STORE_BOX_ELEMS * (BN // STORE_BOX))
    comptime BOX = Scalar[DType.uint32](STORE_BOX_ELEMS)
    comptime SIDE = Scalar[DType.uint32](STORE_BOX)
    comptime C = Scalar[DType.uint32](CHUNK)
    var r = row % SIDE
    return (
        (row // SIDE) * BOX_ROW
        + (col_chunk // 8) * BOX
        + r * SIDE
        + ((col_chunk % 8) ^ (r % 8)) * C
    )


@always_inline
def gelu_tanh_grad_alone(x: SIMD[DType.float32, _]) -> type_of(x):
    """gelu_tanh'(x) where GELU itself is not needed: from t = tanh(u),
    0.5 (1 + t) + 0.5 x u' (1 - t^2), u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2): with
    x^2 formed, two instructions for u, two for 0.5 x u', three to combine (gemm_common's
    gelu_tanh_grad, from the sigmoid GELU shares, takes nine)."""
    var x2 = x * x
    var t = tanh_approx(x * (0.7978845608028654 + 0.035677408136300125 * x2))
    var half_du = x * (0.3989422804014327 + 0.05351611220445019 * x2)
    return half_du * (1 - t * t) + (0.5 + 0.5 * t)


# --8<-- [start:gelu_grad_tile]
@always_inline
def gelu_grad_tile[
    dtype: DType, BM: Int, BN: Int, FROM_PRE: Bool
](
    tile_boxes: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    saved: Pointer[Scalar[dtype], MutAnyOrigin],
    partials: Pointer[Float32, MutAnyOrigin],
    row0: Int,
    n0: Int,
    M: Int,
    N: Int,
    tile_row: Int,
    sums: Bool,
    etid: Int,
):
    """The epilogue warps' part of the MLP backward's product: dst = staged * saved over
    one staged BM x BN tile at (row0, n0), where `saved` holds GELU's derivative, or with
    FROM_PRE its input, whose derivative the warps compute; `saved` and `dst` are
    row-major M x N. Thread `etid` keeps one column chunk (16 bytes) and takes every
    GROUPS-th row of it, so that it can add up its columns: with `sums` it stores their
    float32 sums (before rounding) as row tile_row * GROUPS + etid / (BN / CHUNK) of
    the (rows, N) `partials` (tile_row: the tile's row of tiles over the whole batch),
    GROUPS rows a tile (rows past M add nothing, and are stored). Loads are
    issued AHEAD rows ahead; the consumers asked L2 for the tile of `saved`
    before their k-loop.
    N % 8 == 0: a chunk is all in or all out."""
    comptime CHUNK = 16 // size_of[dtype]()
    comptime COL_CHUNKS = BN // CHUNK
    comptime GROUPS = EPI_THREADS // COL_CHUNKS
    comptime assert (
        EPI_THREADS % COL_CHUNKS == 0
    ), "whole groups of column chunks"
    comptime assert (
        STORE_BOX // CHUNK == 8
    ), "a box row is one 128-byte swizzle span"
    comptime U = DType.uint32
    var cc = Scalar[U](etid % COL_CHUNKS)
    var group = etid // COL_CHUNKS
    var col = n0 + Int(cc) * CHUNK
    if col >= N:  # no column here; its partial sums are not read either
        return
    var rows = Scalar[U](max(0, min(BM, M - row0)))
    var pitch = Scalar[U](N)
    # 32-bit offsets from the chunk's top (the plan keeps BM * N below 2^31)
    var top = row0 * N + col
    var col_dst = dst.unsafe_offset(top)
    var col_saved = saved.unsafe_offset(top)
    var total = SIMD[DType.float32, CHUNK](0)
    # `saved` of this thread's next AHEAD rows, loaded while it works on the current
    # one: the loads wait for L2 or memory, while the staged values wait for shared
    # memory only
    comptime STEP = Scalar[U](GROUPS)
    comptime AHEAD = EPI_GRAD_AHEAD
    var ahead = SIMD[dtype, CHUNK * AHEAD](0)
    comptime for i in range(AHEAD):
        var row = Scalar[U](group + i * GROUPS)
        if row < rows:
            ahead = ahead.insert[offset=i * CHUNK](
                col_saved.unsafe_load[width=CHUNK, alignment=16](
                    Int(row * pitch)
                )
            )
    var base = Scalar[U](group)
    while base < rows:
        comptime for i in range(AHEAD):
            var row = base + Scalar[U](i) * STEP
            if row < rows:
                var x = ahead.slice[CHUNK, offset=i * CHUNK]().cast[
                    DType.float32
                ]()
                var later = row + Scalar[U](AHEAD) * STEP
                if later < rows:  # into the slot just read
                    ahead = ahead.insert[offset=i * CHUNK](
                        col_saved.unsafe_load[width=CHUNK, alignment=16](
                            Int(later * pitch)
                        )
                    )
                var grad = tile_boxes.unsafe_load[width=CHUNK, alignment=16](
                    Int(staged_chunk[BN, CHUNK](row, cc))
                ).cast[DType.float32]()
                var factor = x
                comptime if FROM_PRE:
                    factor = gelu_tanh_grad_alone(x)
                var v = grad * factor
                col_dst.unsafe_store[alignment=16](
                    Int(row * pitch), v.cast[dtype]()
                )
                total += v
        base += Scalar[U](AHEAD) * STEP
    if sums:  # a kernel argument: the same in every thread
        partials.unsafe_store[alignment=16](
            (tile_row * GROUPS + group) * N + col, total
        )


# --8<-- [end:gelu_grad_tile]
