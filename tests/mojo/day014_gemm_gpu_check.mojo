# Day 014 GPU check: runs Gemm / GemmBatched.execute and compares the results with a
# float64 reference computed here on the host; on a GPU it then times the issue's
# benchmark shapes.
#   mojo run -I . tests/mojo/day014_gemm_gpu_check.mojo                                 (CPU branch)
#   mojo build -I . --target-accelerator nvidia:90 tests/mojo/day014_gemm_gpu_check.mojo (GPU binary)
# Correctness covers every transpose pair, odd sizes (tails of every tile), the
# unvectorised path (a leading dim that is not a multiple of 16 bytes), alpha/beta
# other than 1/0, c broadcast as a row, and beta = 0 with NaN in c (must not leak).
# Sizes too large for a full host reference are checked on sampled entries.
# bf16 runs on every tensor-core kernel (mma.sync and the wgmma tile sizes) are
# labelled [mma.sync] / [wgmma...]; [auto] is the op's own choice. Each TIME line
# gives TFLOP/s and, for bf16, the percentage of the 714 TFLOP/s cuBLAS baseline.
from extensibility import InputTensor, OutputTensor, StaticTensorSpec
from max.gpu.host import DeviceContext
from std.sys import has_accelerator
from std.utils import IndexList

from days.day014.gemm import (
    Gemm,
    GemmBatched,
    GemmProblem,
    operand_offset,
    launch_gemm,
    untracked,
    GEMM_AUTO,
    GEMM_MMA_SYNC,
    GEMM_WG_64x128,
    GEMM_WG_128x128,
    GEMM_WG_128x256,
    GEMM_TMA_128x128,
    GEMM_TMA_128x256,
)

comptime ON_GPU = has_accelerator()
comptime TARGET = "gpu" if ON_GPU else "cpu"

# c layouts
comptime C_NAN = 0  # (1, 1) NaN with beta forced to 0: c must never be read
comptime C_FULL = 1  # (M, N) [(B, M, N) batched]
comptime C_ROW = 2  # (1, N) [(1, 1, N) batched]: a bias row


struct Lcg:
    var state: UInt64

    def __init__(out self, seed: UInt64):
        self.state = seed

    def next(mut self) -> Float64:
        """Uniform in [-1, 1)."""
        self.state = self.state * 6364136223846793005 + 1442695040888963407
        return Float64(self.state >> 40) / Float64(1 << 23) - 1.0


def tolerance[dtype: DType]() -> Float64:
    """Allowed |got - want| / sum_k |alpha a b| + |beta c| (the error scale of a dot product).
    """
    comptime if dtype == DType.float64:
        return 1e-12
    comptime if dtype == DType.float32:
        return 2e-6
    comptime if dtype == DType.float16:
        return 2e-3  # the result is rounded to fp16 (2^-11) once
    return 1.6e-2  # bf16: rounded to 2^-8 once; products are exact in the fp32 accumulator


struct Case:
    var batch: Int
    var m: Int
    var n: Int
    var k: Int
    var alpha: Float32
    var beta: Float32
    var c_kind: Int

    def __init__(
        out self,
        batch: Int,
        m: Int,
        n: Int,
        k: Int,
        alpha: Float32,
        beta: Float32,
        c_kind: Int,
    ):
        self.batch = batch
        self.m = m
        self.n = n
        self.k = k
        self.alpha = alpha
        self.beta = beta if c_kind != C_NAN else 0
        self.c_kind = c_kind

    def flops(self) -> Float64:
        return (
            2.0
            * Float64(self.batch)
            * Float64(self.m)
            * Float64(self.n)
            * Float64(self.k)
        )


def kernel_name(kernel: Int) -> String:
    if kernel == GEMM_MMA_SYNC:
        return "mma.sync"
    if kernel == GEMM_WG_64x128:
        return "wgmma64x128"
    if kernel == GEMM_WG_128x128:
        return "wgmma128x128"
    if kernel == GEMM_WG_128x256:
        return "wgmma128x256"
    if kernel == GEMM_TMA_128x128:
        return "tma128x128"
    if kernel == GEMM_TMA_128x256:
        return "tma128x256"
    return "auto"


