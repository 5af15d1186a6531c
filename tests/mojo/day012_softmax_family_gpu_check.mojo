# Day 012 GPU check: the four softmax-family ops against a float64 host reference on
# shapes that reach every kernel variant (warp rows, block rows, looped rows, rows
# split over a thread-block cluster; 16-byte vectors and the scalar fallback for
# unaligned widths), then, on a GPU, kernel timings for the issue's benchmark
# shapes, with the long-row kernels (looped vs cluster) side by side.
#   mojo run -I . tests/mojo/day012_softmax_family_gpu_check.mojo                 (CPU branch)
#   mojo build -I . --target-accelerator nvidia:90 tests/mojo/day012_softmax_family_gpu_check.mojo
from extensibility import InputTensor, OutputTensor, StaticTensorSpec
from max.gpu.host import DeviceContext, DeviceBuffer, HostBuffer
from std.math import exp, log
from std.sys import has_accelerator, size_of
from std.utils import IndexList

from days.day012.softmax_family import (
    CLUSTER_CACHE_BYTES,
    LogSoftmax,
    LogSoftmaxBackward,
    Softmax,
    SoftmaxBackward,
    cluster_size_for,
    launch_cluster,
    launch_looped,
    smallest_cluster,
    vec_width,
)

comptime TARGET = "gpu" if has_accelerator() else "cpu"

# which kernel runs an op: the op's own dispatch, or (GPU only) one long-row kernel
comptime DISPATCH = 0
comptime LOOPED = 1  # one block per row, head cached (v5)
comptime CLUSTER = 2  # row split over cluster_size_for(...) CTAs (the default)
comptime CLUSTER_MIN = 3  # the fewest CTAs whose slices fit (one CTA per SM)


def fill_random[
    dtype: DType
](host: HostBuffer[dtype], n: Int, seed: UInt64, scale: Float64):
    var state = seed
    for i in range(n):  # a small LCG: values in [-scale, scale)
        state = state * 6364136223846793005 + 1442695040888963407
        var u = Float64(state >> 40) / Float64(1 << 24)
        host[i] = Scalar[DType.float64]((u * 2 - 1) * scale).cast[dtype]()


def cluster_ctas(
    kernel: Int, cols: Int, tensors: Int, elem: Int, w: Int
) -> Int:
    """CTAs per row of a cluster kernel (0: the row does not fit 8 CTAs)."""
    if kernel == CLUSTER:
        return cluster_size_for(cols, tensors, elem, w)
    return smallest_cluster(cols, tensors, elem, w, CLUSTER_CACHE_BYTES)


def run_long_row_kernel[
    dtype: DType, OP: Int, KERNEL: Int, W: Int
](
    ctx: DeviceContext,
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    a: Pointer[Scalar[dtype], MutAnyOrigin],
    b: Pointer[Scalar[dtype], MutAnyOrigin],
    rows: Int,
    cols: Int,
) raises where dtype.is_floating_point():
    comptime BACKWARD = OP >= 2
    comptime LOG = OP % 2 == 1
    comptime if KERNEL == LOOPED:
        launch_looped[dtype, BACKWARD, LOG, W](ctx, dst, a, b, rows, cols)
    else:
        var c = cluster_ctas(
            KERNEL, cols, 2 if BACKWARD else 1, size_of[dtype](), W
        )
        launch_cluster[dtype, BACKWARD, LOG, W](ctx, dst, a, b, rows, cols, c)


def run_op[
    dtype: DType, OP: Int, KERNEL: Int = DISPATCH
](
    ctx: DeviceContext,
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    a: Pointer[Scalar[dtype], MutAnyOrigin],
    b: Pointer[Scalar[dtype], MutAnyOrigin],
    rows: Int,
    cols: Int,
) raises where dtype.is_floating_point():
    """OP: 0 softmax, 1 log_softmax, 2 softmax_backward, 3 log_softmax_backward.

    KERNEL != DISPATCH calls a long-row kernel directly (GPU only); the buffers come
    from enqueue_create_buffer, so 16-byte vectors apply when W divides cols.
    """
    comptime if KERNEL != DISPATCH and has_accelerator():
        comptime VW = vec_width[dtype]()
        if cols % VW == 0:
            run_long_row_kernel[dtype, OP, KERNEL, VW](
                ctx, dst, a, b, rows, cols
            )
        else:
            run_long_row_kernel[dtype, OP, KERNEL, 1](
                ctx, dst, a, b, rows, cols
            )
        return
    comptime Spec = StaticTensorSpec[dtype, 2, ...].get_unknown()
    var shape = IndexList[2](rows, cols)
    var o = OutputTensor[static_spec=Spec](dst, shape)
    var x = InputTensor[static_spec=Spec](a, shape)
    var y = InputTensor[static_spec=Spec](b, shape)
    comptime if OP == 0:
        Softmax.execute[TARGET](o, x, ctx)
    elif OP == 1:
        LogSoftmax.execute[TARGET](o, x, ctx)
    elif OP == 2:
        SoftmaxBackward.execute[TARGET](o, x, y, ctx)
    else:
        LogSoftmaxBackward.execute[TARGET](o, x, y, ctx)


