# Day 015: one generic reduction for vectors far larger than a block.
#
# A row of n elements is cut across `blocks` blocks of BLOCK threads. Each block
# folds its share (vectorized 16-byte loads, UNROLL loads in flight per thread),
# merges its threads with warp shuffles and one round through shared memory, and
# writes one partial. The partials are a much shorter row, reduced the same way;
# passes repeat until one value per row is left. Since day016 the GPU launches (block
# counts, passes, 16-byte or scalar loads) are planned in pytorch_custom_ops/long_softmax.py;
# `reduce_rows` here is the CPU branch's copy of that schedule.
#
# Which elements a thread visits is decided by `visit_slice`, shared by every kernel
# of the day (the reductions and the softmax stages that write). The CPU branch runs
# the same traversal, thread by thread, so the index arithmetic that decides which
# element goes to which block and thread (tiles, the partial tile, the scalar tail,
# the reverse order) is exercised by the CPU tests too, not only on a GPU.
#
# Threads accumulate in `acc` (float32, or float64 for float64 data). Partials
# between blocks are float64: there are at most a few thousand per row, so their
# precision costs nothing, and a 2^28-element sum is not rounded to float32 at
# every level of the tree.

from max.gpu import thread_idx, block_idx, barrier, WARP_SIZE, lane_id, warp_id
from max.gpu.primitives import warp
from std.memory import stack_allocation
from std.math import ceildiv, isnan
from std.sys import size_of

comptime F64 = DType.float64
comptime PARTIAL = F64  # dtype of the partials in the workspace
comptime Ptr[dtype: DType] = Pointer[Scalar[dtype], MutUntrackedOrigin]
comptime WsPtr = Ptr[PARTIAL]

# BLOCK (threads per block) is a compile-time parameter of every kernel and of the CPU
# emulation, given by the op (pytorch_custom_ops/long_softmax.py: the OpSpec's BLOCK),
# so that the launch and the kernels cannot disagree on it.
comptime UNROLL = 4  # vector loads a thread issues before it uses the first one
# The CPU branch's block sizing, the GPU plan's (pytorch_custom_ops/long_softmax.py)
# on a pretend device: a block gets at least one fp32 tile of work, and 128 blocks
# fill the "device" (32 SMs x 4). A different choice only changes the block count.
comptime MIN_BLOCK_ELEMS = 4096
comptime CPU_BLOCKS = 128


@always_inline
def vec_width[dtype: DType]() -> Int:
    """Elements in one 16-byte load."""
    return 16 // size_of[dtype]()


# --8<-- [start:ops]
trait ReduceOp:
    """An associative, commutative operation with an identity."""

    @staticmethod
    def identity[acc: DType]() -> Scalar[acc]:
        ...

    @staticmethod
    def apply[
        acc: DType, w: Int
    ](a: SIMD[acc, w], b: SIMD[acc, w]) -> SIMD[acc, w]:
        ...


struct MaxOp(ReduceOp):
    @staticmethod
    def identity[acc: DType]() -> Scalar[acc]:
        return Scalar[acc].MIN  # -inf

    @staticmethod
    def apply[
        acc: DType, w: Int
    ](a: SIMD[acc, w], b: SIMD[acc, w]) -> SIMD[acc, w]:
        comptime assert acc.is_floating_point()
        # max.f32 returns the non-NaN operand; a NaN anywhere must reach the
        # result (torch gives a NaN row), so NaN lanes are forced through.
        return (isnan(a) | isnan(b)).select(a + b, max(a, b))


struct SumOp(ReduceOp):
    @staticmethod
    def identity[acc: DType]() -> Scalar[acc]:
        return 0

    @staticmethod
    def apply[
        acc: DType, w: Int
    ](a: SIMD[acc, w], b: SIMD[acc, w]) -> SIMD[acc, w]:
        return a + b


@always_inline
def reduce_lanes[
    Op: ReduceOp, acc: DType, w: Int
](v: SIMD[acc, w]) -> Scalar[acc]:
    var r = v[0]
    comptime for i in range(1, w):
        r = Op.apply[acc, 1](r, v[i])
    return r


