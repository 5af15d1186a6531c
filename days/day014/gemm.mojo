# Day 014: GEMM as a MAX custom op.
#
#     output = alpha * op(A) @ op(B) + beta * c        op(X) = X or X^T
#
# A is stored (M, K), or (K, M) when TRANSPOSE_A; B is stored (K, N), or (N, K)
# when TRANSPOSE_B. `c` is a separate input that broadcasts to (M, N) (each of its
# dims is 1 or full: a bias row is c of shape (1, N)); it is never written. beta
# scales c only, and beta == 0 means c is not read at all, so NaN/inf in c cannot
# leak into the result (BLAS semantics). alpha and beta arrive as a float32 (2,)
# tensor on the op's device and are read inside the kernel: a new value costs
# nothing, while the transposes are compile-time parameters (one graph each).
#
# GPU paths (one launch, grid = output tiles x batch; since day 016 the launch, i.e.
# which kernel, its grid, block, shared memory and TMA maps, is the Python launch plan
# in pytorch_custom_ops/gemm_gpu.py). Each kernel has its own file (gemm_v1_simt,
# gemm_v1_mma_sync, gemm_v2_wgmma, gemm_v3_tma), what they share is gemm_common:
#   * float32 / float64: a SIMT kernel. A 128x128 block tile, K in steps of 16; each
#     of the 256 threads owns an 8x8 block of outputs in registers, reads its A and
#     B fragments as 16-byte vectors from shared memory, and prefetches the next K
#     tile from global memory into registers while it computes the current one
#     (two shared buffers, one barrier per K step).
#   * bfloat16 / float16: tensor cores (mma.sync m16n8k16, fp32 accumulation). A
#     128x128x32 block tile, 8 warps each owning 64x32 outputs, a 4-stage cp.async
#     pipeline from global to shared memory, ldmatrix (.trans for operands whose
#     stored layout is the transpose of what mma wants) from shared to registers.
#     On VEC shapes the op instead uses the Hopper kernel: wgmma.mma_async m64nNk16
#     reading both operands from shared memory through matrix descriptors, one
#     warpgroup per 64 rows of a 128x128 (or 64x128) tile, a cp.async pipeline
#     into the canonical no-swizzle core-matrix layout (see gemm_wgmma_kernel).
# Both read global memory with 16-byte vectors when every leading dimension and
# pointer allows it (VEC); otherwise with guarded scalar loads. Tails (sizes that are
# not tile multiples) are zero-filled in shared memory and masked on store.

from extensibility import register, InputTensor, OutputTensor
from max.gpu.host import DeviceContext

from days.day014.gemm_common import (
    accum_dtype,
    GemmProblem,
    broadcast_stride,
    op_dims,
    operand_offset,
)


# ---------------------------------------------------------------------------
# CPU branch (what CI runs): plain loops, accumulating a row of C at a time.


# --8<-- [start:cpu]
def gemm_cpu[dtype: DType, TA: Bool, TB: Bool](p: GemmProblem[dtype]):
    """For each row i of C: acc[:] += op(A)[i, kk] * op(B)[kk, :] over kk, then the
    epilogue. With B stored (K, N) the inner loop is contiguous."""
    comptime acc = accum_dtype[dtype]()
    var alpha = p.alpha_beta[unsafe_offset=0].cast[acc]()
    var beta = p.alpha_beta[unsafe_offset=1].cast[acc]()
    var M = p.m
    var N = p.n
    var K = p.k
    var row = List[Scalar[acc]](length=N, fill=0)
    for bt in range(p.batch):
        var a = p.a.unsafe_offset(bt * p.a_bs)
        var b = p.b.unsafe_offset(bt * p.b_bs)
        var c = p.c.unsafe_offset(bt * p.c_bs)
        var o = p.out.unsafe_offset(bt * M * N)
        for i in range(M):
            for j in range(N):
                row[j] = 0
            for kk in range(K):
                var av = a[
                    unsafe_offset=operand_offset[not TA](i, kk, M, K)
                ].cast[acc]()
                for j in range(N):
                    row[j] += (
                        av
                        * b[unsafe_offset=operand_offset[TB](j, kk, N, K)].cast[
                            acc
                        ]()
                    )
            for j in range(N):
                var v = alpha * row[j]
                if (
                    beta != 0
                ):  # beta == 0: c is never read (NaN in c must not leak)
                    v += (
                        beta
                        * c[unsafe_offset=i * p.c_rs + j * p.c_cs].cast[acc]()
                    )
                o[unsafe_offset=i * N + j] = v.cast[dtype]()


# --8<-- [end:cpu]


# ---------------------------------------------------------------------------
# Dispatch.


def untracked[
    T: AnyType
](p: Pointer[T, MutAnyOrigin]) -> Pointer[T, MutUntrackedOrigin]:
    return p.unsafe_origin_cast[MutUntrackedOrigin]()


def run_gemm[
    target: StaticString, dtype: DType, TA: Bool, TB: Bool
](p: GemmProblem[dtype]) raises:
    comptime if target == "gpu":
        # since day 016 the GPU launch (kernel choice, grid, tensor maps) is the
        # Python launch plan's (pytorch_custom_ops/gemm_gpu.py): one source of
        # launch logic per op
        raise Error(
            "gemm: on a GPU this op is launched by pytorch_custom_ops (direct"
            " launch)"
        )
    else:
        gemm_cpu[dtype, TA, TB](p)


