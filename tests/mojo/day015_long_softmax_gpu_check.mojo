# Day 015 GPU check: both long-softmax pipelines against a float64 reference computed
# here on the host, then timed for the issue's shapes.
#   mojo run -I . tests/mojo/day015_long_softmax_gpu_check.mojo                  (CPU branch)
#   mojo build -I . --target-accelerator nvidia:90 tests/mojo/day015_long_softmax_gpu_check.mojo
#       -o day015_check && ./day015_check                                         (H100)
# Checks: N = 1, N not a multiple of the block or of the vector width (the scalar
# path when rows > 1), partial tiles, several rows, -inf entries, a fully masked row,
# a NaN row, +1e4 offsets, bf16, the row max and sum left in the workspace, and the
# timed shapes themselves (sampled elements + the row sums).
from extensibility import InputTensor, OutputTensor, StaticTensorSpec
from max.gpu.host import DeviceContext
from std.math import exp, ceildiv
from std.sys import has_accelerator
from std.utils import IndexList

from days.day015.long_softmax import (
    LongSoftmax,
    MAX_SLOT,
    PARTIALS,
    SUM_SLOT,
    four_stage_softmax,
    fused_softmax,
)
from days.day015.multiblock_reduce import Ptr, WsPtr

comptime F32 = DType.float32
comptime F64 = DType.float64
comptime WsSpec = StaticTensorSpec[F64, 2, ...].get_unknown()
comptime TARGET = "gpu" if has_accelerator() else "cpu"
comptime MAX_BLOCKS_PER_ROW = 1024  # pytorch_custom_ops/long_softmax.py uses the same


def workspace_slots(n: Int) -> Int:
    var cap = min(MAX_BLOCKS_PER_ROW, max(1, ceildiv(n, 4096)))
    return PARTIALS + 2 * (cap + cap % 2)


struct Lcg:
    var state: UInt64

    def __init__(out self, seed: UInt64):
        self.state = seed

    def next(mut self) -> Float64:
        """Uniform in [0, 1)."""
        self.state = self.state * 6364136223846793005 + 1442695040888963407
        return Float64(self.state >> 40) / Float64(1 << 24)


