# Day 019, part 28: split-K inside a thread-block cluster (version 4's SPLIT = 3).
# The CTAs of a cluster walk different k-steps of the same output tile, then add
# their partial sums through each other's shared memory (distributed shared memory):
# no float32 workspace in global memory and no second kernel, which is what day 019's
# split-K (part 3) pays for. Here: the PTX for an asynchronous store into another CTA's
# shared memory that its mbarrier counts, and the reduction itself.

from max.gpu import thread_idx
from std.sys._assembly import inlined_assembly

from max.gpu.sync import mbarrier_arrive_expect_tx_shared

from days.day014.gemm_common import wg_store_acc
from days.day014.gemm_v2_wgmma import WG_THREADS
from days.day014.gemm_v3_tma import mbar_wait


# --8<-- [start:dsmem]
@always_inline
def store_cta_async_f32x4(
    dst: Pointer[
        Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    bar: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    cta: Int,
    v: SIMD[DType.float32, 4],
):
    """Write 16 bytes at `dst`'s offset in CTA `cta`'s shared memory, asynchronously:
    when they have landed, that CTA's mbarrier at `bar`'s offset counts 16 bytes of its
    transaction (complete_tx), as a TMA copy does. Its waiters then see them; no fence
    and no arrive by the sender."""
    inlined_assembly[
        """{
        .reg .b32 rdst, rbar;
        mapa.shared::cluster.u32 rdst, $0, $2;
        mapa.shared::cluster.u32 rbar, $1, $2;
        st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [rdst], {$3, $4, $5, $6}, [rbar];
        }""",
        NoneType,
        constraints="r,r,r,f,f,f,f",
    ](Int32(Int(dst)), Int32(Int(bar)), Int32(cta), v[0], v[1], v[2], v[3])


# --8<-- [end:dsmem]


# --8<-- [start:reduce_in_cluster]
@always_inline
def reduce_in_cluster[
    dtype: DType,
    BN: Int,
    F32_OUT: Bool,
    CLUSTER: Int,
    UNITS: Int,
    PER_OWNER: Int,
    UNIT_COLS: Int,
](
    acc: SIMD[DType.float32, _],
    red: Pointer[
        Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    red_full: Pointer[
        Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    rank: Int,
    out_t: Pointer[Scalar[dtype], MutAnyOrigin],
    c_t: Pointer[Scalar[dtype], MutAnyOrigin],
    alpha: Float32,
    beta: Float32,
    row0: Int,
    n0: Int,
    M: Int,
    N: Int,
    c_rs: Int,
    c_cs: Int,
    bias: Pointer[Scalar[dtype], MutAnyOrigin],
    aux: Pointer[Scalar[dtype], MutAnyOrigin],
):
    """Split-K in a cluster (SPLIT = 3): this consumer's partial sums `acc` of the tile
    at (row0, n0), its rows in m64 row blocks of BN columns, are added to the other
    CTAs' and stored.

    The tile is cut into UNITS units of 64 rows x UNIT_COLS (32: whole groups of 4
    column blocks, wg_store_acc's) columns: unit u is row block u // (BN / 32), columns
    32 (u % (BN / 32)) on, 16 accumulators a thread at acc[16 u:], and belongs to CTA
    u % CLUSTER. Every CTA's thread t holds the same positions of the tile, so a unit
    travels as 4 chunks of 4 floats a thread and is added elementwise: no index
    arithmetic. Each thread sends the units it does not own
    to their owners (slot (sender's distance - 1, u // CLUSTER) of the owner's `red`)
    with st.async, whose bytes the owner's `red_full` counts as for a TMA copy (the
    owner expects them); then it waits for its own, adds, and stores its units with
    wg_store_acc (the plain epilogue: alpha, beta c, F32_OUT). Call it from all 128
    threads of the consumer warpgroup, once a tile.
    """
    comptime assert UNIT_COLS == 32, "units of 4 column blocks"
    comptime QN = BN // UNIT_COLS  # units across a row block
    comptime CHUNK = WG_THREADS * 4  # floats of one chunk, all threads
    comptime UNIT = 4 * CHUNK
    var tid = thread_idx.x % WG_THREADS
    comptime for u in range(UNITS):
        var owner = u % CLUSTER
        if owner != rank:
            # this CTA's place among the owner's senders: 0 .. CLUSTER - 2
            var sender = (rank - owner + CLUSTER) % CLUSTER - 1
            var slot = red.unsafe_offset(
                (sender * PER_OWNER + u // CLUSTER) * UNIT + tid * 4
            )
            comptime for ch in range(4):
                store_cta_async_f32x4(
                    slot.unsafe_offset(ch * CHUNK),
                    red_full,
                    owner,
                    acc.slice[4, offset=u * 16 + ch * 4](),
                )
    # one thread announces the bytes this CTA's units receive from the others
    if tid == 0:
        var owned = (UNITS - rank + CLUSTER - 1) // CLUSTER
        mbarrier_arrive_expect_tx_shared(
            red_full, Int32((CLUSTER - 1) * owned * UNIT * 4)
        )
    mbar_wait(red_full, 0)
    comptime for u in range(UNITS):
        if u % CLUSTER == rank:
            var part = acc.slice[16, offset=u * 16]()
            for sender in range(CLUSTER - 1):
                var slot = red.unsafe_offset(
                    (sender * PER_OWNER + u // CLUSTER) * UNIT + tid * 4
                )
                comptime for ch in range(4):
                    part = part.insert[offset=ch * 4](
                        part.slice[4, offset=ch * 4]()
                        + slot.unsafe_load[width=4, alignment=16](ch * CHUNK)
                    )
            wg_store_acc[dtype, UNIT_COLS, False, False, False, F32_OUT, False](
                rebind[SIMD[DType.float32, UNIT_COLS // 2]](part),
                out_t,
                c_t,
                alpha,
                beta,
                row0 + (u // QN) * 64,
                n0 + (u % QN) * UNIT_COLS,
                M,
                N,
                c_rs,
                c_cs,
                bias,
                aux,
                0,
            )


# --8<-- [end:reduce_in_cluster]
