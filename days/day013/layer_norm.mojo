# Day 013: LayerNorm forward and backward as MAX custom ops.
#
# Forward: y = (x - mean) * rstd * weight + bias over each row of a (rows, cols)
# tensor, and the row statistics mean and rstd = 1 / sqrt(var + eps) as float32.
# Backward: grad_x for each row, fused in the same pass, and grad_weight /
# grad_bias as column sums over all rows, reduced in two deterministic stages
# (per-worker partial sums, then one kernel that adds the partials up).
#
# We store rstd, not var: the backward needs exactly rstd, and storing it means
# the backward uses the very number the forward multiplied by (no second sqrt
# that could round differently) and needs no eps.
#
# On the GPU a row is loaded into registers once, with 16-byte vector loads when
# the row and the pointers allow it, so x (and in the backward dy) is read from
# memory once. The statistics never use E[x^2] - E[x]^2, which cancels for
# x = 1e4 + noise: rows in registers get a corrected two-pass (sum, then sums
# around that mean), rows too long for registers merge per-thread
# (count, mean, M2) partials (Chan et al., the parallel form of Welford).
#
# Since day 016 the GPU kernels are launched from Python: the launch plans in
# pytorch_custom_ops/layer_norm.py pick the tier, grid, block, shared memory
# and workspace; `execute` here runs the CPU branch only.

from extensibility import register, InputTensor, OutputTensor
from max.gpu import (
    thread_idx,
    block_idx,
    grid_dim,
    barrier,
    WARP_SIZE,
    lane_id,
    warp_id,
    MAX_THREADS_PER_BLOCK_METADATA,
)
from max.gpu.primitives import warp
from max.gpu.host import DeviceContext
from max.gpu.memory import external_memory
from std.memory import stack_allocation
from std.memory.alloc import unsafe_alloc
from std.math import rsqrt
from std.sys import size_of
from std.utils import StaticTuple

from days.day009.online_softmax import accum_dtype


# Flags of the fused forms (day 020), runtime values: one kernel serves the
# plain and the fused calls, and a uniform branch per row costs nothing.
comptime ADD_DELTA = Int64(1)  # forward: normalise x + delta, write that sum
# forward: no mean and rstd (their pointers may be null): a call without autograd
# needs only y, and two fewer allocations save the host ~2 us a call (day 016)
comptime NO_STATS = Int64(2)
comptime ADD_GRAD = Int64(1)  # backward: add grad_resid into grad_x
comptime WRITE_LOW = Int64(2)  # backward: write grad_x once more, in ldtype


@always_inline
def added[
    dtype: DType, ldtype: DType, VEC: Int
](x: SIMD[dtype, VEC], d: SIMD[ldtype, VEC]) -> SIMD[
    dtype, VEC
] where dtype.is_floating_point():
    """x + d the way torch adds a float32 (or same-dtype) tensor and a lower
    one: in the accumulation dtype, rounded once to x's dtype."""
    comptime acc = accum_dtype[dtype]()
    return (x.cast[acc]() + d.cast[acc]()).cast[dtype]()


# --8<-- [start:merge]
@always_inline
def merge_stats[
    acc: DType
](
    n_a: Scalar[acc],
    mean_a: Scalar[acc],
    m2_a: Scalar[acc],
    n_b: Scalar[acc],
    mean_b: Scalar[acc],
    m2_b: Scalar[acc],
) -> Tuple[Scalar[acc], Scalar[acc], Scalar[acc]] where acc.is_floating_point():
    """Merge two (count, mean, M2) partials of a row, M2 = sum((x - mean)^2).

    Chan et al.'s update: only the *difference* of the two means is squared, so
    a row at 1e4 + N(0, 1) keeps its variance, where E[x^2] - E[x]^2 would
    subtract two float32 numbers near 1e8 (spacing 8) and lose all of it.
    The formula is symmetric in a and b, so both lanes of a butterfly step get
    the same numbers (up to FMA contraction: see `row_stats`).
    """
    var n = n_a + n_b
    if n == 0:
        return (n, Scalar[acc](0), Scalar[acc](0))
    var d = mean_b - mean_a
    var mean = (n_a * mean_a + n_b * mean_b) / n
    return (n, mean, (m2_a + m2_b) + d * d * (n_a * n_b / n))


@always_inline
def vector_stats[
    acc: DType, width: Int
](v: SIMD[acc, width]) -> Tuple[
    Scalar[acc], Scalar[acc], Scalar[acc]
] where acc.is_floating_point():
    """(count, mean, M2) of one vector, two-pass in registers (exact)."""
    var mean = v.reduce_add() / Scalar[acc](width)
    var d = v - mean
    return (Scalar[acc](width), mean, (d * d).reduce_add())


# --8<-- [end:merge]


