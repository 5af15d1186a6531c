# Day 015: softmax of rows far longer than a block (up to 2^28 elements), each row
# spread over many blocks.
#
# Two pipelines, one op (`PIPELINE` picks one at compile time):
#   four_stage  1. m = reduce[max](x)                      (multi-pass, 2 launches)
#               2. y = exp(x - m), one partial sum per block
#               3. s = reduce[sum](partials)                (1 launch)
#               4. y *= 1 / s                             (in place)
#               memory: 3 reads + 2 writes of the row
#   fused       A. each block: online (max, sum of exp) over its share, one read
#               B+C. each block merges its row's (m_b, s_b) pairs (redone by every
#                    block instead of a launch), then y = exp(x - m) / s
#               memory: 2 reads + 1 write of the row
#
# The workspace (float64, one row of slots per data row) holds the partials:
#   [MAX_SLOT, SUM_SLOT, -, -, region A: cap partials, region B: cap partials]
# After either pipeline ws[r, MAX_SLOT] and ws[r, SUM_SLOT] hold row r's max and sum
# of exp(x - max), which the tests read.
#
# Since day016 the GPU launches are planned in Python (pytorch_custom_ops/long_softmax.py:
# which kernels, how many blocks a row, the reduction passes); this file keeps the
# kernels and the CPU branch, which runs the same grid block by block. The workspace
# layout below is the kernels' (they index it); the plan mirrors these three numbers
# and a test compares them with this file.

from extensibility import register, InputTensor, OutputTensor
from max.gpu import thread_idx, block_idx, barrier, WARP_SIZE, lane_id, warp_id
from max.gpu.primitives import warp
from max.gpu.host import DeviceContext
from std.memory import stack_allocation

# float64 to 1 ulp (Mojo 1.2's own exp is ~3e-13 off); std.math.exp for the rest
from days.day009.exp_f64 import exp
from std.utils.numerics import nan

from days.day009.online_softmax import combine, finite
from days.day015.multiblock_reduce import (
    CPU_BLOCKS,
    PARTIAL,
    Ptr,
    WsPtr,
    MaxOp,
    SumOp,
    SliceVisitor,
    accum_dtype,
    blocks_per_row,
    block_reduce,
    fold_into,
    load_as,
    reduce_rows_cpu,
    store_as,
    vec_width,
    vectors_fit,
    visit_slice,
)

comptime MAX_SLOT = 0
comptime SUM_SLOT = 1
comptime PARTIALS = 4  # region A starts here (16-byte aligned); region B at PARTIALS + cap


def workspace_cap(slots: Int) -> Int:
    """Partials per region in a workspace row of `slots` values."""
    return (slots - PARTIALS) // 2


@always_inline
def inverse_sum[
    acc: DType
](m: Scalar[PARTIAL], s: Scalar[PARTIAL]) -> Scalar[acc]:
    """1/s, or NaN when the row max is not finite (a fully masked row, +inf or NaN
    in the row): torch gives a NaN row there."""
    return (1 / s).cast[acc]() if finite(m) else nan[acc]()


# --8<-- [start:online_update]
@always_inline
def online_update[
    acc: DType, w: Int
](mut m: Scalar[acc], mut s: Scalar[acc], x: SIMD[acc, w]):
    """Fold w new elements into a running (max, sum of exp(x - max)).

    Per vector, not per element: one exp per element plus one rescale per vector,
    where folding elements one at a time with `combine` costs two exps each. No
    branches: with an `if` around the rescale, each vector's load was sunk below
    the previous vector's branches and only one load per thread was in flight
    (seen in the PTX); straight-line code lets all UNROLL loads issue together.
    """
    comptime assert acc.is_floating_point()
    comptime NEG_INF = Scalar[acc].MIN
    var m_new = max(m, x.reduce_max())  # max() drops NaN: handled below
    # rescale() and the sum, without branches; a -inf max means "nothing yet"
    var keep = exp(m - m_new)
    var add = exp(x - m_new).reduce_add()
    s = (0 if m == NEG_INF else keep) * s + (0 if m_new == NEG_INF else add)
    # A NaN in x makes the sum NaN: w multiplies and adds, where isnan().reduce_or()
    # took 16 instructions a vector. Scaled by 1/w (exact) so that finite values of
    # opposite signs near the float max cannot overflow to inf - inf. (A real
    # -inf + inf is NaN too, but a row holding +inf is a NaN row anyway.)
    var total = (x * Scalar[acc](1.0 / Float64(w))).reduce_add()
    m = nan[acc]() if (m != m or total != total) else m_new


