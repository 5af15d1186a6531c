# Day 020: cross-entropy over a vocabulary, forward and backward.
#
#     forward:   loss[r] = lse[r] - x[r, t[r]],   lse[r] = log(sum_c exp(x[r, c]))
#     backward:  grad[r, c] = (exp(x[r, c] - lse[r]) - onehot(t[r])[c]) * f[r]
#     (both 0 where t[r] == ignore; f[r] = grad_loss * 1/counted rows for a mean)
#
# Day 012's lesson at vocabulary sizes: a log_softmax writes a (rows, vocab) tensor that
# the loss then reads again, and its backward reads it once more. Here the forward reads
# each row once (one block per row, day 012's fold_and_cache for the (max, sum of exp)
# pair, day 009's block_combine to merge the threads' pairs) and writes two numbers per
# row: the loss and the log-sum-exp. The backward reads the row again with its lse and
# writes the gradient. The probabilities are never written.
#
# When the logits need a gradient, a third kernel does both in one pass (part 11): it reads
# the row once into registers and a shared-memory cache (day 012's looped softmax), writes
# the loss and lse, then the gradient for grad_loss = 1 from the cache: 2 N V bytes instead
# of 3 N V. The backward then only has to scale that gradient by the real grad_loss, and a
# fourth kernel does it in place, returning at once when grad_loss is 1 (loss.backward()).
# Part 1's first design did one pass too, but its backward multiplied by grad_loss
# unconditionally (another read and write of N V), and it lost to F.cross_entropy.
# Per-row losses and lse are stored as float64 (N values each).

from extensibility import register, InputTensor, OutputTensor
from max.gpu import (
    MAX_THREADS_PER_BLOCK_METADATA,
    WARP_SIZE,
    block_idx,
    grid_dim,
    thread_idx,
)
from max.gpu.host import DeviceContext
from max.gpu.memory import external_memory
from max.gpu.primitives import block
from std.math import isnan, log

# float64 to 1 ulp (Mojo 1.2's own exp is ~3e-13 off); std.math.exp for the rest
from days.day009.exp_f64 import exp
from std.memory import stack_allocation
from std.utils.static_tuple import StaticTuple

from days.day009.online_softmax import (
    accum_dtype,
    block_combine,
    finite,
    nan_value,
    row_max_sum_cpu,
)
from days.day012.softmax_family import (
    UNROLL,
    SharedPtr,
    fold_and_cache,
    load_shared,
    load_vec,
    store_vec,
)