# --8<-- [start:row_reductions]
@always_inline
def row_stats[
    acc: DType, TPR: Int
](n: Scalar[acc], mean: Scalar[acc], m2: Scalar[acc]) -> Tuple[
    Scalar[acc], Scalar[acc], Scalar[acc]
] where acc.is_floating_point():
    """Merge the partials of the TPR threads that share a row (a warp, or the
    whole block when TPR > 32). Every thread of the row gets the same result."""
    var rn = n
    var rmean = mean
    var rm2 = m2
    # butterfly: every lane ends with the warp's stats
    comptime for k in range(5):
        var o = merge_stats(
            rn,
            rmean,
            rm2,
            warp.shuffle_xor(rn, UInt32(1 << k)),
            warp.shuffle_xor(rmean, UInt32(1 << k)),
            warp.shuffle_xor(rm2, UInt32(1 << k)),
        )
        rn = o[0]
        rmean = o[1]
        rm2 = o[2]
    comptime if TPR == WARP_SIZE:
        # lanes can differ in the last bit if the compiler contracted a*b + c
        # into an FMA differently; lane 0's numbers are the row's numbers
        return (warp.broadcast(rn), warp.broadcast(rmean), warp.broadcast(rm2))
    else:
        comptime NW = TPR // WARP_SIZE
        var sh = stack_allocation[
            3 * NW, Scalar[acc], address_space=AddressSpace.SHARED
        ]()
        if lane_id() == 0:
            sh[unsafe_offset=3 * warp_id()] = rn
            sh[unsafe_offset=3 * warp_id() + 1] = rmean
            sh[unsafe_offset=3 * warp_id() + 2] = rm2
        barrier()
        rn = sh[unsafe_offset=0]
        rmean = sh[unsafe_offset=1]
        rm2 = sh[unsafe_offset=2]
        comptime for w in range(1, NW):  # same order in every thread
            var o = merge_stats(
                rn,
                rmean,
                rm2,
                sh[unsafe_offset=3 * w],
                sh[unsafe_offset=3 * w + 1],
                sh[unsafe_offset=3 * w + 2],
            )
            rn = o[0]
            rmean = o[1]
            rm2 = o[2]
        barrier()  # a later reduction may reuse `sh`
        return (rn, rmean, rm2)


@always_inline
def row_sums[
    acc: DType, TPR: Int, K: Int
](v: SIMD[acc, K]) -> SIMD[acc, K] where acc.is_floating_point():
    """K sums over the TPR threads of a row. a + b == b + a, so the butterfly
    leaves identical values in every lane, and every thread adds the warps'
    sums in the same order."""
    var s = v
    comptime for k in range(5):
        comptime for e in range(K):
            s[e] += warp.shuffle_xor(s[e], UInt32(1 << k))
    comptime if TPR == WARP_SIZE:
        return s
    else:
        comptime NW = TPR // WARP_SIZE
        var sh = stack_allocation[
            K * NW, Scalar[acc], address_space=AddressSpace.SHARED
        ]()
        if lane_id() == 0:
            comptime for e in range(K):
                sh[unsafe_offset=K * warp_id() + e] = s[e]
        barrier()
        comptime for e in range(K):
            s[e] = sh[unsafe_offset=e]
        comptime for w in range(1, NW):
            comptime for e in range(K):
                s[e] += sh[unsafe_offset=K * w + e]
        barrier()  # a later reduction may reuse `sh`
        return s


# --8<-- [end:row_reductions]


