# Day 014, version 3: TMA into 128-byte swizzled tiles, a producer warpgroup and
# wgmma consumers. Builds on version 2 (its warpgroup size) and the shared epilogue.

from max.gpu import (
    MAX_THREADS_PER_BLOCK_METADATA,
    thread_idx,
    block_idx,
    barrier,
    lane_id,
)
from max.gpu.compute.mma import (
    WGMMADescriptor,
    wgmma_async,
    wgmma_fence_aligned,
    wgmma_commit_group_sync,
    wgmma_wait_group_sync,
)
from max.gpu.memory import (
    cp_async_bulk_tensor_shared_cluster_global,
    external_memory,
)
from max.gpu.host.nvidia.tma import TMADescriptor, TensorMapSwizzle
from max.gpu.primitives import warp
from max.gpu.sync import (
    mbarrier_init,
    mbarrier_arrive,
    mbarrier_arrive_expect_tx_shared,
)
from std.math import ceildiv
from std.sys import size_of
from std.sys._assembly import inlined_assembly
from std.utils import IndexList, StaticTuple

from days.day014.gemm_common import tile_coords, wg_store_acc, wg_store_acc_f32
from days.day014.gemm_v2_wgmma import WG_THREADS


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
# with three consumers (512 threads, 128 registers a thread at launch): 24 + 3 x 160
comptime TMA3_CONSUMER_REGS = 160
comptime TMA3_PRODUCER_REGS = 24
comptime PROMOTE = 8  # 3xTF32: k-steps (of 32) per wgmma partial sum (see the kernel)


@always_inline
def tma_bk[dtype: DType]() -> Int:
    """k per stage for `dtype`: one 128-byte swizzled row (64 16-bit elements, or 32
    float32 ones for the 3xTF32 form below)."""
    return 128 // size_of[dtype]()


