# Day 013 GPU check: LayerNorm.execute and LayerNormBackward.execute against a
# float64 reference computed here on the host, then (on a GPU) timings.
#   mojo run -I . tests/mojo/day013_layer_norm_gpu_check.mojo                  (CPU branch)
#   mojo build -I . --target-accelerator nvidia:90 tests/mojo/day013_layer_norm_gpu_check.mojo -o ln_check
# Every launch path is exercised: a warp per row, 256 and 512 threads per row,
# the streaming kernels for long rows, 16-byte vectors and the element-wise
# fallback (odd cols, a misaligned pointer), several rows per backward worker.
# Bytes model of the timings (s = bytes per element, N = rows * cols):
#   forward:  read x, write y          = 2 N s  (+ weight, bias, mean, rstd)
#   backward: read dy and x, write dx  = 3 N s  (+ weight, mean, rstd, grads)
# The extra terms are counted too; they are < 1% at these shapes.
from extensibility import InputTensor, OutputTensor, StaticTensorSpec
from max.gpu.host import DeviceContext
from std.math import sqrt
from std.sys import has_accelerator, size_of
from std.utils import IndexList

from days.day013.layer_norm import LayerNorm, LayerNormBackward

comptime TARGET = "gpu" if has_accelerator() else "cpu"
comptime EPS = Float32(1e-5)
comptime P64 = Pointer[Float64, MutAnyOrigin]


def fill[
    dtype: DType
](
    p: Pointer[Scalar[dtype], MutAnyOrigin],
    n: Int,
    seed: UInt64,
    offset: Float64,
    scale: Float64,
):
    """Fill p with offset + scale * u, u uniform in [-1, 1) from a small LCG."""
    var state = seed * 2862933555777941757 + 3037000493
    for i in range(n):
        state = state * 6364136223846793005 + 1442695040888963407
        var u = Float64(state >> 40) / Float64(1 << 23) - 1.0
        p[unsafe_offset=i] = Scalar[dtype](offset + scale * u)


def rel_err[
    dtype: DType
](got: Pointer[Scalar[dtype], MutAnyOrigin], want: P64, n: Int) -> Float64:
    """Max |got - want| / max(max |want|, 1): error on the scale of the output
    (the data are O(1); the floor covers outputs that are exactly 0, such as
    grad_x of a one-column row, which comes out at rounding level)."""
    var err: Float64 = 0
    var scale: Float64 = 1
    for i in range(n):
        var w = want[unsafe_offset=i]
        err = max(err, abs(Float64(got[unsafe_offset=i]) - w))
        scale = max(scale, abs(w))
    if err != err:
        return Float64.MAX  # NaN
    return err / scale


def tolerance[dtype: DType]() -> Tuple[Float64, Float64]:
    """(forward, backward) tolerance on rel_err. float64 gradients are limited
    by the float32 rstd they are computed from."""
    comptime if dtype == DType.float64:
        return (1e-12, 1e-6)
    elif dtype == DType.float32:
        return (1e-5, 1e-4)
    elif dtype == DType.float16:
        return (2e-3, 4e-3)
    else:
        return (1e-2, 2e-2)