# --8<-- [start:kernel]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLOCK))
)
def cross_entropy_kernel[
    dtype: DType, W: Int, BLOCK: Int
](
    loss: Pointer[Float64, MutAnyOrigin],
    lse: Pointer[Float64, MutAnyOrigin],
    logits: Pointer[Scalar[dtype], MutAnyOrigin],
    targets: Pointer[Int64, MutAnyOrigin],
    cols: Int64,
    ignore_index: Int64,
) where dtype.is_floating_point():
    """Forward, one block per row: one read of the row, the loss and the lse written. A
    target outside [0, cols) that is not ignore_index gives a NaN loss (and lse, so that
    the backward's gradient is NaN too); the caller checks targets on the host where it
    can."""
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var red_m = stack_allocation[
        BLOCK // WARP_SIZE, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var red_s = stack_allocation[
        BLOCK // WARP_SIZE, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var n = Int(cols)
    var row = block_idx.x
    var base = row * n
    var t = targets[unsafe_offset=row]
    if (
        t == ignore_index
    ):  # the whole block agrees: no barrier is skipped by some threads only
        if thread_idx.x == 0:
            loss[unsafe_offset=row] = 0
            lse[unsafe_offset=row] = 0
        return
    var no_cache = (
        external_memory[  # launched with no dynamic shared memory: unused
            Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16
        ]()
    )
    var m, s = fold_and_cache[dtype, W, BLOCK](logits, base, n, no_cache, 0)
    m, s = block_combine[acc, BLOCK](m, s, red_m, red_s)
    _ = write_loss_and_lse(loss, lse, logits, row, base, t, cols, m, s)


@always_inline
def write_loss_and_lse[
    dtype: DType
](
    loss: Pointer[Float64, MutAnyOrigin],
    lse: Pointer[Float64, MutAnyOrigin],
    logits: Pointer[Scalar[dtype], MutAnyOrigin],
    row: Int,
    base: Int,
    t: Int64,
    cols: Int64,
    m: Scalar[accum_dtype[dtype]()],
    s: Scalar[accum_dtype[dtype]()],
) -> Scalar[accum_dtype[dtype]()] where dtype.is_floating_point():
    """From the row's (max, sum) pair, which every thread holds: thread 0 writes the
    row's loss and lse; every thread gets the lse (NaN for an invalid target or a row
    with NaN or +inf, so that its gradient is NaN too)."""
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var valid = t >= 0 and t < cols
    var ok = valid and finite(m)
    var shift = m + log(s) if ok else nan_value[acc]()
    if thread_idx.x == 0:
        var xt = logits[unsafe_offset=base + (Int(t) if valid else 0)].cast[
            acc
        ]()
        var l = log(s) - (
            xt - m
        )  # xt - m first: exact when both are large and close
        # NaN, like torch, for a row with NaN or +inf (log(s) - (xt - m) gave +inf
        # for a +inf logit) or with every logit -inf
        loss[unsafe_offset=row] = (l if ok else nan_value[acc]()).cast[
            DType.float64
        ]()
        lse[unsafe_offset=row] = shift.cast[DType.float64]()
    return shift


# --8<-- [end:kernel]


# --8<-- [start:backward]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLOCK))
)
def cross_entropy_backward_kernel[
    dtype: DType, W: Int, BLOCK: Int
](
    grad: Pointer[Scalar[dtype], MutAnyOrigin],
    logits: Pointer[Scalar[dtype], MutAnyOrigin],
    targets: Pointer[Int64, MutAnyOrigin],
    lse: Pointer[Float64, MutAnyOrigin],
    factor: Pointer[Float64, MutAnyOrigin],
    factor_stride: Int64,
    cols: Int64,
    ignore_index: Int64,
) where dtype.is_floating_point():
    """Backward, one block per row: grad = (exp(x - lse) - onehot(t)) * factor, a stream
    of the row in and out with UNROLL vectors in flight per thread. factor is one value
    (stride 0: mean, sum) or one per row (stride 1: reduction none)."""
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var n = Int(cols)
    var row = block_idx.x
    var base = row * n
    var t = targets[unsafe_offset=row]
    if t == ignore_index:
        for c in range(thread_idx.x * W, n, BLOCK * W):
            store_vec[dtype, W](grad, base + c, SIMD[dtype, W](0))
        return
    var f = factor[unsafe_offset=Int(row) * Int(factor_stride)].cast[acc]()
    var shift = lse[unsafe_offset=row].cast[acc]()
    var no_cache = (
        external_memory[  # launched with no dynamic shared memory: unused
            Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16
        ]()
    )
    write_row_grad[dtype, W, BLOCK](
        grad, logits, base, n, no_cache, 0, Int(t), shift, f
    )