@always_inline
def wgmma_k[dtype: DType]() -> Int:
    """k of one wgmma instruction: 32 bytes of a row (k16 for 16-bit, k8 for tf32).
    """
    return 32 // size_of[dtype]()


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
def ring_slot[STAGES: Int](i: Int) -> Tuple[Int, Int]:
    """(stage, phase parity) of the i-th use (i >= 0) of a ring of STAGES buffers.

    In 32-bit unsigned arithmetic: `i % STAGES` on a signed 64-bit Int is a sign fix-up
    at 4 stages and a ~25-instruction multiply-high sequence at 3, 5 or 7, on the vector
    ALUs, in every k-loop iteration (seen in the SASS, days 018 and 019)."""
    var u = UInt32(i)
    return (Int(u % UInt32(STAGES)), Int((u // UInt32(STAGES)) % 2))


struct RingCursor[STAGES: Int](Movable):
    """ring_slot's (stage, phase) of one use of the ring, stepped to the next use by
    adding one: a k-loop that divides its index by STAGES in every iteration spent
    ~a fifth of its stall samples on that multiply-high (day 019, part 28's profile);
    a cursor divides once, where its walk starts."""

    var stage: Int
    var phase: Int

    @always_inline
    def __init__(out self, i: Int):
        var slot = ring_slot[Self.STAGES](i)
        self.stage, self.phase = slot[0], slot[1]

    @always_inline
    def advance(mut self):
        if self.stage == Self.STAGES - 1:
            self.stage, self.phase = 0, self.phase ^ 1
        else:
            self.stage += 1

    @always_inline
    def before(self) -> Int:
        """The stage of the use before this one."""
        return self.stage - 1 if self.stage > 0 else Self.STAGES - 1


@always_inline
def consumer_index(wg: Int) -> Int:
    """A consumer warpgroup's index (wg - 1), broadcast from lane 0.

    `thread_idx.x // 128` is the same in every lane of a warp, but ptxas cannot prove
    it, so every wgmma descriptor built from it is a vector value moved into a uniform
    register (`R2UR`) in each k-loop iteration. A value broadcast with `shfl.sync` is
    provably warp-uniform and keeps that arithmetic on the uniform datapath
    (CUTLASS's "canonical" warpgroup index; seen in the SASS, days 018 and 019).
    """
    return Int(warp.broadcast(Int32(wg - 1)))


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
    comptime row_bytes = 128  # one swizzle span
    comptime BK = tma_bk[dtype]()
    comptime if K_CONTIG:
        return WGMMADescriptor[dtype].create[
            8 * row_bytes // 16, 1, TensorMapSwizzle.SWIZZLE_128B
        ](tile.unsafe_offset(mn * BK + ks * wgmma_k[dtype]()))
    else:
        comptime assert (
            size_of[dtype]() == 2
        ), "tf32 wgmma reads k-major tiles only"

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


@always_inline
def consume_k_step[
    dtype: DType, A_KC: Bool, B_KC: Bool, BM: Int, BN: Int, STAGES: Int
](
    sa: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    sb: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    full: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    empty: Pointer[
        Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    kt: Int,
    cw: Int,
    acc: SIMD[DType.float32, BN // 2],
) -> SIMD[DType.float32, BN // 2]:
    """A consumer's k-step kt: wait for its stage, issue its wgmmas (float32 operands:
    the tf32 form), and hand the stage of k-step kt - 1 back to the producer."""
    comptime BK = tma_bk[dtype]()
    var s = kt % STAGES
    mbar_wait(full.unsafe_offset(s), (kt // STAGES) % 2)
    var sa_k = sa.unsafe_offset(s * BM * BK)
    var sb_k = sb.unsafe_offset(s * BN * BK)
    var out = acc
    wgmma_fence_aligned()
    comptime for ks in range(BK // wgmma_k[dtype]()):
        out = wgmma_async[
            64,
            BN,
            wgmma_k[dtype](),
            a_type=dtype,
            b_type=dtype,
            layout_a="row" if A_KC else "col",
            layout_b="col" if B_KC else "row",
        ](
            tma_desc[dtype, A_KC](sa_k, cw * 64, ks),
            tma_desc[dtype, B_KC](sb_k, 0, ks),
            out,
        )
    wgmma_commit_group_sync()
    # one group stays in flight; the one before it has retired, so its stage goes
    # back to the producer
    wgmma_wait_group_sync[1]()
    if kt > 0 and lane_id() == 0:
        _ = mbarrier_arrive(empty.unsafe_offset((kt - 1) % STAGES))
    return out


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
    F32_OUT: Bool,
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
    this kernel's tiles.

    float32 is 3xTF32 (day 019, part 9): a and b are not the operands but their
    tf32 planes, written by day 019's split kernel, each (2 * batch, MN, K)
    k-major: plane 2 bt holds tf32(x) ("hi"), plane 2 bt + 1 tf32(x - hi) ("lo").
    The k-loop runs three passes over K, lo·hi, hi·lo, hi·hi (small terms first);
    lo·lo, ~2^-22 of a product, is left out. The tensor cores' own float32 sums lose
    more than IEEE additions (measured on the H100: 1.6e-6 of |a| @ |b| at K = 4096,
    2.5e-6 at 20000, cuBLAS's float32 3.7e-7 and 3.2e-8), so every PROMOTE k-steps the
    wgmma accumulator is added into a second one by ordinary float32 adds and
    restarted from zero (DeepSeek-V3's "promotion" for FP8): two accumulators, so
    tiles at most 128 wide.

    F32_OUT (16-bit operands): dst and c hold float32 (passed as pointers like the
    others), the plain epilogue's float32 form: a weight gradient written in its
    float32 master weight's dtype (day 020; day 019's part 12 for this kernel).
    """
    comptime CONSUMERS = BM // 64
    comptime PRODUCER_REGS = (
        TMA3_PRODUCER_REGS if CONSUMERS == 3 else TMA_PRODUCER_REGS
    )
    comptime CONSUMER_REGS = (
        TMA3_CONSUMER_REGS if CONSUMERS == 3 else TMA_CONSUMER_REGS
    )
    comptime A_KC = not TA  # A is k-contiguous when stored (M, K)
    comptime B_KC = TB  # B is k-contiguous when stored (N, K)
    comptime PLANES = dtype == DType.float32  # 3xTF32
    comptime PASSES = 3 if PLANES else 1
    comptime BK = tma_bk[dtype]()
    comptime A_ELEMS = BM * BK
    comptime B_ELEMS = BN * BK
    comptime STAGE_BYTES = (A_ELEMS + B_ELEMS) * size_of[dtype]()
    comptime assert BM % 64 == 0 and BN % 64 == 0 and BN <= 256, "tile shape"
    comptime assert (
        CONSUMERS == 2 or CONSUMERS == 3
    ), "two or three consumer warpgroups"
    comptime assert (
        WG_THREADS * (PRODUCER_REGS + CONSUMERS * CONSUMER_REGS) <= 65536
    ), "setmaxnreg: the register file"
    comptime assert STAGES >= 2, "at least two stages"
    comptime assert SMEM == STAGES * (STAGE_BYTES + 16), "stages + mbarriers"
    comptime assert (
        BK * size_of[dtype]() == 128
    ), "a k row is one 128-byte swizzle span (the tensor maps' box width)"
    comptime assert not PLANES or (
        A_KC and B_KC
    ), "tf32 planes are k-major (wgmma has no transposed tf32 form)"
    comptime assert not PLANES or BN <= 128, "3xTF32 keeps two accumulators"
    comptime assert not (
        PLANES and F32_OUT
    ), "3xTF32 writes float32 anyway: F32_OUT is for 16-bit operands"

    var M = Int(m)
    var N = Int(n)
    var K = Int(k)
    var tile = tile_coords(block_idx.x, ceildiv(M, BM), ceildiv(N, BN))
    var m0 = tile[0] * BM
    var n0 = tile[1] * BN
    var bt = block_idx.z
    var num_k = ceildiv(K, BK)
    var steps = PASSES * num_k  # k-steps, all passes

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
        set_max_registers[False, PRODUCER_REGS]()
        if thread_idx.x == 0:
            var a_ptr = Pointer(to=a_map).unsafe_bitcast[NoneType]()
            var b_ptr = Pointer(to=b_map).unsafe_bitcast[NoneType]()
            for kt in range(steps):
                var s = kt % STAGES
                if kt >= STAGES:  # wait until the consumers released round r-1
                    mbar_wait(empty.unsafe_offset(s), (kt // STAGES - 1) % 2)
                mbarrier_arrive_expect_tx_shared(
                    full.unsafe_offset(s), Int32(STAGE_BYTES)
                )
                var k0 = kt * BK
                var a_bt = bt
                var b_bt = bt
                comptime if PLANES:  # pass p: planes (lo, hi), (hi, lo), (hi, hi)
                    var p = kt // num_k
                    k0 = (kt - p * num_k) * BK
                    a_bt = 2 * bt + Int(p == 0)
                    b_bt = 2 * bt + Int(p == 1)
                tma_load_operand[dtype, A_KC, BM](
                    a_ptr,
                    sa.unsafe_offset(s * A_ELEMS),
                    full.unsafe_offset(s),
                    m0,
                    k0,
                    a_bt,
                )
                tma_load_operand[dtype, B_KC, BN](
                    b_ptr,
                    sb.unsafe_offset(s * B_ELEMS),
                    full.unsafe_offset(s),
                    n0,
                    k0,
                    b_bt,
                )
    else:
        set_max_registers[True, CONSUMER_REGS]()
        var alpha = alpha_beta[unsafe_offset=0]  # loaded while the k-loop runs
        var beta = alpha_beta[unsafe_offset=1]
        var cw = consumer_index(wg)  # this consumer's 64 rows of the block tile
        var acc = SIMD[DType.float32, BN // 2](0)
        var total = SIMD[DType.float32, BN // 2](0)  # 3xTF32: the promoted sum
        comptime if PLANES:  # groups of PROMOTE k-steps, each summed into `total`
            var kb = 0
            while kb < steps:
                var ke = min(kb + PROMOTE, steps)
                for kt in range(kb, ke):
                    acc = consume_k_step[dtype, A_KC, B_KC, BM, BN, STAGES](
                        sa, sb, full, empty, kt, cw, acc
                    )
                # the group's wgmmas retire before any other instruction reads
                # their registers (else ptxas serializes every wgmma: C7514)
                wgmma_wait_group_sync[0]()
                total += acc
                acc = SIMD[DType.float32, BN // 2](0)
                kb = ke
        else:
            for kt in range(steps):
                acc = consume_k_step[dtype, A_KC, B_KC, BM, BN, STAGES](
                    sa, sb, full, empty, kt, cw, acc
                )
        wgmma_wait_group_sync[0]()
        comptime if PLANES or F32_OUT:  # (without PLANES, total stays 0)
            wg_store_acc_f32[BN](
                total + acc,
                dst.unsafe_bitcast[Float32]().unsafe_offset(bt * M * N),
                c.unsafe_bitcast[Float32]().unsafe_offset(bt * Int(c_bs)),
                alpha,
                beta,
                m0 + cw * 64,
                n0,
                M,
                N,
                Int(c_rs),
                Int(c_cs),
            )
            return
        wg_store_acc[dtype, BN](
            acc,
            dst.unsafe_offset(bt * M * N),
            c.unsafe_offset(bt * Int(c_bs)),
            alpha,
            beta,
            m0 + cw * 64,
            n0,
            M,
            N,
            Int(c_rs),
            Int(c_cs),
            dst,  # no bias, no aux: never read or written
            dst,
            0,
        )


# --8<-- [end:tma_kernel]
