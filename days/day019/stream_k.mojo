# Day 019, part 3: stream-K for version 4's cooperative schedule.
#
# Why: a weight gradient of GPT-2 (dW = Xᵀ dY, K = tokens = 8192) has a small output
# and a long K. 768 x 768 is 18 tiles of 256 x 128 on 132 SMs (14% of the GPU busy);
# 768 x 3072 is 72 (55%). Cutting tiles by output alone cannot fill the machine, so
# stream-K cuts the *iterations*: the problem is tiles x num_k k-steps, laid end to end,
# and block b of a persistent grid of G takes iterations [b I / G, (b + 1) I / G).
# Every block does the same work (±1 k-step); a tile whose k-steps fall to several
# blocks is finished in pieces.
#
# The fix-up, per consumer warp (each warp's accumulator rows are its own, so the
# four warps of a consumer need not wait for each other):
#   1. every piece stores its float32 accumulator in its block's slot of the workspace
#      (slot 0: the block's first unit, slot 1: its last; a block has at most two
#      pieces, at the ends of its range);
#   2. fence, then lane 0 counts the piece in the tile's counter (atomic add);
#   3. the warp that brings the last piece sums all pieces from the workspace in block
#      order (so the result does not depend on who came last) and runs the normal
#      epilogue. Nobody waits for anybody: no order of blocks can deadlock.

from max.gpu import block_dim, block_idx, grid_dim, lane_id, thread_idx, warp_id
from max.gpu.primitives import warp
from std.sys import _RegisterPackType, size_of
from std.sys._assembly import inlined_assembly

comptime SK_THREADS = 128  # a consumer warpgroup


@always_inline
def iter_start(b: Int, total: Int, grid: Int) -> Int:
    """First k-step iteration of block b when `total` are shared by `grid` blocks.
    """
    return b * total // grid


@always_inline
def iter_owner(i: Int, total: Int, grid: Int) -> Int:
    """The block whose range holds iteration i: the last b with iter_start(b) <= i.
    """
    return ((i + 1) * grid - 1) // total


struct Units[STREAM_K: Bool](Movable):
    """The units of work a block (or one ping-pong consumer) walks: whole tiles
    first, first + step, ... below `end` tiles; or, STREAM_K, the k-step iterations
    [cur, end) of the tiles laid end to end (tile t's are t * num_k ... t * num_k +
    num_k - 1), a unit being the part that falls in one tile. After `next()`, the unit
    is k-steps [kb, ke) of tile t. Whole tiles keep kb = 0 and ke = num_k, which the
    compiler sees, so the kernels without stream-K keep their registers."""

    var cur: Int
    var end: Int
    var step: Int
    var num_k: Int
    var t: Int
    var kb: Int
    var ke: Int

    @always_inline
    def __init__(out self, first: Int, end: Int, step: Int, num_k: Int):
        self.cur, self.end, self.step, self.num_k = first, end, step, num_k
        self.t, self.kb, self.ke = 0, 0, num_k

    @always_inline
    def next(mut self) -> Bool:
        if self.cur >= self.end:
            return False
        comptime if Self.STREAM_K:
            self.t = self.cur // self.num_k
            self.kb = self.cur - self.t * self.num_k
            self.ke = min(self.num_k, self.end - self.t * self.num_k)
            self.cur = self.t * self.num_k + self.ke
        else:
            self.t = self.cur
            self.cur += self.step
        return True

    @always_inline
    def whole(self) -> Bool:
        """Does this unit cover all of its tile's k-steps?"""
        comptime if Self.STREAM_K:
            return self.ke - self.kb == self.num_k
        return True


@always_inline
def piece_offset[
    SHARERS: Int, REGION: Int
](b: Int, t: Int, me: Int, num_k: Int, total: Int, grid: Int) -> Int:
    """Where block b's piece of tile t (consumer `me`'s rows) sits in the workspace.
    """
    var slot = 0 if iter_start(b, total, grid) // num_k == t else 1
    return ((b * 2 + slot) * SHARERS + me) * REGION