def fill[
    dtype: DType
](h: Ptr[dtype], rows: Int, n: Int, seed: UInt64, specials: Bool,):
    """Values in [-20, 20). With `specials`: row 0 gets -inf entries, row 1 is fully
    masked (NaN row), row 2 gets a +1e4 offset, row 3 a NaN (NaN row)."""
    var g = Lcg(seed)
    for i in range(rows * n):
        h[unsafe_offset=i] = Scalar[dtype](g.next() * 40.0 - 20.0)
    if not specials:
        return
    var inf = Scalar[dtype].MAX
    for c in range(0, n, 3):
        h[unsafe_offset=c] = Scalar[dtype].MIN  # -inf
    if rows > 1:
        for c in range(n):
            h[unsafe_offset=n + c] = Scalar[dtype].MIN
    if rows > 2:
        for c in range(n):
            h[unsafe_offset=2 * n + c] = (
                h[unsafe_offset=2 * n + c].cast[F64]() + 1e4
            ).cast[dtype]()
    if rows > 3:
        h[unsafe_offset=3 * n + n // 2] = inf - inf  # NaN


def nan_row(x: List[Float64]) -> Bool:
    """Torch's softmax gives a NaN row for a NaN or a +inf in it, or when it is
    fully masked (-inf everywhere)."""
    var finite_max = False
    for v in x:
        if v != v:
            return True
        if v == Float64.MAX:
            return True
        if v > Float64.MIN:
            finite_max = True
    return not finite_max


def check[
    dtype: DType
](
    ctx: DeviceContext,
    rows: Int,
    n: Int,
    pipeline: StaticString,
    specials: Bool,
    tol: Float64,
    sample_every: Int = 1,
) raises:
    var total = rows * n
    var slots = workspace_slots(n)
    var h_in = ctx.enqueue_create_host_buffer[dtype](total)
    var h_out = ctx.enqueue_create_host_buffer[dtype](total)
    var h_ws = ctx.enqueue_create_host_buffer[F64](rows * slots)
    ctx.synchronize()
    fill(
        rebind[Ptr[dtype]](h_in.unsafe_ptr().as_unsafe_any_origin()),
        rows,
        n,
        UInt64(rows * 1000003 + n),
        specials,
    )
    var d_in = ctx.enqueue_create_buffer[dtype](total)
    var d_out = ctx.enqueue_create_buffer[dtype](total)
    var d_ws = ctx.enqueue_create_buffer[F64](rows * slots)
    ctx.enqueue_copy(dst_buf=d_in, src_buf=h_in)
    ctx.synchronize()
    comptime Spec = StaticTensorSpec[dtype, 2, ...].get_unknown()
    var shape = IndexList[2](rows, n)
    var out_t = OutputTensor[static_spec=Spec](d_out.unsafe_ptr(), shape)
    var ws_t = OutputTensor[static_spec=WsSpec](
        d_ws.unsafe_ptr(), IndexList[2](rows, slots)
    )
    var in_t = InputTensor[static_spec=Spec](d_in.unsafe_ptr(), shape)
    if pipeline == "fused":
        LongSoftmax.execute[TARGET, PIPELINE="fused"](out_t, ws_t, in_t, ctx)
    else:
        LongSoftmax.execute[TARGET, PIPELINE="four_stage"](
            out_t, ws_t, in_t, ctx
        )
    ctx.enqueue_copy(dst_buf=h_out, src_buf=d_out)
    ctx.enqueue_copy(dst_buf=h_ws, src_buf=d_ws)
    ctx.synchronize()

    var worst: Float64 = 0
    var worst_sum: Float64 = 0
    var worst_stats: Float64 = 0
    var x = List[Float64](length=n, fill=0)
    for r in range(rows):
        var base = r * n
        for c in range(n):
            x[c] = h_in[base + c].cast[F64]()
        var is_nan_row = nan_row(x)
        if is_nan_row:
            for c in range(n):
                var got = h_out[base + c].cast[F64]()
                if got == got:
                    raise Error(
                        "day015 gpu_check: ",
                        pipeline,
                        " row ",
                        r,
                        " should be NaN, element ",
                        c,
                        " is ",
                        got,
                    )
            continue
        var m = Float64.MIN
        for c in range(n):
            m = max(m, x[c])
        var s: Float64 = 0
        for c in range(n):
            s += exp(x[c] - m)
        var row_sum: Float64 = 0
        for c in range(n):
            var got = h_out[base + c].cast[F64]()
            row_sum += got
            if c % sample_every == 0 or c == n - 1:
                var want = exp(x[c] - m) / s
                var err = abs(got - want) / (want + 1e-300)
                if want == 0:
                    err = abs(got)
                if not (err <= worst):  # also catches NaN
                    worst = err
        worst_sum = max(worst_sum, abs(row_sum - 1))
        var ws_m = h_ws[r * slots + MAX_SLOT]
        var ws_s = h_ws[r * slots + SUM_SLOT]
        var stat_err = abs(ws_m - m) + abs(ws_s - s) / s
        if not (stat_err <= worst_stats):
            worst_stats = stat_err
    print(
        "check",
        pipeline,
        dtype,
        "rows",
        rows,
        "n",
        n,
        "max rel err",
        worst,
        "|row sum - 1|",
        worst_sum,
        "workspace (max, sum) err",
        worst_stats,
    )
    if not (worst <= tol and worst_sum <= tol * 8 and worst_stats <= tol):
        raise Error(
            "day015 gpu_check: ", pipeline, " rows ", rows, " n ", n, " failed"
        )


def check_both[
    dtype: DType
](
    ctx: DeviceContext,
    rows: Int,
    n: Int,
    specials: Bool,
    tol: Float64,
    sample_every: Int = 1,
) raises:
    check[dtype](ctx, rows, n, "fused", specials, tol, sample_every)
    check[dtype](ctx, rows, n, "four_stage", specials, tol, sample_every)


def time_shape(ctx: DeviceContext, rows: Int, n: Int, iters: Int) raises:
    """Microseconds per call for each pipeline; GB/s under two byte models: the
    minimum a softmax must move (read x, write y: 2 N 4 B, as the benchmark counts)
    and what the pipeline itself moves (fused 3 N 4 B, 4-stage 5 N 4 B)."""
    var total = rows * n
    var slots = workspace_slots(n)
    var h_in = ctx.enqueue_create_host_buffer[F32](total)
    ctx.synchronize()
    fill(
        rebind[Ptr[F32]](h_in.unsafe_ptr().as_unsafe_any_origin()),
        rows,
        n,
        7,
        False,
    )
    var d_in = ctx.enqueue_create_buffer[F32](total)
    var d_out = ctx.enqueue_create_buffer[F32](total)
    var d_ws = ctx.enqueue_create_buffer[F64](rows * slots)
    ctx.enqueue_copy(dst_buf=d_in, src_buf=h_in)
    ctx.synchronize()
    var x = rebind[Ptr[F32]](d_in.unsafe_ptr().as_unsafe_any_origin())
    var y = rebind[Ptr[F32]](d_out.unsafe_ptr().as_unsafe_any_origin())
    var ws = rebind[WsPtr](d_ws.unsafe_ptr().as_unsafe_any_origin())

    def fused(
        c: DeviceContext,
    ) raises {var x, var y, var ws, var rows, var n, var slots}:
        _ = fused_softmax[F32, TARGET](c, y, x, ws, rows, n, slots)

    def fused_forward(
        c: DeviceContext,
    ) raises {var x, var y, var ws, var rows, var n, var slots}:
        _ = fused_softmax[F32, TARGET, REVERSE=False](
            c, y, x, ws, rows, n, slots
        )

    def four_stage(
        c: DeviceContext,
    ) raises {var x, var y, var ws, var rows, var n, var slots}:
        _ = four_stage_softmax[F32, TARGET](c, y, x, ws, rows, n, slots)

    var names = List[String]()
    var ns = List[Float64]()
    var traffic = List[Float64]()
    comptime if has_accelerator():
        for _ in range(2):  # warm-up: module load, clocks
            fused(ctx)
            four_stage(ctx)
        ctx.synchronize()
        names.append("fused")
        ns.append(Float64(ctx.execution_time(fused, iters)))
        traffic.append(3)
        names.append("fused_forward_C")
        ns.append(Float64(ctx.execution_time(fused_forward, iters)))
        traffic.append(3)
        names.append("four_stage")
        ns.append(Float64(ctx.execution_time(four_stage, iters)))
        traffic.append(5)
    else:
        from std.time import perf_counter_ns

        for p in range(2):
            var t0 = perf_counter_ns()
            for _ in range(iters):
                if p == 0:
                    fused(ctx)
                else:
                    four_stage(ctx)
            ctx.synchronize()
            names.append("fused" if p == 0 else "four_stage")
            ns.append(Float64(perf_counter_ns() - t0))
            traffic.append(3.0 if p == 0 else 5.0)
    var bytes = Float64(total) * 4
    for i in range(len(names)):
        var us = ns[i] / Float64(iters) / 1e3
        print(
            "time",
            TARGET,
            "rows",
            rows,
            "n",
            n,
            "float32",
            names[i],
            "us",
            us,
            "eff_GB/s(2N*4)",
            2 * bytes / (us * 1e3),
            "moved_GB/s(",
            Int(traffic[i]),
            "N*4)",
            traffic[i] * bytes / (us * 1e3),
        )


def main() raises:
    var ctx = DeviceContext() if has_accelerator() else DeviceContext(api="cpu")
    comptime TOL = 2e-5
    check_both[F32](ctx, 1, 1, False, TOL)
    check_both[F32](ctx, 1, 4097, False, TOL)  # 4096 in vectors, 1 in the tail
    check_both[F32](ctx, 3, 70001, False, TOL)  # rows > 1, odd n: scalar path
    check_both[F32](
        ctx, 5, 50152, False, TOL
    )  # n % 4 == 0: vectors, partial tile
    check_both[F32](ctx, 4, 20000, True, TOL)  # -inf, masked row, +1e4, NaN row
    check_both[DType.bfloat16](ctx, 4, 9000, True, 1.6e-2)
    comptime if has_accelerator():
        check_both[F32](ctx, 1, (1 << 22) + 3, False, TOL, 7)  # 2 reduce passes
        check_both[F32](ctx, 7, (1 << 20) + 8, True, TOL, 7)
        check_both[DType.bfloat16](ctx, 2, (1 << 21) + 16, False, 1.6e-2, 7)
        check_both[F32](ctx, 1, 1 << 20, False, TOL, 3)  # the timed shapes
        check_both[F32](ctx, 1, 1 << 24, False, TOL, 101)
        check_both[F32](ctx, 8, 1 << 22, False, TOL, 101)
        check_both[F32](ctx, 1, 1 << 28, False, TOL, 1009)
        time_shape(ctx, 1, 1 << 20, 200)
        time_shape(ctx, 1, 1 << 24, 50)
        time_shape(ctx, 1, 1 << 28, 20)
        time_shape(ctx, 8, 1 << 22, 50)
    else:
        time_shape(ctx, 1, 1 << 16, 3)
    print("OK")
