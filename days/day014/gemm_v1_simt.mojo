# Day 014, version 1 for float32 / float64: a register-blocked SIMT GEMM.

from max.gpu import thread_idx, block_idx, barrier
from std.memory import stack_allocation
from std.math import ceildiv
from std.sys import size_of

from days.day014.gemm_common import accum_dtype, tile_coords


# ---------------------------------------------------------------------------
# SIMT kernel (float32, float64).

comptime SIMT_THREADS = 256


# --8<-- [start:simt_load]
@always_inline
def stored_offset[k_contiguous: Bool](mn: Int, kk: Int, ld: Int) -> Int:
    """Offset of element (mn, kk) of op(X) in its stored rows of `ld` elements.
    """
    comptime if k_contiguous:
        return mn * ld + kk
    return kk * ld + mn


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
    ld: Int,
    mut regs: Array[SIMD[dtype, VW], LV],
):
    """Global -> registers: this thread's LV vectors of the (BMN x BK) tile at (mn0, k0).

    Vectors run along the stored contiguous dim; `ld` is the stored row stride (K or
    more for a K-contiguous operand, MN or more otherwise: a piece of a split K reads
    inside the rows of the whole matrix). Out-of-range elements read as 0.
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
                    stored_offset[K_CONTIG](mn, kk, ld)
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
                        unsafe_offset=stored_offset[K_CONTIG](emn, ek, ld)
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
comptime SimtSmem[acc: DType] = Pointer[
    Scalar[acc], MutUntrackedOrigin, address_space=AddressSpace.SHARED
]


@always_inline
def simt_smem[acc: DType, BM: Int, BK: Int]() -> SimtSmem[acc]:
    """One operand's two (BK x (BM + 4)) stage buffers of shared memory."""
    return stack_allocation[
        2 * BK * (BM + 4),
        Scalar[acc],
        address_space=AddressSpace.SHARED,
        alignment=16,
    ]()


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
    a_ld: Int64,
    b_ld: Int64,
):
    """Launch with grid (ceil(M/BM) * ceil(N/BN), 1, batch), 256 threads. a_ld and
    b_ld are the operands' stored row strides (packed: K or M for A, N or K for B).
    """
    comptime acc = accum_dtype[dtype]()
    simt_tile[dtype, TA, TB, VEC, BM, BN, BK, TM, TN](
        block_idx.x,
        block_idx.z,
        dst,
        a,
        b,
        c,
        alpha_beta,
        Int(m),
        Int(n),
        Int(k),
        Int(a_bs),
        Int(b_bs),
        Int(c_bs),
        Int(c_rs),
        Int(c_cs),
        Int(a_ld),
        Int(b_ld),
        simt_smem[acc, BM, BK](),
        simt_smem[acc, BN, BK](),
    )


@always_inline
def simt_tile[
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
    pid: Int,
    bt: Int,
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    a: Pointer[Scalar[dtype], MutAnyOrigin],
    b: Pointer[Scalar[dtype], MutAnyOrigin],
    c: Pointer[Scalar[dtype], MutAnyOrigin],
    alpha_beta: Pointer[Float32, MutAnyOrigin],
    M: Int,
    N: Int,
    K: Int,
    a_bs: Int,
    b_bs: Int,
    c_bs: Int,
    c_rs: Int,
    c_cs: Int,
    a_ld: Int,
    b_ld: Int,
    as_: SimtSmem[accum_dtype[dtype]()],
    bs_: SimtSmem[accum_dtype[dtype]()],
):
    """Output tile `pid` (in tile_coords' order) of matrix `bt` of the batch, by the
    block's 256 threads; `as_` and `bs_` are `simt_smem` buffers for BM and BN. The
    kernel above is a grid of these; day 016's one-launch GEMM backward runs two
    products' tiles in one grid."""
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

    var num_m = ceildiv(M, BM)
    var num_n = ceildiv(N, BN)
    var tile = tile_coords(pid, num_m, num_n)
    var m0 = tile[0] * BM
    var n0 = tile[1] * BN
    var a_t = a.unsafe_offset(bt * a_bs)
    var b_t = b.unsafe_offset(bt * b_bs)

    var ra = Array[SIMD[dtype, VW], LVA](fill=0)
    var rb = Array[SIMD[dtype, VW], LVB](fill=0)
    var accs = Array[SIMD[acc, 4], TM * GN](fill=0)

    var tx = thread_idx.x % TX
    var ty = thread_idx.x // TX
    var num_k = ceildiv(K, BK)

    var a_stride = a_ld
    var b_stride = b_ld
    simt_fetch[dtype, not TA, VEC, BM, BK, VW, LVA](
        a_t, m0, 0, M, K, a_stride, ra
    )
    simt_fetch[dtype, TB, VEC, BN, BK, VW, LVB](b_t, n0, 0, N, K, b_stride, rb)
    simt_stash[dtype, acc, not TA, BM, BK, LDA, VW, LVA](ra, as_)
    simt_stash[dtype, acc, TB, BN, BK, LDB, VW, LVB](rb, bs_)
    barrier()

    for kt in range(num_k):
        var cur = kt % 2
        var has_next = kt + 1 < num_k
        if has_next:  # issue the next tile's global loads before the math
            simt_fetch[dtype, not TA, VEC, BM, BK, VW, LVA](
                a_t, m0, (kt + 1) * BK, M, K, a_stride, ra
            )
            simt_fetch[dtype, TB, VEC, BN, BK, VW, LVB](
                b_t, n0, (kt + 1) * BK, N, K, b_stride, rb
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
    var c_t = c.unsafe_offset(bt * c_bs)
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
                                        unsafe_offset=row * c_rs
                                        + (col + e) * c_cs
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