@always_inline
def fence_gpu():
    """Order this thread's global accesses before and after, GPU-wide."""
    inlined_assembly["fence.acq_rel.gpu;", NoneType, constraints=""]()


@always_inline
def sync_warp():
    """All 32 lanes meet here (bar.warp.sync): their stores and fences come first.
    """
    inlined_assembly["bar.warp.sync -1;", NoneType, constraints=""]()


@always_inline
def count_piece(counter: Pointer[Int32, MutAnyOrigin]) -> Int:
    """atomicAdd(counter, 1) (relaxed, GPU scope): the count before this piece.
    """
    return Int(
        inlined_assembly[
            "atom.global.add.u32 $0, [$1], 1;", UInt32, constraints="=r,l"
        ](Int64(Int(counter)))
    )


@always_inline
def load_l2(p: Pointer[Float32, MutAnyOrigin]) -> SIMD[DType.float32, 4]:
    """16 bytes from global memory through L2 only (.cg): another SM wrote them, and
    this SM's L1 is not coherent with its writes."""
    var r = inlined_assembly[
        "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];",
        _RegisterPackType[Float32, Float32, Float32, Float32],
        constraints="=f,=f,=f,=f,l",
    ](Int64(Int(p)))
    return SIMD[DType.float32, 4](r[0], r[1], r[2], r[3])