def check[
    dtype: DType
](
    ctx: DeviceContext,
    rows: Int,
    cols: Int,
    offset: Float64 = 0,
    misalign: Int = 0,
) raises:
    """Forward and backward on one (rows, cols) input; `misalign` shifts the
    x, y, dy and dx pointers by that many elements off 16-byte alignment."""
    comptime S2 = StaticTensorSpec[dtype, 2, ...].get_unknown()
    comptime S1 = StaticTensorSpec[dtype, 1, ...].get_unknown()
    comptime F1 = StaticTensorSpec[DType.float32, 1, ...].get_unknown()
    var n = rows * cols
    var m = misalign
    var hx = ctx.enqueue_create_host_buffer[dtype](n + m)
    var hdy = ctx.enqueue_create_host_buffer[dtype](n + m)
    var hw = ctx.enqueue_create_host_buffer[dtype](cols)
    var hb = ctx.enqueue_create_host_buffer[dtype](cols)
    var heps = ctx.enqueue_create_host_buffer[DType.float32](1)
    ctx.synchronize()
    var seed = UInt64(rows * 7919 + cols)
    fill(hx.unsafe_ptr().as_unsafe_any_origin(), n + m, seed, offset, 3.0)
    fill(hdy.unsafe_ptr().as_unsafe_any_origin(), n + m, seed + 1, 0.0, 1.0)
    fill(hw.unsafe_ptr().as_unsafe_any_origin(), cols, seed + 2, 1.0, 0.5)
    fill(hb.unsafe_ptr().as_unsafe_any_origin(), cols, seed + 3, 0.0, 0.5)
    heps[0] = EPS

    var dx_in = ctx.enqueue_create_buffer[dtype](n + m)
    var ddy = ctx.enqueue_create_buffer[dtype](n + m)
    var dw = ctx.enqueue_create_buffer[dtype](cols)
    var db = ctx.enqueue_create_buffer[dtype](cols)
    var deps = ctx.enqueue_create_buffer[DType.float32](1)
    var dy_out = ctx.enqueue_create_buffer[dtype](n + m)
    var dmean = ctx.enqueue_create_buffer[DType.float32](rows)
    var drstd = ctx.enqueue_create_buffer[DType.float32](rows)
    var dgx = ctx.enqueue_create_buffer[dtype](n + m)
    var dgw = ctx.enqueue_create_buffer[dtype](cols)
    var dgb = ctx.enqueue_create_buffer[dtype](cols)
    ctx.enqueue_copy(dst_buf=dx_in, src_buf=hx)
    ctx.enqueue_copy(dst_buf=ddy, src_buf=hdy)
    ctx.enqueue_copy(dst_buf=dw, src_buf=hw)
    ctx.enqueue_copy(dst_buf=db, src_buf=hb)
    ctx.enqueue_copy(dst_buf=deps, src_buf=heps)
    ctx.synchronize()

    var s2 = IndexList[2](rows, cols)
    var sr = IndexList[1](rows)
    var sc = IndexList[1](cols)
    var px = dx_in.unsafe_ptr().as_unsafe_any_origin().unsafe_offset(m)
    var py = dy_out.unsafe_ptr().as_unsafe_any_origin().unsafe_offset(m)
    var pdy = ddy.unsafe_ptr().as_unsafe_any_origin().unsafe_offset(m)
    var pgx = dgx.unsafe_ptr().as_unsafe_any_origin().unsafe_offset(m)
    LayerNorm.execute[TARGET](
        OutputTensor[static_spec=S2](py, s2),
        OutputTensor[static_spec=F1](dmean.unsafe_ptr(), sr),
        OutputTensor[static_spec=F1](drstd.unsafe_ptr(), sr),
        InputTensor[static_spec=S2](px, s2),
        InputTensor[static_spec=S1](dw.unsafe_ptr(), sc),
        InputTensor[static_spec=S1](db.unsafe_ptr(), sc),
        InputTensor[static_spec=F1](deps.unsafe_ptr(), IndexList[1](1)),
        ctx,
    )
    LayerNormBackward.execute[TARGET](
        OutputTensor[static_spec=S2](pgx, s2),
        OutputTensor[static_spec=S1](dgw.unsafe_ptr(), sc),
        OutputTensor[static_spec=S1](dgb.unsafe_ptr(), sc),
        InputTensor[static_spec=S2](pdy, s2),
        InputTensor[static_spec=S2](px, s2),
        InputTensor[static_spec=S1](dw.unsafe_ptr(), sc),
        InputTensor[static_spec=F1](dmean.unsafe_ptr(), sr),
        InputTensor[static_spec=F1](drstd.unsafe_ptr(), sr),
        ctx,
    )
    var hy = ctx.enqueue_create_host_buffer[dtype](n + m)
    var hmean = ctx.enqueue_create_host_buffer[DType.float32](rows)
    var hrstd = ctx.enqueue_create_host_buffer[DType.float32](rows)
    var hgx = ctx.enqueue_create_host_buffer[dtype](n + m)
    var hgw = ctx.enqueue_create_host_buffer[dtype](cols)
    var hgb = ctx.enqueue_create_host_buffer[dtype](cols)
    ctx.enqueue_copy(dst_buf=hy, src_buf=dy_out)
    ctx.enqueue_copy(dst_buf=hmean, src_buf=dmean)
    ctx.enqueue_copy(dst_buf=hrstd, src_buf=drstd)
    ctx.enqueue_copy(dst_buf=hgx, src_buf=dgx)
    ctx.enqueue_copy(dst_buf=hgw, src_buf=dgw)
    ctx.enqueue_copy(dst_buf=hgb, src_buf=dgb)
    ctx.synchronize()

    # float64 reference from the very values the kernels saw
    var ref_y = List[Float64](length=n, fill=0)
    var ref_gx = List[Float64](length=n, fill=0)
    var ref_gw = List[Float64](length=cols, fill=0)
    var ref_gb = List[Float64](length=cols, fill=0)
    var mean_err: Float64 = 0
    var rstd_err: Float64 = 0
    for r in range(rows):
        var base = m + r * cols
        var s: Float64 = 0
        for c in range(cols):
            s += Float64(hx[base + c])
        var mean = s / Float64(cols)
        var q: Float64 = 0
        for c in range(cols):
            var d = Float64(hx[base + c]) - mean
            q += d * d
        var rstd = 1.0 / sqrt(q / Float64(cols) + Float64(EPS))
        mean_err = max(mean_err, abs(Float64(hmean[r]) - mean) * rstd)
        rstd_err = max(rstd_err, abs(Float64(hrstd[r]) / rstd - 1.0))
        var sg: Float64 = 0
        var sgx: Float64 = 0
        for c in range(cols):
            var xhat = (Float64(hx[base + c]) - mean) * rstd
            var g = Float64(hdy[base + c]) * Float64(hw[c])
            ref_y[r * cols + c] = xhat * Float64(hw[c]) + Float64(hb[c])
            sg += g
            sgx += g * xhat
            ref_gw[c] += Float64(hdy[base + c]) * xhat
            ref_gb[c] += Float64(hdy[base + c])
        for c in range(cols):
            var xhat = (Float64(hx[base + c]) - mean) * rstd
            var g = Float64(hdy[base + c]) * Float64(hw[c])
            ref_gx[r * cols + c] = rstd * (
                g - sg / Float64(cols) - xhat * sgx / Float64(cols)
            )
    var tol = tolerance[dtype]()
    # an offset row's mean is only as good as float32 can hold it (~6e-8 * offset)
    var stat_tol = 1e-5 + 3e-7 * abs(offset)
    var e_y = rel_err(
        hy.unsafe_ptr().as_unsafe_any_origin().unsafe_offset(m),
        ref_y.unsafe_ptr().as_unsafe_any_origin(),
        n,
    )
    var e_gx = rel_err(
        hgx.unsafe_ptr().as_unsafe_any_origin().unsafe_offset(m),
        ref_gx.unsafe_ptr().as_unsafe_any_origin(),
        n,
    )
    var e_gw = rel_err(
        hgw.unsafe_ptr().as_unsafe_any_origin(),
        ref_gw.unsafe_ptr().as_unsafe_any_origin(),
        cols,
    )
    var e_gb = rel_err(
        hgb.unsafe_ptr().as_unsafe_any_origin(),
        ref_gb.unsafe_ptr().as_unsafe_any_origin(),
        cols,
    )
    var fwd_tol = max(tol[0], stat_tol) if dtype != DType.float64 else tol[0]
    # float64 re-derives the mean in the backward; the others use the stored one
    var bwd_tol = (
        max(tol[1], 10 * stat_tol) if dtype != DType.float64 else tol[1]
    )
    print(
        "day013 check",
        TARGET,
        dtype,
        rows,
        "x",
        cols,
        "offset",
        offset,
        "misalign",
        m,
        "| err y",
        e_y,
        "mean",
        mean_err,
        "rstd",
        rstd_err,
        "| dx",
        e_gx,
        "dw",
        e_gw,
        "db",
        e_gb,
    )
    if not (e_y <= fwd_tol and mean_err <= stat_tol and rstd_err <= 1e-5):
        raise Error("day013 gpu_check: forward error above tolerance")
    if not (e_gx <= bwd_tol and e_gw <= bwd_tol and e_gb <= tol[1]):
        raise Error("day013 gpu_check: backward error above tolerance")