def check_alpha_beta(name: StaticString, n: Int) raises:
    if n != 2:
        raise Error(
            name, ": alpha_beta must hold 2 values (alpha, beta), got ", n
        )


@register("gemm")
struct Gemm:
    """Output (M, N) = alpha * op(a) @ op(b) + beta * c; c broadcasts to (M, N).
    """

    @staticmethod
    def execute[
        target: StaticString,
        dtype: DType,
        TRANSPOSE_A: Bool,
        TRANSPOSE_B: Bool,
    ](
        output: OutputTensor[dtype=dtype, rank=2, ...],
        a: InputTensor[dtype=dtype, rank=2, ...],
        b: InputTensor[dtype=dtype, rank=2, ...],
        c: InputTensor[dtype=dtype, rank=2, ...],
        alpha_beta: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert dtype.is_floating_point(), "gemm: float dtypes only"
        var mk = op_dims[TRANSPOSE_A](a.dim_size(0), a.dim_size(1))
        var kn = op_dims[TRANSPOSE_B](b.dim_size(0), b.dim_size(1))
        var M = mk[0]
        var K = mk[1]
        var N = kn[1]
        if kn[0] != K:
            raise Error(
                "gemm: inner dims differ: op(a) is ",
                M,
                "x",
                K,
                ", op(b) is ",
                kn[0],
                "x",
                N,
            )
        if output.dim_size(0) != M or output.dim_size(1) != N:
            raise Error(
                "gemm: output is ",
                output.shape(),
                ", expected (",
                M,
                ", ",
                N,
                ")",
            )
        check_alpha_beta("gemm", alpha_beta.dim_size(0))
        var c_rs = broadcast_stride("gemm", c.dim_size(0), M, c.dim_size(1))
        var c_cs = broadcast_stride("gemm", c.dim_size(1), N, 1)
        var p = GemmProblem[dtype](
            untracked(output.unsafe_ptr()),
            untracked(a.unsafe_ptr()),
            untracked(b.unsafe_ptr()),
            untracked(c.unsafe_ptr()),
            untracked(alpha_beta.unsafe_ptr()),
            1,
            M,
            N,
            K,
            0,
            0,
            0,
            c_rs,
            c_cs,
        )
        run_gemm[target, dtype, TRANSPOSE_A, TRANSPOSE_B](p)


@register("gemm_batched")
struct GemmBatched:
    """Output (B, M, N) = alpha * op(a[i]) @ op(b[i]) + beta * c[i] for every i;
    c broadcasts to (B, M, N)."""

    @staticmethod
    def execute[
        target: StaticString,
        dtype: DType,
        TRANSPOSE_A: Bool,
        TRANSPOSE_B: Bool,
    ](
        output: OutputTensor[dtype=dtype, rank=3, ...],
        a: InputTensor[dtype=dtype, rank=3, ...],
        b: InputTensor[dtype=dtype, rank=3, ...],
        c: InputTensor[dtype=dtype, rank=3, ...],
        alpha_beta: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert (
            dtype.is_floating_point()
        ), "gemm_batched: float dtypes only"
        var batch = a.dim_size(0)
        if b.dim_size(0) != batch:
            raise Error(
                "gemm_batched: a has batch ", batch, ", b has ", b.dim_size(0)
            )
        var mk = op_dims[TRANSPOSE_A](a.dim_size(1), a.dim_size(2))
        var kn = op_dims[TRANSPOSE_B](b.dim_size(1), b.dim_size(2))
        var M = mk[0]
        var K = mk[1]
        var N = kn[1]
        if kn[0] != K:
            raise Error(
                "gemm_batched: inner dims differ: op(a) is ",
                M,
                "x",
                K,
                ", op(b) is ",
                kn[0],
                "x",
                N,
            )
        if (
            output.dim_size(0) != batch
            or output.dim_size(1) != M
            or output.dim_size(2) != N
        ):
            raise Error(
                "gemm_batched: output is ",
                output.shape(),
                ", expected (",
                batch,
                ", ",
                M,
                ", ",
                N,
                ")",
            )
        check_alpha_beta("gemm_batched", alpha_beta.dim_size(0))
        var c_cs = broadcast_stride("gemm_batched", c.dim_size(2), N, 1)
        var c_rs = broadcast_stride(
            "gemm_batched", c.dim_size(1), M, c.dim_size(2)
        )
        var c_bs = broadcast_stride(
            "gemm_batched", c.dim_size(0), batch, c.dim_size(1) * c.dim_size(2)
        )
        var p = GemmProblem[dtype](
            untracked(output.unsafe_ptr()),
            untracked(a.unsafe_ptr()),
            untracked(b.unsafe_ptr()),
            untracked(c.unsafe_ptr()),
            untracked(alpha_beta.unsafe_ptr()),
            batch,
            M,
            N,
            K,
            M * K,
            K * N,
            c_bs,
            c_rs,
            c_cs,
        )
        run_gemm[target, dtype, TRANSPOSE_A, TRANSPOSE_B](p)