def run[
    dtype: DType, TA: Bool, TB: Bool, BATCHED: Bool, KERNEL: Int = GEMM_AUTO
](ctx: DeviceContext, cs: Case, samples: Int, time_iters: Int) raises:
    """Run one case, check it (all entries, or `samples` random ones), optionally time it.

    KERNEL == GEMM_AUTO goes through the op's execute (what torch calls); any other
    value calls launch_gemm with that tensor-core kernel forced (bf16/fp16 only).
    """
    var B = cs.batch
    var M = cs.m
    var N = cs.n
    var K = cs.k
    var na = B * M * K
    var nb = B * K * N
    var no = B * M * N
    var c_b = B if cs.c_kind == C_FULL else 1
    var c_m = M if cs.c_kind == C_FULL else 1
    var c_n = N if cs.c_kind != C_NAN else 1
    var nc = c_b * c_m * c_n
    var h_a = ctx.enqueue_create_host_buffer[dtype](na)
    var h_b = ctx.enqueue_create_host_buffer[dtype](nb)
    var h_c = ctx.enqueue_create_host_buffer[dtype](nc)
    var h_ab = ctx.enqueue_create_host_buffer[DType.float32](2)
    ctx.synchronize()
    var rng = Lcg(UInt64(M * 1000003 + N * 1009 + K * 17 + B))
    for i in range(na):
        h_a[i] = Scalar[dtype](rng.next() * 2.0)
    for i in range(nb):
        h_b[i] = Scalar[dtype](rng.next())
    for i in range(nc):
        h_c[i] = Scalar[dtype](
            rng.next() * 4.0
        ) if cs.c_kind != C_NAN else Scalar[dtype](Float64(0) / Float64(0))
    h_ab[0] = cs.alpha
    h_ab[1] = cs.beta
    var d_a = ctx.enqueue_create_buffer[dtype](na)
    var d_b = ctx.enqueue_create_buffer[dtype](nb)
    var d_c = ctx.enqueue_create_buffer[dtype](nc)
    var d_ab = ctx.enqueue_create_buffer[DType.float32](2)
    var d_o = ctx.enqueue_create_buffer[dtype](no)
    ctx.enqueue_copy(dst_buf=d_a, src_buf=h_a)
    ctx.enqueue_copy(dst_buf=d_b, src_buf=h_b)
    ctx.enqueue_copy(dst_buf=d_c, src_buf=h_c)
    ctx.enqueue_copy(dst_buf=d_ab, src_buf=h_ab)
    ctx.synchronize()

    var pa = d_a.unsafe_ptr().as_unsafe_any_origin()
    var pb = d_b.unsafe_ptr().as_unsafe_any_origin()
    var pc = d_c.unsafe_ptr().as_unsafe_any_origin()
    var pab = d_ab.unsafe_ptr().as_unsafe_any_origin()
    var po = d_o.unsafe_ptr().as_unsafe_any_origin()
    var a_rows = K if TA else M
    var a_cols = M if TA else K
    var b_rows = N if TB else K
    var b_cols = K if TB else N

    def launch(
        ctx: DeviceContext,
    ) raises {
        var pa,
        var pb,
        var pc,
        var pab,
        var po,
        var B,
        var M,
        var N,
        var a_rows,
        var a_cols,
        var b_rows,
        var b_cols,
        var c_b,
        var c_m,
        var c_n,
    }:
        comptime if KERNEL != GEMM_AUTO:
            var K = a_cols if not TA else a_rows
            var p = GemmProblem[dtype](
                untracked(po),
                untracked(pa),
                untracked(pb),
                untracked(pc),
                untracked(pab),
                B,
                M,
                N,
                K,
                M * K,
                K * N,
                c_m * c_n if c_b > 1 else 0,
                c_n if c_m > 1 else 0,
                1 if c_n > 1 else 0,
            )
            launch_gemm[TARGET, dtype, TA, TB, KERNEL](p, ctx)
            return
        comptime S1 = StaticTensorSpec[DType.float32, 1, ...].get_unknown()
        var ab = InputTensor[static_spec=S1](pab, IndexList[1](2))
        comptime if BATCHED:
            comptime S3 = StaticTensorSpec[dtype, 3, ...].get_unknown()
            GemmBatched.execute[TARGET, TRANSPOSE_A=TA, TRANSPOSE_B=TB](
                OutputTensor[static_spec=S3](po, IndexList[3](B, M, N)),
                InputTensor[static_spec=S3](
                    pa, IndexList[3](B, a_rows, a_cols)
                ),
                InputTensor[static_spec=S3](
                    pb, IndexList[3](B, b_rows, b_cols)
                ),
                InputTensor[static_spec=S3](pc, IndexList[3](c_b, c_m, c_n)),
                ab,
                ctx,
            )
        else:
            comptime S2 = StaticTensorSpec[dtype, 2, ...].get_unknown()
            Gemm.execute[TARGET, TRANSPOSE_A=TA, TRANSPOSE_B=TB](
                OutputTensor[static_spec=S2](po, IndexList[2](M, N)),
                InputTensor[static_spec=S2](pa, IndexList[2](a_rows, a_cols)),
                InputTensor[static_spec=S2](pb, IndexList[2](b_rows, b_cols)),
                InputTensor[static_spec=S2](pc, IndexList[2](c_m, c_n)),
                ab,
                ctx,
            )

    launch(ctx)
    ctx.synchronize()

    # float64 reference on all entries, or on `samples` pseudo-random ones
    var worst: Float64 = 0
    var non_finite = 0
    var checked = 0
    var pick = Lcg(7)
    with d_o.map_to_host() as out:
        var total = no if samples == 0 else samples
        for s in range(total):
            var idx = s
            if samples != 0:
                idx = Int((pick.next() + 1.0) * 0.5 * Float64(no)) % no
            var bt = idx // (M * N)
            var i = (idx // N) % M
            var j = idx % N
            var dot: Float64 = 0
            var scale: Float64 = 0
            for kk in range(K):
                var av = Float64(
                    h_a[bt * M * K + operand_offset[not TA](i, kk, M, K)]
                )
                var bv = Float64(
                    h_b[bt * K * N + operand_offset[TB](j, kk, N, K)]
                )
                dot += av * bv
                scale += abs(av * bv)
            var want = Float64(cs.alpha) * dot
            scale = abs(Float64(cs.alpha)) * scale
            if cs.c_kind != C_NAN:
                var cv = Float64(
                    h_c[
                        (bt if c_b > 1 else 0) * c_m * c_n
                        + (i if c_m > 1 else 0) * c_n
                        + (j if c_n > 1 else 0)
                    ]
                )
                want += Float64(cs.beta) * cv
                scale += abs(Float64(cs.beta) * cv)
            var got = Float64(out[idx])
            if got != got or abs(got) > 1e300:
                non_finite += 1
                continue
            worst = max(worst, abs(got - want) / (scale + 1e-30))
            checked += 1
    var name = String(
        "gemm_batched" if BATCHED else "gemm",
        " [",
        kernel_name(KERNEL),
        "] ",
        dtype,
        " TA=",
        TA,
        " TB=",
        TB,
        " B=",
        B,
        " M=",
        M,
        " N=",
        N,
        " K=",
        K,
        " alpha=",
        cs.alpha,
        " beta=",
        cs.beta,
        " c=",
        cs.c_kind,
    )
    print(name, " checked ", checked, " max err/scale ", worst)
    if non_finite > 0:
        raise Error(
            name, ": ", non_finite, " non-finite outputs (NaN in c leaked?)"
        )
    if worst > tolerance[dtype]():
        raise Error(name, ": error ", worst, " > ", tolerance[dtype]())

    if time_iters > 0:
        var ns = ctx.execution_time(launch, time_iters)
        var us = Float64(ns) / Float64(time_iters) / 1e3
        var tflops = cs.flops() / (us * 1e-6) / 1e12
        print(
            "TIME",
            "gemm_batched" if BATCHED else "gemm",
            kernel_name(KERNEL),
            dtype,
            "TA=",
            TA,
            "TB=",
            TB,
            "shape",
            B,
            "x",
            M,
            "x",
            N,
            "x",
            K,
            "us",
            us,
            "TFLOP/s",
            tflops,
            "%cuBLAS714",
            tflops / 7.14 if dtype == DType.bfloat16 else Float64(0),
        )


def check_transposes[
    dtype: DType
](ctx: DeviceContext, cs: Case, samples: Int) raises:
    run[dtype, False, False, False](ctx, cs, samples, 0)
    run[dtype, False, True, False](ctx, cs, samples, 0)
    run[dtype, True, False, False](ctx, cs, samples, 0)
    run[dtype, True, True, False](ctx, cs, samples, 0)


def check_kernels[
    TA: Bool, TB: Bool, BATCHED: Bool
](ctx: DeviceContext, cs: Case, samples: Int, time_iters: Int) raises:
    """The same bf16 case on every tensor-core kernel (mma.sync, the version 2
    wgmma tiles, the version 3 TMA tiles: the ids GEMM_MMA_SYNC..GEMM_TMA_128x256).

    A failing kernel does not stop the others (so one H100 run times whichever are
    right); the last failure is raised after all of them ran.
    """
    var failed = String()
    comptime for kernel in range(GEMM_MMA_SYNC, GEMM_TMA_128x256 + 1):
        try:
            run[DType.bfloat16, TA, TB, BATCHED, kernel](
                ctx, cs, samples, time_iters
            )
        except e:
            print("FAIL", kernel_name(kernel), e)
            failed = String(e)
    if failed.byte_length() > 0:
        raise Error(failed)


def check_kernels_transposes(ctx: DeviceContext, cs: Case, samples: Int) raises:
    check_kernels[False, False, False](ctx, cs, samples, 0)
    check_kernels[False, True, False](ctx, cs, samples, 0)
    check_kernels[True, False, False](ctx, cs, samples, 0)
    check_kernels[True, True, False](ctx, cs, samples, 0)


def timed[
    dtype: DType, TA: Bool, TB: Bool, BATCHED: Bool, KERNEL: Int = GEMM_AUTO
](ctx: DeviceContext, cs: Case, iters: Int, mut failures: Int):
    """Time one case (checked on 256 sampled entries); a failure is counted, not raised.
    """
    try:
        run[dtype, TA, TB, BATCHED, KERNEL](ctx, cs, 256, iters)
    except e:
        print("FAIL", e)
        failures += 1


def timed_kernels[
    TA: Bool, TB: Bool, BATCHED: Bool
](ctx: DeviceContext, cs: Case, iters: Int, mut failures: Int):
    try:
        check_kernels[TA, TB, BATCHED](ctx, cs, 256, iters)
    except:
        failures += 1  # check_kernels printed which kernel failed


def timed_tma[
    TA: Bool, TB: Bool
](ctx: DeviceContext, cs: Case, mut failures: Int):
    timed[DType.bfloat16, TA, TB, False, GEMM_TMA_128x128](
        ctx, cs, 10, failures
    )
    timed[DType.bfloat16, TA, TB, False, GEMM_TMA_128x256](
        ctx, cs, 10, failures
    )


def main() raises:
    # has_accelerator() inline: through the module-level ON_GPU alias this ternary
    # crashed the CPU context ("pure virtual method called" in synchronize)
    var ctx = DeviceContext() if has_accelerator() else DeviceContext(api="cpu")
    comptime if not ON_GPU:
        # CPU branch: small and quick
        check_transposes[DType.float32](
            ctx, Case(1, 17, 33, 9, 1.5, -0.5, C_FULL), 0
        )
        run[DType.float32, False, False, False](
            ctx, Case(1, 5, 7, 3, 1, 0, C_NAN), 0, 0
        )
        run[DType.bfloat16, False, True, False](
            ctx, Case(1, 9, 8, 40, 0.5, 2, C_ROW), 0, 0
        )
        run[DType.float32, True, False, True](
            ctx, Case(3, 6, 5, 4, 2, 1, C_FULL), 0, 0
        )
        # the forced-kernel path (launch_gemm with a GemmProblem built here)
        run[DType.bfloat16, True, True, True, GEMM_WG_128x128](
            ctx, Case(2, 8, 16, 24, 1.5, -0.5, C_ROW), 0, 0
        )
        print("OK")
        return

    # Each section runs even if an earlier one failed (one H100 run should report
    # everything); any failure makes the program exit non-zero at the end.
    var failures = 0
    try:
        # every tensor-core kernel forced, on shapes where the wgmma path applies (rows
        # multiples of 8 elements): tails in M (136 = 128 + 8), N (264 = 256 + 8) and
        # K (72 = 64 + 8, 1032), a single 8x8x8 tile, and several tiles in each dim
        var vshapes = List[IndexList[3]]()
        vshapes.append(IndexList[3](8, 8, 8))
        vshapes.append(IndexList[3](136, 264, 72))
        vshapes.append(IndexList[3](520, 776, 1032))
        for sh in vshapes:
            var full = sh[0] * sh[1] <= 300_000
            check_kernels_transposes(
                ctx,
                Case(1, sh[0], sh[1], sh[2], 1.25, -0.75, C_FULL),
                0 if full else 2000,
            )
        check_kernels[False, True, False](
            ctx, Case(1, 200, 1000, 64, 1, 1, C_ROW), 2000, 0
        )
        check_kernels[False, False, False](
            ctx, Case(1, 256, 512, 128, 1, 0, C_NAN), 2000, 0
        )
        check_kernels[False, False, True](
            ctx, Case(3, 136, 264, 72, 0.5, 2, C_FULL), 2000, 0
        )
        check_kernels[True, True, True](
            ctx, Case(2, 64, 128, 200, 1, 0, C_NAN), 0, 0
        )
        print("correctness (forced kernels) OK")
    except e:
        print("FAIL forced-kernel correctness:", e)
        failures += 1
    try:
        # ---- correctness: odd sizes, all transposes, both GPU kernels ----
        # (M, N, K): tails in every dim; 1000 is a multiple of 8 (vector path) while the
        # others force the guarded scalar path; 257 x 4097 crosses many tiles
        var shapes = List[IndexList[3]]()
        shapes.append(IndexList[3](1, 1, 1))
        shapes.append(IndexList[3](17, 33, 9))
        shapes.append(IndexList[3](1000, 1000, 1000))
        shapes.append(IndexList[3](129, 4097, 65))
        shapes.append(IndexList[3](4097, 17, 1000))
        shapes.append(IndexList[3](200, 136, 4097))
        shapes.append(IndexList[3](256, 256, 256))
        for sh in shapes:
            var full = sh[0] * sh[1] <= 300_000
            var samples = 0 if full else 2000
            var cs = Case(1, sh[0], sh[1], sh[2], 1.25, -0.75, C_FULL)
            check_transposes[DType.float32](ctx, cs, samples)
            check_transposes[DType.bfloat16](ctx, cs, samples)
        check_transposes[DType.float16](
            ctx, Case(1, 1000, 1000, 1000, 1, 0, C_NAN), 2000
        )
        check_transposes[DType.float64](
            ctx, Case(1, 129, 67, 300, 0.5, 2, C_ROW), 0
        )
        # beta = 0 with NaN in c, and a bias row
        run[DType.float32, False, False, False](
            ctx, Case(1, 512, 512, 512, 1, 0, C_NAN), 2000, 0
        )
        run[DType.bfloat16, False, True, False](
            ctx, Case(1, 512, 512, 512, 1, 0, C_NAN), 2000, 0
        )
        run[DType.float32, False, True, False](
            ctx, Case(1, 300, 1000, 64, 1, 1, C_ROW), 2000, 0
        )
        run[DType.bfloat16, False, True, False](
            ctx, Case(1, 300, 1000, 64, 1, 1, C_ROW), 2000, 0
        )
        # batched, including a batch of odd matrices (unaligned batch offsets)
        run[DType.float32, False, False, True](
            ctx, Case(5, 33, 17, 9, 1, 0.5, C_FULL), 0, 0
        )
        run[DType.float32, True, True, True](
            ctx, Case(3, 130, 129, 64, 2, 1, C_ROW), 0, 0
        )
        run[DType.bfloat16, False, False, True](
            ctx, Case(5, 33, 17, 9, 1, 0.5, C_FULL), 0, 0
        )
        run[DType.bfloat16, True, False, True](
            ctx, Case(4, 256, 256, 256, 1, 0, C_NAN), 0, 0
        )
        print("correctness OK")
    except e:
        print("FAIL op correctness:", e)
        failures += 1

    # ---- timing: the issue's benchmark shapes ----
    var sizes = List[Int]()
    sizes.append(1024)
    sizes.append(4096)
    sizes.append(8192)
    for s in sizes:
        var it = 20 if s < 8192 else 5
        var cs = Case(1, s, s, s, 1, 0, C_NAN)
        timed[DType.float32, False, False, False](ctx, cs, it, failures)
        timed[DType.bfloat16, False, False, False](
            ctx, cs, it, failures
        )  # the op
        timed_kernels[False, False, False](ctx, cs, it, failures)
    # the layout nn.Linear uses (weight stored (N, K)), and the other transposes, at 4096
    var cs4 = Case(1, 4096, 4096, 4096, 1, 0, C_NAN)
    timed[DType.float32, False, True, False](ctx, cs4, 10, failures)
    timed[DType.bfloat16, False, True, False](ctx, cs4, 10, failures)
    timed[DType.bfloat16, False, True, False, GEMM_MMA_SYNC](
        ctx, cs4, 10, failures
    )
    timed[DType.float32, True, False, False](ctx, cs4, 10, failures)
    timed[DType.bfloat16, True, False, False](ctx, cs4, 10, failures)
    timed[DType.bfloat16, True, False, False, GEMM_MMA_SYNC](
        ctx, cs4, 10, failures
    )
    timed_tma[False, True](ctx, cs4, failures)
    timed_tma[True, False](ctx, cs4, failures)
    timed_tma[True, True](ctx, cs4, failures)
    var csb = Case(8, 1024, 1024, 1024, 1, 0, C_NAN)
    timed[DType.float32, False, False, True](ctx, csb, 20, failures)
    timed[DType.bfloat16, False, False, True](ctx, csb, 20, failures)
    timed_kernels[False, False, True](ctx, csb, 20, failures)
    if failures > 0:
        raise Error(failures, " check(s) failed (see FAIL lines)")
    print("OK")