def time_shape[dtype: DType](ctx: DeviceContext, rows: Int, cols: Int) raises:
    """Median-free but honest: GPU event time of 20 calls of each op, as the
    torch op calls them (the backward includes its workspace and 2nd stage)."""
    comptime S2 = StaticTensorSpec[dtype, 2, ...].get_unknown()
    comptime S1 = StaticTensorSpec[dtype, 1, ...].get_unknown()
    comptime F1 = StaticTensorSpec[DType.float32, 1, ...].get_unknown()
    var n = rows * cols
    var hx = ctx.enqueue_create_host_buffer[dtype](n)
    var hw = ctx.enqueue_create_host_buffer[dtype](cols)
    ctx.synchronize()
    fill(hx.unsafe_ptr().as_unsafe_any_origin(), n, 5, 0.0, 2.0)
    fill(hw.unsafe_ptr().as_unsafe_any_origin(), cols, 6, 1.0, 0.5)
    var bx = ctx.enqueue_create_buffer[dtype](n)
    var by = ctx.enqueue_create_buffer[dtype](n)
    var bdy = ctx.enqueue_create_buffer[dtype](n)
    var bdx = ctx.enqueue_create_buffer[dtype](n)
    var bw = ctx.enqueue_create_buffer[dtype](cols)
    var bgw = ctx.enqueue_create_buffer[dtype](cols)
    var bgb = ctx.enqueue_create_buffer[dtype](cols)
    var bmean = ctx.enqueue_create_buffer[DType.float32](rows)
    var brstd = ctx.enqueue_create_buffer[DType.float32](rows)
    var beps = ctx.enqueue_create_buffer[DType.float32](1)
    ctx.enqueue_copy(dst_buf=bx, src_buf=hx)
    ctx.enqueue_copy(dst_buf=bdy, src_buf=hx)
    ctx.enqueue_copy(dst_buf=bw, src_buf=hw)
    beps.enqueue_fill(EPS)
    ctx.synchronize()
    var px = bx.unsafe_ptr().as_unsafe_any_origin()
    var py = by.unsafe_ptr().as_unsafe_any_origin()
    var pdy = bdy.unsafe_ptr().as_unsafe_any_origin()
    var pdx = bdx.unsafe_ptr().as_unsafe_any_origin()
    var pw = bw.unsafe_ptr().as_unsafe_any_origin()
    var pgw = bgw.unsafe_ptr().as_unsafe_any_origin()
    var pgb = bgb.unsafe_ptr().as_unsafe_any_origin()
    var pm = bmean.unsafe_ptr().as_unsafe_any_origin()
    var pr = brstd.unsafe_ptr().as_unsafe_any_origin()
    var pe = beps.unsafe_ptr().as_unsafe_any_origin()

    def forward(
        c: DeviceContext,
    ) raises {
        var px, var py, var pw, var pm, var pr, var pe, var rows, var cols
    }:
        LayerNorm.execute[TARGET](
            OutputTensor[static_spec=S2](py, IndexList[2](rows, cols)),
            OutputTensor[static_spec=F1](pm, IndexList[1](rows)),
            OutputTensor[static_spec=F1](pr, IndexList[1](rows)),
            InputTensor[static_spec=S2](px, IndexList[2](rows, cols)),
            InputTensor[static_spec=S1](pw, IndexList[1](cols)),
            InputTensor[static_spec=S1](pw, IndexList[1](cols)),
            InputTensor[static_spec=F1](pe, IndexList[1](1)),
            c,
        )

    def backward(
        c: DeviceContext,
    ) raises {
        var px,
        var pdy,
        var pdx,
        var pw,
        var pgw,
        var pgb,
        var pm,
        var pr,
        var rows,
        var cols,
    }:
        LayerNormBackward.execute[TARGET](
            OutputTensor[static_spec=S2](pdx, IndexList[2](rows, cols)),
            OutputTensor[static_spec=S1](pgw, IndexList[1](cols)),
            OutputTensor[static_spec=S1](pgb, IndexList[1](cols)),
            InputTensor[static_spec=S2](pdy, IndexList[2](rows, cols)),
            InputTensor[static_spec=S2](px, IndexList[2](rows, cols)),
            InputTensor[static_spec=S1](pw, IndexList[1](cols)),
            InputTensor[static_spec=F1](pm, IndexList[1](rows)),
            InputTensor[static_spec=F1](pr, IndexList[1](rows)),
            c,
        )

    def copy(c: DeviceContext) raises {var by, var bx}:
        c.enqueue_copy(dst_buf=by, src_buf=bx)

    comptime ITERS = 20
    forward(ctx)  # warm-up: loads the kernels
    backward(ctx)
    copy(ctx)
    ctx.synchronize()
    var s = size_of[dtype]()
    var fwd_bytes = 2 * n * s + 2 * cols * s + 8 * rows
    var bwd_bytes = 3 * n * s + 3 * cols * s + 8 * rows
    var results = List[Tuple[String, Int, Int]]()
    results.append(("copy", ctx.execution_time(copy, ITERS), 2 * n * s))
    results.append(("forward", ctx.execution_time(forward, ITERS), fwd_bytes))
    results.append(("backward", ctx.execution_time(backward, ITERS), bwd_bytes))
    for entry in results:
        var us = Float64(entry[1]) / ITERS / 1e3
        print(
            "day013 time",
            dtype,
            rows,
            "x",
            cols,
            entry[0],
            "us",
            us,
            "GB/s",
            Float64(entry[2]) / (us * 1e3),
        )


