# Day 018: what every version of the Hopper FlashAttention forward shares: the tile
# loads (4-D TMA boxes), the online softmax on a wgmma accumulator, the P fragments
# for the register-A wgmma, and the epilogue (O / l and the log-sum-exp).
#
# Accumulator layout (wgmma m64nN, fp32; day014's wg_store_acc uses the same): thread
# (warp w of the warpgroup, lane = 4 g + t) holds element 4 j + e of a 64 x N tile at
#     row 16 w + g + 8 (e // 2),   col 8 j + 2 t + e % 2.
# So each thread sees two rows (g and g + 8) and 2 of every 8 columns; a row's other
# columns sit in the 3 lanes that share g (lane ^ 1, lane ^ 2).
#
# The register-A fragment of a 64 x 16 k step (m64k16) is, per thread, the elements
# (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..): accumulator elements
# 8 kk .. 8 kk + 7 of columns 16 kk .. 16 kk + 15, in order. P = softmax(S) turns
# into the A operand of O += P V by a cast, with no shuffle.

from max.gpu import block_idx, grid_dim, lane_id, warp_id
from max.gpu.compute.mma import (
    wgmma_async,
    wgmma_commit_group_sync,
    wgmma_fence_aligned,
)
from max.gpu.memory import cp_async_bulk_tensor_shared_cluster_global
from max.gpu.sync import mbarrier_arrive, mbarrier_arrive_expect_tx_shared
from std.sys import size_of
from max.gpu.primitives import warp
from std.math import ceildiv, exp2, log2
from std.memory import bitcast
from std.utils import IndexList
from std.sys._assembly import inlined_assembly

from days.day014.gemm_common import quad_transpose
from days.day014.gemm_v3_tma import TMA_BK, mbar_wait, ring_slot, tma_desc
from days.day018.operand_hold import hold_32, hold_64, hold_96
from days.day018.pv_wgmma_64x128 import pv_wgmma_issue_64x128, pv_wait_64x128
from days.day018.pv_wgmma_64x64 import pv_wgmma_issue_64x64, pv_wait_64x64
from days.day018.pv_wgmma_128x128 import pv_wgmma_issue_128x128, pv_wait_128x128
from days.day018.pv_wgmma_128x192 import (
    pv_wait_128x192,
    pv_wgmma_issue_128x192,
    s_wgmma_issue_64x192,
)
from days.day018.pv_wgmma_128x64 import pv_wgmma_issue_128x64, pv_wait_128x64

comptime NEG_INF = Float32.MIN  # -inf: exp2(-inf) == 0


@always_inline
def lanes(n: Int) -> Int:
    """n rounded up to a power of two, the SIMD width that holds n values (Mojo's widths
    must be powers of two): a 192-key tile's 96 scores a thread travel in 128 lanes.
    """
    var w = 1
    while w < n:
        w *= 2
    return w


@always_inline
def load_box[
    dtype: DType
](
    tma_map: OpaquePointer[mut=False, _],
    dst: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    bar: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    col: Int,
    row: Int,
    head: Int,
    batch: Int,
):
    """One TMA box of a (batch, head, seq, head_dim) tensor viewed 4-D as stored
    (innermost first: col, row, head, batch); rows past the sequence read as 0.
    """
    cp_async_bulk_tensor_shared_cluster_global(
        dst, tma_map, bar, IndexList[4](col, row, head, batch)
    )


@always_inline
def quad_max(v: Float32) -> Float32:
    """Max over the 4 lanes that hold one accumulator row."""
    var r = max(v, warp.shuffle_xor(v, UInt32(1)))
    return max(r, warp.shuffle_xor(r, UInt32(2)))


@always_inline
def quad_sum(v: Float32) -> Float32:
    var r = v + warp.shuffle_xor(v, UInt32(1))
    return r + warp.shuffle_xor(r, UInt32(2))