# --8<-- [start:fixup]
@always_inline
def finish_piece[
    SHARERS: Int, N: Int
](
    mut acc: SIMD[DType.float32, N],
    partials: Pointer[Float32, MutAnyOrigin],
    counters: Pointer[Int32, MutAnyOrigin],
    t: Int,
    me: Int,
    num_k: Int,
    total: Int,
    grid: Int,
) -> Bool:
    """Hand in this warp's piece of tile t; True when it was the last one, and then
    `acc` holds the whole tile's sum (this warp's rows) for the epilogue.

    A thread's N accumulators go to the workspace as N/4 16-byte blocks, block q of
    thread i at (q * 128 + i) * 4: a warp's store is 512 contiguous bytes.
    """
    comptime REGION = N * SK_THREADS  # floats of one consumer's piece
    var w = warp_id() % 4
    var tid = w * 32 + lane_id()
    var mine = partials.unsafe_offset(
        piece_offset[SHARERS, REGION](block_idx.x, t, me, num_k, total, grid)
    )
    comptime for q in range(N // 4):
        mine.unsafe_store[alignment=16](
            (q * SK_THREADS + tid) * 4, acc.slice[4, offset=4 * q]()
        )
    fence_gpu()
    sync_warp()
    var before = 0
    if lane_id() == 0:
        before = count_piece(counters.unsafe_offset((t * SHARERS + me) * 4 + w))
    before = warp.broadcast(before)
    var first = iter_owner(t * num_k, total, grid)
    var last = iter_owner(t * num_k + num_k - 1, total, grid)
    if before != last - first:
        return False
    fence_gpu()
    acc = SIMD[DType.float32, N](0)
    for b in range(first, last + 1):
        var p = partials.unsafe_offset(
            piece_offset[SHARERS, REGION](b, t, me, num_k, total, grid)
        )
        comptime for q in range(N // 4):
            acc = acc.insert[offset=4 * q](
                acc.slice[4, offset=4 * q]()
                + load_l2(p.unsafe_offset((q * SK_THREADS + tid) * 4))
            )
    return True


# --8<-- [end:fixup]


# ---------------------------------------------------------------------------
# Split-K with a second kernel (SPLIT = 2 in version 4). The fix-up above puts a whole
# tile's sum on one SM: the last warp of 7 pieces reads 7 x 16 KB alone, and on the H100
# that cost 10 + 2.5 us per piece. Instead each piece stores its float32 accumulator
# where its outputs go, in slice s of a (S, batch, M, N) workspace, and a second kernel
# on every SM sums the S slices and runs the epilogue (alpha, beta c, the cast).


# --8<-- [start:store_piece]
@always_inline
def store_piece[
    BN: Int, N: Int
](
    acc: SIMD[DType.float32, N],
    ws: Pointer[Float32, MutAnyOrigin],
    row0: Int,
    n0: Int,
    M: Int,
    Ncols: Int,
):
    """Store a consumer's accumulator (N / (BN / 2) m64 row blocks from row0) as float32
    at its outputs' places in one (M, Ncols) slice: element 4 j + e of a row block sits
    at row 16 warp + g + 8 (e // 2), col 8 j + 2 t + e % 2 (g = lane // 4, t = lane % 4),
    so each lane writes 8-byte pairs and a warp's store fills whole 32-byte sectors.
    """
    comptime FRAG = BN // 2
    var g = lane_id() // 4
    var t = lane_id() % 4
    var w = warp_id() % 4
    comptime for r in range(N // FRAG):
        comptime for half in range(2):
            var row = row0 + r * 64 + 16 * w + g + 8 * half
            if row < M:
                comptime for j in range(BN // 8):
                    var col = n0 + 8 * j + 2 * t
                    if (
                        col < Ncols
                    ):  # Ncols % 8 == 0: a pair is all in or all out
                        ws.unsafe_store[alignment=8](
                            row * Ncols + col,
                            acc.slice[2, offset=r * FRAG + 4 * j + 2 * half](),
                        )


# --8<-- [end:store_piece]


# --8<-- [start:sum_pieces]
def split_k_sum_kernel[
    dtype: DType, odtype: DType
](
    dst: Pointer[Scalar[odtype], MutAnyOrigin],
    ws: Pointer[Float32, MutAnyOrigin],
    c: Pointer[Scalar[dtype], MutAnyOrigin],
    alpha_beta: Pointer[Float32, MutAnyOrigin],
    bias: Pointer[Scalar[dtype], MutAnyOrigin],
    m: Int64,
    n: Int64,
    batch: Int64,
    splits: Int64,
    c_bs: Int64,
    c_rs: Int64,
    c_cs: Int64,
    with_bias: Int64,
):
    """dst = alpha * (sum of the S slices of ws) [+ bias] + beta * c, 4 outputs a
    thread in a grid-stride loop (n % 8 == 0: 4 never straddle a row). The slices
    are added in order s = 0, 1, ..., so equal inputs give equal bits. dst is
    odtype: the operands' dtype, or float32 for a float32 master weight's
    gradient (day 020). With `with_bias` the row `bias` (n values) is added too:
    a linear layer's bias next to its residual in c (day 019, part 20).
    """
    var M = Int(m)
    var N = Int(n)
    var total = Int(batch) * M * N
    var alpha = alpha_beta[unsafe_offset=0]
    var beta = alpha_beta[unsafe_offset=1]
    var i = (block_idx.x * block_dim.x + thread_idx.x) * 4
    var step = grid_dim.x * block_dim.x * 4
    while i < total:
        var acc = ws.unsafe_load[width=4, alignment=16](i)
        for s in range(1, Int(splits)):
            acc += ws.unsafe_load[width=4, alignment=16](s * total + i)
        acc *= alpha
        var bt = i // (M * N)
        var row = (i - bt * M * N) // N
        var col = i - bt * M * N - row * N
        if with_bias != 0:
            comptime for e in range(4):
                acc[e] += bias[unsafe_offset=col + e].cast[DType.float32]()
        if beta != 0:
            var base = bt * Int(c_bs) + row * Int(c_rs)
            comptime for e in range(4):
                acc[e] += (
                    beta
                    * c[unsafe_offset=base + (col + e) * Int(c_cs)].cast[
                        DType.float32
                    ]()
                )
        dst.unsafe_store[alignment=4 * size_of[odtype]()](i, acc.cast[odtype]())
        i += step


# --8<-- [end:sum_pieces]