@always_inline
def fold_into[
    Op: ReduceOp, acc: DType, VEC: Int, w: Int
](total: SIMD[acc, VEC], x: SIMD[acc, w]) -> SIMD[acc, VEC]:
    """Fold a full vector lane by lane, or a tail element into lane 0."""
    comptime if w == VEC:
        return Op.apply[acc, VEC](total, rebind[SIMD[acc, VEC]](x))
    else:
        var r = total
        r[0] = Op.apply[acc, 1](r[0], reduce_lanes[Op](x))
        return r


# --8<-- [end:ops]


def accum_dtype[dtype: DType]() -> DType:
    """What a thread accumulates in: float64 for float64 data, else float32."""
    return F64 if dtype == F64 else DType.float32


@always_inline
def load_as[
    dtype: DType, acc: DType, w: Int
](src: Ptr[dtype], i: Int) -> SIMD[acc, w]:
    """Elements i..i+w-1 converted to acc; i is a multiple of w (aligned load).
    """
    return src.unsafe_load[width=w, alignment=w * size_of[dtype]()](i).cast[
        acc
    ]()


@always_inline
def store_as[
    dtype: DType, acc: DType, w: Int
](dst: Ptr[dtype], i: Int, v: SIMD[acc, w]):
    dst.unsafe_store[alignment=w * size_of[dtype]()](i, v.cast[dtype]())


def vectors_fit[
    dtype: DType
](p: Ptr[dtype], row_stride: Int, rows: Int) -> Bool:
    """16-byte loads are legal when every row starts on a 16-byte boundary."""
    comptime VEC = vec_width[dtype]()
    return Int(p) % 16 == 0 and (rows == 1 or row_stride % VEC == 0)


# --8<-- [start:traversal]
trait SliceVisitor:
    """One thread's part in a kernel: read w elements as `acc`, then use them.
    """

    comptime acc: DType

    def load[w: Int](self, i: Int) -> SIMD[Self.acc, w]:
        ...

    def consume[w: Int](mut self, i: Int, x: SIMD[Self.acc, w]):
        ...


@always_inline
def visit_slice[
    V: SliceVisitor, VEC: Int, BLOCK: Int, REVERSE: Bool = False
](mut v: V, n: Int, blk: Int, blocks: Int, tid: Int):
    """Visit thread `tid`'s share of block `blk` (of `blocks`) of an n-element row.

    The row is cut into tiles of BLOCK * UNROLL vectors of VEC elements. Full tiles
    go to the blocks round-robin (a grid-stride loop over tiles); inside a tile,
    thread t takes vectors t, t + BLOCK, ..., so each load instruction of a warp
    covers 512 contiguous bytes. The partial last tile and the scalar tail (n % VEC
    elements) go to the block next in line. REVERSE visits the same elements last
    tile first: a pass that follows a forward pass starts on what is still in L2.
    """
    comptime assert (
        BLOCK % 32 == 0 and 0 < BLOCK <= 1024
    ), "BLOCK: whole (NVIDIA) warps, at most 1024 threads"
    comptime TILE = BLOCK * UNROLL
    var nvec = n // VEC
    var full = nvec // TILE
    var owns_rest = blk == full % blocks
    comptime if REVERSE:
        if owns_rest:
            _visit_rest[VEC=VEC, BLOCK=BLOCK](v, n, nvec, full * TILE, tid)
        if blk < full:
            var t = blk + (full - 1 - blk) // blocks * blocks
            while t >= 0:
                _visit_tile[VEC=VEC, BLOCK=BLOCK](v, t * TILE + tid)
                t -= blocks
    else:
        for t in range(blk, full, blocks):
            _visit_tile[VEC=VEC, BLOCK=BLOCK](v, t * TILE + tid)
        if owns_rest:
            _visit_rest[VEC=VEC, BLOCK=BLOCK](v, n, nvec, full * TILE, tid)


@always_inline
def _visit_tile[V: SliceVisitor, VEC: Int, BLOCK: Int](mut v: V, first: Int):
    # all UNROLL loads first, then the math: the loads are in flight together, and
    # an in-place pass (src == dst) cannot have a store ordered before a load
    var xs = SIMD[V.acc, VEC * UNROLL](0)
    comptime for u in range(UNROLL):
        xs = xs.insert[offset=u * VEC](v.load[VEC]((first + u * BLOCK) * VEC))
    comptime for u in range(UNROLL):
        v.consume[VEC](
            (first + u * BLOCK) * VEC, xs.slice[VEC, offset=u * VEC]()
        )