@always_inline
def write_row_grad[
    dtype: DType, W: Int, BLOCK: Int
](
    grad: Pointer[Scalar[dtype], MutAnyOrigin],
    logits: Pointer[Scalar[dtype], MutAnyOrigin],
    base: Int,
    n: Int,
    cache: SharedPtr[dtype],
    cached: Int,
    t: Int,
    shift: Scalar[accum_dtype[dtype]()],
    f: Scalar[accum_dtype[dtype]()],
) where dtype.is_floating_point():
    """grad[base + c] = (exp(x[c] - shift) - onehot(t)[c]) * f for c < n, UNROLL
    vectors in flight per thread; x[c] comes from `cache` for c < cached (filled by
    fold_and_cache: each thread reads back what it cached itself, so no barrier), from
    `logits` after that. A NaN shift (an invalid target; a row with NaN, +inf or only
    -inf) writes NaN everywhere: exp(NaN) may be +inf (Mojo 1.2's), so the factor f
    becomes NaN too: one select a row, not one an element.
    """
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    comptime STEP = BLOCK * W
    var fs = shift if isnan(shift) else f  # anything * NaN is NaN
    for c0 in range(thread_idx.x * W, n, STEP * UNROLL):
        var xs = SIMD[dtype, W * UNROLL](0)
        comptime for u in range(UNROLL):
            var c = c0 + u * STEP
            if c < n:
                xs = xs.insert[offset=u * W](
                    load_shared[dtype, W](cache, c) if c
                    < cached else load_vec[dtype, W](logits, base + c)
                )
        comptime for u in range(UNROLL):
            var c = c0 + u * STEP
            if c < n:
                var x = xs.slice[W, offset=u * W]().cast[acc]()
                var g = exp(x - shift) * fs
                if c <= t < c + W:
                    comptime for j in range(W):  # a compile-time lane: no spill
                        if c + j == t:
                            g[j] -= fs
                store_vec[dtype, W](grad, base + c, g.cast[dtype]())


# --8<-- [end:backward]


# --8<-- [start:fused]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLOCK))
)
def cross_entropy_with_grad_kernel[
    dtype: DType, W: Int, BLOCK: Int
](
    loss: Pointer[Float64, MutAnyOrigin],
    lse: Pointer[Float64, MutAnyOrigin],
    grad: Pointer[Scalar[dtype], MutAnyOrigin],
    logits: Pointer[Scalar[dtype], MutAnyOrigin],
    targets: Pointer[Int64, MutAnyOrigin],
    factor: Pointer[Float64, MutAnyOrigin],
    cols: Int64,
    ignore_index: Int64,
    cached: Int64,
) where dtype.is_floating_point():
    """Forward and backward in one pass, one block per row: the row is read once (its
    first `cached` elements also copied to shared memory, which the launch sized), the
    loss and lse are written, then the gradient for grad_loss = 1, times factor[0]
    (1 / counted rows for a mean, 1 for a sum), from the cache and only the uncached
    tail from global memory again."""
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var red_m = stack_allocation[
        BLOCK // WARP_SIZE, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var red_s = stack_allocation[
        BLOCK // WARP_SIZE, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var n = Int(cols)
    var row = block_idx.x
    var base = row * n
    var t = targets[unsafe_offset=row]
    if t == ignore_index:  # the whole block agrees, as in the forward
        if thread_idx.x == 0:
            loss[unsafe_offset=row] = 0
            lse[unsafe_offset=row] = 0
        for c in range(thread_idx.x * W, n, BLOCK * W):
            store_vec[dtype, W](grad, base + c, SIMD[dtype, W](0))
        return
    var cache = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16
    ]()
    var m, s = fold_and_cache[dtype, W, BLOCK](
        logits, base, n, cache, Int(cached)
    )
    m, s = block_combine[acc, BLOCK](m, s, red_m, red_s)
    var shift = write_loss_and_lse(loss, lse, logits, row, base, t, cols, m, s)
    write_row_grad[dtype, W, BLOCK](
        grad,
        logits,
        base,
        n,
        cache,
        Int(cached),
        Int(t),
        shift,
        factor[0].cast[acc](),
    )