# --8<-- [end:online_update]


# -- the visitors: what one thread does with the elements it is dealt -----------------
struct OnlineFold[dtype: DType](SliceVisitor):
    """Fused stage A: a running (max, sum of exp) over the thread's elements."""

    comptime acc = accum_dtype[Self.dtype]()
    var src: Ptr[Self.dtype]
    var m: Scalar[Self.acc]
    var s: Scalar[Self.acc]

    def __init__(out self, src: Ptr[Self.dtype]):
        self.src = src
        self.m = Scalar[Self.acc].MIN
        self.s = 0

    def load[w: Int](self, i: Int) -> SIMD[Self.acc, w]:
        return load_as[Self.dtype, Self.acc, w](self.src, i)

    def consume[w: Int](mut self, i: Int, x: SIMD[Self.acc, w]):
        online_update(self.m, self.s, x)


struct Normalize[dtype: DType](SliceVisitor):
    """Fused stage C: y = exp(x - m) * inv."""

    comptime acc = accum_dtype[Self.dtype]()
    var src: Ptr[Self.dtype]
    var dst: Ptr[Self.dtype]
    var m: Scalar[Self.acc]
    var inv: Scalar[Self.acc]

    def __init__(
        out self,
        src: Ptr[Self.dtype],
        dst: Ptr[Self.dtype],
        m: Scalar[Self.acc],
        inv: Scalar[Self.acc],
    ):
        self.src = src
        self.dst = dst
        self.m = m
        self.inv = inv

    def load[w: Int](self, i: Int) -> SIMD[Self.acc, w]:
        return load_as[Self.dtype, Self.acc, w](self.src, i)

    def consume[w: Int](mut self, i: Int, x: SIMD[Self.acc, w]):
        comptime assert Self.acc.is_floating_point()
        store_as(self.dst, i, exp(x - self.m) * self.inv)


struct ExpSum[dtype: DType, VEC: Int](SliceVisitor):
    """4-stage stage 2: y = exp(x - m), and a running sum of it."""

    comptime acc = accum_dtype[Self.dtype]()
    var src: Ptr[Self.dtype]
    var dst: Ptr[Self.dtype]
    var m: Scalar[Self.acc]
    var total: SIMD[Self.acc, Self.VEC]

    def __init__(
        out self,
        src: Ptr[Self.dtype],
        dst: Ptr[Self.dtype],
        m: Scalar[Self.acc],
    ):
        self.src = src
        self.dst = dst
        self.m = m
        self.total = 0

    def load[w: Int](self, i: Int) -> SIMD[Self.acc, w]:
        return load_as[Self.dtype, Self.acc, w](self.src, i)

    def consume[w: Int](mut self, i: Int, x: SIMD[Self.acc, w]):
        comptime assert Self.acc.is_floating_point()
        var e = exp(x - self.m)
        store_as(self.dst, i, e)
        self.total = fold_into[SumOp](self.total, e)

    def result(self) -> Scalar[PARTIAL]:
        return self.total.reduce_add().cast[PARTIAL]()


struct Scale[dtype: DType](SliceVisitor):
    """4-stage stage 4: p *= inv, in place."""

    comptime acc = accum_dtype[Self.dtype]()
    var p: Ptr[Self.dtype]
    var inv: Scalar[Self.acc]

    def __init__(out self, p: Ptr[Self.dtype], inv: Scalar[Self.acc]):
        self.p = p
        self.inv = inv

    def load[w: Int](self, i: Int) -> SIMD[Self.acc, w]:
        return load_as[Self.dtype, Self.acc, w](self.p, i)

    def consume[w: Int](mut self, i: Int, x: SIMD[Self.acc, w]):
        store_as(self.p, i, x * self.inv)