@always_inline
def _visit_rest[
    V: SliceVisitor, VEC: Int, BLOCK: Int
](mut v: V, n: Int, nvec: Int, start: Int, tid: Int):
    for j in range(start + tid, nvec, BLOCK):
        v.consume[VEC](j * VEC, v.load[VEC](j * VEC))
    for e in range(nvec * VEC + tid, n, BLOCK):
        v.consume[1](e, v.load[1](e))


# --8<-- [end:traversal]


# --8<-- [start:block_reduce]
@always_inline
def warp_reduce[Op: ReduceOp, acc: DType](x: Scalar[acc]) -> Scalar[acc]:
    """Butterfly over the warp: every lane ends with the warp's result."""
    comptime assert WARP_SIZE == 32, "NVIDIA warps"
    var v = x
    comptime for k in range(5):
        v = Op.apply[acc, 1](v, warp.shuffle_xor(v, UInt32(1 << k)))
    return v


@always_inline
def block_reduce[
    Op: ReduceOp, acc: DType, BLOCK: Int
](x: Scalar[acc]) -> Scalar[acc]:
    """Every thread of the block gets the block's result (one barrier)."""
    comptime NW = BLOCK // WARP_SIZE
    var red = stack_allocation[
        NW, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var v = warp_reduce[Op](x)
    if lane_id() == 0:
        red[unsafe_offset=warp_id()] = v
    barrier()
    v = red[unsafe_offset=0]
    comptime for w in range(1, NW):
        v = Op.apply[acc, 1](v, red[unsafe_offset=w])
    return v


# --8<-- [end:block_reduce]


struct Fold[Op: ReduceOp, dtype: DType, VEC: Int](SliceVisitor):
    """A thread's running result of Op over the elements it visits."""

    comptime acc = accum_dtype[Self.dtype]()
    var src: Ptr[Self.dtype]
    var total: SIMD[Self.acc, Self.VEC]

    def __init__(out self, src: Ptr[Self.dtype]):
        self.src = src
        self.total = SIMD[Self.acc, Self.VEC](Self.Op.identity[Self.acc]())

    def load[w: Int](self, i: Int) -> SIMD[Self.acc, w]:
        return load_as[Self.dtype, Self.acc, w](self.src, i)

    def consume[w: Int](mut self, i: Int, x: SIMD[Self.acc, w]):
        self.total = fold_into[Self.Op](self.total, x)

    def result(self) -> Scalar[PARTIAL]:
        return reduce_lanes[Self.Op](self.total).cast[PARTIAL]()


# --8<-- [start:reduce_kernel]
def reduce_kernel[
    Op: ReduceOp, dtype: DType, VEC: Int, BLOCK: Int
](
    dst: WsPtr,
    dst_stride: Int64,
    src: Ptr[dtype],
    src_stride: Int64,
    n: Int64,
    blocks: Int64,
):
    """One pass: block b of row r writes Op over its share to dst[r * dst_stride + b].
    Launch with grid_dim = rows * blocks, block_dim = BLOCK."""
    var nb = Int(blocks)
    var row = block_idx.x // nb
    var blk = block_idx.x % nb
    var fold = Fold[Op, dtype, VEC](src.unsafe_offset(row * Int(src_stride)))
    visit_slice[VEC=VEC, BLOCK=BLOCK](fold, Int(n), blk, nb, thread_idx.x)
    var total = block_reduce[Op, BLOCK=BLOCK](fold.result())
    if thread_idx.x == 0:
        dst[unsafe_offset=row * Int(dst_stride) + blk] = total


# --8<-- [end:reduce_kernel]


# The two reductions the day launches, as kernels of their own: a launcher names a
# kernel by its function and dtype/int/bool parameters, not by a trait argument.
def reduce_max_kernel[
    dtype: DType, VEC: Int, BLOCK: Int
](
    dst: WsPtr,
    dst_stride: Int64,
    src: Ptr[dtype],
    src_stride: Int64,
    n: Int64,
    blocks: Int64,
):
    reduce_kernel[MaxOp, dtype, VEC, BLOCK](
        dst, dst_stride, src, src_stride, n, blocks
    )


def reduce_sum_kernel[
    dtype: DType, VEC: Int, BLOCK: Int
](
    dst: WsPtr,
    dst_stride: Int64,
    src: Ptr[dtype],
    src_stride: Int64,
    n: Int64,
    blocks: Int64,
):
    reduce_kernel[SumOp, dtype, VEC, BLOCK](
        dst, dst_stride, src, src_stride, n, blocks
    )


def reduce_blocks_cpu[
    Op: ReduceOp, dtype: DType, VEC: Int, BLOCK: Int
](
    dst: WsPtr,
    dst_stride: Int,
    src: Ptr[dtype],
    src_stride: Int,
    n: Int,
    rows: Int,
    blocks: Int,
):
    """The reduce_kernel on the CPU: the same blocks and threads, one after another.
    """
    for row in range(rows):
        for blk in range(blocks):
            var total = Op.identity[PARTIAL]()
            for tid in range(BLOCK):
                var fold = Fold[Op, dtype, VEC](
                    src.unsafe_offset(row * src_stride)
                )
                visit_slice[VEC=VEC, BLOCK=BLOCK](fold, n, blk, blocks, tid)
                total = Op.apply[PARTIAL, 1](total, fold.result())
            dst[unsafe_offset=row * dst_stride + blk] = total


def reduce_pass_cpu[
    Op: ReduceOp, dtype: DType, BLOCK: Int
](
    dst: WsPtr,
    dst_stride: Int,
    src: Ptr[dtype],
    src_stride: Int,
    n: Int,
    rows: Int,
    blocks: Int,
):
    """One pass of `blocks` blocks per row; 16-byte loads when the rows allow.
    """
    comptime VEC = vec_width[dtype]()
    if vectors_fit(src, src_stride, rows):
        reduce_blocks_cpu[Op, dtype, VEC, BLOCK](
            dst, dst_stride, src, src_stride, n, rows, blocks
        )
    else:
        reduce_blocks_cpu[Op, dtype, 1, BLOCK](
            dst, dst_stride, src, src_stride, n, rows, blocks
        )


def blocks_per_row(n: Int, rows: Int, cap: Int, fill: Int) -> Int:
    """Enough blocks to fill the device, none with less than MIN_BLOCK_ELEMS, at
    most `cap` (the partials' room in the workspace)."""
    return max(1, min(ceildiv(n, MIN_BLOCK_ELEMS), fill // rows, cap))


def reduce_rows_cpu[
    Op: ReduceOp, dtype: DType, BLOCK: Int
](
    src: Ptr[dtype],
    src_stride: Int,
    n: Int,
    rows: Int,
    ws: WsPtr,
    ws_stride: Int,
    result_slot: Int,
    first_region: Int,
    second_region: Int,
    cap: Int,
    fill: Int,
) -> Int:
    """Reduce each row of `src` to one value, written to ws[row, result_slot].

    Pass 1 writes one partial per block; every later pass reduces the partials of
    the pass before, ping-ponging between two workspace regions of `cap` values a
    row, until one block per row is left and it writes the result. Returns the
    number of passes. (The GPU's schedule is the same, planned in Python.)
    """
    var blocks = blocks_per_row(n, rows, cap, fill)
    var out_slot = result_slot if blocks == 1 else first_region
    reduce_pass_cpu[Op, dtype, BLOCK](
        ws.unsafe_offset(out_slot), ws_stride, src, src_stride, n, rows, blocks
    )
    var passes = 1
    var current = first_region
    var spare = second_region
    var m = blocks
    while m > 1:
        var next_blocks = blocks_per_row(m, rows, cap, fill)
        out_slot = result_slot if next_blocks == 1 else spare
        reduce_pass_cpu[Op, PARTIAL, BLOCK](
            ws.unsafe_offset(out_slot),
            ws_stride,
            ws.unsafe_offset(current),
            ws_stride,
            m,
            rows,
            next_blocks,
        )
        passes += 1
        m = next_blocks
        spare = current
        current = out_slot
    return passes