def main() raises:
    var ctx = DeviceContext() if has_accelerator() else DeviceContext(api="cpu")
    # tiny and odd shapes, each launch tier, vector and element-wise loads
    check[DType.float32](ctx, 1, 1)
    check[DType.float32](ctx, 67, 17)
    check[DType.float32](ctx, 33, 1000)
    check[DType.float32](ctx, 5, 4097)
    check[DType.bfloat16](ctx, 9, 4096)
    check[DType.float64](ctx, 17, 33)
    check[DType.float64](ctx, 8, 64, offset=1e6)  # backward re-derives the mean
    check[DType.float32](
        ctx, 16, 1024, offset=1e4
    )  # large offset, small spread
    check[DType.float32](ctx, 9, 4096, misalign=1)
    comptime if has_accelerator():
        check[DType.float32](ctx, 64, 1024)  # a warp per row, full
        check[DType.float32](ctx, 3000, 64)  # many rows per backward worker
        check[DType.float32](ctx, 3, 1026)  # element loads, 512 threads
        check[DType.float32](ctx, 9, 4096)  # 256 threads x 4 float4
        check[DType.float32](ctx, 5, 6000)  # backward: 512 threads x 4 float4
        check[DType.float32](ctx, 7, 12288)  # 512 threads x 8 float4
        check[DType.float32](ctx, 3, 70000)  # streaming kernels
        check[DType.float32](ctx, 300, 20000)  # streaming, several rows/worker
        check[DType.float32](ctx, 2000, 4096, offset=1e4)
        check[DType.bfloat16](ctx, 33, 1000)
        check[DType.bfloat16](ctx, 5, 4097)
        check[DType.bfloat16](ctx, 7, 12288)
        check[DType.bfloat16](
            ctx, 4, 30000
        )  # backward: shared memory too small
        check[DType.bfloat16](ctx, 3, 70000)
        check[DType.bfloat16](ctx, 8, 2048, misalign=3)
        check[DType.float16](ctx, 33, 1000)
        check[DType.float16](ctx, 1000, 4096)
        check[DType.float64](ctx, 33, 1000)
        check[DType.float64](ctx, 3, 3001)
        check[DType.float64](ctx, 2, 20000)
        check[DType.float64](ctx, 64, 512, offset=1e6)
        print("OK")  # correctness first; timings below are informational
        for cols in [1024, 4096, 16384]:
            time_shape[DType.float32](ctx, 4096, cols)
        time_shape[DType.float32](ctx, 32768, 4096)
        for cols in [1024, 4096, 16384]:
            time_shape[DType.bfloat16](ctx, 4096, cols)
        time_shape[DType.bfloat16](ctx, 32768, 4096)
    else:
        print("OK")