def ptr[
    dtype: DType
](mut buf: DeviceBuffer[dtype]) -> Pointer[Scalar[dtype], MutAnyOrigin]:
    return buf.unsafe_ptr().as_unsafe_any_origin()


def reference(
    op: Int, x: List[Float64], g: List[Float64], r: Int, cols: Int
) -> List[Float64]:
    """Row r of op in float64. For the backwards, the forward output is computed
    here from x (softmax or log_softmax), and g is the incoming gradient."""
    var base = r * cols
    var m: Float64 = -1e300
    for c in range(cols):
        m = max(m, x[base + c])
    var s: Float64 = 0
    for c in range(cols):
        s += exp(x[base + c] - m)
    var out = List[Float64]()
    var dot: Float64 = 0
    var gsum: Float64 = 0
    for c in range(cols):
        var p = exp(x[base + c] - m) / s
        dot += g[base + c] * p
        gsum += g[base + c]
    for c in range(cols):
        var p = exp(x[base + c] - m) / s
        if op == 0:
            out.append(p)
        elif op == 1:
            out.append(x[base + c] - m - log(s))
        elif op == 2:
            out.append(p * (g[base + c] - dot))
        else:
            out.append(g[base + c] - p * gsum)
    return out^


def op_name(op: Int) -> String:
    if op == 0:
        return "softmax"
    if op == 1:
        return "log_softmax"
    if op == 2:
        return "softmax_bwd"
    return "log_softmax_bwd"


def kernel_name(kernel: Int) -> String:
    if kernel == LOOPED:
        return "[looped]"
    if kernel == CLUSTER:
        return "[cluster]"
    if kernel == CLUSTER_MIN:
        return "[cluster-min]"
    return ""


def max_prob(x: List[Float64], r: Int, cols: Int) -> Float64:
    """The largest softmax probability of row r."""
    var m: Float64 = -1e300
    for c in range(cols):
        m = max(m, x[r * cols + c])
    var s: Float64 = 0
    for c in range(cols):
        s += exp(x[r * cols + c] - m)
    return 1 / s