@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLOCK))
)
def scale_unless_one_kernel[
    dtype: DType, W: Int, BLOCK: Int, factor_dtype: DType
](
    data: Pointer[Scalar[dtype], MutAnyOrigin],
    factor: Pointer[Scalar[factor_dtype], MutAnyOrigin],
    count: Int64,
) where dtype.is_floating_point():
    """data[:count] *= factor[0], in place; nothing is read or written when the factor is
    exactly 1 (the backward of loss.backward()): every block returns at once. count is a
    multiple of W. The host never reads the factor, so this can be captured in a graph.
    The factor is read in its own dtype (the loss's): no cast kernel before this one.
    """
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var f = factor[0].cast[DType.float64]()
    if f == 1:
        return
    var fa = f.cast[acc]()
    var n = Int(count)
    var step = grid_dim.x * BLOCK * W
    for i in range((block_idx.x * BLOCK + thread_idx.x) * W, n, step):
        var v = load_vec[dtype, W](data, i).cast[acc]() * fa
        store_vec[dtype, W](data, i, v.cast[dtype]())


# --8<-- [end:fused]


# --8<-- [start:small]
# The small work around the one-pass kernel, a kernel each instead of torch's ops (part
# 12): at 8192 rows, torch's ~12 small kernels (the target check, the count of counted
# rows, the mean) took ~21 us of a 0.665 ms call.
comptime SMALL_UNROLL = 8


@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLOCK))
)
def target_stats_kernel[
    BLOCK: Int
](
    scale: Pointer[Float64, MutAnyOrigin],
    bad: Pointer[Int64, MutAnyOrigin],
    targets: Pointer[Int64, MutAnyOrigin],
    rows: Int64,
    classes: Int64,
    ignore_index: Int64,
    mean: Int64,
):
    """One block reads every target once: scale[0] = 1 / the rows whose target is not
    ignore_index when `mean` is nonzero (inf for none: the mean of nothing is NaN, as in
    torch), else 1; bad[0] = how many of those targets are outside [0, classes).
    """
    var counted = Int64(0)
    var wrong = Int64(0)
    var n = Int(rows)
    # SMALL_UNROLL loads in flight per thread: one trip to memory for 8192 rows
    for r0 in range(thread_idx.x, n, BLOCK * SMALL_UNROLL):
        var ts = SIMD[DType.int64, SMALL_UNROLL](ignore_index)
        comptime for u in range(SMALL_UNROLL):
            if r0 + u * BLOCK < n:
                ts[u] = targets[unsafe_offset=r0 + u * BLOCK]
        comptime for u in range(SMALL_UNROLL):
            var t = ts[u]
            if t != ignore_index:
                counted += 1
                if t < 0 or t >= classes:
                    wrong += 1
    counted = block.sum[block_size=BLOCK](counted)
    wrong = block.sum[block_size=BLOCK](wrong)
    if thread_idx.x == 0:
        scale[0] = 1 / Float64(counted) if mean != 0 else Float64(1)
        bad[0] = wrong


@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLOCK))
)
def sum_rows_kernel[
    dtype: DType, BLOCK: Int
](
    loss: Pointer[Scalar[dtype], MutAnyOrigin],
    rows: Pointer[Float64, MutAnyOrigin],
    scale: Pointer[Float64, MutAnyOrigin],
    n: Int64,
):
    """One block: loss[0] = (sum of the n float64 per-row losses) * scale[0], cast to
    the loss's dtype once at the end (as torch's sum, then mean, then cast)."""
    var total = Float64(0)
    for r0 in range(thread_idx.x, Int(n), BLOCK * SMALL_UNROLL):
        var xs = SIMD[DType.float64, SMALL_UNROLL](0)
        comptime for u in range(SMALL_UNROLL):
            if r0 + u * BLOCK < Int(n):
                xs[u] = rows[unsafe_offset=r0 + u * BLOCK]
        total += xs.reduce_add()
    total = block.sum[block_size=BLOCK](total)
    if thread_idx.x == 0:
        loss[0] = (total * scale[0]).cast[dtype]()


# --8<-- [end:small]