# --8<-- [start:forward_kernel]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(TPR * ROWS))
)
@__name(t"ln_fwd_{dtype}_{ldtype}_v{VEC}_t{TPR}_i{ITEMS}_r{ROWS}")
def layer_norm_fwd_kernel[
    dtype: DType, ldtype: DType, VEC: Int, TPR: Int, ITEMS: Int, ROWS: Int
](
    y: Pointer[Scalar[ldtype], MutAnyOrigin],
    mean_out: Pointer[Float32, MutAnyOrigin],
    rstd_out: Pointer[Float32, MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    weight: Pointer[Scalar[dtype], MutAnyOrigin],
    bias: Pointer[Scalar[dtype], MutAnyOrigin],
    eps: Pointer[Float32, MutAnyOrigin],
    delta: Pointer[Scalar[ldtype], MutAnyOrigin],
    x_sum: Pointer[Scalar[dtype], MutAnyOrigin],
    rows: Int64,
    cols: Int64,
    flags: Int64,
) where (dtype.is_floating_point() and ldtype.is_floating_point()):
    """TPR threads per row (32: a warp, ROWS rows per block; else the block,
    ROWS = 1). Thread t holds the vectors t, t + TPR, ... of its row in
    registers (ITEMS of them at most): x is read once. cols must be a multiple
    of VEC, and every pointer 16-byte aligned when VEC > 1.

    y is written in ldtype (dtype, or bfloat16/float16 next to a float32 x:
    the dtype the next matrix product wants under autocast). With ADD_DELTA in
    `flags` the row normalised is x + delta, rounded to dtype as torch's add
    would, and that sum is written to x_sum (a pre-LN residual stream's add,
    fused: day 020). With NO_STATS mean and rstd are not written."""
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    comptime ALIGN = VEC * size_of[dtype]()
    comptime LALIGN = VEC * size_of[ldtype]()
    var n = Int(cols)
    var nvec = n // VEC
    var t = thread_idx.x % TPR
    var e = eps[unsafe_offset=0].cast[acc]()
    var add = (flags & ADD_DELTA) != 0
    var stats = (flags & NO_STATS) == 0
    for row in range(
        block_idx.x * ROWS + thread_idx.x // TPR, Int(rows), grid_dim.x * ROWS
    ):
        var base = row * n
        # 1. the row into registers, every load issued before any is used
        var v = Array[SIMD[dtype, VEC], ITEMS](fill=SIMD[dtype, VEC](0))
        comptime for i in range(ITEMS):
            if i * TPR + t < nvec:
                v[i] = x.unsafe_load[width=VEC, alignment=ALIGN](
                    base + (i * TPR + t) * VEC
                )
        if add:
            # every delta load before the first store: x_sum may alias delta as
            # far as the compiler knows, so a load after a store waits for the
            # add before it, one memory round trip per vector (day 016, part ten)
            var dv = Array[SIMD[ldtype, VEC], ITEMS](fill=SIMD[ldtype, VEC](0))
            comptime for i in range(ITEMS):
                if i * TPR + t < nvec:
                    dv[i] = delta.unsafe_load[width=VEC, alignment=LALIGN](
                        base + (i * TPR + t) * VEC
                    )
            comptime for i in range(ITEMS):
                var j = base + (i * TPR + t) * VEC
                if i * TPR + t < nvec:
                    v[i] = added(v[i], dv[i])
                    x_sum.unsafe_store[alignment=ALIGN](j, v[i])
        # 2. corrected two-pass statistics, both passes over registers:
        # m0 = sum(x) / n, then d = x - m0 gives mean = m0 + sum(d) / n and
        # var = sum(d^2) / n - (sum(d) / n)^2, where sum(d) is tiny: no
        # cancellation even for x = 1e4 + noise (E[x^2] - E[x]^2 would lose it)
        var s = SIMD[acc, 1](0)
        comptime for i in range(ITEMS):
            if i * TPR + t < nvec:
                s += v[i].cast[acc]().reduce_add()
        var m0 = row_sums[acc, TPR, 1](s)[0] / Scalar[acc](n)
        var c = SIMD[acc, 2](0)
        comptime for i in range(ITEMS):
            if i * TPR + t < nvec:
                var d = v[i].cast[acc]() - m0
                c[0] += d.reduce_add()
                c[1] += (d * d).reduce_add()
        c = row_sums[acc, TPR, 2](c)
        var corr = c[0] / Scalar[acc](n)
        var rstd = rsqrt(max(c[1] / Scalar[acc](n) - corr * corr, 0) + e)
        if t == 0 and stats:
            mean_out[unsafe_offset=row] = (m0 + corr).cast[DType.float32]()
            rstd_out[unsafe_offset=row] = rstd.cast[DType.float32]()
        # 3. normalise from registers
        comptime for i in range(ITEMS):
            var j = (i * TPR + t) * VEC
            if i * TPR + t < nvec:
                var w = weight.unsafe_load[width=VEC, alignment=ALIGN](j)
                var b = bias.unsafe_load[width=VEC, alignment=ALIGN](j)
                var xc = (v[i].cast[acc]() - m0) - corr
                var out = xc * rstd * w.cast[acc]() + b.cast[acc]()
                y.unsafe_store[alignment=LALIGN](base + j, out.cast[ldtype]())


# --8<-- [end:forward_kernel]


@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(TPR))
)
@__name(t"ln_fwd_stream_{dtype}_{ldtype}_v{VEC}_t{TPR}")
def layer_norm_fwd_stream_kernel[
    dtype: DType, ldtype: DType, VEC: Int, TPR: Int
](
    y: Pointer[Scalar[ldtype], MutAnyOrigin],
    mean_out: Pointer[Float32, MutAnyOrigin],
    rstd_out: Pointer[Float32, MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    weight: Pointer[Scalar[dtype], MutAnyOrigin],
    bias: Pointer[Scalar[dtype], MutAnyOrigin],
    eps: Pointer[Float32, MutAnyOrigin],
    delta: Pointer[Scalar[ldtype], MutAnyOrigin],
    x_sum: Pointer[Scalar[dtype], MutAnyOrigin],
    rows: Int64,
    cols: Int64,
    flags: Int64,
) where (dtype.is_floating_point() and ldtype.is_floating_point()):
    """Rows too long for registers: one block per row, Welford-style merging of
    per-vector statistics, then a second read of the row (mostly from L2).
    With ADD_DELTA the first pass writes x + delta to x_sum and the second
    reads it back (each thread its own vectors: no barrier needed)."""
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    comptime ALIGN = VEC * size_of[dtype]()
    comptime LALIGN = VEC * size_of[ldtype]()
    var n = Int(cols)
    var nvec = n // VEC
    var t = thread_idx.x
    var e = eps[unsafe_offset=0].cast[acc]()
    var add = (flags & ADD_DELTA) != 0
    var stats = (flags & NO_STATS) == 0
    var src = x_sum if add else x  # what the second pass normalises
    for row in range(block_idx.x, Int(rows), grid_dim.x):
        var base = row * n
        var cnt = Scalar[acc](0)
        var mean = Scalar[acc](0)
        var m2 = Scalar[acc](0)
        for j in range(t, nvec, TPR):
            var v = x.unsafe_load[width=VEC, alignment=ALIGN](base + j * VEC)
            if add:
                v = added(
                    v,
                    delta.unsafe_load[width=VEC, alignment=LALIGN](
                        base + j * VEC
                    ),
                )
                x_sum.unsafe_store[alignment=ALIGN](base + j * VEC, v)
            var p = vector_stats(v.cast[acc]())
            var o = merge_stats(cnt, mean, m2, p[0], p[1], p[2])
            cnt = o[0]
            mean = o[1]
            m2 = o[2]
        var st = row_stats[acc, TPR](cnt, mean, m2)
        mean = st[1]
        var rstd = rsqrt(st[2] / st[0] + e)
        if t == 0 and stats:
            mean_out[unsafe_offset=row] = mean.cast[DType.float32]()
            rstd_out[unsafe_offset=row] = rstd.cast[DType.float32]()
        for j in range(t, nvec, TPR):
            var v = src.unsafe_load[width=VEC, alignment=ALIGN](base + j * VEC)
            var w = weight.unsafe_load[width=VEC, alignment=ALIGN](j * VEC)
            var b = bias.unsafe_load[width=VEC, alignment=ALIGN](j * VEC)
            var out = (v.cast[acc]() - mean) * rstd * w.cast[acc]() + b.cast[
                acc
            ]()
            y.unsafe_store[alignment=LALIGN](base + j * VEC, out.cast[ldtype]())


# --8<-- [start:backward_row]
@always_inline
def backward_row[
    dtype: DType,
    ldtype: DType,
    acc: DType,
    VEC: Int,
    TPR: Int,
    ITEMS: Int,
    SUMS: Bool,
](
    row: Int,
    n: Int,
    t: Int,
    grad_x: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_out: Pointer[Scalar[ldtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    weight: Pointer[Scalar[dtype], MutAnyOrigin],
    mean_in: Pointer[Float32, MutAnyOrigin],
    rstd_in: Pointer[Float32, MutAnyOrigin],
    grad_resid: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_low: Pointer[Scalar[ldtype], MutAnyOrigin],
    add_grad: Bool,
    write_low: Bool,
    mine: Pointer[
        Scalar[acc], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
) where (dtype.is_floating_point() and ldtype.is_floating_point()):
    """One row's grad_x, by the TPR threads that share it (thread t of them holds
    vectors t, t + TPR, ... of the row): with g = dy * w and xhat = (x - mean)
    * rstd, grad_x = rstd * (g - mean(g) - xhat * mean(g * xhat)). SUMS: add
    dy * xhat and dy into the worker's column sums `mine` ([dw | db], 2 n
    values); day 016's one-launch kernel sums the columns elsewhere."""
    comptime assert acc.is_floating_point()
    comptime ALIGN = VEC * size_of[dtype]()
    comptime LALIGN = VEC * size_of[ldtype]()
    comptime SALIGN = min(VEC * size_of[acc](), 16)
    var nvec = n // VEC
    var base = row * n
    var xv = Array[SIMD[dtype, VEC], ITEMS](fill=SIMD[dtype, VEC](0))
    var dyv = Array[SIMD[ldtype, VEC], ITEMS](fill=SIMD[ldtype, VEC](0))
    comptime for i in range(ITEMS):
        if i * TPR + t < nvec:
            xv[i] = x.unsafe_load[width=VEC, alignment=ALIGN](
                base + (i * TPR + t) * VEC
            )
            dyv[i] = grad_out.unsafe_load[width=VEC, alignment=LALIGN](
                base + (i * TPR + t) * VEC
            )
    # the residual gradient with them: loaded after the row sums, its latency
    # stood alone (day 020 measured the fused backward at 70% of bandwidth)
    var rv = Array[SIMD[dtype, VEC], ITEMS](fill=SIMD[dtype, VEC](0))
    if add_grad:
        comptime for i in range(ITEMS):
            if i * TPR + t < nvec:
                rv[i] = grad_resid.unsafe_load[width=VEC, alignment=ALIGN](
                    base + (i * TPR + t) * VEC
                )
    var mean = mean_in[unsafe_offset=row].cast[acc]()
    var rstd = rstd_in[unsafe_offset=row].cast[acc]()
    comptime if dtype == DType.float64:
        # float32 statistics would cost float64 gradients their precision
        # when |mean| >> std; the row is in registers, so re-derive it
        var s = Scalar[acc](0)
        comptime for i in range(ITEMS):
            if i * TPR + t < nvec:
                s += xv[i].cast[acc]().reduce_add()
        mean = row_sums[acc, TPR, 1](s)[0] / Scalar[acc](n)
    # the row's sum(g) and sum(g * xhat)
    var sg = Scalar[acc](0)
    var sgx = Scalar[acc](0)
    comptime for i in range(ITEMS):
        if i * TPR + t < nvec:
            var g = (
                dyv[i].cast[acc]()
                * weight.unsafe_load[width=VEC, alignment=ALIGN](
                    (i * TPR + t) * VEC
                ).cast[acc]()
            )
            var xhat = (xv[i].cast[acc]() - mean) * rstd
            sg += g.reduce_add()
            sgx += (g * xhat).reduce_add()
    var tot = row_sums[acc, TPR, 2](SIMD[acc, 2](sg, sgx))
    var a = tot[0] / Scalar[acc](n)
    var b = tot[1] / Scalar[acc](n)
    comptime for i in range(ITEMS):
        var j = (i * TPR + t) * VEC
        if i * TPR + t < nvec:
            var dy = dyv[i].cast[acc]()
            var g = (
                dy
                * weight.unsafe_load[width=VEC, alignment=ALIGN](j).cast[acc]()
            )
            var xhat = (xv[i].cast[acc]() - mean) * rstd
            var dx = (rstd * (g - a - xhat * b)).cast[dtype]()
            if add_grad:  # torch's add of the two gradients, rounded once
                dx = added(dx, rv[i])
            grad_x.unsafe_store[alignment=ALIGN](base + j, dx)
            if write_low:
                grad_low.unsafe_store[alignment=LALIGN](
                    base + j, dx.cast[ldtype]()
                )
            comptime if SUMS:
                mine.unsafe_store[alignment=SALIGN](
                    j,
                    mine.unsafe_load[width=VEC, alignment=SALIGN](j)
                    + dy * xhat,
                )
                mine.unsafe_store[alignment=SALIGN](
                    n + j,
                    mine.unsafe_load[width=VEC, alignment=SALIGN](n + j) + dy,
                )


# --8<-- [end:backward_row]


# --8<-- [start:backward_kernel]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(TPR * ROWS))
)
@__name(t"ln_bwd_{dtype}_{ldtype}_v{VEC}_t{TPR}_i{ITEMS}_r{ROWS}")
def layer_norm_bwd_kernel[
    dtype: DType,
    ldtype: DType,
    acc: DType,
    VEC: Int,
    TPR: Int,
    ITEMS: Int,
    ROWS: Int,
](
    grad_x: Pointer[Scalar[dtype], MutAnyOrigin],
    partials: Pointer[Scalar[acc], MutAnyOrigin],
    grad_out: Pointer[Scalar[ldtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    weight: Pointer[Scalar[dtype], MutAnyOrigin],
    mean_in: Pointer[Float32, MutAnyOrigin],
    rstd_in: Pointer[Float32, MutAnyOrigin],
    grad_resid: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_low: Pointer[Scalar[ldtype], MutAnyOrigin],
    rows: Int64,
    cols: Int64,
    flags: Int64,
) where (dtype.is_floating_point() and ldtype.is_floating_point()):
    """A persistent grid: each of the grid_dim.x * ROWS workers (a warp or a
    block) takes rows worker, worker + workers, ... For each row
    backward_row writes grad_x and adds dy * xhat and dy into the worker's own
    float32 column sums in shared memory (2 * cols per worker). At the end each block writes one row of
    partial sums: partials[block] = [sum dy * xhat | sum dy].
    Launch with 2 * cols * ROWS * sizeof(acc) bytes of dynamic shared memory.
    acc is accum_dtype[dtype]: a parameter only because the launch plan sizes
    the shared memory and the workspace by it, and this assert checks its
    choice when the kernel is built.

    The fused form (day 020): grad_out is in ldtype (the forward's y); with
    ADD_GRAD the gradient that reached x + delta by the residual stream,
    grad_resid, is added into grad_x, and with WRITE_LOW grad_x is written
    once more in ldtype (delta's gradient)."""
    comptime assert acc == accum_dtype[dtype](), "acc: accum_dtype[dtype]"
    comptime assert acc.is_floating_point()
    comptime SALIGN = min(VEC * size_of[acc](), 16)
    var n = Int(cols)
    var nvec = n // VEC
    var t = thread_idx.x % TPR
    var add_grad = (flags & ADD_GRAD) != 0
    var write_low = (flags & WRITE_LOW) != 0
    var slot = thread_idx.x // TPR
    var sums = external_memory[
        Scalar[acc], address_space=AddressSpace.SHARED, alignment=16
    ]()
    var mine = sums.unsafe_offset(slot * 2 * n)  # [dw | db] of this worker
    comptime for i in range(ITEMS):
        if i * TPR + t < nvec:
            mine.unsafe_store[alignment=SALIGN](
                (i * TPR + t) * VEC, SIMD[acc, VEC](0)
            )
            mine.unsafe_store[alignment=SALIGN](
                n + (i * TPR + t) * VEC, SIMD[acc, VEC](0)
            )

    for row in range(block_idx.x * ROWS + slot, Int(rows), grid_dim.x * ROWS):
        backward_row[dtype, ldtype, acc, VEC, TPR, ITEMS, True](
            row,
            n,
            t,
            grad_x,
            grad_out,
            x,
            weight,
            mean_in,
            rstd_in,
            grad_resid,
            grad_low,
            add_grad,
            write_low,
            mine,
        )

    # one row of partial sums per block
    var out = partials.unsafe_offset(block_idx.x * 2 * n)
    comptime if ROWS == 1:  # the block is the worker: copy own columns
        comptime for i in range(ITEMS):
            var j = (i * TPR + t) * VEC
            if i * TPR + t < nvec:
                out.unsafe_store[alignment=SALIGN](
                    j, mine.unsafe_load[width=VEC, alignment=SALIGN](j)
                )
                out.unsafe_store[alignment=SALIGN](
                    n + j, mine.unsafe_load[width=VEC, alignment=SALIGN](n + j)
                )
    else:  # ROWS warps: add their slices, in a fixed order
        barrier()
        for k in range(thread_idx.x, 2 * n, TPR * ROWS):
            var s = sums[unsafe_offset=k]
            comptime for w in range(1, ROWS):
                s += sums[unsafe_offset=w * 2 * n + k]
            out[unsafe_offset=k] = s


# --8<-- [end:backward_kernel]


@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(TPR))
)
@__name(t"ln_bwd_stream_{dtype}_{ldtype}_v{VEC}_t{TPR}")
def layer_norm_bwd_stream_kernel[
    dtype: DType, ldtype: DType, acc: DType, VEC: Int, TPR: Int
](
    grad_x: Pointer[Scalar[dtype], MutAnyOrigin],
    partials: Pointer[Scalar[acc], MutAnyOrigin],
    grad_out: Pointer[Scalar[ldtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    weight: Pointer[Scalar[dtype], MutAnyOrigin],
    mean_in: Pointer[Float32, MutAnyOrigin],
    rstd_in: Pointer[Float32, MutAnyOrigin],
    grad_resid: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_low: Pointer[Scalar[ldtype], MutAnyOrigin],
    rows: Int64,
    cols: Int64,
    flags: Int64,
) where (dtype.is_floating_point() and ldtype.is_floating_point()):
    """Rows too long for registers: each block reads its row twice (sums, then
    grad_x) and keeps its column sums directly in its row of `partials`
    (acc, ldtype and flags as in layer_norm_bwd_kernel)."""
    comptime assert acc == accum_dtype[dtype](), "acc: accum_dtype[dtype]"
    comptime assert acc.is_floating_point()
    comptime ALIGN = VEC * size_of[dtype]()
    comptime LALIGN = VEC * size_of[ldtype]()
    comptime SALIGN = min(VEC * size_of[acc](), 16)
    var n = Int(cols)
    var nvec = n // VEC
    var t = thread_idx.x
    var add_grad = (flags & ADD_GRAD) != 0
    var write_low = (flags & WRITE_LOW) != 0
    var mine = partials.unsafe_offset(block_idx.x * 2 * n)
    for j in range(t, nvec, TPR):
        mine.unsafe_store[alignment=SALIGN](j * VEC, SIMD[acc, VEC](0))
        mine.unsafe_store[alignment=SALIGN](n + j * VEC, SIMD[acc, VEC](0))
    for row in range(block_idx.x, Int(rows), grid_dim.x):
        var base = row * n
        var mean = mean_in[unsafe_offset=row].cast[acc]()
        var rstd = rstd_in[unsafe_offset=row].cast[acc]()
        comptime if dtype == DType.float64:  # see layer_norm_bwd_kernel
            var s = Scalar[acc](0)
            for j in range(t, nvec, TPR):
                s += (
                    x.unsafe_load[width=VEC, alignment=ALIGN](base + j * VEC)
                    .cast[acc]()
                    .reduce_add()
                )
            mean = row_sums[acc, TPR, 1](s)[0] / Scalar[acc](n)
        var sg = Scalar[acc](0)
        var sgx = Scalar[acc](0)
        for j in range(t, nvec, TPR):
            var g = (
                grad_out.unsafe_load[width=VEC, alignment=LALIGN](
                    base + j * VEC
                ).cast[acc]()
                * weight.unsafe_load[width=VEC, alignment=ALIGN](j * VEC).cast[
                    acc
                ]()
            )
            var xhat = (
                x.unsafe_load[width=VEC, alignment=ALIGN](base + j * VEC).cast[
                    acc
                ]()
                - mean
            ) * rstd
            sg += g.reduce_add()
            sgx += (g * xhat).reduce_add()
        var tot = row_sums[acc, TPR, 2](SIMD[acc, 2](sg, sgx))
        var a = tot[0] / Scalar[acc](n)
        var b = tot[1] / Scalar[acc](n)
        for j in range(t, nvec, TPR):
            var dy = grad_out.unsafe_load[width=VEC, alignment=LALIGN](
                base + j * VEC
            ).cast[acc]()
            var g = (
                dy
                * weight.unsafe_load[width=VEC, alignment=ALIGN](j * VEC).cast[
                    acc
                ]()
            )
            var xhat = (
                x.unsafe_load[width=VEC, alignment=ALIGN](base + j * VEC).cast[
                    acc
                ]()
                - mean
            ) * rstd
            var dx = (rstd * (g - a - xhat * b)).cast[dtype]()
            if add_grad:  # as in layer_norm_bwd_kernel
                dx = added(
                    dx,
                    grad_resid.unsafe_load[width=VEC, alignment=ALIGN](
                        base + j * VEC
                    ),
                )
            grad_x.unsafe_store[alignment=ALIGN](base + j * VEC, dx)
            if write_low:
                grad_low.unsafe_store[alignment=LALIGN](
                    base + j * VEC, dx.cast[ldtype]()
                )
            mine.unsafe_store[alignment=SALIGN](
                j * VEC,
                mine.unsafe_load[width=VEC, alignment=SALIGN](j * VEC)
                + dy * xhat,
            )
            mine.unsafe_store[alignment=SALIGN](
                n + j * VEC,
                mine.unsafe_load[width=VEC, alignment=SALIGN](n + j * VEC) + dy,
            )


# --8<-- [start:partials_kernel]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](
        Int32(SUM_COLS * SUM_LANES)
    )
)
@__name(t"ln_sum_partials_{dtype}_c{SUM_COLS}_l{SUM_LANES}")
def sum_partials_kernel[
    dtype: DType, acc: DType, SUM_COLS: Int, SUM_LANES: Int
](
    grad_weight: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_bias: Pointer[Scalar[dtype], MutAnyOrigin],
    partials: Pointer[Scalar[acc], MutAnyOrigin],
    parts: Int64,
    cols: Int64,
    width: Int64,
) where dtype.is_floating_point():
    """Second stage, one block of SUM_COLS x SUM_LANES threads per SUM_COLS
    columns of the (parts, width) partials: column k is summed by SUM_LANES
    threads (rows p = lane, lane + SUM_LANES, ...), then by one, always in the
    same order, so the result does not depend on timing (no atomics). Sums of
    columns k < cols go to grad_weight[k], the others to grad_bias[k - cols]:
    the layer norm's partials are [dw | db], width = 2 cols. Day 019's GEMM
    writes one vector's (a bias gradient's): width = cols, grad_bias unused.
    The launch plan picks SUM_COLS and SUM_LANES; block and grid follow from them.
    """
    comptime assert acc == accum_dtype[dtype](), "acc: accum_dtype[dtype]"
    var sh = stack_allocation[
        SUM_COLS * SUM_LANES, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var n2 = Int(width)
    var c = thread_idx.x % SUM_COLS
    var lane = thread_idx.x // SUM_COLS
    var k = block_idx.x * SUM_COLS + c
    var s = SIMD[acc, 4](0)  # 4 independent chains: 4 loads in flight
    if k < n2:
        var p = lane
        while p + 3 * SUM_LANES < Int(parts):
            s[0] += partials[unsafe_offset=p * n2 + k]
            s[1] += partials[unsafe_offset=(p + SUM_LANES) * n2 + k]
            s[2] += partials[unsafe_offset=(p + 2 * SUM_LANES) * n2 + k]
            s[3] += partials[unsafe_offset=(p + 3 * SUM_LANES) * n2 + k]
            p += 4 * SUM_LANES
        while p < Int(parts):
            s[0] += partials[unsafe_offset=p * n2 + k]
            p += SUM_LANES
    sh[unsafe_offset=lane * SUM_COLS + c] = s.reduce_add()
    barrier()
    if lane == 0 and k < n2:
        var total = sh[unsafe_offset=c]
        comptime for l in range(1, SUM_LANES):
            total += sh[unsafe_offset=l * SUM_COLS + c]
        if k < Int(cols):
            grad_weight[unsafe_offset=k] = total.cast[dtype]()
        else:
            grad_bias[unsafe_offset=k - Int(cols)] = total.cast[dtype]()


# --8<-- [end:partials_kernel]


# -- CPU reference path ----------------------------------------------------------
# --8<-- [start:cpu]
comptime CPU_CHUNK = 256  # elements per partial sum
comptime CPU_ROW_BLOCK = 64  # rows per partial column sum, like one GPU worker


def chunked_sum[
    dtype: DType, POWER: Int
](
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    base: Int,
    n: Int,
    center: Scalar[accum_dtype[dtype]()],
) -> Scalar[accum_dtype[dtype]()] where dtype.is_floating_point():
    """Sum of (x - center)^POWER (POWER 1 or 2) over a row, in chunks of
    CPU_CHUNK: one float32 accumulator over a 70000-long row drifts."""
    comptime acc = accum_dtype[dtype]()
    var total = Scalar[acc](0)
    for start in range(0, n, CPU_CHUNK):
        var part = Scalar[acc](0)
        for c in range(start, min(start + CPU_CHUNK, n)):
            var d = x[unsafe_offset=base + c].cast[acc]() - center
            comptime if POWER == 1:
                part += d
            else:
                part += d * d
        total += part
    return total


def row_mean_var_cpu[
    dtype: DType
](x: Pointer[Scalar[dtype], MutAnyOrigin], base: Int, n: Int) -> Tuple[
    Scalar[accum_dtype[dtype]()],
    Scalar[accum_dtype[dtype]()],
    Scalar[accum_dtype[dtype]()],
] where dtype.is_floating_point():
    """(m0, corr, var) of one row, the corrected two-pass way of the GPU
    kernel: the mean is m0 + corr, and x - mean is best computed as
    (x - m0) - corr."""
    comptime acc = accum_dtype[dtype]()
    var m0 = chunked_sum[dtype, 1](x, base, n, Scalar[acc](0)) / Scalar[acc](n)
    var corr = chunked_sum[dtype, 1](x, base, n, m0) / Scalar[acc](n)
    var sq = chunked_sum[dtype, 2](x, base, n, m0) / Scalar[acc](n)
    return (m0, corr, max(sq - corr * corr, 0))


def layer_norm_cpu[
    dtype: DType
](
    y: Pointer[Scalar[dtype], MutAnyOrigin],
    mean_out: Pointer[Float32, MutAnyOrigin],
    rstd_out: Pointer[Float32, MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    weight: Pointer[Scalar[dtype], MutAnyOrigin],
    bias: Pointer[Scalar[dtype], MutAnyOrigin],
    eps: Float32,
    rows: Int,
    n: Int,
) where dtype.is_floating_point():
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    for r in range(rows):
        var st = row_mean_var_cpu(x, r * n, n)
        var rstd = rsqrt(st[2] + eps.cast[acc]())
        mean_out[unsafe_offset=r] = (st[0] + st[1]).cast[DType.float32]()
        rstd_out[unsafe_offset=r] = rstd.cast[DType.float32]()
        for c in range(n):
            var xc = (x[unsafe_offset=r * n + c].cast[acc]() - st[0]) - st[1]
            var v = xc * rstd
            y[unsafe_offset=r * n + c] = (
                v * weight[unsafe_offset=c].cast[acc]()
                + bias[unsafe_offset=c].cast[acc]()
            ).cast[dtype]()


def layer_norm_backward_cpu[
    dtype: DType
](
    grad_x: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_weight: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_bias: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_out: Pointer[Scalar[dtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    weight: Pointer[Scalar[dtype], MutAnyOrigin],
    mean_in: Pointer[Float32, MutAnyOrigin],
    rstd_in: Pointer[Float32, MutAnyOrigin],
    rows: Int,
    n: Int,
) where dtype.is_floating_point():
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    # [dw | db] over all rows, and over the current block of rows
    var total = unsafe_alloc[Scalar[acc]](2 * n)
    var part = unsafe_alloc[Scalar[acc]](2 * n)
    for k in range(2 * n):
        total[unsafe_offset=k] = 0
        part[unsafe_offset=k] = 0
    for r in range(rows):
        var base = r * n
        var mean = mean_in[unsafe_offset=r].cast[acc]()
        var rstd = rstd_in[unsafe_offset=r].cast[acc]()
        comptime if dtype == DType.float64:  # see layer_norm_bwd_kernel
            var st = row_mean_var_cpu(x, base, n)
            mean = st[0] + st[1]
        var sg = Scalar[acc](0)
        var sgx = Scalar[acc](0)
        for c in range(n):
            var g = (
                grad_out[unsafe_offset=base + c].cast[acc]()
                * weight[unsafe_offset=c].cast[acc]()
            )
            sg += g
            sgx += g * (x[unsafe_offset=base + c].cast[acc]() - mean) * rstd
        var a = sg / Scalar[acc](n)
        var b = sgx / Scalar[acc](n)
        for c in range(n):
            var dy = grad_out[unsafe_offset=base + c].cast[acc]()
            var xhat = (x[unsafe_offset=base + c].cast[acc]() - mean) * rstd
            var g = dy * weight[unsafe_offset=c].cast[acc]()
            grad_x[unsafe_offset=base + c] = (rstd * (g - a - xhat * b)).cast[
                dtype
            ]()
            part[unsafe_offset=c] += dy * xhat
            part[unsafe_offset=n + c] += dy
        if (r + 1) % CPU_ROW_BLOCK == 0 or r + 1 == rows:
            for k in range(2 * n):
                total[unsafe_offset=k] += part[unsafe_offset=k]
                part[unsafe_offset=k] = 0
    for c in range(n):
        grad_weight[unsafe_offset=c] = total[unsafe_offset=c].cast[dtype]()
        grad_bias[unsafe_offset=c] = total[unsafe_offset=n + c].cast[dtype]()
    total.unsafe_free()
    part.unsafe_free()


# --8<-- [end:cpu]


# -- the ops -------------------------------------------------------------------
@register("layer_norm")
struct LayerNorm:
    """LayerNorm over the last dim of a contiguous (rows, cols) tensor.

    Outputs y (like x), mean and rstd (float32, one per row); inputs x,
    weight and bias (cols,), eps as a float32 (1,) tensor (a runtime value:
    a new eps does not recompile)."""

    @staticmethod
    def execute[
        target: StaticString,
        dtype: DType,
    ](
        y: OutputTensor[dtype=dtype, rank=2, ...],
        mean: OutputTensor[dtype=DType.float32, rank=1, ...],
        rstd: OutputTensor[dtype=DType.float32, rank=1, ...],
        x: InputTensor[dtype=dtype, rank=2, ...],
        weight: InputTensor[dtype=dtype, rank=1, ...],
        bias: InputTensor[dtype=dtype, rank=1, ...],
        eps: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert (
            dtype.is_floating_point()
        ), "layer_norm: float dtypes only"
        var rows = x.dim_size(0)
        var cols = x.dim_size(1)
        if y.shape() != x.shape():
            raise Error(
                "layer_norm: y shape ", y.shape(), " != x shape ", x.shape()
            )
        if mean.dim_size(0) != rows or rstd.dim_size(0) != rows:
            raise Error("layer_norm: mean and rstd need ", rows, " entries")
        if weight.dim_size(0) != cols or bias.dim_size(0) != cols:
            raise Error("layer_norm: weight and bias need ", cols, " entries")
        if eps.dim_size(0) != 1:
            raise Error("layer_norm: eps must hold one value")
        if rows == 0 or cols == 0:
            return
        comptime if target == "gpu":
            raise Error(
                "layer_norm: on a GPU this op is launched by pytorch_custom_ops"
                " (direct launch)"
            )
        else:
            layer_norm_cpu(
                y.unsafe_ptr(),
                mean.unsafe_ptr(),
                rstd.unsafe_ptr(),
                x.unsafe_ptr(),
                weight.unsafe_ptr(),
                bias.unsafe_ptr(),
                eps.unsafe_ptr()[unsafe_offset=0],
                rows,
                cols,
            )


@register("layer_norm_backward")
struct LayerNormBackward:
    """Gradients of `layer_norm` from the saved float32 mean and rstd.

    Outputs grad_x (rows, cols), grad_weight and grad_bias (cols,), all in the
    input dtype (the column sums run in float32, float64 for float64); inputs
    grad_out and x (rows, cols), weight (cols,), mean and rstd (rows,)."""

    @staticmethod
    def execute[
        target: StaticString,
        dtype: DType,
    ](
        grad_x: OutputTensor[dtype=dtype, rank=2, ...],
        grad_weight: OutputTensor[dtype=dtype, rank=1, ...],
        grad_bias: OutputTensor[dtype=dtype, rank=1, ...],
        grad_out: InputTensor[dtype=dtype, rank=2, ...],
        x: InputTensor[dtype=dtype, rank=2, ...],
        weight: InputTensor[dtype=dtype, rank=1, ...],
        mean: InputTensor[dtype=DType.float32, rank=1, ...],
        rstd: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert (
            dtype.is_floating_point()
        ), "layer_norm_backward: float dtypes only"
        var rows = x.dim_size(0)
        var cols = x.dim_size(1)
        if grad_x.shape() != x.shape() or grad_out.shape() != x.shape():
            raise Error(
                "layer_norm_backward: grad_x ",
                grad_x.shape(),
                " and grad_out ",
                grad_out.shape(),
                " must match x ",
                x.shape(),
            )
        if (
            weight.dim_size(0) != cols
            or grad_weight.dim_size(0) != cols
            or grad_bias.dim_size(0) != cols
        ):
            raise Error(
                "layer_norm_backward: weight, grad_weight and grad_bias need ",
                cols,
                " entries",
            )
        if mean.dim_size(0) != rows or rstd.dim_size(0) != rows:
            raise Error(
                "layer_norm_backward: mean and rstd need ", rows, " entries"
            )
        if cols == 0:
            return
        comptime if target == "gpu":
            raise Error(
                "layer_norm_backward: on a GPU this op is launched by"
                " pytorch_custom_ops (direct launch)"
            )
        else:
            if rows == 0:  # no rows: the column sums are empty sums
                for c in range(cols):
                    grad_weight.unsafe_ptr()[unsafe_offset=c] = 0
                    grad_bias.unsafe_ptr()[unsafe_offset=c] = 0
                return
            layer_norm_backward_cpu(
                grad_x.unsafe_ptr(),
                grad_weight.unsafe_ptr(),
                grad_bias.unsafe_ptr(),
                grad_out.unsafe_ptr(),
                x.unsafe_ptr(),
                weight.unsafe_ptr(),
                mean.unsafe_ptr(),
                rstd.unsafe_ptr(),
                rows,
                cols,
            )