@always_inline
def mask_tile[
    sw: Int, //, BN: Int, CAUSAL: Bool
](mut s: SIMD[DType.float32, sw], row0: Int, kv0: Int, Lk: Int):
    """-inf where a key is past Lk or, causal, after the query (top-left aligned:
    query i sees keys j <= i, as SDPA's is_causal). row0: this thread's row g.
    """
    var t = lane_id() % 4
    comptime for j in range(BN // 8):
        comptime for e in range(4):
            var col = kv0 + 8 * j + 2 * t + e % 2
            var row = row0 + 8 * (e // 2)
            var masked = col >= Lk
            comptime if CAUSAL:
                masked = masked or col > row
            if masked:
                s[4 * j + e] = NEG_INF


@always_inline
def online_softmax[
    sw: Int, //, BN: Int
](
    mut s: SIMD[DType.float32, sw],
    mut m: SIMD[DType.float32, 2],
    mut l: SIMD[DType.float32, 2],
    c: Float32,
) -> SIMD[DType.float32, 2]:
    """One kv tile of the online softmax on raw scores s (masked ones -inf) with
    c = scale * log2(e) > 0: s becomes P = exp2(s c - m_new), one FMA and one exp2 per
    score (the max is taken on the raw scores: scaling by c > 0 keeps it the max). The
    running max m (in the log2 domain) and the thread's partial row sums l are
    updated; returns alpha = exp2(m - m_new), by which the caller rescales O
    (`rescale`) once no wgmma is writing it."""
    var mx = SIMD[DType.float32, 2](NEG_INF)
    comptime for j in range(BN // 8):
        mx[0] = max(mx[0], max(s[4 * j], s[4 * j + 1]))
        mx[1] = max(mx[1], max(s[4 * j + 2], s[4 * j + 3]))
    var m_new = SIMD[DType.float32, 2](
        max(m[0], quad_max(mx[0]) * c), max(m[1], quad_max(mx[1]) * c)
    )
    # a row with every key masked so far keeps m = -inf: subtract 0 instead, so
    # exp2(-inf - -inf) does not make a NaN (its p are 0 either way)
    var base = SIMD[DType.float32, 2](
        m_new[0] if m_new[0] != NEG_INF else 0,
        m_new[1] if m_new[1] != NEG_INF else 0,
    )
    var alpha = exp2(m - base)
    var rs = SIMD[DType.float32, 2](0)
    comptime for j in range(BN // 8):
        comptime for e in range(4):
            var p = exp2(s[4 * j + e].fma(c, -base[e // 2]))
            s[4 * j + e] = p
            rs[e // 2] += p
    l = l * alpha + rs
    m = m_new
    return alpha


@always_inline
def rescale[
    D: Int
](mut o: SIMD[DType.float32, D // 2], alpha: SIMD[DType.float32, 2]):
    """O's row g by alpha[0], row g + 8 by alpha[1]."""
    comptime for j in range(D // 8):
        comptime for e in range(4):
            o[4 * j + e] *= alpha[e // 2]


@always_inline
def p_fragments[
    sw: Int, //, dtype: DType, BN: Int
](p: SIMD[DType.float32, sw]) -> SIMD[DType.uint32, sw // 2]:
    """P as the register-A operand of BN/16 k steps, 16-bit pairs packed in 32 bits
    (sw: the scores' SIMD width, lanes(BN / 2))."""
    return bitcast[DType.uint32, sw // 2](p.cast[dtype]())


@always_inline
def store_rows[
    dtype: DType, D: Int, BLOCKS: Bool = False
](
    acc: SIMD[DType.float32, D // 2],
    scale: SIMD[DType.float32, 2],
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    row0: Int,
    rows: Int,
    rs: Int,
):
    """acc * scale (per row: g, g + 8) for this thread's rows below `rows`, from the
    warpgroup's first row row0, into dst (row stride rs, unit column stride).

    A thread holds 2 adjacent values of each 8-column block, so a plain store is 4
    bytes, and a warp's store writes half of each 32-byte sector it touches. BLOCKS:
    the quad's 4 lanes first swap their pairs of 4 blocks (`quad_transpose`) so that
    each lane stores one whole block, 16 bytes (dst and rs 16-byte aligned; every lane
    of the warp must call it)."""
    var g = lane_id() // 4
    var t = lane_id() % 4
    comptime for half in range(2):
        var row = row0 + (warp_id() % 4) * 16 + g + 8 * half
        comptime if BLOCKS:
            comptime assert size_of[dtype]() == 2 and D % 32 == 0
            comptime for jq in range(D // 32):
                var pairs = SIMD[DType.uint32, 4]()
                comptime for jj in range(4):
                    comptime j = 4 * jq + jj
                    var v = (
                        acc.slice[2, offset=4 * j + 2 * half]() * scale[half]
                    )
                    pairs[jj] = bitcast[DType.uint32, 1](v.cast[dtype]())[0]
                quad_transpose(pairs, t)  # every lane: shuffles
                if row < rows:
                    dst.unsafe_store[alignment=16](
                        row * rs + 8 * (4 * jq + t), bitcast[dtype, 8](pairs)
                    )
        else:
            if row < rows:
                comptime for j in range(D // 8):
                    var v = (
                        acc.slice[2, offset=4 * j + 2 * half]() * scale[half]
                    )
                    dst.unsafe_store[alignment=4](
                        row * rs + 8 * j + 2 * t, v.cast[dtype]()
                    )


@always_inline
def store_o_lse[
    dtype: DType, D: Int
](
    o: SIMD[DType.float32, D // 2],
    l: SIMD[DType.float32, 2],
    m: SIMD[DType.float32, 2],
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    row0: Int,
    Lq: Int,
    o_rs: Int,
):
    """O / l for this thread's two rows (row0 = the warpgroup's first row) and the
    row log-sum-exp in the log2 domain, m + log2(l) (what the backward reads).
    `dst` and `lse` point at this (batch, head)'s first row; O goes out in 16-byte
    blocks (`store_rows`), so dst and o_rs are 16-byte aligned (attention_gpu checks).
    """
    var lt = SIMD[DType.float32, 2](quad_sum(l[0]), quad_sum(l[1]))
    store_rows[dtype, D, True](o, 1.0 / lt, dst, row0, Lq, o_rs)
    if lane_id() % 4 == 0:
        comptime for half in range(2):
            var row = row0 + (warp_id() % 4) * 16 + lane_id() // 4 + 8 * half
            if row < Lq:
                lse[unsafe_offset=row] = m[half] + log2(lt[half])


# -- O += P V through the generated assembly (pv_wgmma_*.mojo) ---------------------------
@always_inline
def pv_issue[
    pw: Int, dw: Int, //, dtype: DType, D: Int, BN: Int
](
    p: SIMD[DType.uint32, pw],
    descs: SIMD[DType.int64, dw],
    o: SIMD[DType.float32, D // 2],
) -> type_of(o):
    """Start O += P V (BN/16 k steps, one commit group); `pv_wait` ends it."""
    comptime if D == 64 and BN == 64:
        return rebind[type_of(o)](
            pv_wgmma_issue_64x64[dtype](
                rebind[SIMD[DType.uint32, 16]](p),
                rebind[SIMD[DType.int64, 4]](descs),
                rebind[SIMD[DType.float32, 32]](o),
            )
        )
    elif D == 128 and BN == 64:
        return rebind[type_of(o)](
            pv_wgmma_issue_128x64[dtype](
                rebind[SIMD[DType.uint32, 16]](p),
                rebind[SIMD[DType.int64, 4]](descs),
                rebind[SIMD[DType.float32, 64]](o),
            )
        )
    elif D == 64:
        return rebind[type_of(o)](
            pv_wgmma_issue_64x128[dtype](
                rebind[SIMD[DType.uint32, 32]](p),
                rebind[SIMD[DType.int64, 8]](descs),
                rebind[SIMD[DType.float32, 32]](o),
            )
        )
    elif BN == 192:
        comptime assert D == 128, "192-key tiles at head dim 128"
        return rebind[type_of(o)](
            pv_wgmma_issue_128x192[dtype](
                rebind[SIMD[DType.uint32, 64]](p),
                rebind[SIMD[DType.int64, 16]](descs),
                rebind[SIMD[DType.float32, 64]](o),
            )
        )
    else:
        comptime assert D == 128, "head dim 64 or 128"
        return rebind[type_of(o)](
            pv_wgmma_issue_128x128[dtype](
                rebind[SIMD[DType.uint32, 32]](p),
                rebind[SIMD[DType.int64, 8]](descs),
                rebind[SIMD[DType.float32, 64]](o),
            )
        )


@always_inline
def pv_wait[
    pw: Int, //, D: Int, BN: Int
](p: SIMD[DType.uint32, pw], o: SIMD[DType.float32, D // 2]) -> type_of(o):
    """wait_group 0, holding P's registers and O's until every wgmma is done."""
    comptime if D == 64 and BN == 64:
        return rebind[type_of(o)](
            pv_wait_64x64(
                rebind[SIMD[DType.uint32, 16]](p),
                rebind[SIMD[DType.float32, 32]](o),
            )
        )
    elif D == 128 and BN == 64:
        return rebind[type_of(o)](
            pv_wait_128x64(
                rebind[SIMD[DType.uint32, 16]](p),
                rebind[SIMD[DType.float32, 64]](o),
            )
        )
    elif D == 64:
        return rebind[type_of(o)](
            pv_wait_64x128(
                rebind[SIMD[DType.uint32, 32]](p),
                rebind[SIMD[DType.float32, 32]](o),
            )
        )
    elif BN == 192:
        return rebind[type_of(o)](
            pv_wait_128x192(
                rebind[SIMD[DType.uint32, 64]](p),
                rebind[SIMD[DType.float32, 64]](o),
            )
        )
    else:
        return rebind[type_of(o)](
            pv_wait_128x128(
                rebind[SIMD[DType.uint32, 32]](p),
                rebind[SIMD[DType.float32, 64]](o),
            )
        )


@always_inline
def hold[n: Int](v: SIMD[DType.float32, n]) -> type_of(v):
    """Route accumulator registers through an empty asm after a wait, so no use of
    them can be scheduled before it."""
    comptime if n == 32:
        return rebind[type_of(v)](hold_32(rebind[SIMD[DType.float32, 32]](v)))
    elif n == 128:  # a 192-key tile's scores: 96 lanes used
        return rebind[type_of(v)](hold_96(rebind[SIMD[DType.float32, 128]](v)))
    else:
        comptime assert n == 64, "32, 64 or 128 (96 used) registers"
        return rebind[type_of(v)](hold_64(rebind[SIMD[DType.float32, 64]](v)))


@always_inline
def v_descs[
    dtype: DType, D: Int, BN: Int
](
    sv: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ]
) -> SIMD[DType.int64, lanes(BN // 16)]:
    """The descriptor of each 16-key k step of a V stage (mn-major, 128-byte swizzle):
    key slice kk // 4 of 64 keys holds D/64 boxes of 64 x 64."""
    var descs = SIMD[DType.int64, lanes(BN // 16)](0)
    comptime for kk in range(BN // 16):
        descs[kk] = tma_desc[dtype, False](
            sv.unsafe_offset((kk // 4) * D * TMA_BK), 0, kk % 4
        ).desc
    return descs


@always_inline
def s_wgmma[
    dtype: DType, D: Int, BN: Int
](
    sq: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    sk: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
) -> SIMD[DType.float32, lanes(BN // 2)]:
    """Issue S = Q K^T (64 x BN, D/16 k steps from shared memory) and commit it; the
    caller waits (wgmma_wait_group_sync) and then `hold`s the result."""
    comptime if BN == 192:
        var a_descs = SIMD[DType.int64, D // 16](0)
        var b_descs = SIMD[DType.int64, D // 16](0)
        comptime for ks in range(D // 16):
            comptime db = ks // 4
            a_descs[ks] = tma_desc[dtype, True](
                sq.unsafe_offset(db * TMA_BK * TMA_BK), 0, ks % 4
            ).desc
            b_descs[ks] = tma_desc[dtype, True](
                sk.unsafe_offset(db * BN * TMA_BK), 0, ks % 4
            ).desc
        return rebind[SIMD[DType.float32, lanes(BN // 2)]](
            s_wgmma_issue_64x192[dtype](
                rebind[SIMD[DType.int64, 8]](a_descs),
                rebind[SIMD[DType.int64, 8]](b_descs),
            )
        )
    var sc = SIMD[DType.float32, lanes(BN // 2)](0)
    wgmma_fence_aligned()
    comptime for ks in range(D // 16):
        comptime db = ks // 4
        sc = wgmma_async[
            64,
            BN,
            16,
            a_type=dtype,
            b_type=dtype,
            layout_a="row",
            layout_b="col",
        ](
            tma_desc[dtype, True](
                sq.unsafe_offset(db * TMA_BK * TMA_BK), 0, ks % 4
            ),
            tma_desc[dtype, True](
                sk.unsafe_offset(db * BN * TMA_BK), 0, ks % 4
            ),
            sc,
        )
    wgmma_commit_group_sync()
    return sc


# -- the producer warpgroup (one thread issues every copy) -----------------------------------
comptime CONSUMERS = 2  # consumer warpgroups per block, 64 query rows each
comptime BM = 64 * CONSUMERS  # query rows per block
comptime BOX = TMA_BK * TMA_BK  # elements of one 64 x 64 box


# -- releasing a stage: one empty barrier for both streams, or one each (SPLIT) --------
# The forward's stage holds K_j (read by S_j) and V_j (read by P_j V_j, which is issued
# a tile later in versions 2-4). With one barrier, K_{j+STAGES} waits for P_j V_j; with
# SPLIT it waits only for S_j, as FlashAttention-3's separate K and V pipelines do.
@always_inline
def empty_s1[
    STAGES: Int, SPLIT: Bool
](
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED]
) -> type_of(bars):
    """Stream 1's empty barriers: after q_empty with SPLIT (bars 2 + 3 STAGES ..),
    else the shared ones (1 + 2 STAGES ..)."""
    return bars.unsafe_offset(2 + 3 * STAGES if SPLIT else 1 + 2 * STAGES)


@always_inline
def release_s0[
    STAGES: Int, SPLIT: Bool
](
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    s: Int,
):
    """This warp is done with stage s's stream 0 (SPLIT; else `release_s1` frees both).
    """
    comptime if SPLIT:
        arrive_lane0(bars.unsafe_offset(1 + 2 * STAGES + s))


@always_inline
def release_s1[
    STAGES: Int, SPLIT: Bool
](
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    s: Int,
):
    """This warp is done with stage s's stream 1 (and, without SPLIT, stream 0).
    """
    comptime if SPLIT:
        arrive_lane0(empty_s1[STAGES, SPLIT](bars).unsafe_offset(s))
    else:
        if lane_id() == 0:
            _ = mbarrier_arrive(empty_s1[STAGES, SPLIT](bars).unsafe_offset(s))


@always_inline
def arrive_lane0(
    bar: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED]
):
    """Lane 0 arrives on `bar`, by a predicated instruction: a `lane_id() == 0` branch
    per release moved the k-loop's stage arithmetic off the uniform datapath (SASS:
    uniform instructions 93 -> 51 with SPLIT's second release)."""
    inlined_assembly[
        """{
        .reg .pred lane0;
        .reg .b32 lane;
        mov.u32 lane, %laneid;
        setp.eq.u32 lane0, lane, 0;
        @lane0 mbarrier.arrive.shared::cta.b64 _, [$0];
        }""",
        NoneType,
        constraints="r",
    ](Int32(Int(bar)))


@always_inline
def produce[
    dtype: DType,
    D: Int,
    BN: Int,
    STAGES: Int,
    N_FIXED: Int,
    NC: Int = CONSUMERS,
    SPLIT: Bool = False,
](
    f0_map: OpaquePointer[mut=False, _],
    f1_map: OpaquePointer[mut=False, _],
    s0_map: OpaquePointer[mut=False, _],
    s1_map: OpaquePointer[mut=False, _],
    sfix: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    skv: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    f_row: Int,
    f_head: Int,
    b: Int,
    n_tiles: Int,
    s_head0: Int,
    s_row0: Int,
    per_head: Int,
):
    """The block's fixed tiles once (N_FIXED tensors, the NC consumers' 64 rows from
    f_row: Q in the forward), then the streamed pairs tile by tile into stage
    j % STAGES once the consumers have released it (K and V in the forward). Tile j
    starts at row s_row0 + (j % per_head) * BN of head s_head0 + j // per_head: the
    backward's dK/dV pass walks every query head of a kv head's group that way.

    A stage holds stream 0 as D/64 boxes of BN rows x 64 (k-major) and stream 1 as
    BN/64 key slices of D/64 boxes of 64 x 64 (mn-major); at BN = 64 the two layouts
    are the same, so either operand form can read either stream. Barriers: fixed,
    full_0[STAGES], full_1[STAGES], empty[STAGES]; the streams count their bytes
    apart so that a product on stream 0 can start while stream 1 lands. SPLIT: the
    consumers release the streams apart too (`release_s0`, `release_s1`)."""
    produce_fixed[dtype, D, N_FIXED, NC](
        f0_map, f1_map, sfix, bars, f_row, f_head, b
    )
    produce_stream[dtype, D, BN, STAGES, SPLIT](
        s0_map, s1_map, skv, bars, b, s_head0, s_row0, per_head, 0, n_tiles
    )


@always_inline
def produce_fixed[
    dtype: DType, D: Int, N_FIXED: Int, NC: Int
](
    f0_map: OpaquePointer[mut=False, _],
    f1_map: OpaquePointer[mut=False, _],
    sfix: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    fixed: Pointer[
        Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    f_row: Int,
    f_head: Int,
    b: Int,
):
    """The fixed tiles (`produce`) onto barrier `fixed`. A consumer's 64 rows that lie
    before row 0 (`block_first_row`) load row 0's instead, which it does not read: a
    box is not started at a negative row."""
    comptime DB = D // TMA_BK
    comptime F_ELEMS = NC * DB * BOX
    mbarrier_arrive_expect_tx_shared(
        fixed, Int32(N_FIXED * F_ELEMS * size_of[dtype]())
    )
    comptime for f in range(N_FIXED):
        comptime for c in range(NC):
            comptime for db in range(DB):
                load_box(
                    f0_map if f == 0 else f1_map,
                    sfix.unsafe_offset(f * F_ELEMS + (c * DB + db) * BOX),
                    fixed,
                    db * TMA_BK,
                    max(f_row + c * 64, 0),
                    f_head,
                    b,
                )


@always_inline
def produce_stream[
    dtype: DType, D: Int, BN: Int, STAGES: Int, SPLIT: Bool = False
](
    s0_map: OpaquePointer[mut=False, _],
    s1_map: OpaquePointer[mut=False, _],
    skv: Pointer[
        Scalar[dtype], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    bars: Pointer[Int64, MutUntrackedOrigin, address_space=AddressSpace.SHARED],
    b: Int,
    s_head0: Int,
    s_row0: Int,
    per_head: Int,
    it0: Int,
    n_tiles: Int,
):
    """Streamed tiles 0 <= j < n_tiles (`produce`). A persistent block's stream
    goes on across its work tiles: tile j is the block's (it0 + j)-th, which names its
    stage and the phase of the stage's barriers. SPLIT: stream 1 waits for its own
    empty barrier (`empty_s1`), so stream 0's next tile can load while the
    consumers still read this stage's stream 1."""
    comptime DB = D // TMA_BK
    comptime T_ELEMS = BN * D
    var full0 = bars.unsafe_offset(1)
    var full1 = bars.unsafe_offset(1 + STAGES)
    var empty = bars.unsafe_offset(1 + 2 * STAGES)
    var empty1 = empty_s1[STAGES, SPLIT](bars)
    for j in range(n_tiles):
        var g = it0 + j
        var s = ring_slot[STAGES](g)[0]
        if g >= STAGES:
            mbar_wait(empty.unsafe_offset(s), ring_slot[STAGES](g - STAGES)[1])
        var st0 = skv.unsafe_offset(s * 2 * T_ELEMS)
        var st1 = st0.unsafe_offset(T_ELEMS)
        var head = s_head0 + j // per_head
        var row = s_row0 + (j % per_head) * BN
        mbarrier_arrive_expect_tx_shared(
            full0.unsafe_offset(s), Int32(T_ELEMS * size_of[dtype]())
        )
        comptime for db in range(DB):
            load_box(
                s0_map,
                st0.unsafe_offset(db * BN * TMA_BK),
                full0.unsafe_offset(s),
                db * TMA_BK,
                row,
                head,
                b,
            )
        comptime if SPLIT:
            if g >= STAGES:
                mbar_wait(
                    empty1.unsafe_offset(s), ring_slot[STAGES](g - STAGES)[1]
                )
        mbarrier_arrive_expect_tx_shared(
            full1.unsafe_offset(s), Int32(T_ELEMS * size_of[dtype]())
        )
        comptime for ks in range(BN // TMA_BK):
            comptime for db in range(DB):
                load_box(
                    s1_map,
                    st1.unsafe_offset((ks * DB + db) * BOX),
                    full1.unsafe_offset(s),
                    db * TMA_BK,
                    row + ks * TMA_BK,
                    head,
                    b,
                )


# The blocks of a causal backward pass differ in work: the dQ pass's query block walks
# the keys up to it, the dK/dV pass's key block the queries from it on. The grid's x
# (fixed blocks) runs fastest, so each head's heaviest block came up in its turn, and
# the last head's ran alone at the end. `heavy_first` renumbers the blocks: HEAD_GROUP
# heads at a time (their streamed tiles stay in L2), heaviest fixed block first, the
# group's heads interleaved.
comptime HEAD_GROUP = 4


@always_inline
def heavy_first[LAST: Bool](n_heads: Int) -> Tuple[Int, Int, Int]:
    """(fixed block, head, batch) of this block in the heavy-first order, on a grid of
    (fixed blocks, n_heads, batch); LAST: the last fixed block is the heaviest (query
    blocks), else the first (key blocks)."""
    var n_fixed = Int(grid_dim.x)
    var linear = Int(block_idx.x) + n_fixed * (
        Int(block_idx.y) + n_heads * Int(block_idx.z)
    )
    return heavy_first_at[LAST](
        linear, n_fixed, n_heads, n_heads * Int(grid_dim.z)
    )


@always_inline
def heavy_first_at[
    LAST: Bool
](linear: Int, n_fixed: Int, n_heads: Int, heads: Int) -> Tuple[Int, Int, Int]:
    """`heavy_first` of the `linear`-th block of n_fixed x heads (batch, head) pairs:
    also the work order of a persistent grid's tile scheduler (backward version 8).
    """
    var group = linear // (HEAD_GROUP * n_fixed)
    var size = min(HEAD_GROUP, heads - group * HEAD_GROUP)
    var within = linear - group * HEAD_GROUP * n_fixed
    var rank = within // size  # 0: the heaviest
    var bh = group * HEAD_GROUP + within % size
    var fixed = n_fixed - 1 - rank if LAST else rank
    return (fixed, bh % n_heads, bh // n_heads)


@always_inline
def block_first_row[
    BM: Int, CAUSAL: Bool
](block: Int, n_blocks: Int, L: Int) -> Int:
    """The first row of query block `block` (of n_blocks, BM rows each, L rows in all).
    Causal, the blocks end at L's last 64-row slice instead of starting at row 0: where
    BM does not divide L, the part-full block is then the first one, whose rows see the
    fewest keys, instead of the last, whose rows see them all with one or two of its
    consumers idle. Its idle consumers get whole 64-row slices before row 0: they load
    row 0's Q (`produce_fixed`), which they do not read, and `row_bound` drops them.
    """
    comptime if CAUSAL:
        return block * BM - (n_blocks * BM - L) // 64 * 64
    return block * BM


@always_inline
def kv_tiles[BM: Int, BN: Int, CAUSAL: Bool](q0: Int, Lk: Int) -> Int:
    """K/V tiles of BN keys that BM query rows from q0 read: causal, up to their last
    row (the forward's work tiles and consumers, the dQ pass's blocks and consumers).
    """
    return ceildiv(min(Lk, q0 + BM) if CAUSAL else Lk, BN)


@always_inline
def row_bound[CAUSAL: Bool](row0: Int, L: Int) -> Int:
    """The bound of a consumer's `row < bound` checks, its 64 rows from row0: L, or
    where they lie before row 0 (`block_first_row`) row0 itself, which none of them is
    below, so that it reads and writes none (a bound of 0 would let them all through).
    """
    comptime if CAUSAL:
        return L if row0 >= 0 else row0
    return L


@always_inline
def needs_mask[BN: Int, CAUSAL: Bool](kv0: Int, row0: Int, Lk: Int) -> Bool:
    """Whether a tile starting at key kv0 has a key past Lk or, causal, after the
    consumer's first query row0 (its last row is row0 + 63)."""
    return kv0 + BN > Lk or (CAUSAL and kv0 + BN - 1 > row0)


@always_inline
def opaque_zero() -> Int:
    """0 from a volatile asm: `p.unsafe_offset(opaque_zero())` inside a loop keeps what is
    computed from p (wgmma descriptors of a fixed tile) in the loop, where a hoisted
    copy would hold registers across it (backward version 6 at head_dim 128: 52-60
    bytes of spill stores without it, 12-20 with it; ptxas -v)."""
    return Int(
        inlined_assembly[
            "mov.u32 $0, 0;", UInt32, constraints="=r", has_side_effect=True
        ]()
    )
