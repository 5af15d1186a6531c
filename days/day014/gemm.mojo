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
# in pytorch_custom_ops/gemm_gpu.py):
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
from max.gpu import (
    MAX_THREADS_PER_BLOCK_METADATA,
    thread_idx,
    block_idx,
    barrier,
    lane_id,
    warp_id,
)
from max.gpu.compute.mma import (
    mma,
    ld_matrix,
    WGMMADescriptor,
    wgmma_async,
    wgmma_fence_aligned,
    wgmma_commit_group_sync,
    wgmma_wait_group_sync,
)
from max.gpu.memory import (
    async_copy,
    async_copy_commit_group,
    async_copy_wait_group,
    cp_async_bulk_tensor_shared_cluster_global,
    external_memory,
)
from max.gpu.host import DeviceContext
from max.gpu.host.nvidia.tma import TMADescriptor, TensorMapSwizzle
from max.gpu.sync import (
    mbarrier_init,
    mbarrier_arrive,
    mbarrier_arrive_expect_tx_shared,
)
from std.memory import stack_allocation, bitcast
from std.math import ceildiv
from std.sys import size_of
from std.sys._assembly import inlined_assembly
from std.utils import IndexList, StaticTuple


def accum_dtype[dtype: DType]() -> DType:
    """Accumulate in float64 for float64 inputs, float32 for everything else."""
    return DType.float64 if dtype == DType.float64 else DType.float32


# --8<-- [start:problem]
@fieldwise_init
struct GemmProblem[dtype: DType](ImplicitlyCopyable):
    """One (batched) GEMM: pointers, sizes and strides, host side.

    Element (i, j) of op(A) in batch `bt` is a[bt*a_bs + i*K + j] (stored (M, K)),
    or a[bt*a_bs + j*M + i] when TRANSPOSE_A; the same for B. c is read at
    c[bt*c_bs + i*c_rs + j*c_cs]: a stride of 0 broadcasts that dim.
    """

    var out: Pointer[Scalar[Self.dtype], MutUntrackedOrigin]
    var a: Pointer[Scalar[Self.dtype], MutUntrackedOrigin]
    var b: Pointer[Scalar[Self.dtype], MutUntrackedOrigin]
    var c: Pointer[Scalar[Self.dtype], MutUntrackedOrigin]
    var alpha_beta: Pointer[Float32, MutUntrackedOrigin]
    var batch: Int
    var m: Int
    var n: Int
    var k: Int
    var a_bs: Int
    var b_bs: Int
    var c_bs: Int
    var c_rs: Int
    var c_cs: Int


# --8<-- [end:problem]


def broadcast_stride(
    name: StaticString, size: Int, full: Int, stride: Int
) raises -> Int:
    """The stride of one dim of c: 0 when it broadcasts (size 1), else `stride`.
    """
    if size == full:
        return stride if full != 1 else 0
    if size == 1:
        return 0
    raise Error(
        name,
        ": c has size ",
        size,
        " where the output has ",
        full,
        " (must be 1 or equal)",
    )


def op_dims[transpose: Bool](rows: Int, cols: Int) -> Tuple[Int, Int]:
    """(rows, cols) of op(X) for a stored (rows, cols) X."""
    comptime if transpose:
        return (cols, rows)
    return (rows, cols)


# ---------------------------------------------------------------------------
# Tile scheduling shared by both GPU kernels.