def check[
    dtype: DType, OP: Int, KERNEL: Int = DISPATCH
](
    ctx: DeviceContext,
    rows: Int,
    cols: Int,
    tol: Float64,
    scale: Float64 = 8.0,
    holes: Bool = False,
) raises where dtype.is_floating_point():
    """Run op OP on (rows, cols) and compare with the float64 reference.

    x is uniform in [-scale, scale); with `holes`, every 97th element of x is -inf
    (a masked logit: softmax 0, log_softmax -inf, which must match exactly)."""
    var n = rows * cols
    var hx = ctx.enqueue_create_host_buffer[dtype](n)
    var hg = ctx.enqueue_create_host_buffer[dtype](n)
    ctx.synchronize()
    fill_random(hx, n, UInt64(rows * 7919 + cols), scale)
    fill_random(hg, n, UInt64(cols * 104729 + rows), 1.0)
    if holes:
        for i in range(3, n, 97):
            hx[i] = Scalar[dtype].MIN
    var x = List[Float64]()
    var g = List[Float64]()
    for i in range(n):
        x.append(Float64(hx[i].cast[DType.float64]()))
        g.append(Float64(hg[i].cast[DType.float64]()))
    # the backwards take the forward output y, rounded to dtype like torch would hold it
    var hy = ctx.enqueue_create_host_buffer[dtype](n)
    ctx.synchronize()
    if OP >= 2:
        for r in range(rows):
            var y = reference(OP - 2, x, g, r, cols)
            for c in range(cols):
                hy[r * cols + c] = Scalar[DType.float64](y[c]).cast[dtype]()
    var d_a = ctx.enqueue_create_buffer[dtype](n)
    var d_b = ctx.enqueue_create_buffer[dtype](n)
    var d_o = ctx.enqueue_create_buffer[dtype](n)
    d_o.enqueue_fill(
        Scalar[dtype](7)
    )  # a skipped element cannot pass as correct
    if OP >= 2:
        ctx.enqueue_copy(dst_buf=d_a, src_buf=hg)
        ctx.enqueue_copy(dst_buf=d_b, src_buf=hy)
    else:
        ctx.enqueue_copy(dst_buf=d_a, src_buf=hx)
        ctx.enqueue_copy(dst_buf=d_b, src_buf=hx)
    ctx.synchronize()
    run_op[dtype, OP, KERNEL](ctx, ptr(d_o), ptr(d_a), ptr(d_b), rows, cols)
    var worst: Float64 = 0
    var bad = 0  # non-finite mismatches (a -inf where none belongs, NaN, ...)
    var inf = Float64.MAX
    with d_o.map_to_host() as got:
        for r in range(rows):
            var want = reference(OP, x, g, r, cols)
            # errors relative to the row's largest value; for softmax_backward at
            # least the size of its terms, y * g: a one-hot y gives dx ~ 0, which
            # any rounding would miss by 100%
            var row_scale: Float64 = 0
            var g_max: Float64 = 0
            for c in range(cols):
                if abs(want[c]) < inf:
                    row_scale = max(row_scale, abs(want[c]))
                g_max = max(g_max, abs(g[r * cols + c]))
            if OP == 2:
                row_scale = max(row_scale, g_max * max_prob(x, r, cols))
            for c in range(cols):
                var v = Float64(got[r * cols + c].cast[DType.float64]())
                if not (abs(want[c]) < inf):  # log_softmax of a masked logit
                    if not (v == want[c]):
                        bad += 1
                    continue
                var err = abs(v - want[c])
                if not (err < inf):  # NaN or inf where a number belongs
                    bad += 1
                    continue
                worst = max(worst, err / (row_scale + 1e-30))
    print(
        "  ",
        op_name(OP),
        kernel_name(KERNEL),
        dtype,
        rows,
        "x",
        cols,
        "scale",
        scale,
        "holes" if holes else "",
        "max err / row max",
        worst,
        "non-finite mismatches",
        bad,
    )
    if not (worst <= tol) or bad > 0:
        raise Error(
            "day012 gpu_check: ",
            op_name(OP),
            kernel_name(KERNEL),
            " ",
            rows,
            "x",
            cols,
            " error ",
            worst,
            " > ",
            tol,
            " or ",
            bad,
            " non-finite mismatches",
        )


def check_all_ops[
    dtype: DType, KERNEL: Int = DISPATCH
](
    ctx: DeviceContext,
    rows: Int,
    cols: Int,
    tol: Float64,
    scale: Float64 = 8.0,
    holes: Bool = False,
) raises where dtype.is_floating_point():
    check[dtype, 0, KERNEL](ctx, rows, cols, tol, scale, holes)
    check[dtype, 1, KERNEL](ctx, rows, cols, tol, scale, holes)
    check[dtype, 2, KERNEL](ctx, rows, cols, tol, scale, holes)
    check[dtype, 3, KERNEL](ctx, rows, cols, tol, scale, holes)


def check_long_rows[
    dtype: DType
](
    ctx: DeviceContext, rows: Int, cols: Int, tol: Float64
) raises where dtype.is_floating_point():
    """A long row through the op's dispatch with large magnitudes and -inf holes,
    then through each long-row kernel directly. The row must fit 8 CTAs, forward
    and backward (run_long_row_kernel raises otherwise)."""
    check_all_ops[dtype](ctx, rows, cols, tol, 1000.0, True)
    check_all_ops[dtype, LOOPED](ctx, rows, cols, tol)
    check_all_ops[dtype, CLUSTER](ctx, rows, cols, tol, 1000.0, True)
    check_all_ops[dtype, CLUSTER_MIN](ctx, rows, cols, tol)


