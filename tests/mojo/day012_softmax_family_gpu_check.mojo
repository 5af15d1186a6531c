# Day 012 GPU check: the four softmax-family ops against a float64 host reference on
# shapes that reach every kernel variant (warp rows, block rows, looped rows; 16-byte
# vectors and the scalar fallback for unaligned widths), then, on a GPU, kernel
# timings for the issue's benchmark shapes.
#   mojo run -I . tests/mojo/day012_softmax_family_gpu_check.mojo                 (CPU branch)
#   mojo build -I . --target-accelerator nvidia:90 tests/mojo/day012_softmax_family_gpu_check.mojo
from extensibility import InputTensor, OutputTensor, StaticTensorSpec
from max.gpu.host import DeviceContext, DeviceBuffer, HostBuffer
from std.math import exp, log
from std.sys import has_accelerator, size_of
from std.utils import IndexList

from days.day012.softmax_family import (
    LogSoftmax,
    LogSoftmaxBackward,
    Softmax,
    SoftmaxBackward,
)

comptime TARGET = "gpu" if has_accelerator() else "cpu"


def fill_random[
    dtype: DType
](host: HostBuffer[dtype], n: Int, seed: UInt64, scale: Float64):
    var state = seed
    for i in range(n):  # a small LCG: values in [-scale, scale)
        state = state * 6364136223846793005 + 1442695040888963407
        var u = Float64(state >> 40) / Float64(1 << 24)
        host[i] = Scalar[DType.float64]((u * 2 - 1) * scale).cast[dtype]()


def run_op[
    dtype: DType, OP: Int
](
    ctx: DeviceContext,
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    a: Pointer[Scalar[dtype], MutAnyOrigin],
    b: Pointer[Scalar[dtype], MutAnyOrigin],
    rows: Int,
    cols: Int,
) raises:
    """OP: 0 softmax, 1 log_softmax, 2 softmax_backward, 3 log_softmax_backward.
    """
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


def check[
    dtype: DType, OP: Int
](ctx: DeviceContext, rows: Int, cols: Int, tol: Float64) raises:
    """Run op OP on (rows, cols) and compare with the float64 reference."""
    var n = rows * cols
    var hx = ctx.enqueue_create_host_buffer[dtype](n)
    var hg = ctx.enqueue_create_host_buffer[dtype](n)
    ctx.synchronize()
    fill_random(hx, n, UInt64(rows * 7919 + cols), 8.0)
    fill_random(hg, n, UInt64(cols * 104729 + rows), 1.0)
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
    if OP >= 2:
        ctx.enqueue_copy(dst_buf=d_a, src_buf=hg)
        ctx.enqueue_copy(dst_buf=d_b, src_buf=hy)
    else:
        ctx.enqueue_copy(dst_buf=d_a, src_buf=hx)
        ctx.enqueue_copy(dst_buf=d_b, src_buf=hx)
    ctx.synchronize()
    run_op[dtype, OP](ctx, ptr(d_o), ptr(d_a), ptr(d_b), rows, cols)
    var worst: Float64 = 0
    with d_o.map_to_host() as got:
        for r in range(rows):
            var want = reference(OP, x, g, r, cols)
            var scale: Float64 = 0  # errors relative to the row's largest value
            for c in range(cols):
                scale = max(scale, abs(want[c]))
            for c in range(cols):
                var err = abs(
                    Float64(got[r * cols + c].cast[DType.float64]()) - want[c]
                )
                worst = max(worst, err / (scale + 1e-30))
    var names: List[String] = [
        "softmax",
        "log_softmax",
        "softmax_backward",
        "log_softmax_backward",
    ]
    print("  ", names[OP], dtype, rows, "x", cols, "max err / row max", worst)
    if not (worst <= tol):
        raise Error(
            "day012 gpu_check: ",
            names[OP],
            " ",
            rows,
            "x",
            cols,
            " error ",
            worst,
            " > ",
            tol,
        )


def check_all_ops[
    dtype: DType
](ctx: DeviceContext, rows: Int, cols: Int, tol: Float64) raises:
    check[dtype, 0](ctx, rows, cols, tol)
    check[dtype, 1](ctx, rows, cols, tol)
    check[dtype, 2](ctx, rows, cols, tol)
    check[dtype, 3](ctx, rows, cols, tol)


def time_op[
    dtype: DType, OP: Int
](ctx: DeviceContext, rows: Int, cols: Int, copy_gbps: Float64) raises:
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
        run_op[dtype, OP](c, po, pa, pb, rows, cols)

    launch(ctx)
    ctx.synchronize()
    var iters = 20
    var us = Float64(ctx.execution_time(launch, iters)) / Float64(iters) / 1e3
    var tensors = 3 if OP >= 2 else 2
    var gbps = Float64(tensors * n * size_of[dtype]()) / us / 1e3
    var names: List[String] = [
        "softmax",
        "log_softmax",
        "softmax_bwd",
        "log_softmax_bwd",
    ]
    print(
        "  ",
        names[OP],
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
](ctx: DeviceContext, rows: Int, cols: Int, copy_gbps: Float64) raises:
    time_op[dtype, 0](ctx, rows, cols, copy_gbps)
    time_op[dtype, 1](ctx, rows, cols, copy_gbps)
    time_op[dtype, 2](ctx, rows, cols, copy_gbps)
    time_op[dtype, 3](ctx, rows, cols, copy_gbps)


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


def main() raises:
    var ctx = DeviceContext() if has_accelerator() else DeviceContext(api="cpu")
    print("day012 softmax family on", TARGET)
    # (rows, cols): warp rows (1, 37 scalar, 256), block rows (1000, 4097 scalar), looped (40000)
    check_all_ops[DType.float32](ctx, 5, 1, 1e-6)
    check_all_ops[DType.float32](ctx, 9, 37, 1e-6)
    check_all_ops[DType.float32](ctx, 7, 256, 1e-6)
    check_all_ops[DType.float32](ctx, 3, 1000, 1e-6)
    check_all_ops[DType.float32](ctx, 3, 4097, 1e-6)
    check_all_ops[DType.bfloat16](ctx, 5, 1024, 2e-2)
    comptime if has_accelerator():
        check_all_ops[DType.float32](ctx, 67, 4096, 1e-6)
        check_all_ops[DType.float32](ctx, 3, 32000, 1e-6)
        check_all_ops[DType.float32](ctx, 2, 40000, 1e-6)
        check_all_ops[DType.float32](ctx, 2, 40001, 1e-6)  # unaligned, looped
        check_all_ops[DType.float32](ctx, 2, 128256, 1e-6)
        check_all_ops[DType.bfloat16](ctx, 3, 4100, 2e-2)
        check_all_ops[DType.bfloat16](ctx, 3, 128256, 2e-2)
        check_all_ops[DType.float16](ctx, 3, 16384, 2e-2)
        var copy_gbps = copy_bandwidth(ctx)
        print("copy GB/s", copy_gbps)
        var shapes: List[Tuple[Int, Int]] = [
            (32768, 256),
            (32768, 1024),
            (32768, 4096),
            (16384, 16384),
            (4096, 32000),
            (4096, 128256),
        ]
        for shape in shapes:
            time_shape[DType.float32](ctx, shape[0], shape[1], copy_gbps)
        for shape in shapes:
            time_shape[DType.bfloat16](ctx, shape[0], shape[1], copy_gbps)
    print("OK")