@always_inline
def tile_coords(pid: Int, num_m: Int, num_n: Int) -> Tuple[Int, Int]:
    """Map a linear block id to (tile_m, tile_n), GROUP_M tile rows at a time.

    Consecutive blocks walk down a group of 8 tile rows before moving right, so the
    blocks resident together share both A rows and B columns in L2 (plain row-major
    order would stream all of B once per tile row).
    """
    comptime GROUP_M = 8
    var per_group = GROUP_M * num_n
    var first_m = (pid // per_group) * GROUP_M
    var rows = min(num_m - first_m, GROUP_M)
    var local = pid % per_group
    return (first_m + local % rows, local // rows)


@always_inline
def operand_offset[
    k_contiguous: Bool
](mn: Int, kk: Int, mn_size: Int, k_size: Int) -> Int:
    """Offset of element (mn, kk) of op(X) viewed as (MN, K) in its stored layout.
    """
    comptime if k_contiguous:
        return mn * k_size + kk
    return kk * mn_size + mn


# ---------------------------------------------------------------------------
# SIMT kernel (float32, float64).

comptime SIMT_THREADS = 256


# --8<-- [start:simt_load]
@always_inline
def simt_fetch[
    dtype: DType,
    K_CONTIG: Bool,
    VEC: Bool,
    BMN: Int,
    BK: Int,
    VW: Int,
    LV: Int,
](
    src: Pointer[Scalar[dtype], MutAnyOrigin],
    mn0: Int,
    k0: Int,
    mn_size: Int,
    k_size: Int,
    mut regs: Array[SIMD[dtype, VW], LV],
):
    """Global -> registers: this thread's LV vectors of the (BMN x BK) tile at (mn0, k0).

    Vectors run along the stored contiguous dim. Out-of-range elements read as 0.
    """
    comptime PER_ROW = BK // VW if K_CONTIG else BMN // VW
    comptime for i in range(LV):
        var v = thread_idx.x + i * SIMT_THREADS
        var row = v // PER_ROW
        var col = (v % PER_ROW) * VW
        var mn = mn0 + (row if K_CONTIG else col)
        var kk = k0 + (col if K_CONTIG else row)
        comptime if VEC:
            # every leading dim is a multiple of VW: a vector is all in or all out
            if mn < mn_size and kk < k_size:
                regs[i] = src.unsafe_load[width=VW, alignment=16](
                    operand_offset[K_CONTIG](mn, kk, mn_size, k_size)
                )
            else:
                regs[i] = 0
        else:
            var vec = SIMD[dtype, VW](0)
            comptime for e in range(VW):
                var emn = mn + (0 if K_CONTIG else e)
                var ek = kk + (e if K_CONTIG else 0)
                if emn < mn_size and ek < k_size:
                    vec[e] = src[
                        unsafe_offset=operand_offset[K_CONTIG](
                            emn, ek, mn_size, k_size
                        )
                    ]
            regs[i] = vec


@always_inline
def simt_stash[
    dtype: DType,
    acc: DType,
    K_CONTIG: Bool,
    BMN: Int,
    BK: Int,
    LD: Int,
    VW: Int,
    LV: Int,
](
    regs: Array[SIMD[dtype, VW], LV],
    smem: Pointer[
        Scalar[acc], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
):
    """Registers -> shared memory laid out [k][mn] (row stride LD), converted to acc.
    """
    comptime PER_ROW = BK // VW if K_CONTIG else BMN // VW
    comptime for i in range(LV):
        var v = thread_idx.x + i * SIMT_THREADS
        var row = v // PER_ROW
        var col = (v % PER_ROW) * VW
        comptime if K_CONTIG:  # the vector runs along k: transpose into [k][mn]
            comptime for e in range(VW):
                smem[unsafe_offset=(col + e) * LD + row] = regs[i][e].cast[
                    acc
                ]()
        else:
            smem.unsafe_store[alignment=16](row * LD + col, regs[i].cast[acc]())


# --8<-- [end:simt_load]


# --8<-- [start:simt_kernel]
def gemm_simt_kernel[
    dtype: DType,
    TA: Bool,
    TB: Bool,
    VEC: Bool,
    BM: Int,
    BN: Int,
    BK: Int,
    TM: Int,
    TN: Int,
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    a: Pointer[Scalar[dtype], MutAnyOrigin],
    b: Pointer[Scalar[dtype], MutAnyOrigin],
    c: Pointer[Scalar[dtype], MutAnyOrigin],
    alpha_beta: Pointer[Float32, MutAnyOrigin],
    m: Int64,
    n: Int64,
    k: Int64,
    a_bs: Int64,
    b_bs: Int64,
    c_bs: Int64,
    c_rs: Int64,
    c_cs: Int64,
):
    """Launch with grid (ceil(M/BM) * ceil(N/BN), 1, batch), 256 threads."""
    comptime acc = accum_dtype[dtype]()
    comptime VW = 16 // size_of[dtype]()  # elements per 16-byte global vector
    comptime TX = BN // TN  # threads along N
    comptime TY = BM // TM  # threads along M
    comptime assert TX * TY == SIMT_THREADS, "256 threads per block"
    comptime assert (
        TM % 4 == 0 and TN % 4 == 0
    ), "thread tiles are 4-wide vectors"
    comptime GM = TM // 4  # 4-row groups per thread, BM // GM rows apart
    comptime GN = TN // 4
    comptime LDA = BM + 4  # +4: the transposing stores of k-contiguous tiles conflict less
    comptime LDB = BN + 4
    comptime LVA = BM * BK // VW // SIMT_THREADS  # vectors per thread per tile
    comptime LVB = BN * BK // VW // SIMT_THREADS
    comptime assert LVA * VW * SIMT_THREADS == BM * BK, "A tile splits evenly"
    comptime assert LVB * VW * SIMT_THREADS == BN * BK, "B tile splits evenly"

    var M = Int(m)
    var N = Int(n)
    var K = Int(k)
    var num_m = ceildiv(M, BM)
    var num_n = ceildiv(N, BN)
    var tile = tile_coords(block_idx.x, num_m, num_n)
    var m0 = tile[0] * BM
    var n0 = tile[1] * BN
    var bt = block_idx.z
    var a_t = a.unsafe_offset(bt * Int(a_bs))
    var b_t = b.unsafe_offset(bt * Int(b_bs))

    # two buffers per operand: compute on one while the other is being filled
    var as_ = stack_allocation[
        2 * BK * LDA,
        Scalar[acc],
        address_space=AddressSpace.SHARED,
        alignment=16,
    ]()
    var bs_ = stack_allocation[
        2 * BK * LDB,
        Scalar[acc],
        address_space=AddressSpace.SHARED,
        alignment=16,
    ]()
    var ra = Array[SIMD[dtype, VW], LVA](fill=0)
    var rb = Array[SIMD[dtype, VW], LVB](fill=0)
    var accs = Array[SIMD[acc, 4], TM * GN](fill=0)

    var tx = thread_idx.x % TX
    var ty = thread_idx.x // TX
    var num_k = ceildiv(K, BK)

    simt_fetch[dtype, not TA, VEC, BM, BK, VW, LVA](a_t, m0, 0, M, K, ra)
    simt_fetch[dtype, TB, VEC, BN, BK, VW, LVB](b_t, n0, 0, N, K, rb)
    simt_stash[dtype, acc, not TA, BM, BK, LDA, VW, LVA](ra, as_)
    simt_stash[dtype, acc, TB, BN, BK, LDB, VW, LVB](rb, bs_)
    barrier()

    for kt in range(num_k):
        var cur = kt % 2
        var has_next = kt + 1 < num_k
        if has_next:  # issue the next tile's global loads before the math
            simt_fetch[dtype, not TA, VEC, BM, BK, VW, LVA](
                a_t, m0, (kt + 1) * BK, M, K, ra
            )
            simt_fetch[dtype, TB, VEC, BN, BK, VW, LVB](
                b_t, n0, (kt + 1) * BK, N, K, rb
            )
        var sa = as_.unsafe_offset(cur * BK * LDA)
        var sb = bs_.unsafe_offset(cur * BK * LDB)
        comptime for kk in range(BK):
            var fa = Array[SIMD[acc, 4], GM](fill=0)
            var fb = Array[SIMD[acc, 4], GN](fill=0)
            comptime for g in range(GM):
                fa[g] = sa.unsafe_load[width=4, alignment=16](
                    kk * LDA + g * (BM // GM) + ty * 4
                )
            comptime for h in range(GN):
                fb[h] = sb.unsafe_load[width=4, alignment=16](
                    kk * LDB + h * (BN // GN) + tx * 4
                )
            comptime for g in range(GM):
                comptime for r in range(4):
                    var av = SIMD[acc, 4](fa[g][r])
                    comptime for h in range(GN):
                        accs[(g * 4 + r) * GN + h] = av.fma(
                            fb[h], accs[(g * 4 + r) * GN + h]
                        )
        if has_next:
            var nxt = 1 - cur
            simt_stash[dtype, acc, not TA, BM, BK, LDA, VW, LVA](
                ra, as_.unsafe_offset(nxt * BK * LDA)
            )
            simt_stash[dtype, acc, TB, BN, BK, LDB, VW, LVB](
                rb, bs_.unsafe_offset(nxt * BK * LDB)
            )
        barrier()

    # epilogue: alpha * acc + beta * c, masked at the edges
    var alpha = alpha_beta[unsafe_offset=0].cast[acc]()
    var beta = alpha_beta[unsafe_offset=1].cast[acc]()
    var o_t = dst.unsafe_offset(bt * M * N)
    var c_t = c.unsafe_offset(bt * Int(c_bs))
    comptime for g in range(GM):
        comptime for r in range(4):
            var row = m0 + g * (BM // GM) + ty * 4 + r
            if row < M:
                comptime for h in range(GN):
                    var col = n0 + h * (BN // GN) + tx * 4
                    var v = accs[(g * 4 + r) * GN + h] * alpha
                    if beta != 0:
                        comptime for e in range(4):
                            if col + e < N:
                                v[e] += (
                                    beta
                                    * c_t[
                                        unsafe_offset=row * Int(c_rs)
                                        + (col + e) * Int(c_cs)
                                    ].cast[acc]()
                                )
                    var o = v.cast[dtype]()
                    var stored = False
                    comptime if VEC and dtype == DType.float32:
                        if col + 3 < N:  # N % 4 == 0 under VEC
                            o_t.unsafe_store[alignment=16](row * N + col, o)
                            stored = True
                    if not stored:
                        comptime for e in range(4):
                            if col + e < N:
                                o_t[unsafe_offset=row * N + col + e] = o[e]


# --8<-- [end:simt_kernel]


# ---------------------------------------------------------------------------
# Tensor-core kernel (bfloat16, float16): mma.sync m16n8k16, fp32 accumulators.

comptime TC_BM = 128  # 64 when 128-row tiles would leave SMs idle (the launch plan)
comptime TC_BN = 128
comptime TC_BK = 32
comptime TC_STAGES = 4
comptime TC_THREADS = 256  # 8 warps: 2 along M x 4 along N
comptime TC_WN = 32
comptime TC_NI = TC_WN // 8  # n8 tiles per warp
comptime TC_PAD = 8  # 16 bytes: rows stay 16-byte aligned, ldmatrix rows hit distinct banks


def tc_ld[k_contiguous: Bool, bmn: Int]() -> Int:
    """Row stride (elements) of a shared tile: [mn][k] if k-contiguous, else [k][mn].
    """
    return (TC_BK if k_contiguous else bmn) + TC_PAD


def tc_tile_elems[k_contiguous: Bool, bmn: Int]() -> Int:
    return (bmn if k_contiguous else TC_BK) * tc_ld[k_contiguous, bmn]()


# --8<-- [start:tc_load]
@always_inline
def tc_load_tile[
    dtype: DType, K_CONTIG: Bool, VEC: Bool, BMN: Int
](
    src: Pointer[Scalar[dtype], MutAnyOrigin],
    smem: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    mn0: Int,
    k0: Int,
    mn_size: Int,
    k_size: Int,
):
    """Global -> shared for one (BMN x BK) tile, kept in its stored orientation.

    VEC: 16-byte cp.async per vector (asynchronous; src_size 0 zero-fills vectors
    that lie outside the matrix). Otherwise guarded scalar loads and stores.
    """
    comptime VW = 8  # 16 bytes of a 2-byte type
    comptime LD = tc_ld[K_CONTIG, BMN]()
    comptime PER_ROW = TC_BK // VW if K_CONTIG else BMN // VW
    comptime LV = BMN * TC_BK // VW // TC_THREADS
    comptime assert LV * VW * TC_THREADS == BMN * TC_BK, "tile splits evenly"
    comptime for i in range(LV):
        var v = thread_idx.x + i * TC_THREADS
        var row = v // PER_ROW
        var col = (v % PER_ROW) * VW
        var mn = mn0 + (row if K_CONTIG else col)
        var kk = k0 + (col if K_CONTIG else row)
        var dst = smem.unsafe_offset(row * LD + col)
        comptime if VEC:
            var inside = mn < mn_size and kk < k_size
            var off = operand_offset[K_CONTIG](
                mn, kk, mn_size, k_size
            ) if inside else 0
            # without `fill`, async_copy drops src_size (plain 16-byte copy)
            async_copy[16, fill=Scalar[dtype](0)](
                src.unsafe_offset(off).unsafe_address_space_cast[
                    AddressSpace.GLOBAL
                ](),
                dst,
                src_size=Int32(16 if inside else 0),
            )
        else:
            comptime for e in range(VW):
                var emn = mn + (0 if K_CONTIG else e)
                var ek = kk + (e if K_CONTIG else 0)
                var x = Scalar[dtype](0)
                if emn < mn_size and ek < k_size:
                    x = src[
                        unsafe_offset=operand_offset[K_CONTIG](
                            emn, ek, mn_size, k_size
                        )
                    ]
                dst[unsafe_offset=e] = x


# --8<-- [end:tc_load]


# --8<-- [start:tc_frags]
@always_inline
def load_a_frag[
    dtype: DType, K_CONTIG: Bool, BM: Int
](
    smem: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    m_base: Int,
    kk: Int,
) -> SIMD[dtype, 8]:
    """The A fragment of one m16 x k16 mma tile (4 ldmatrix 8x8 matrices).

    Register j of the fragment is the 8x8 block (rows m_base + 8*(j%2), cols kk + 8*(j//2)).
    Stored [m][k], lane l points at row m_base + l%16, col kk + 8*(l//16); stored [k][m]
    the same blocks are read transposed (ldmatrix.trans), lane l at row
    kk + l%8 + 8*(j//2), col m_base + 8*(j%2) with j = l//8.
    """
    comptime LD = tc_ld[K_CONTIG, BM]()
    var lane = lane_id()
    var half = smem.unsafe_bitcast[
        Float16
    ]()  # ldmatrix moves b16: any 2-byte type
    comptime if K_CONTIG:
        var p = half.unsafe_offset(
            (m_base + lane % 16) * LD + kk + (lane // 16) * 8
        )
        return bitcast[dtype, 8](ld_matrix[8](p))
    else:
        var j = lane // 8
        var p = half.unsafe_offset(
            (kk + lane % 8 + (j // 2) * 8) * LD + m_base + (j % 2) * 8
        )
        return bitcast[dtype, 8](ld_matrix[8, transpose=True](p))


@always_inline
def load_b_frags[
    dtype: DType, K_CONTIG: Bool
](
    smem: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    n_base: Int,
    kk: Int,
) -> SIMD[dtype, 8]:
    """B fragments of two n8 x k16 mma tiles (n_base and n_base + 8): elements 0-3 and 4-7.

    Register j is the 8x8 block (k rows kk + 8*(j%2), n cols n_base + 8*(j//2)).
    Stored [n][k] (TRANSPOSE_B) it is read directly, stored [k][n] transposed.
    """
    comptime LD = tc_ld[K_CONTIG, TC_BN]()
    var lane = lane_id()
    var j = lane // 8
    var r = lane % 8
    var half = smem.unsafe_bitcast[Float16]()
    comptime if K_CONTIG:
        var p = half.unsafe_offset(
            (n_base + (j // 2) * 8 + r) * LD + kk + (j % 2) * 8
        )
        return bitcast[dtype, 8](ld_matrix[8](p))
    else:
        var p = half.unsafe_offset(
            (kk + (j % 2) * 8 + r) * LD + n_base + (j // 2) * 8
        )
        return bitcast[dtype, 8](ld_matrix[8, transpose=True](p))


# --8<-- [end:tc_frags]


# --8<-- [start:tc_kernel]
def gemm_tc_kernel[
    dtype: DType,
    TA: Bool,
    TB: Bool,
    VEC: Bool,
    BM: Int,
    SMEM: Int,
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    a: Pointer[Scalar[dtype], MutAnyOrigin],
    b: Pointer[Scalar[dtype], MutAnyOrigin],
    c: Pointer[Scalar[dtype], MutAnyOrigin],
    alpha_beta: Pointer[Float32, MutAnyOrigin],
    m: Int64,
    n: Int64,
    k: Int64,
    a_bs: Int64,
    b_bs: Int64,
    c_bs: Int64,
    c_rs: Int64,
    c_cs: Int64,
):
    """Launch with grid (ceil(M/BM) * ceil(N/128), 1, batch), 256 threads and
    SMEM bytes of dynamic shared memory.

    SMEM is the launch plan's number (pytorch_custom_ops/gemm_gpu.py): passed here
    as a parameter so that a plan whose size does not match this layout fails to
    build instead of overrunning shared memory."""
    comptime WM = BM // 2  # warp tile: WM x TC_WN
    comptime MI = WM // 16  # m16 tiles per warp
    comptime A_KC = not TA  # A is k-contiguous when stored (M, K)
    comptime B_KC = TB  # B is k-contiguous when stored (N, K)
    comptime A_ELEMS = tc_tile_elems[A_KC, BM]()
    comptime B_ELEMS = tc_tile_elems[B_KC, TC_BN]()
    comptime assert (
        SMEM == TC_STAGES * (A_ELEMS + B_ELEMS) * size_of[dtype]()
    ), "SMEM is the size of the stage buffers"

    var M = Int(m)
    var N = Int(n)
    var K = Int(k)
    var tile = tile_coords(block_idx.x, ceildiv(M, BM), ceildiv(N, TC_BN))
    var m0 = tile[0] * BM
    var n0 = tile[1] * TC_BN
    var bt = block_idx.z
    var a_t = a.unsafe_offset(bt * Int(a_bs))
    var b_t = b.unsafe_offset(bt * Int(b_bs))

    var smem = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16
    ]()
    var sa = smem
    var sb = smem.unsafe_offset(TC_STAGES * A_ELEMS)

    var wid = warp_id()
    var wm = (
        wid // (TC_BN // TC_WN)
    ) * WM  # warp's offset inside the block tile
    var wn = (wid % (TC_BN // TC_WN)) * TC_WN
    var accs = Array[SIMD[DType.float32, 4], MI * TC_NI](fill=0)
    var num_k = ceildiv(K, TC_BK)

    # prologue: fill STAGES - 1 stages; one commit group per stage, even if empty,
    # so that "wait until at most STAGES - 2 groups are pending" always means
    # "the stage about to be read has landed"
    comptime for s in range(TC_STAGES - 1):
        if s < num_k:
            tc_load_tile[dtype, A_KC, VEC, BM](
                a_t, sa.unsafe_offset(s * A_ELEMS), m0, s * TC_BK, M, K
            )
            tc_load_tile[dtype, B_KC, VEC, TC_BN](
                b_t, sb.unsafe_offset(s * B_ELEMS), n0, s * TC_BK, N, K
            )
        async_copy_commit_group()

    for kt in range(num_k):
        async_copy_wait_group(TC_STAGES - 2)
        barrier()  # stage kt is visible to all; everyone is done with stage kt - 1
        var nxt = kt + TC_STAGES - 1
        if nxt < num_k:  # refill the stage computed in the previous iteration
            var s = nxt % TC_STAGES
            tc_load_tile[dtype, A_KC, VEC, BM](
                a_t, sa.unsafe_offset(s * A_ELEMS), m0, nxt * TC_BK, M, K
            )
            tc_load_tile[dtype, B_KC, VEC, TC_BN](
                b_t, sb.unsafe_offset(s * B_ELEMS), n0, nxt * TC_BK, N, K
            )
        async_copy_commit_group()

        var cur = kt % TC_STAGES
        var sa_k = sa.unsafe_offset(cur * A_ELEMS)
        var sb_k = sb.unsafe_offset(cur * B_ELEMS)
        comptime for kk in range(0, TC_BK, 16):
            var fa = Array[SIMD[dtype, 8], MI](fill=0)
            var fb = Array[SIMD[dtype, 8], TC_NI // 2](fill=0)
            comptime for i in range(MI):
                fa[i] = load_a_frag[dtype, A_KC, BM](sa_k, wm + i * 16, kk)
            comptime for p in range(TC_NI // 2):
                fb[p] = load_b_frags[dtype, B_KC](sb_k, wn + p * 16, kk)
            comptime for i in range(MI):
                comptime for j in range(TC_NI):
                    var c_in = accs[i * TC_NI + j]
                    mma(
                        accs[i * TC_NI + j],
                        fa[i],
                        fb[j // 2].slice[4, offset=(j % 2) * 4](),
                        c_in,
                    )

    # epilogue. Accumulator element e of tile (i, j) is row g + 8*(e//2), col 2*t + e%2
    # with g = lane // 4, t = lane % 4.
    var alpha = alpha_beta[unsafe_offset=0]
    var beta = alpha_beta[unsafe_offset=1]
    var o_t = dst.unsafe_offset(bt * M * N)
    var c_t = c.unsafe_offset(bt * Int(c_bs))
    var g = lane_id() // 4
    var t = lane_id() % 4
    comptime for i in range(MI):
        comptime for half in range(2):
            var row = m0 + wm + i * 16 + g + half * 8
            if row < M:
                comptime for j in range(TC_NI):
                    var col = n0 + wn + j * 8 + 2 * t
                    var v = (
                        accs[i * TC_NI + j].slice[2, offset=half * 2]() * alpha
                    )
                    if beta != 0:
                        comptime for e in range(2):
                            if col + e < N:
                                v[e] += (
                                    beta
                                    * c_t[
                                        unsafe_offset=row * Int(c_rs)
                                        + (col + e) * Int(c_cs)
                                    ].cast[DType.float32]()
                                )
                    var o = v.cast[dtype]()
                    var stored = False
                    comptime if VEC:
                        if (
                            col + 1 < N
                        ):  # N % 8 == 0 under VEC: 4-byte aligned pair
                            o_t.unsafe_store[alignment=4](row * N + col, o)
                            stored = True
                    if not stored:
                        comptime for e in range(2):
                            if col + e < N:
                                o_t[unsafe_offset=row * N + col + e] = o[e]


# --8<-- [end:tc_kernel]


# ---------------------------------------------------------------------------
# Hopper tensor-core kernel (bfloat16, float16): wgmma.mma_async, fp32 accumulators.
#
# One warpgroup (4 warps, 128 threads) per 64 rows of the block tile: it issues
# m64nBNk16 wgmma instructions whose operands are read straight from shared memory
# through 64-bit matrix descriptors, so no ldmatrix and no A/B fragments in
# registers. Shared tiles use the "no swizzle" canonical layout, built of 8x8 core
# matrices (8 rows of 16 bytes, 128 contiguous bytes each):
#   * byte offset of 16-byte vector (row r, vector v) of a tile is v * ROWS * 16 + r * 16,
#     where "row" is the stored layout's strided dim and "vector" its contiguous one;
#   * k-contiguous operand (A, or B^T): rows = mn (BMN), vectors = k/8 (8 per BK = 64);
#     descriptor LBO (next core matrix along k) = BMN * 16, SBO (along mn) = 128;
#   * mn-contiguous operand (A^T, or B): rows = k (64), vectors = mn/8;
#     LBO (along k) = 128, SBO (along mn) = 64 * 16 = 1024.
# Eight consecutive threads copy one core matrix (128 contiguous bytes), so the
# cp.async writes are free of bank conflicts, and a warp reads 4 vectors (64 B) of
# 8 global rows.

comptime WG_BK = 64  # k per pipeline stage: 4 wgmma k16 steps
comptime WG_STAGES = 4  # shared stages; loads run STAGES - 2 tiles ahead
comptime WG_THREADS = 128  # one warpgroup


@always_inline
def fence_async_shared():
    """Make this thread's completed cp.async writes (generic proxy) visible to wgmma
    (async proxy) reads of shared memory."""
    inlined_assembly[
        "fence.proxy.async.shared::cta;", NoneType, constraints=""
    ]()


# --8<-- [start:wg_load]
@always_inline
def wg_load_tile[
    dtype: DType, K_CONTIG: Bool, BMN: Int, THREADS: Int
](
    src: Pointer[Scalar[dtype], MutAnyOrigin],
    smem: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    mn0: Int,
    k0: Int,
    mn_size: Int,
    k_size: Int,
):
    """Global -> shared (cp.async, 16 B each) of one BMN x WG_BK tile into the
    core-matrix layout. Vectors outside the matrix are zero-filled (src_size 0).

    Vector i of thread t is v = t + i * THREADS; within a warp (q = v // 32, l = v % 32)
    lanes l % 8 walk 8 consecutive rows and l // 8 four consecutive vectors.
    """
    comptime ROWS = BMN if K_CONTIG else WG_BK  # the stored layout's strided dim
    comptime VECS = WG_BK // 8 if K_CONTIG else BMN // 8  # 16-byte vectors per row
    comptime RG = ROWS // 8  # groups of 8 rows
    comptime LV = ROWS * VECS // THREADS
    comptime assert LV * THREADS == ROWS * VECS, "tile splits evenly"
    comptime assert VECS % 4 == 0 and ROWS % 8 == 0, "whole warps per 8x4 block"
    comptime for i in range(LV):
        var v = thread_idx.x + i * THREADS
        var q = v // 32
        var l = v % 32
        var row = l % 8 + 8 * (q % RG)
        var vec = l // 8 + 4 * (q // RG)
        var mn = mn0 + (row if K_CONTIG else vec * 8)
        var kk = k0 + (vec * 8 if K_CONTIG else row)
        var inside = mn < mn_size and kk < k_size
        var off = operand_offset[K_CONTIG](
            mn, kk, mn_size, k_size
        ) if inside else 0
        async_copy[16, fill=Scalar[dtype](0)](
            src.unsafe_offset(off).unsafe_address_space_cast[
                AddressSpace.GLOBAL
            ](),
            smem.unsafe_offset((vec * ROWS + row) * 8),
            src_size=Int32(16 if inside else 0),
        )


# --8<-- [end:wg_load]


# --8<-- [start:wg_desc]
@always_inline
def wg_desc[
    dtype: DType, K_CONTIG: Bool, BMN: Int
](
    tile: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    mn: Int,
    ks: Int,
) -> WGMMADescriptor[dtype]:
    """Descriptor of the (64 or BN) x k16 slice at row `mn`, k step `ks` (k = 16*ks)
    of a tile in the core-matrix layout. LBO: next core matrix along k; SBO: along mn.
    `create[SBO, LBO]` takes both in 16-byte units (it does not shift them).
    """
    comptime if K_CONTIG:
        # vector (k/8) * BMN * 16 + mn * 16
        return WGMMADescriptor[dtype].create[128 // 16, BMN](
            tile.unsafe_offset((2 * ks * BMN + mn) * 8)
        )
    else:
        # (mn/8) * 64 * 16 + k * 16
        return WGMMADescriptor[dtype].create[WG_BK, 128 // 16](
            tile.unsafe_offset((mn // 8) * WG_BK * 8 + 16 * ks * 8)
        )


# --8<-- [end:wg_desc]


# --8<-- [start:wg_epilogue]
@always_inline
def wg_store_acc[
    dtype: DType, BN: Int
](
    acc: SIMD[DType.float32, BN // 2],
    o_t: Pointer[Scalar[dtype], MutAnyOrigin],
    c_t: Pointer[Scalar[dtype], MutAnyOrigin],
    alpha_beta: Pointer[Float32, MutAnyOrigin],
    row0: Int,
    n0: Int,
    M: Int,
    N: Int,
    c_rs: Int,
    c_cs: Int,
):
    """Epilogue of one warpgroup's 64 x BN wgmma accumulator whose first row is
    `row0`: out = alpha * acc + beta * c, straight from registers (N % 8 == 0).

    Accumulator element 4*j + e sits at row 16*warp + g + 8*(e//2), col
    8*j + 2*t + e%2 (g = lane // 4, t = lane % 4): the mma.sync C layout per n8.
    """
    var alpha = alpha_beta[unsafe_offset=0]
    var beta = alpha_beta[unsafe_offset=1]
    var g = lane_id() // 4
    var t = lane_id() % 4
    var wrow = row0 + (warp_id() % 4) * 16 + g
    var out = acc * alpha
    if beta != 0:
        comptime for half in range(2):
            var row = wrow + half * 8
            comptime for j in range(BN // 8):
                var col = n0 + j * 8 + 2 * t
                if row < M and col < N:
                    comptime for e in range(2):
                        out[4 * j + 2 * half + e] += (
                            beta
                            * c_t[
                                unsafe_offset=row * c_rs + (col + e) * c_cs
                            ].cast[DType.float32]()
                        )
    comptime for half in range(2):
        var row = wrow + half * 8
        if row < M:
            comptime for j in range(BN // 8):
                var col = n0 + j * 8 + 2 * t
                if col < N:  # N % 8 == 0: the pair is all in or all out
                    o_t.unsafe_store[alignment=4](
                        row * N + col,
                        out.slice[2, offset=4 * j + 2 * half]().cast[dtype](),
                    )


# --8<-- [end:wg_epilogue]


# --8<-- [start:wg_kernel]
def gemm_wgmma_kernel[
    dtype: DType,
    TA: Bool,
    TB: Bool,
    BM: Int,
    BN: Int,
    SMEM: Int,
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    a: Pointer[Scalar[dtype], MutAnyOrigin],
    b: Pointer[Scalar[dtype], MutAnyOrigin],
    c: Pointer[Scalar[dtype], MutAnyOrigin],
    alpha_beta: Pointer[Float32, MutAnyOrigin],
    m: Int64,
    n: Int64,
    k: Int64,
    a_bs: Int64,
    b_bs: Int64,
    c_bs: Int64,
    c_rs: Int64,
    c_cs: Int64,
):
    """Launch with grid (ceil(M/BM) * ceil(N/BN), 1, batch), BM/64 warpgroups
    (2 * BM threads) and SMEM bytes of dynamic shared memory (the launch plan's
    number, checked against this layout). Requires the VEC conditions (16-byte
    aligned rows and pointers)."""
    comptime NWG = BM // 64  # warpgroups, each owns 64 rows x BN
    comptime THREADS = NWG * WG_THREADS
    comptime A_KC = not TA  # A is k-contiguous when stored (M, K)
    comptime B_KC = TB  # B is k-contiguous when stored (N, K)
    comptime A_ELEMS = BM * WG_BK
    comptime B_ELEMS = BN * WG_BK
    comptime assert BM % 64 == 0 and BN % 64 == 0 and BN <= 256, "tile shape"
    comptime assert (
        SMEM == WG_STAGES * (A_ELEMS + B_ELEMS) * size_of[dtype]()
    ), "SMEM is the size of the stage buffers"

    var M = Int(m)
    var N = Int(n)
    var K = Int(k)
    var tile = tile_coords(block_idx.x, ceildiv(M, BM), ceildiv(N, BN))
    var m0 = tile[0] * BM
    var n0 = tile[1] * BN
    var bt = block_idx.z
    var a_t = a.unsafe_offset(bt * Int(a_bs))
    var b_t = b.unsafe_offset(bt * Int(b_bs))

    var smem = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=128
    ]()
    var sa = smem
    var sb = smem.unsafe_offset(WG_STAGES * A_ELEMS)
    var wg = thread_idx.x // WG_THREADS
    var acc = SIMD[DType.float32, BN // 2](0)
    var num_k = ceildiv(K, WG_BK)

    # prologue: STAGES - 2 tiles in flight, one commit group per tile (empty ones
    # too), so "at most STAGES - 3 groups pending" means "tile kt has landed"
    comptime for s in range(WG_STAGES - 2):
        if s < num_k:
            wg_load_tile[dtype, A_KC, BM, THREADS](
                a_t, sa.unsafe_offset(s * A_ELEMS), m0, s * WG_BK, M, K
            )
            wg_load_tile[dtype, B_KC, BN, THREADS](
                b_t, sb.unsafe_offset(s * B_ELEMS), n0, s * WG_BK, N, K
            )
        async_copy_commit_group()

    for kt in range(num_k):
        async_copy_wait_group(WG_STAGES - 3)
        fence_async_shared()
        # tile kt is visible to every thread, and every warpgroup has retired the
        # wgmma group of tile kt - 2 (wait_group 1 below), so its stage is free
        barrier()
        var nxt = kt + WG_STAGES - 2
        if nxt < num_k:
            var s = nxt % WG_STAGES
            wg_load_tile[dtype, A_KC, BM, THREADS](
                a_t, sa.unsafe_offset(s * A_ELEMS), m0, nxt * WG_BK, M, K
            )
            wg_load_tile[dtype, B_KC, BN, THREADS](
                b_t, sb.unsafe_offset(s * B_ELEMS), n0, nxt * WG_BK, N, K
            )
        async_copy_commit_group()

        var cur = kt % WG_STAGES
        var sa_k = sa.unsafe_offset(cur * A_ELEMS)
        var sb_k = sb.unsafe_offset(cur * B_ELEMS)
        wgmma_fence_aligned()
        comptime for ks in range(WG_BK // 16):
            acc = wgmma_async[
                64,
                BN,
                16,
                a_type=dtype,
                b_type=dtype,
                layout_a="row" if A_KC else "col",
                layout_b="col" if B_KC else "row",
            ](
                wg_desc[dtype, A_KC, BM](sa_k, wg * 64, ks),
                wg_desc[dtype, B_KC, BN](sb_k, 0, ks),
                acc,
            )
        wgmma_commit_group_sync()
        # keep one group in flight: the next tile's loads and wgmma overlap it
        wgmma_wait_group_sync[1]()
    wgmma_wait_group_sync[0]()

    var o_t = dst.unsafe_offset(bt * M * N)
    var c_t = c.unsafe_offset(bt * Int(c_bs))
    wg_store_acc[dtype, BN](
        acc, o_t, c_t, alpha_beta, m0 + wg * 64, n0, M, N, Int(c_rs), Int(c_cs)
    )


# --8<-- [end:wg_kernel]


# ---------------------------------------------------------------------------
# Version 3, Hopper: TMA loads into 128-byte swizzled tiles, a producer warpgroup
# and consumer warpgroups that only multiply (bfloat16, float16).
#
# Version 2 made every thread both load (cp.async, one 16-byte vector at a time) and
# multiply, with a block-wide barrier per k tile. Here the two jobs are split:
#   * warpgroup 0 is the producer. One of its threads issues TMA copies
#     (cp.async.bulk.tensor): the copy engine moves a whole tile per instruction,
#     zero-fills what lies outside the matrix and writes the 128-byte swizzled layout
#     that wgmma reads without bank conflicts. The warpgroup gives most of its
#     registers back (setmaxnreg) to the consumers.
#   * warpgroups 1..BM/64 are consumers; each owns 64 rows x BN of the block tile.
# Each of the STAGES shared buffers has two mbarriers: `full` (the producer announces
# the stage's byte count; the TMA unit completes the phase when the bytes have
# landed) and `empty` (each consumer warp arrives once the wgmma group that read the
# stage has retired). The main loop has no block-wide barrier.
#
# 128-byte swizzle: a row of 64 16-bit elements is 128 bytes; TMA stores 16-byte
# chunk c of row r at chunk c ^ (r % 8), and wgmma undoes the XOR when a descriptor
# says SWIZZLE_128B. Both apply it to absolute shared addresses, so each 8-row
# block (1024 bytes) must start 1024-byte aligned. Tile layouts, in elements:
#   * k-contiguous operand (A, or B^T): BMN rows of 64 k (one TMA box). Descriptor
#     SBO (next 8 rows) = 1024 B; LBO unused. A k16 step moves the start address
#     by 32 B inside the swizzled row: the hardware applies the XOR after adding.
#   * mn-contiguous operand (A^T, or B): BMN/64 boxes of 64 k rows x 64 mn. SBO
#     (next 8 k rows) = 1024 B, LBO (next box of 64 mn) = 8192 B; a k16 step moves
#     the start address by 16 rows = 2048 B.

comptime TMA_BK = 64  # k per stage: one 128-byte swizzled row of 16-bit elements
comptime TMA_BOX = 64  # mn width of one box of an mn-contiguous operand (128 B)
comptime TMA_CONSUMER_REGS = 232  # setmaxnreg: what each consumer thread grows to
comptime TMA_PRODUCER_REGS = 40  # ... and each producer thread shrinks to
# The stage count (how many fit in the shared-memory budget) and the tensor maps (one
# per operand, viewed as (batch, rows, cols) as stored, box BMN x 64 or 64 x 64, 128-byte
# swizzle) are the launch plan's, in pytorch_custom_ops/gemm_gpu.py; STAGES and SMEM
# reach the kernel as parameters.


@always_inline
def fence_mbarrier_init():
    """Make mbarrier.init visible to the async proxy (the TMA unit) before use.
    """
    inlined_assembly[
        "fence.mbarrier_init.release.cluster;", NoneType, constraints=""
    ]()


@always_inline
def mbar_wait(
    bar: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    parity: Int,
):
    """Spin until the mbarrier phase with this parity (0, 1, 0, ...) completes.
    """
    inlined_assembly[
        """{
        .reg .pred done;
        WAIT:
        mbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1;
        @!done bra WAIT;
        }""",
        NoneType,
        constraints="r,r",
    ](Int32(Int(bar)), Int32(parity))


@always_inline
def set_max_registers[grow: Bool, count: Int]():
    """Hand registers between the warpgroups of a block (setmaxnreg; all threads of
    a warpgroup execute it)."""
    comptime op = "inc" if grow else "dec"
    inlined_assembly[
        "setmaxnreg." + op + ".sync.aligned.u32 " + String(count) + ";",
        NoneType,
        constraints="",
    ]()


# --8<-- [start:tma_load]
@always_inline
def tma_load_operand[
    dtype: DType, K_CONTIG: Bool, BMN: Int
](
    tma_map: OpaquePointer[mut=False, _],
    tile: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    bar: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    mn0: Int,
    k0: Int,
    bt: Int,
):
    """Start the copy of one stage's tile (BMN x 64 of op(X)); `bar` counts the bytes.
    TMA coordinates go innermost first: (col, row, batch)."""
    comptime if K_CONTIG:
        cp_async_bulk_tensor_shared_cluster_global(
            tile, tma_map, bar, IndexList[3](k0, mn0, bt)
        )
    else:
        comptime for j in range(BMN // TMA_BOX):
            cp_async_bulk_tensor_shared_cluster_global(
                tile.unsafe_offset(j * TMA_BOX * TMA_BK),
                tma_map,
                bar,
                IndexList[3](mn0 + j * TMA_BOX, k0, bt),
            )


# --8<-- [end:tma_load]


# --8<-- [start:tma_desc]
@always_inline
def tma_desc[
    dtype: DType, K_CONTIG: Bool
](
    tile: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    mn: Int,
    ks: Int,
) -> WGMMADescriptor[dtype]:
    """Descriptor of the slice at row `mn` (a multiple of 64), k step `ks` of a
    swizzled tile. `create[SBO, LBO]` takes both in 16-byte units."""
    comptime row_bytes = TMA_BK * size_of[dtype]()  # 128
    comptime if K_CONTIG:
        return WGMMADescriptor[dtype].create[
            8 * row_bytes // 16, 1, TensorMapSwizzle.SWIZZLE_128B
        ](tile.unsafe_offset(mn * TMA_BK + ks * 16))
    else:
        return WGMMADescriptor[dtype].create[
            8 * row_bytes // 16,
            TMA_BOX * row_bytes // 16,
            TensorMapSwizzle.SWIZZLE_128B,
        ](
            tile.unsafe_offset(
                (mn // TMA_BOX) * TMA_BOX * TMA_BK + ks * 16 * TMA_BOX
            )
        )


# --8<-- [end:tma_desc]


# --8<-- [start:tma_kernel]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](
        Int32(WG_THREADS * (1 + BM // 64))
    )
)
@__llvm_arg_metadata(a_map, `nvvm.grid_constant`)
@__llvm_arg_metadata(b_map, `nvvm.grid_constant`)
def gemm_tma_kernel[
    dtype: DType,
    TA: Bool,
    TB: Bool,
    BM: Int,
    BN: Int,
    STAGES: Int,
    SMEM: Int,
](
    a_map: TMADescriptor,
    b_map: TMADescriptor,
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    c: Pointer[Scalar[dtype], MutAnyOrigin],
    alpha_beta: Pointer[Float32, MutAnyOrigin],
    m: Int64,
    n: Int64,
    k: Int64,
    c_bs: Int64,
    c_rs: Int64,
    c_cs: Int64,
):
    """Launch with grid (ceil(M/BM) * ceil(N/BN), 1, batch), 128 * (1 + BM/64)
    threads and SMEM bytes of dynamic shared memory: STAGES stage buffers, then a
    `full` and an `empty` mbarrier (8 B each) per stage. The launch plan picks
    STAGES (as many as its budget holds) and builds a_map and b_map with boxes of
    this kernel's tiles."""
    comptime CONSUMERS = BM // 64
    comptime A_KC = not TA  # A is k-contiguous when stored (M, K)
    comptime B_KC = TB  # B is k-contiguous when stored (N, K)
    comptime A_ELEMS = BM * TMA_BK
    comptime B_ELEMS = BN * TMA_BK
    comptime STAGE_BYTES = (A_ELEMS + B_ELEMS) * size_of[dtype]()
    comptime assert BM % 64 == 0 and BN % 64 == 0 and BN <= 256, "tile shape"
    comptime assert STAGES >= 2, "at least two stages"
    comptime assert SMEM == STAGES * (STAGE_BYTES + 16), "stages + mbarriers"
    comptime assert (
        TMA_BK * size_of[dtype]() == 128
    ), "a k row is one 128-byte swizzle span (the tensor maps' box width)"

    var M = Int(m)
    var N = Int(n)
    var K = Int(k)
    var tile = tile_coords(block_idx.x, ceildiv(M, BM), ceildiv(N, BN))
    var m0 = tile[0] * BM
    var n0 = tile[1] * BN
    var bt = block_idx.z
    var num_k = ceildiv(K, TMA_BK)

    var smem = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=1024
    ]()
    var sa = smem
    var sb = smem.unsafe_offset(STAGES * A_ELEMS)
    var full = smem.unsafe_offset(STAGES * (A_ELEMS + B_ELEMS)).unsafe_bitcast[
        Int64
    ]()
    var empty = full.unsafe_offset(STAGES)
    if thread_idx.x == 0:
        comptime for s in range(STAGES):
            mbarrier_init(full.unsafe_offset(s), 1)
            mbarrier_init(empty.unsafe_offset(s), Int32(CONSUMERS * 4))
        fence_mbarrier_init()
    barrier()

    var wg = thread_idx.x // WG_THREADS
    if wg == 0:
        # producer: one thread keeps up to STAGES tiles in flight
        set_max_registers[False, TMA_PRODUCER_REGS]()
        if thread_idx.x == 0:
            var a_ptr = Pointer(to=a_map).unsafe_bitcast[NoneType]()
            var b_ptr = Pointer(to=b_map).unsafe_bitcast[NoneType]()
            for kt in range(num_k):
                var s = kt % STAGES
                if kt >= STAGES:  # wait until the consumers released round r-1
                    mbar_wait(empty.unsafe_offset(s), (kt // STAGES - 1) % 2)
                mbarrier_arrive_expect_tx_shared(
                    full.unsafe_offset(s), Int32(STAGE_BYTES)
                )
                tma_load_operand[dtype, A_KC, BM](
                    a_ptr,
                    sa.unsafe_offset(s * A_ELEMS),
                    full.unsafe_offset(s),
                    m0,
                    kt * TMA_BK,
                    bt,
                )
                tma_load_operand[dtype, B_KC, BN](
                    b_ptr,
                    sb.unsafe_offset(s * B_ELEMS),
                    full.unsafe_offset(s),
                    n0,
                    kt * TMA_BK,
                    bt,
                )
    else:
        set_max_registers[True, TMA_CONSUMER_REGS]()
        var cw = wg - 1  # this consumer's 64 rows of the block tile
        var acc = SIMD[DType.float32, BN // 2](0)
        for kt in range(num_k):
            var s = kt % STAGES
            mbar_wait(full.unsafe_offset(s), (kt // STAGES) % 2)
            var sa_k = sa.unsafe_offset(s * A_ELEMS)
            var sb_k = sb.unsafe_offset(s * B_ELEMS)
            wgmma_fence_aligned()
            comptime for ks in range(TMA_BK // 16):
                acc = wgmma_async[
                    64,
                    BN,
                    16,
                    a_type=dtype,
                    b_type=dtype,
                    layout_a="row" if A_KC else "col",
                    layout_b="col" if B_KC else "row",
                ](
                    tma_desc[dtype, A_KC](sa_k, cw * 64, ks),
                    tma_desc[dtype, B_KC](sb_k, 0, ks),
                    acc,
                )
            wgmma_commit_group_sync()
            # one group stays in flight; the one before it has retired, so its
            # stage goes back to the producer
            wgmma_wait_group_sync[1]()
            if kt > 0 and lane_id() == 0:
                _ = mbarrier_arrive(empty.unsafe_offset((kt - 1) % STAGES))
        wgmma_wait_group_sync[0]()
        wg_store_acc[dtype, BN](
            acc,
            dst.unsafe_offset(bt * M * N),
            c.unsafe_offset(bt * Int(c_bs)),
            alpha_beta,
            m0 + cw * 64,
            n0,
            M,
            N,
            Int(c_rs),
            Int(c_cs),
        )


# --8<-- [end:tma_kernel]


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