def time_op[
    dtype: DType, OP: Int, KERNEL: Int = DISPATCH
](
    ctx: DeviceContext, rows: Int, cols: Int, copy_gbps: Float64
) raises where dtype.is_floating_point():
    var n = rows * cols
    var a = ctx.enqueue_create_buffer[dtype](n)
    var b = ctx.enqueue_create_buffer[dtype](n)
    var o = ctx.enqueue_create_buffer[dtype](n)
    a.enqueue_fill(Scalar[dtype](0.5))  # values do not change the work done
    b.enqueue_fill(Scalar[dtype](0.25))
    ctx.synchronize()

    var po = ptr(o)
    var pa = ptr(a)
    var pb = ptr(b)

    def launch(
        c: DeviceContext,
    ) raises {var po, var pa, var pb, var rows, var cols}:
        run_op[dtype, OP, KERNEL](c, po, pa, pb, rows, cols)

    launch(ctx)
    ctx.synchronize()
    var iters = 20
    var us = Float64(ctx.execution_time(launch, iters)) / Float64(iters) / 1e3
    var tensors = 3 if OP >= 2 else 2
    var gbps = Float64(tensors * n * size_of[dtype]()) / us / 1e3
    var tag = kernel_name(KERNEL)
    comptime if KERNEL == CLUSTER or KERNEL == CLUSTER_MIN:
        var w = vec_width[dtype]() if cols % vec_width[dtype]() == 0 else 1
        var ctas = cluster_ctas(
            KERNEL, cols, 2 if OP >= 2 else 1, size_of[dtype](), w
        )
        var name = "cluster" if KERNEL == CLUSTER else "cluster-min"
        tag = String("[", name, " ", ctas, " CTAs]")
    print(
        "  ",
        op_name(OP),
        tag,
        dtype,
        rows,
        "x",
        cols,
        " us",
        us,
        " GB/s",
        gbps,
        " % copy",
        100 * gbps / copy_gbps,
    )


def time_shape[
    dtype: DType
](
    ctx: DeviceContext, rows: Int, cols: Int, copy_gbps: Float64
) raises where dtype.is_floating_point():
    time_op[dtype, 0](ctx, rows, cols, copy_gbps)
    time_op[dtype, 1](ctx, rows, cols, copy_gbps)
    time_op[dtype, 2](ctx, rows, cols, copy_gbps)
    time_op[dtype, 3](ctx, rows, cols, copy_gbps)


def time_long_op[
    dtype: DType, OP: Int
](
    ctx: DeviceContext, rows: Int, cols: Int, copy_gbps: Float64
) raises where dtype.is_floating_point():
    """The op as dispatched (untagged line), then the long-row kernels side by side:
    looped (v5), the cluster the dispatch picks, and the fewest-CTA cluster when
    that differs. For rows of at most
    CACHE_BYTES (e.g. 32000 fp32 forward) the dispatch takes the looped kernel.
    """
    var tensors = 2 if OP >= 2 else 1
    var w = vec_width[dtype]() if cols % vec_width[dtype]() == 0 else 1
    time_op[dtype, OP](ctx, rows, cols, copy_gbps)  # what the op runs
    time_op[dtype, OP, LOOPED](ctx, rows, cols, copy_gbps)
    var c = cluster_ctas(CLUSTER, cols, tensors, size_of[dtype](), w)
    var c_min = cluster_ctas(CLUSTER_MIN, cols, tensors, size_of[dtype](), w)
    if c > 0:
        time_op[dtype, OP, CLUSTER](ctx, rows, cols, copy_gbps)
    if c_min > 0 and c_min != c:
        time_op[dtype, OP, CLUSTER_MIN](ctx, rows, cols, copy_gbps)


def time_long_shape[
    dtype: DType
](
    ctx: DeviceContext, rows: Int, cols: Int, copy_gbps: Float64
) raises where dtype.is_floating_point():
    time_long_op[dtype, 0](ctx, rows, cols, copy_gbps)
    time_long_op[dtype, 1](ctx, rows, cols, copy_gbps)
    time_long_op[dtype, 2](ctx, rows, cols, copy_gbps)
    time_long_op[dtype, 3](ctx, rows, cols, copy_gbps)


def copy_bandwidth(ctx: DeviceContext) raises -> Float64:
    comptime N = 1 << 28  # 1 GiB of float32
    var a = ctx.enqueue_create_buffer[DType.float32](N)
    var b = ctx.enqueue_create_buffer[DType.float32](N)
    a.enqueue_fill(1.0)
    ctx.synchronize()

    def copy(c: DeviceContext) raises {var a, var b}:
        c.enqueue_copy(dst_buf=b, src_buf=a)

    copy(ctx)
    var us = Float64(ctx.execution_time(copy, 10)) / 10 / 1e3
    return Float64(2 * N * 4) / us / 1e3