# --8<-- [start:cpu]
def cross_entropy_cpu[
    dtype: DType
](
    loss: Pointer[Float64, MutAnyOrigin],
    lse: Pointer[Float64, MutAnyOrigin],
    logits: Pointer[Scalar[dtype], MutAnyOrigin],
    targets: Pointer[Int64, MutAnyOrigin],
    rows: Int,
    cols: Int,
    ignore_index: Int64,
) where dtype.is_floating_point():
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    for r in range(rows):
        var t = targets[unsafe_offset=r]
        if t == ignore_index:
            loss[unsafe_offset=r] = 0
            lse[unsafe_offset=r] = 0
            continue
        var m, s = row_max_sum_cpu(logits, r * cols, cols)
        var valid = t >= 0 and t < Int64(cols)
        var xt = logits[unsafe_offset=r * cols + (Int(t) if valid else 0)].cast[
            acc
        ]()
        var l = log(s) - (xt - m)
        var ok = valid and finite(m)
        loss[unsafe_offset=r] = (l if ok else nan_value[acc]()).cast[
            DType.float64
        ]()
        lse[unsafe_offset=r] = (m + log(s) if ok else nan_value[acc]()).cast[
            DType.float64
        ]()


def cross_entropy_backward_cpu[
    dtype: DType
](
    grad: Pointer[Scalar[dtype], MutAnyOrigin],
    logits: Pointer[Scalar[dtype], MutAnyOrigin],
    targets: Pointer[Int64, MutAnyOrigin],
    lse: Pointer[Float64, MutAnyOrigin],
    factor: Pointer[Float64, MutAnyOrigin],
    factor_stride: Int,
    rows: Int,
    cols: Int,
    ignore_index: Int64,
) where dtype.is_floating_point():
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    for r in range(rows):
        var base = r * cols
        var t = targets[unsafe_offset=r]
        var f = factor[unsafe_offset=r * factor_stride].cast[acc]()
        var shift = lse[unsafe_offset=r].cast[acc]()
        for c in range(cols):
            var g = Scalar[acc](0)
            if t != ignore_index:
                var x = logits[unsafe_offset=base + c].cast[acc]()
                g = (
                    exp(x - shift) * f if shift == shift else shift
                )  # NaN: see write_row_grad
                if Int64(c) == t:
                    g -= f
            grad[unsafe_offset=base + c] = g.cast[dtype]()


# --8<-- [end:cpu]


comptime GPU_LAUNCH_MOVED = (
    ": on a GPU this op is launched by pytorch_custom_ops (direct launch)"
)


def check_rows(
    name: StaticString, rows: Int, n: Int, what: StaticString
) raises:
    if n != rows:
        raise Error(name, ": ", rows, " rows of logits, ", n, " ", what)


