# Day 020: cross-entropy over a vocabulary in one pass over each row of logits.
#
#     loss[r]  = log(sum_c exp(x[r, c])) - x[r, t[r]]             (0 where t[r] == ignore)
#     grad[r]  = (softmax(x[r]) - onehot(t[r])) * scale           (0 where t[r] == ignore)
#
# Day 012's lesson at vocabulary sizes: a log_softmax writes a (rows, vocab) tensor that
# the loss then reads again, and its backward reads it once more. Here one block reads
# its row once, caching it in shared memory (day 012's fold_and_cache: a bf16 row of
# 50304 is 100 KB, a float32 one 201 KB, both fit), merges the (max, sum of exp) pairs
# (day 009's block_combine), and writes the loss and, when asked, the gradient of the
# logits from the cache. The probabilities are never written. Per-row losses are stored
# as float64 (N values: a rounding-free sum for any logits dtype). `scale` is read from a
# device tensor (1 / the number of counted rows for a mean), so nothing waits for the host.

from extensibility import register, InputTensor, OutputTensor
from max.gpu import (
    MAX_THREADS_PER_BLOCK_METADATA,
    WARP_SIZE,
    block_idx,
    thread_idx,
)
from max.gpu.host import DeviceContext
from max.gpu.memory import external_memory
from std.math import exp, log
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
    SharedPtr,
    fold_and_cache,
    load_shared,
    load_vec,
    store_vec,
)


# --8<-- [start:write_grad]
@always_inline
def write_grad[
    dtype: DType, W: Int, BLOCK: Int
](
    grad: Pointer[Scalar[dtype], MutAnyOrigin],
    logits: Pointer[Scalar[dtype], MutAnyOrigin],
    base: Int,
    n: Int,
    cache: SharedPtr[dtype],
    cached: Int,
    m: Scalar[accum_dtype[dtype]()],
    s: Scalar[accum_dtype[dtype]()],
    target: Int,
    scale: Scalar[accum_dtype[dtype]()],
) where dtype.is_floating_point():
    """The gradient: (exp(x - m) / s - onehot(target)) * scale over [base, base + n), reading x
    from the cache where fold_and_cache put it (the same thread wrote it there).
    """
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var inv = scale / s
    for c in range(thread_idx.x * W, n, BLOCK * W):
        var raw = load_shared[dtype, W](cache, c) if c < cached else load_vec[
            dtype, W
        ](logits, base + c)
        var g = exp(raw.cast[acc]() - m) * inv
        if c <= target < c + W:
            comptime for j in range(
                W
            ):  # a compile-time lane: no vector spilled to the stack
                if c + j == target:
                    g[j] -= scale
        if not finite(m):
            g = SIMD[acc, W](nan_value[acc]())
        store_vec[dtype, W](grad, base + c, g.cast[dtype]())


# --8<-- [end:write_grad]