def check_cluster_policy() raises:
    """The CTAs per row the dispatch picks (0: looped), as the journal states them:
    (cols, tensors, element bytes, vector width, CTAs)."""
    var cases: List[Tuple[Int, Int, Int, Int, Int]] = [
        (128256, 1, 4, 4, 8),  # fp32 forward: 8 x 64 KB
        (128256, 2, 4, 4, 8),  # fp32 backward: 8 x 128 KB (one CTA per SM)
        (128256, 1, 2, 8, 4),  # bf16 forward: 4 x 64 KB
        (128256, 2, 2, 8, 8),  # bf16 backward: 8 x 64 KB
        (32000, 2, 4, 4, 4),  # fp32 backward: 4 x 64 KB
        (56000, 1, 4, 4, 2),  # fp32 forward: 2 x 112000 bytes
        (131071, 2, 4, 1, 8),  # odd: scalar slices of 16384
        (229376, 2, 4, 4, 8),  # fp32 backward: the longest row 8 CTAs hold
        (229380, 2, 4, 4, 0),  # ... one vector more: looped
        (458752, 1, 4, 4, 8),  # fp32 forward: the longest row
        (458756, 1, 4, 4, 0),
    ]
    for row in cases:
        var got = cluster_size_for(row[0], row[1], row[2], row[3])
        if got != row[4]:
            raise Error(
                "day012 gpu_check: cluster_size_for(",
                row[0],
                ", ",
                row[1],
                " tensors) = ",
                got,
                ", expected ",
                row[4],
            )
    print("   cluster sizes as documented")


def main() raises:
    var ctx = DeviceContext() if has_accelerator() else DeviceContext(api="cpu")
    print("day012 softmax family on", TARGET)
    check_cluster_policy()
    # (rows, cols): warp rows (1, 37 scalar, 256), block rows (1000, 4097 scalar)
    check_all_ops[DType.float32](ctx, 5, 1, 1e-6)
    check_all_ops[DType.float32](ctx, 9, 37, 1e-6)
    check_all_ops[DType.float32](ctx, 7, 256, 1e-6, 1000.0, True)
    check_all_ops[DType.float32](ctx, 3, 1000, 1e-6)
    check_all_ops[DType.float32](ctx, 3, 4097, 1e-6)
    check_all_ops[DType.bfloat16](ctx, 5, 1024, 2e-2)
    comptime if has_accelerator():
        check_all_ops[DType.float32](ctx, 67, 4096, 1e-6)
        check_all_ops[DType.float32](ctx, 2, 40000, 1e-6)
        check_all_ops[DType.bfloat16](ctx, 3, 4100, 2e-2)
        check_all_ops[DType.float16](ctx, 3, 16384, 2e-2)
        # long rows: dispatch (looped or cluster), looped, both cluster sizes;
        # 40961 and 131071 are odd (scalar loads), 56000 fp32 takes a 2-CTA cluster
        check_long_rows[DType.float32](ctx, 3, 32000, 1e-6)
        check_long_rows[DType.float32](ctx, 2, 40961, 1e-6)
        check_long_rows[DType.float32](ctx, 2, 56000, 1e-6)
        check_long_rows[DType.float32](ctx, 2, 128256, 1e-6)
        check_long_rows[DType.float32](ctx, 2, 131071, 1e-6)
        check_long_rows[DType.bfloat16](ctx, 3, 32000, 2e-2)
        check_long_rows[DType.bfloat16](ctx, 2, 40961, 2e-2)
        check_long_rows[DType.bfloat16](ctx, 3, 128256, 2e-2)
        check_long_rows[DType.bfloat16](ctx, 2, 131071, 2e-2)
        check_long_rows[DType.bfloat16](ctx, 2, 262144, 2e-2)
        # fp32 262144: the forward takes 8 CTAs, the backward (2 MB) the looped kernel
        check_all_ops[DType.float32](ctx, 2, 262144, 1e-6, 1000.0, True)
        check[DType.float32, 0, CLUSTER](ctx, 2, 262144, 1e-6)
        check[DType.float32, 1, CLUSTER](ctx, 2, 262144, 1e-6)
        var copy_gbps = copy_bandwidth(ctx)
        print("copy GB/s", copy_gbps)
        var shapes: List[Tuple[Int, Int]] = [
            (32768, 256),
            (32768, 1024),
            (32768, 4096),
            (16384, 16384),
        ]
        for shape in shapes:
            time_shape[DType.float32](ctx, shape[0], shape[1], copy_gbps)
        for shape in shapes:
            time_shape[DType.bfloat16](ctx, shape[0], shape[1], copy_gbps)
        # long rows: every kernel that can take them, side by side
        var long_shapes: List[Tuple[Int, Int]] = [
            (4096, 32000),
            (4096, 128256),
            (256, 262144),
        ]
        for shape in long_shapes:
            time_long_shape[DType.float32](ctx, shape[0], shape[1], copy_gbps)
        for shape in long_shapes:
            time_long_shape[DType.bfloat16](ctx, shape[0], shape[1], copy_gbps)
    print("OK")