@register("cross_entropy")
struct CrossEntropy:
    """Per-row losses and log-sum-exps."""

    @staticmethod
    def execute[
        target: StaticString, dtype: DType, IGNORE_INDEX: Int
    ](
        loss: OutputTensor[dtype=DType.float64, rank=1, ...],
        lse: OutputTensor[dtype=DType.float64, rank=1, ...],
        logits: InputTensor[dtype=dtype, rank=2, ...],
        targets: InputTensor[dtype=DType.int64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert dtype.is_floating_point(), "cross_entropy: float logits"
        var rows = logits.dim_size(0)
        check_rows("cross_entropy", rows, targets.dim_size(0), "targets")
        check_rows("cross_entropy", rows, loss.dim_size(0), "losses")
        check_rows("cross_entropy", rows, lse.dim_size(0), "lse values")
        comptime if target == "gpu":
            raise Error("cross_entropy", GPU_LAUNCH_MOVED)
        else:
            cross_entropy_cpu[dtype](
                loss.unsafe_ptr(),
                lse.unsafe_ptr(),
                logits.unsafe_ptr(),
                targets.unsafe_ptr(),
                rows,
                logits.dim_size(1),
                Int64(IGNORE_INDEX),
            )


@register("cross_entropy_backward")
struct CrossEntropyBackward:
    """The gradient of the logits from the forward's lse and the factor per row.
    """

    @staticmethod
    def execute[
        target: StaticString, dtype: DType, IGNORE_INDEX: Int
    ](
        grad: OutputTensor[dtype=dtype, rank=2, ...],
        logits: InputTensor[dtype=dtype, rank=2, ...],
        targets: InputTensor[dtype=DType.int64, rank=1, ...],
        lse: InputTensor[dtype=DType.float64, rank=1, ...],
        factor: InputTensor[dtype=DType.float64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert dtype.is_floating_point(), "cross_entropy: float logits"
        var rows = logits.dim_size(0)
        check_rows(
            "cross_entropy_backward", rows, targets.dim_size(0), "targets"
        )
        check_rows(
            "cross_entropy_backward", rows, lse.dim_size(0), "lse values"
        )
        var nf = factor.dim_size(0)
        if nf != 1:
            check_rows("cross_entropy_backward", rows, nf, "factors")
        if grad.shape() != logits.shape():
            raise Error(
                "cross_entropy_backward: grad ",
                grad.shape(),
                " != logits ",
                logits.shape(),
            )
        comptime if target == "gpu":
            raise Error("cross_entropy_backward", GPU_LAUNCH_MOVED)
        else:
            cross_entropy_backward_cpu[dtype](
                grad.unsafe_ptr(),
                logits.unsafe_ptr(),
                targets.unsafe_ptr(),
                lse.unsafe_ptr(),
                factor.unsafe_ptr(),
                0 if nf == 1 else 1,
                rows,
                logits.dim_size(1),
                Int64(IGNORE_INDEX),
            )


@register("cross_entropy_with_grad")
struct CrossEntropyWithGrad:
    """Per-row losses and lse, and the gradient of the logits for grad_loss = 1 times
    the one factor (the forward and backward of a mean or a sum, in one call).
    """

    @staticmethod
    def execute[
        target: StaticString, dtype: DType, IGNORE_INDEX: Int
    ](
        loss: OutputTensor[dtype=DType.float64, rank=1, ...],
        lse: OutputTensor[dtype=DType.float64, rank=1, ...],
        grad: OutputTensor[dtype=dtype, rank=2, ...],
        logits: InputTensor[dtype=dtype, rank=2, ...],
        targets: InputTensor[dtype=DType.int64, rank=1, ...],
        factor: InputTensor[dtype=DType.float64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert dtype.is_floating_point(), "cross_entropy: float logits"
        comptime name = "cross_entropy_with_grad"
        var rows = logits.dim_size(0)
        check_rows(name, rows, targets.dim_size(0), "targets")
        check_rows(name, rows, loss.dim_size(0), "losses")
        check_rows(name, rows, lse.dim_size(0), "lse values")
        if factor.dim_size(0) != 1:
            raise Error(name, ": one factor, got ", factor.dim_size(0))
        if grad.shape() != logits.shape():
            raise Error(
                name, ": grad ", grad.shape(), " != logits ", logits.shape()
            )
        comptime if target == "gpu":
            raise Error(name, GPU_LAUNCH_MOVED)
        else:  # the two CPU loops in turn: the CPU path is for correctness, not speed
            var cols = logits.dim_size(1)
            var ignore = Int64(IGNORE_INDEX)
            cross_entropy_cpu[dtype](
                loss.unsafe_ptr(),
                lse.unsafe_ptr(),
                logits.unsafe_ptr(),
                targets.unsafe_ptr(),
                rows,
                cols,
                ignore,
            )
            cross_entropy_backward_cpu[dtype](
                grad.unsafe_ptr(),
                logits.unsafe_ptr(),
                targets.unsafe_ptr(),
                lse.unsafe_ptr(),
                factor.unsafe_ptr(),
                0,
                rows,
                cols,
                ignore,
            )
