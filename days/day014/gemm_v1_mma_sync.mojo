# Day 014, version 1 for bfloat16 / float16: Ampere-style tensor cores (mma.sync).

from max.gpu import thread_idx, block_idx, barrier, lane_id, warp_id
from max.gpu.compute.mma import mma, ld_matrix
from max.gpu.memory import (
    async_copy,
    async_copy_commit_group,
    async_copy_wait_group,
    external_memory,
)
from std.memory import bitcast
from std.math import ceildiv
from std.sys import size_of

from days.day014.gemm_common import tile_coords, operand_offset


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
