# Day 014, version 2: Hopper warpgroup MMA (wgmma) with cp.async loads.

from max.gpu import thread_idx, block_idx, barrier
from max.gpu.compute.mma import (
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
    external_memory,
)
from std.math import ceildiv
from std.sys import size_of
from std.sys._assembly import inlined_assembly

from days.day014.gemm_common import tile_coords, operand_offset, wg_store_acc


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
    var alpha = alpha_beta[unsafe_offset=0]  # loaded while the k-loop runs
    var beta = alpha_beta[unsafe_offset=1]
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
        acc,
        o_t,
        c_t,
        alpha,
        beta,
        m0 + wg * 64,
        n0,
        M,
        N,
        Int(c_rs),
        Int(c_cs),
        o_t,  # no bias, no aux: never read or written
        o_t,
        0,
    )


# --8<-- [end:wg_kernel]