# -- merging (max, sum) pairs across a block ---------------------------------------
@always_inline
def block_combine[
    acc: DType, BLOCK: Int
](m: Scalar[acc], s: Scalar[acc]) -> Tuple[
    Scalar[acc], Scalar[acc]
] where acc.is_floating_point():
    """Day 009's warp butterfly of `combine`, then one round through shared memory;
    every thread gets the block's pair."""
    comptime assert WARP_SIZE == 32, "NVIDIA warps"
    comptime NW = BLOCK // WARP_SIZE
    var red_m = stack_allocation[
        NW, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var red_s = stack_allocation[
        NW, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var mm = m
    var ss = s
    comptime for k in range(5):
        var m_other = warp.shuffle_xor(mm, UInt32(1 << k))
        var s_other = warp.shuffle_xor(ss, UInt32(1 << k))
        mm, ss = combine(mm, ss, m_other, s_other)
    if lane_id() == 0:
        red_m[unsafe_offset=warp_id()] = mm
        red_s[unsafe_offset=warp_id()] = ss
    barrier()
    mm = red_m[unsafe_offset=0]
    ss = red_s[unsafe_offset=0]
    comptime for w in range(1, NW):
        mm, ss = combine(mm, ss, red_m[unsafe_offset=w], red_s[unsafe_offset=w])
    return (mm, ss)


@always_inline
def pairs_max(
    ws_row: WsPtr, blocks: Int, start: Int, step: Int
) -> Scalar[PARTIAL]:
    """Fused stage B, step 1 for one thread: the max of m_j, j = start, start + step..
    """
    var m = MaxOp.identity[PARTIAL]()
    for j in range(start, blocks, step):
        m = MaxOp.apply[PARTIAL, 1](m, ws_row[unsafe_offset=PARTIALS + j])
    return m


def pairs_sum[
    acc: DType
](
    ws_row: WsPtr,
    cap: Int,
    blocks: Int,
    start: Int,
    step: Int,
    m: Scalar[PARTIAL],
) -> Scalar[PARTIAL] where acc.is_floating_point():
    """Fused stage B, step 2: the sum of s_j * exp(m_j - m) over the same pairs.

    Max first, then one rescale per pair, instead of folding the pairs with `combine`
    down a tree (two exps at every level, in float64: a software exp; ~1000 lines
    of PTX, estimated at 5-7 us of a 528-block launch). The exp runs in acc (MUFU for float32); the sum is float64.
    A block whose elements were all -inf has m_j = -inf and s_j = 0: it adds 0,
    unless the whole row is masked, which is a NaN row anyway.
    """
    var s = Scalar[PARTIAL](0)
    for j in range(start, blocks, step):
        var m_j = ws_row[unsafe_offset=PARTIALS + j]
        var s_j = ws_row[unsafe_offset=PARTIALS + cap + j]
        s += s_j * exp((m_j - m).cast[acc]()).cast[PARTIAL]()
    return s


# -- fused pipeline -----------------------------------------------------------------
# --8<-- [start:fused_kernels]
def online_partials_kernel[
    dtype: DType, VEC: Int, BLOCK: Int
](
    ws: WsPtr,
    ws_stride: Int64,
    cap: Int64,
    x: Ptr[dtype],
    n: Int64,
    blocks: Int64,
):
    """Stage A: block b of row r writes its (max, sum) pair to region A / B [b].
    """
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var nb = Int(blocks)
    var row = block_idx.x // nb
    var blk = block_idx.x % nb
    var v = OnlineFold[dtype](x.unsafe_offset(row * Int(n)))
    visit_slice[VEC=VEC, BLOCK=BLOCK](v, Int(n), blk, nb, thread_idx.x)
    var m: Scalar[acc]
    var s: Scalar[acc]
    m, s = block_combine[BLOCK=BLOCK](v.m, v.s)
    if thread_idx.x == 0:
        var ws_row = ws.unsafe_offset(row * Int(ws_stride))
        ws_row[unsafe_offset=PARTIALS + blk] = m.cast[PARTIAL]()
        ws_row[unsafe_offset=PARTIALS + Int(cap) + blk] = s.cast[PARTIAL]()


def normalize_kernel[
    dtype: DType, VEC: Int, REVERSE: Bool, BLOCK: Int
](
    y: Ptr[dtype],
    x: Ptr[dtype],
    ws: WsPtr,
    ws_stride: Int64,
    cap: Int64,
    n: Int64,
    blocks: Int64,
):
    """Stages B + C: every block merges its row's pairs (a few KB, from L2; cheaper
    than a launch), then writes exp(x - m) / s over its share."""
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var nb = Int(blocks)
    var row = block_idx.x // nb
    var blk = block_idx.x % nb
    var ws_row = ws.unsafe_offset(row * Int(ws_stride))
    var m = block_reduce[MaxOp, BLOCK=BLOCK](
        pairs_max(ws_row, nb, thread_idx.x, BLOCK)
    )
    barrier()  # the two block reductions may share their shared-memory scratch
    var s = block_reduce[SumOp, BLOCK=BLOCK](
        pairs_sum[acc](ws_row, Int(cap), nb, thread_idx.x, BLOCK, m)
    )
    if blk == 0 and thread_idx.x == 0:
        ws_row[unsafe_offset=MAX_SLOT] = m
        ws_row[unsafe_offset=SUM_SLOT] = s
    var base = row * Int(n)
    var v = Normalize[dtype](
        x.unsafe_offset(base),
        y.unsafe_offset(base),
        m.cast[acc](),
        inverse_sum[acc](m, s),
    )
    visit_slice[VEC=VEC, BLOCK=BLOCK, REVERSE=REVERSE](
        v, Int(n), blk, nb, thread_idx.x
    )


# --8<-- [end:fused_kernels]


def online_partials_cpu[
    dtype: DType, VEC: Int, BLOCK: Int
](
    ws: WsPtr,
    ws_stride: Int,
    cap: Int,
    x: Ptr[dtype],
    n: Int,
    rows: Int,
    blocks: Int,
):
    for row in range(rows):
        var ws_row = ws.unsafe_offset(row * ws_stride)
        for blk in range(blocks):
            var m = Scalar[PARTIAL].MIN
            var s = Scalar[PARTIAL](0)
            for tid in range(BLOCK):
                var v = OnlineFold[dtype](x.unsafe_offset(row * n))
                visit_slice[VEC=VEC, BLOCK=BLOCK](v, n, blk, blocks, tid)
                m, s = combine(m, s, v.m.cast[PARTIAL](), v.s.cast[PARTIAL]())
            ws_row[unsafe_offset=PARTIALS + blk] = m
            ws_row[unsafe_offset=PARTIALS + cap + blk] = s


def normalize_cpu[
    dtype: DType, VEC: Int, REVERSE: Bool, BLOCK: Int
](
    y: Ptr[dtype],
    x: Ptr[dtype],
    ws: WsPtr,
    ws_stride: Int,
    cap: Int,
    n: Int,
    rows: Int,
    blocks: Int,
):
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    for row in range(rows):
        var ws_row = ws.unsafe_offset(row * ws_stride)
        # stage B once per row here (every GPU block repeats it)
        var m = pairs_max(ws_row, blocks, 0, 1)
        var s = pairs_sum[acc](ws_row, cap, blocks, 0, 1, m)
        ws_row[unsafe_offset=MAX_SLOT] = m
        ws_row[unsafe_offset=SUM_SLOT] = s
        for blk in range(blocks):
            for tid in range(BLOCK):
                var v = Normalize[dtype](
                    x.unsafe_offset(row * n),
                    y.unsafe_offset(row * n),
                    m.cast[acc](),
                    inverse_sum[acc](m, s),
                )
                visit_slice[VEC=VEC, BLOCK=BLOCK, REVERSE=REVERSE](
                    v, n, blk, blocks, tid
                )


def fused_softmax_cpu[
    dtype: DType, BLOCK: Int, REVERSE: Bool = True
](y: Ptr[dtype], x: Ptr[dtype], ws: WsPtr, rows: Int, n: Int, ws_stride: Int):
    """The fused pipeline's two kernels, block by block (2 launches on a GPU).
    """
    comptime VEC = vec_width[dtype]()
    var cap = workspace_cap(ws_stride)
    var blocks = blocks_per_row(n, rows, cap, CPU_BLOCKS)
    if vectors_fit(x, n, rows) and vectors_fit(y, n, rows):
        online_partials_cpu[dtype, VEC, BLOCK](
            ws, ws_stride, cap, x, n, rows, blocks
        )
        normalize_cpu[dtype, VEC, REVERSE, BLOCK](
            y, x, ws, ws_stride, cap, n, rows, blocks
        )
    else:
        online_partials_cpu[dtype, 1, BLOCK](
            ws, ws_stride, cap, x, n, rows, blocks
        )
        normalize_cpu[dtype, 1, REVERSE, BLOCK](
            y, x, ws, ws_stride, cap, n, rows, blocks
        )


# -- 4-stage pipeline ---------------------------------------------------------------
def exp_sum_kernel[
    dtype: DType, VEC: Int, BLOCK: Int
](
    y: Ptr[dtype],
    x: Ptr[dtype],
    ws: WsPtr,
    ws_stride: Int64,
    n: Int64,
    blocks: Int64,
):
    """Stage 2: y = exp(x - m); block b of row r writes its sum to region A[b].
    """
    comptime acc = accum_dtype[dtype]()
    var nb = Int(blocks)
    var row = block_idx.x // nb
    var blk = block_idx.x % nb
    var ws_row = ws.unsafe_offset(row * Int(ws_stride))
    var base = row * Int(n)
    var v = ExpSum[dtype, VEC](
        x.unsafe_offset(base),
        y.unsafe_offset(base),
        ws_row[unsafe_offset=MAX_SLOT].cast[acc](),
    )
    visit_slice[VEC=VEC, BLOCK=BLOCK](v, Int(n), blk, nb, thread_idx.x)
    var total = block_reduce[SumOp, BLOCK=BLOCK](v.result())
    if thread_idx.x == 0:
        ws_row[unsafe_offset=PARTIALS + blk] = total


def scale_kernel[
    dtype: DType, VEC: Int, REVERSE: Bool, BLOCK: Int
](y: Ptr[dtype], ws: WsPtr, ws_stride: Int64, n: Int64, blocks: Int64):
    """Stage 4: y *= 1 / s, in place."""
    comptime acc = accum_dtype[dtype]()
    var nb = Int(blocks)
    var row = block_idx.x // nb
    var blk = block_idx.x % nb
    var ws_row = ws.unsafe_offset(row * Int(ws_stride))
    var v = Scale[dtype](
        y.unsafe_offset(row * Int(n)),
        inverse_sum[acc](
            ws_row[unsafe_offset=MAX_SLOT], ws_row[unsafe_offset=SUM_SLOT]
        ),
    )
    visit_slice[VEC=VEC, BLOCK=BLOCK, REVERSE=REVERSE](
        v, Int(n), blk, nb, thread_idx.x
    )


def exp_sum_cpu[
    dtype: DType, VEC: Int, BLOCK: Int
](
    y: Ptr[dtype],
    x: Ptr[dtype],
    ws: WsPtr,
    ws_stride: Int,
    n: Int,
    rows: Int,
    blocks: Int,
):
    comptime acc = accum_dtype[dtype]()
    for row in range(rows):
        var ws_row = ws.unsafe_offset(row * ws_stride)
        for blk in range(blocks):
            var total = Scalar[PARTIAL](0)
            for tid in range(BLOCK):
                var v = ExpSum[dtype, VEC](
                    x.unsafe_offset(row * n),
                    y.unsafe_offset(row * n),
                    ws_row[unsafe_offset=MAX_SLOT].cast[acc](),
                )
                visit_slice[VEC=VEC, BLOCK=BLOCK](v, n, blk, blocks, tid)
                total += v.result()
            ws_row[unsafe_offset=PARTIALS + blk] = total


def scale_cpu[
    dtype: DType, VEC: Int, REVERSE: Bool, BLOCK: Int
](y: Ptr[dtype], ws: WsPtr, ws_stride: Int, n: Int, rows: Int, blocks: Int):
    comptime acc = accum_dtype[dtype]()
    for row in range(rows):
        var ws_row = ws.unsafe_offset(row * ws_stride)
        var inv = inverse_sum[acc](
            ws_row[unsafe_offset=MAX_SLOT], ws_row[unsafe_offset=SUM_SLOT]
        )
        for blk in range(blocks):
            for tid in range(BLOCK):
                var v = Scale[dtype](y.unsafe_offset(row * n), inv)
                visit_slice[VEC=VEC, BLOCK=BLOCK, REVERSE=REVERSE](
                    v, n, blk, blocks, tid
                )


def four_stage_softmax_cpu[
    dtype: DType, BLOCK: Int, REVERSE: Bool = True
](y: Ptr[dtype], x: Ptr[dtype], ws: WsPtr, rows: Int, n: Int, ws_stride: Int):
    """The 4-stage pipeline's kernels, block by block (5 launches on an H100).
    """
    comptime VEC = vec_width[dtype]()
    var cap = workspace_cap(ws_stride)
    var blocks = blocks_per_row(n, rows, cap, CPU_BLOCKS)
    var region_a = PARTIALS
    var region_b = PARTIALS + cap
    # 1. m = reduce[max](x): one partial per block into A, then A -> MAX_SLOT
    _ = reduce_rows_cpu[MaxOp, dtype, BLOCK](
        x,
        n,
        n,
        rows,
        ws,
        ws_stride,
        MAX_SLOT,
        region_a,
        region_b,
        cap,
        CPU_BLOCKS,
    )
    # 2. y = exp(x - m); one partial sum per block into A (same blocks as pass 1)
    if vectors_fit(x, n, rows) and vectors_fit(y, n, rows):
        exp_sum_cpu[dtype, VEC, BLOCK](y, x, ws, ws_stride, n, rows, blocks)
    else:
        exp_sum_cpu[dtype, 1, BLOCK](y, x, ws, ws_stride, n, rows, blocks)
    # 3. s = reduce[sum](A) -> SUM_SLOT
    _ = reduce_rows_cpu[SumOp, PARTIAL, BLOCK](
        ws.unsafe_offset(region_a),
        ws_stride,
        blocks,
        rows,
        ws,
        ws_stride,
        SUM_SLOT,
        region_b,
        region_a,
        cap,
        CPU_BLOCKS,
    )
    # 4. y *= 1 / s
    if vectors_fit(y, n, rows):
        scale_cpu[dtype, VEC, REVERSE, BLOCK](y, ws, ws_stride, n, rows, blocks)
    else:
        scale_cpu[dtype, 1, REVERSE, BLOCK](y, ws, ws_stride, n, rows, blocks)


# --8<-- [start:op]
@register("long_softmax")
struct LongSoftmax:
    """Softmax over the last dim of a contiguous (rows, n) tensor, each row spread
    over many blocks of BLOCK threads. `workspace` is float64 scratch, at least
    PARTIALS + 2 slots a row; more slots allow more blocks per row (up to
    (slots - PARTIALS) // 2). On a GPU, pytorch_custom_ops launches the kernels
    itself (direct launch, day016); MAX runs this op on the CPU.
    """

    @staticmethod
    def execute[
        target: StaticString,
        dtype: DType,
        PIPELINE: StaticString,
        BLOCK: Int,
    ](
        output: OutputTensor[dtype=dtype, rank=2, ...],
        workspace: OutputTensor[dtype=PARTIAL, rank=2, ...],
        x: InputTensor[dtype=dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert (
            dtype.is_floating_point()
        ), "long_softmax: float dtypes only"
        comptime assert (
            PIPELINE == "fused" or PIPELINE == "four_stage"
        ), "long_softmax: PIPELINE is 'fused' or 'four_stage'"
        comptime if target == "gpu":
            raise Error(
                "long_softmax: on a GPU this op is launched by"
                " pytorch_custom_ops (direct launch)"
            )
        if output.shape() != x.shape():
            raise Error(
                "long_softmax: output shape ",
                output.shape(),
                " != input shape ",
                x.shape(),
            )
        var rows = x.dim_size(0)
        var n = x.dim_size(1)
        var slots = workspace.dim_size(1)
        if workspace.dim_size(0) != rows or slots < PARTIALS + 2:
            raise Error(
                "long_softmax: workspace must be (rows, >= ",
                PARTIALS + 2,
                "), got ",
                workspace.shape(),
                " for ",
                rows,
                " rows",
            )
        if rows == 0 or n == 0:
            return
        var y = rebind[Ptr[dtype]](output.unsafe_ptr())
        var src = rebind[Ptr[dtype]](x.unsafe_ptr())
        var ws = rebind[WsPtr](workspace.unsafe_ptr())
        comptime if PIPELINE == "fused":
            fused_softmax_cpu[dtype, BLOCK](y, src, ws, rows, n, slots)
        else:
            four_stage_softmax_cpu[dtype, BLOCK](y, src, ws, rows, n, slots)


# --8<-- [end:op]