# --8<-- [start:kernel]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLOCK))
)
def cross_entropy_kernel[
    dtype: DType, W: Int, BLOCK: Int, GRAD: Bool
](
    grad: Pointer[Scalar[dtype], MutAnyOrigin],
    loss: Pointer[Float64, MutAnyOrigin],
    logits: Pointer[Scalar[dtype], MutAnyOrigin],
    targets: Pointer[Int64, MutAnyOrigin],
    scale: Pointer[Float64, MutAnyOrigin],
    cols: Int64,
    cached: Int64,
    ignore_index: Int64,
) where dtype.is_floating_point():
    """One block per row. GRAD = False (no autograd) writes only the loss: one read of
    the row. GRAD = True also writes the gradient of the logits from the cached row. A
    target outside [0, cols) that is not ignore_index gives a NaN loss and gradient (the
    caller checks targets on the host where it can)."""
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var red_m = stack_allocation[
        BLOCK // WARP_SIZE, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var red_s = stack_allocation[
        BLOCK // WARP_SIZE, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var cache = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16
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
        comptime if GRAD:
            for c in range(thread_idx.x * W, n, BLOCK * W):
                store_vec[dtype, W](grad, base + c, SIMD[dtype, W](0))
        return
    var head = Int(
        cached
    ) if GRAD else 0  # without a gradient pass there is nothing to cache for
    var m, s = fold_and_cache[dtype, W, BLOCK](logits, base, n, cache, head)
    m, s = block_combine[acc, BLOCK](m, s, red_m, red_s)
    var valid = t >= 0 and t < cols
    var tc = Int(t) if valid else 0
    if thread_idx.x == 0:
        var xt = logits[unsafe_offset=base + tc].cast[acc]()
        var l = log(s) - (
            xt - m
        )  # xt - m first: exact when both are large and close
        loss[unsafe_offset=row] = (l if valid else nan_value[acc]()).cast[
            DType.float64
        ]()
    comptime if GRAD:
        var sc = scale[unsafe_offset=0].cast[acc]()
        if not valid:
            sc = nan_value[acc]()
        write_grad[dtype, W, BLOCK](
            grad, logits, base, n, cache, head, m, s, tc, sc
        )


# --8<-- [end:kernel]


# --8<-- [start:cpu]
def cross_entropy_cpu[
    dtype: DType, GRAD: Bool
](
    grad: Pointer[Scalar[dtype], MutAnyOrigin],
    loss: Pointer[Float64, MutAnyOrigin],
    logits: Pointer[Scalar[dtype], MutAnyOrigin],
    targets: Pointer[Int64, MutAnyOrigin],
    scale: Float64,
    rows: Int,
    cols: Int,
    ignore_index: Int64,
) where dtype.is_floating_point():
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    for r in range(rows):
        var base = r * cols
        var t = targets[unsafe_offset=r]
        if t == ignore_index:
            loss[unsafe_offset=r] = 0
            comptime if GRAD:
                for c in range(cols):
                    grad[unsafe_offset=base + c] = 0
            continue
        var m, s = row_max_sum_cpu(logits, base, cols)
        var valid = t >= 0 and t < Int64(cols)
        var tc = Int(t) if valid else 0
        var l = log(s) - (logits[unsafe_offset=base + tc].cast[acc]() - m)
        loss[unsafe_offset=r] = (l if valid else nan_value[acc]()).cast[
            DType.float64
        ]()
        comptime if GRAD:
            var sc = scale.cast[acc]() if valid else nan_value[acc]()
            for c in range(cols):
                var x = logits[unsafe_offset=base + c].cast[acc]()
                var g = exp(x - m) / s * sc
                if c == tc:
                    g -= sc
                if not finite(m):
                    g = nan_value[acc]()
                grad[unsafe_offset=base + c] = g.cast[dtype]()


# --8<-- [end:cpu]


comptime GPU_LAUNCH_MOVED = (
    ": on a GPU this op is launched by pytorch_custom_ops (direct launch)"
)


def check_rows(
    name: StaticString, rows: Int, cols: Int, n_targets: Int, n_loss: Int
) raises:
    if n_targets != rows or n_loss != rows:
        raise Error(
            name,
            ": ",
            rows,
            " rows of logits, ",
            n_targets,
            " targets, ",
            n_loss,
            " losses",
        )


@register("cross_entropy")
struct CrossEntropy:
    """Per-row losses and the gradient of the logits, scaled by scale[0]."""

    @staticmethod
    def execute[
        target: StaticString, dtype: DType, IGNORE_INDEX: Int
    ](
        grad: OutputTensor[dtype=dtype, rank=2, ...],
        loss: OutputTensor[dtype=DType.float64, rank=1, ...],
        logits: InputTensor[dtype=dtype, rank=2, ...],
        targets: InputTensor[dtype=DType.int64, rank=1, ...],
        scale: InputTensor[dtype=DType.float64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert dtype.is_floating_point(), "cross_entropy: float logits"
        var rows = logits.dim_size(0)
        var cols = logits.dim_size(1)
        check_rows(
            "cross_entropy", rows, cols, targets.dim_size(0), loss.dim_size(0)
        )
        if grad.shape() != logits.shape():
            raise Error(
                "cross_entropy: grad ",
                grad.shape(),
                " != logits ",
                logits.shape(),
            )
        comptime if target == "gpu":
            raise Error("cross_entropy", GPU_LAUNCH_MOVED)
        else:
            cross_entropy_cpu[dtype, True](
                grad.unsafe_ptr(),
                loss.unsafe_ptr(),
                logits.unsafe_ptr(),
                targets.unsafe_ptr(),
                scale.unsafe_ptr()[unsafe_offset=0],
                rows,
                cols,
                Int64(IGNORE_INDEX),
            )


@register("cross_entropy_loss")
struct CrossEntropyLoss:
    """Per-row losses only (no autograd: the gradient pass is skipped)."""

    @staticmethod
    def execute[
        target: StaticString, dtype: DType, IGNORE_INDEX: Int
    ](
        loss: OutputTensor[dtype=DType.float64, rank=1, ...],
        logits: InputTensor[dtype=dtype, rank=2, ...],
        targets: InputTensor[dtype=DType.int64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert dtype.is_floating_point(), "cross_entropy: float logits"
        var rows = logits.dim_size(0)
        var cols = logits.dim_size(1)
        check_rows(
            "cross_entropy_loss",
            rows,
            cols,
            targets.dim_size(0),
            loss.dim_size(0),
        )
        comptime if target == "gpu":
            raise Error("cross_entropy_loss", GPU_LAUNCH_MOVED)
        else:
            cross_entropy_cpu[dtype, False](
                logits.unsafe_ptr(),  # unused without GRAD
                loss.unsafe_ptr(),
                logits.unsafe_ptr(),
                targets.unsafe_ptr(),
                Float64(1),
                rows,
                cols,
                Int64(IGNORE_INDEX),
            )
