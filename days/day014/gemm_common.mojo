# Day 014: what every GEMM kernel of the day shares (and day 016's launch plans
# assume): the problem a call describes, the strides of a broadcast c, the tile order,
# operand offsets, and the wgmma register epilogue that versions 2 and 3 both use.
#
# The kernels, one file per version (the ladder of the day's journal):
#   gemm_v1_simt.mojo      float32 / float64: a register-blocked SIMT kernel
#   gemm_v1_mma_sync.mojo  bfloat16 / float16: Ampere-style mma.sync tensor cores
#   gemm_v2_wgmma.mojo     bfloat16 / float16: Hopper wgmma, cp.async loads
#   gemm_v3_tma.mojo       bfloat16 / float16: TMA, 128-byte swizzle, producer warpgroup
# and gemm.mojo, the op: its CPU branch and the MAX registration.

from max.gpu import lane_id, warp_id
from max.gpu.primitives import warp
from std.math import ceildiv
from std.memory import bitcast
from std.sys import size_of
from std.sys._assembly import inlined_assembly


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
def tile_coords[
    GROUP_M: Int = 8
](pid: Int, num_m: Int, num_n: Int) -> Tuple[Int, Int]:
    """Map a linear tile id to (tile_m, tile_n), GROUP_M tile rows at a time.

    Consecutive tiles walk down a group of GROUP_M tile rows before moving right, so
    the blocks resident together share both A rows and B columns in L2 (plain
    row-major order would stream all of B once per tile row).
    """
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


# --8<-- [start:wg_epilogue]
@always_inline
def store_streaming(
    p: Pointer[Float32, MutAnyOrigin], v: SIMD[DType.float32, 2]
):
    """8 bytes to global memory marked evict-first (st.global.cs): data that no kernel
    reads soon, which should not push out of L2 what this kernel reads again (a weight
    gradient's 154 MB of float32 at GPT-2's output head, against the 1.6 GB operand
    whose 256-column panels six tiles share through L2)."""
    inlined_assembly[
        "st.global.cs.v2.f32 [$0], {$1, $2};", NoneType, constraints="l,f,f"
    ](UInt64(Int(p)), v[0], v[1])


@always_inline
def tanh_approx(x: SIMD[DType.float32, _]) -> type_of(x):
    """tanh by the SFU (tanh.approx.f32: one instruction, relative error ~2^-11).
    """
    var r = type_of(x)()
    comptime for i in range(x.length):
        r[i] = inlined_assembly[
            "tanh.approx.f32 $0, $1;", Float32, constraints="=f,f"
        ](x[i])
    return r


@always_inline
def _gelu_sigmoid(x: SIMD[DType.float32, _]) -> type_of(x):
    """sigmoid(2u) = (1 + tanh(u)) / 2, u = sqrt(2/pi) (x + 0.044715 x^3): GELU and its
    derivative share it. One SFU instruction: the GELU epilogue's values are bound by the
    SFU (16 a clock per SM against 128 FMAs), and exp + reciprocal took two (day 019,
    part 10). tanh.approx's error, 2^-11 of tanh, is at most an eighth of a bf16 ulp
    of GELU for x > 0, and at most 2.5e-4 |x| in absolute terms where GELU is near 0.
    """
    var u = x * (0.7978845608028654 + 0.035677408136300125 * x * x)
    return 0.5 + 0.5 * tanh_approx(u)


@always_inline
def gelu_tanh(x: SIMD[DType.float32, _]) -> type_of(x):
    """GPT-2's GELU, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) = x sigmoid(2u).
    """
    return x * _gelu_sigmoid(x)


@always_inline
def gelu_tanh_grad(x: SIMD[DType.float32, _], s: type_of(x)) -> type_of(x):
    """The derivative of gelu_tanh at x, given s = _gelu_sigmoid(x): gelu = x s, so
    gelu' = s + 2 x s (1 - s) u', u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2). The same
    value as torch's tanh form (1 - tanh(u)^2 = 4 s (1 - s)), and finite everywhere.
    """
    var du = 0.7978845608028654 * (1 + 0.134145 * x * x)
    return s + 2 * x * s * (1 - s) * du


@always_inline
def quad_transpose(mut p: SIMD[DType.uint32, 4], t: Int):
    """Transpose a 4 x 4 block held by the 4 lanes of a quad (t = lane % 4): lane t's
    element e moves to lane e's element t. One xor-shuffle stage per index bit: where
    bit b of the lane and of the element differ, the pair of lanes t, t ^ 2^b swap.
    Every lane of the warp must take part (no divergent branch around a call).
    """
    comptime for b in range(2):
        comptime m = 1 << b
        var hi = (t >> b) & 1 == 1
        comptime for e0 in range(4):
            comptime if e0 & m == 0:
                comptime e1 = e0 | m
                var got = warp.shuffle_xor(p[e0] if hi else p[e1], UInt32(m))
                if hi:
                    p[e0] = got
                else:
                    p[e1] = got


@always_inline
def _packed[dtype: DType](v: SIMD[DType.float32, 2]) -> UInt32:
    return bitcast[DType.uint32, 1](v.cast[dtype]())[0]


@always_inline
def scaled_with_bias[
    dtype: DType, BN: Int, BIAS: Bool
](
    acc: SIMD[DType.float32, BN // 2],
    alpha: Float32,
    bias: Pointer[Scalar[dtype], MutAnyOrigin],
    n0: Int,
    N: Int,
) -> type_of(acc):
    """alpha * acc, plus bias[col] with BIAS (4-byte aligned): one 4-byte load per
    column pair serves both rows a thread holds (wg_store_acc's layout, below).
    """
    var out = acc * alpha
    comptime if BIAS:
        var t = lane_id() % 4
        comptime for j in range(BN // 8):
            var col = n0 + j * 8 + 2 * t
            if col < N:
                var b = bias.unsafe_load[width=2, alignment=4](col).cast[
                    DType.float32
                ]()
                out[4 * j] += b[0]
                out[4 * j + 1] += b[1]
                out[4 * j + 2] += b[0]
                out[4 * j + 3] += b[1]
    return out


@always_inline
def load_c_pairs[
    dtype: DType, NJ: Int, GELU_GRAD: Bool
](
    c_t: Pointer[Scalar[dtype], MutAnyOrigin],
    row: Int,
    n0: Int,
    M: Int,
    N: Int,
    c_rs: Int,
    c_cs: Int,
    with_c: Bool,
) -> SIMD[DType.uint32, NJ]:
    """The pairs of c a lane needs for one row and NJ column blocks of 8 from n0 (pair
    j at column n0 + 8 j + 2 t), packed as 32 bits, all loaded before the first store
    and none behind a per-pair branch: out-of-range lanes read row M - 1 / column N - 2
    instead, and their results are never stored. (Loads between the stores ran one at a
    time, since a store may write what the next load reads: GELU_GRAD's product took
    402 us at 16384 x 768 -> 3072 on the H100, day 020, and adding a (1, s, s) causal
    mask to attention scores cost 3x the product itself, day 016.) GELU_GRAD's c is
    full, contiguous and aligned (its caller's promise): a pair per 4-byte load. beta's
    c may have any strides: two 2-byte loads, only where `with_c` (beta != 0).
    """
    var t = lane_id() % 4
    var safe = c_t.unsafe_offset(min(row, M - 1) * c_rs)
    var cq = SIMD[DType.uint32, NJ]()
    comptime if GELU_GRAD:
        comptime for j in range(NJ):
            var col = min(n0 + j * 8 + 2 * t, N - 2)
            cq[j] = bitcast[DType.uint32, 1](
                safe.unsafe_load[width=2, alignment=4](col)
            )[0]
    else:
        if with_c:  # beta: the same in every lane
            comptime for j in range(NJ):
                var p = safe.unsafe_offset(
                    min(n0 + j * 8 + 2 * t, N - 2) * c_cs
                )
                cq[j] = bitcast[DType.uint32, 1](
                    SIMD[dtype, 2](p[unsafe_offset=0], p[unsafe_offset=c_cs])
                )[0]
    return cq


@always_inline
def load_c_blocks[
    dtype: DType, NJ: Int
](
    c_t: Pointer[Scalar[dtype], MutAnyOrigin],
    row: Int,
    n0: Int,
    M: Int,
    N: Int,
    c_rs: Int,
) -> SIMD[DType.uint32, NJ]:
    """load_c_pairs' pairs (pair j of a lane at column n0 + 8 j + 2 t) from whole 16-byte
    blocks: in each group of 4 column blocks, lane t of a quad loads block t (the one it
    stores, wg_store_acc) and a quad_transpose hands each lane its pairs. One load where
    load_c_pairs issues 8 two-byte loads: c read that way cost a residual linear 14 us
    on a 23 us product (8192 x 768 -> 768, day 019, part 16). The caller's promise
    (C_BLOCKS): c_cs == 1, c_t and every row (c_rs) 16-byte aligned, N % 8 == 0, so a
    block is all in or all out; out-of-range lanes read row M - 1 or the last block, and
    their results are never stored. Every lane of the warp must call it.
    """
    var t = lane_id() % 4
    var safe = c_t.unsafe_offset(min(row, M - 1) * c_rs)
    var cq = SIMD[DType.uint32, NJ]()
    comptime for jq in range(NJ // 4):
        var col = min(n0 + (4 * jq + t) * 8, N - 8)
        var q = bitcast[DType.uint32, 4](
            safe.unsafe_load[width=8, alignment=16](col)
        )
        quad_transpose(q, t)
        cq = cq.insert[offset=4 * jq](q)
    return cq


@always_inline
def epilogue_pair[
    dtype: DType, GELU: Bool, GELU_GRAD: Bool
](
    v: SIMD[DType.float32, 2],
    cq: UInt32,
    beta: Float32,
    with_c: Bool,
    aux: Int,
    mut pre: UInt32,
) -> SIMD[DType.float32, 2]:
    """One pair's epilogue after alpha and bias: GELU (with `pre` set to what aux
    keeps, its input or, aux == 2, its derivative there), then + beta c or, GELU_GRAD,
    * c (c's pair packed in `cq`)."""
    var w = v
    comptime if GELU:
        var sig = _gelu_sigmoid(w)
        # a select, not a branch: aux is the same in every lane
        var kept = gelu_tanh_grad(w, sig) if aux == 2 else w
        pre = _packed[dtype](kept)
        w = w * sig
    var cv = bitcast[dtype, 2](SIMD[DType.uint32, 1](cq)).cast[DType.float32]()
    comptime if GELU_GRAD:
        w *= cv
    else:
        if with_c:
            w += beta * cv
    return w


@always_inline
def wg_store_acc[
    dtype: DType,
    BN: Int,
    BIAS: Bool = False,
    GELU: Bool = False,
    GELU_GRAD: Bool = False,
    F32_OUT: Bool = False,
    C_BLOCKS: Bool = False,
](
    acc: SIMD[DType.float32, BN // 2],
    o_t: Pointer[Scalar[dtype], MutAnyOrigin],
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
    aux_t: Pointer[Scalar[dtype], MutAnyOrigin],
    aux: Int,
):
    """Epilogue of one warpgroup's 64 x BN wgmma accumulator whose first row is
    `row0`, straight from registers (N % 8 == 0; o_t and aux_t 16-byte aligned):

        out = act(alpha * acc + bias) + beta * c      act = GELU or none
        out = alpha * acc * c                         GELU_GRAD (c: GELU's derivative)

    BIAS adds bias[col] (bias 4-byte aligned). GELU applies gelu_tanh and, where
    `aux` is 1, first writes its input (the pre-activation torch's gelu_backward
    needs) to aux_t, laid out like out; where `aux` is 2, GELU's derivative at that
    input instead. GELU_GRAD is the backward's other half: the gradient of GELU's
    input is the product (the gradient of its output) times that saved derivative,
    read as c (full, row-major, 4-byte aligned; beta must be 0). F32_OUT: o_t
    holds float32 values (the caller passes a float32 pointer cast to dtype's), for
    the weight gradient of float32 master weights (day 020), so no kernel converts it
    afterwards; each lane then stores its pairs directly (8 bytes; a warp writes whole
    32-byte sectors), marked evict-first (store_streaming). C_BLOCKS reads beta's c in
    16-byte blocks (load_c_blocks, whose promise the caller keeps). Day 014's kernels use
    none of them (they pass o_t for both pointers, never touched); day 019's fused
    linear layers and day 020's MLP do. Call it from every lane of the
    warpgroup: the stores go through warp shuffles.

    Accumulator element 4*j + e sits at row 16*warp + g + 8*(e//2), col
    8*j + 2*t + e%2 (g = lane // 4, t = lane % 4): the mma.sync C layout per n8.
    A lane holds 2 adjacent values of each 8-column block, so a direct store is 4
    bytes and a warp's store touches 8 rows: the epilogue of a 128 x 256 tile took
    ~20% of the kernel at K = 4096 (Nsight Compute, day 019). Instead the quad's 4
    lanes transpose their pairs of 4 blocks (quad_transpose), and each lane stores
    one whole block: 16 bytes, a quarter of the store instructions.
    """
    comptime assert (
        size_of[dtype]() == 2
    ), "16-bit operands (a pair packs in 32 bits)"
    comptime assert BN % 32 == 0, "whole groups of 4 column blocks"
    comptime assert not (
        GELU_GRAD and (BIAS or GELU)
    ), "GELU_GRAD is an epilogue of its own"
    comptime assert not (
        F32_OUT and (BIAS or GELU or GELU_GRAD)
    ), "float32 outputs: the plain epilogue (a weight gradient)"
    var o32 = o_t.unsafe_bitcast[Float32]()
    var g = lane_id() // 4
    var t = lane_id() % 4
    var wrow = row0 + (warp_id() % 4) * 16 + g

    # beta == 0 compiles without c (tma_store.mojo's wg_store_acc_tma says why)
    @always_inline
    @__parameter
    def epilogue[WITH_C: Bool]():
        var out = scaled_with_bias[dtype, BN, BIAS](acc, alpha, bias, n0, N)
        var with_c = WITH_C and beta != 0
        # GELU goes pair by pair: applied to all 128 values at once it needed three times
        # their registers and spilled.
        comptime for half in range(2):
            var row = wrow + half * 8
            var row_in = row < M
            var cq: SIMD[DType.uint32, BN // 8]
            # (C_BLOCKS loads each half's c here: both halves first measured 7% slower on
            # the 256 x 192 tile, whose epilogue spills; day 019, part 16)
            comptime if C_BLOCKS:
                cq = SIMD[DType.uint32, BN // 8]()
                if with_c:  # beta: the same in every lane
                    cq = load_c_blocks[dtype, BN // 8](c_t, row, n0, M, N, c_rs)
            else:
                cq = load_c_pairs[dtype, BN // 8, GELU_GRAD](
                    c_t, row, n0, M, N, c_rs, c_cs, with_c
                )
            comptime for jq in range(BN // 32):
                var res = SIMD[DType.uint32, 4]()
                var pre = SIMD[DType.uint32, 4]()  # GELU's input, for aux
                comptime for jj in range(4):
                    comptime j = 4 * jq + jj
                    var col = n0 + j * 8 + 2 * t
                    var kept = UInt32(0)
                    var v = epilogue_pair[dtype, GELU, GELU_GRAD](
                        out.slice[2, offset=4 * j + 2 * half](),
                        cq[j],
                        beta,
                        with_c,
                        aux,
                        kept,
                    )
                    pre[jj] = kept
                    comptime if F32_OUT:
                        if row_in and col < N:
                            store_streaming(o32.unsafe_offset(row * N + col), v)
                    else:
                        res[jj] = _packed[dtype](v)
                comptime if not F32_OUT:  # (float32 pairs were stored above)
                    quad_transpose(res, t)
                    comptime if GELU:
                        if (
                            aux != 0
                        ):  # a kernel argument: the same in every lane
                            quad_transpose(pre, t)
                    var col = n0 + (4 * jq + t) * 8  # this lane's whole block
                    if (
                        row_in and col < N
                    ):  # N % 8 == 0: a block is all in or all out
                        o_t.unsafe_store[alignment=16](
                            row * N + col, bitcast[dtype, 8](res)
                        )
                        comptime if GELU:
                            if aux != 0:
                                aux_t.unsafe_store[alignment=16](
                                    row * N + col, bitcast[dtype, 8](pre)
                                )

    # the fused epilogues keep one body (tma_store.mojo's wg_store_acc_tma says why)
    comptime if BIAS or GELU or GELU_GRAD:
        epilogue[True]()
    else:
        if beta != 0:  # a kernel argument: the same in every lane
            epilogue[True]()
        else:
            epilogue[False]()


@always_inline
def wg_store_acc_f32[
    BN: Int
](
    acc: SIMD[DType.float32, BN // 2],
    o_t: Pointer[Float32, MutAnyOrigin],
    c_t: Pointer[Float32, MutAnyOrigin],
    alpha: Float32,
    beta: Float32,
    row0: Int,
    n0: Int,
    M: Int,
    N: Int,
    c_rs: Int,
    c_cs: Int,
):
    """wg_store_acc's plain epilogue for a float32 output (3xTF32, day 019):
    out = alpha * acc + beta * c, each lane storing its pairs (8 bytes: N even and
    o_t 8-byte aligned, the plan's promise). Same accumulator layout."""
    var g = lane_id() // 4
    var t = lane_id() % 4
    var wrow = row0 + (warp_id() % 4) * 16 + g
    var out = acc * alpha
    var with_c = beta != 0
    comptime for half in range(2):
        var row = wrow + half * 8
        var safe = c_t.unsafe_offset(min(row, M - 1) * c_rs)
        comptime for j in range(BN // 8):
            var col = n0 + j * 8 + 2 * t
            var v = out.slice[2, offset=4 * j + 2 * half]()
            # beta is the same in every lane; out-of-range lanes read in range
            if with_c:
                var q = safe.unsafe_offset(min(col, N - 2) * c_cs)
                v += beta * SIMD[DType.float32, 2](
                    q[unsafe_offset=0], q[unsafe_offset=c_cs]
                )
            if row < M and col < N:
                o_t.unsafe_store[alignment=8](row * N + col, v)


@always_inline
def prefetch_l2_rows[
    dtype: DType, ROWS: Int, COLS: Int
](
    p: Pointer[Scalar[dtype], MutAnyOrigin],
    row0: Int,
    col0: Int,
    M: Int,
    N: Int,
    rs: Int,
    tid: Int,
):
    """Ask L2 for the ROWS x COLS block at (row0, col0) of a row-major matrix (rows
    of `rs` elements), one 128-byte line a request, spread over a warpgroup's 128
    threads (`tid`). Issued before a tile's k-loop, so that the epilogue reading the
    block waits for L2, not DRAM (day 020: the MLP backward's GELU_GRAD; measured on
    the H100 it moved that product by ~2%, 250 -> 246 us: its cost was arithmetic).
    """
    comptime LINE = 128 // size_of[dtype]()
    comptime LINES = ceildiv(COLS, LINE)  # a row's lines
    comptime for i in range(ceildiv(ROWS * LINES, 128)):
        var idx = tid + i * 128
        var r = row0 + idx // LINES
        var c = col0 + (idx % LINES) * LINE
        if idx < ROWS * LINES and r < M and c < N:
            inlined_assembly[
                "prefetch.global.L2 [$0];", NoneType, constraints="l"
            ](UInt64(Int(p.unsafe_offset(r * rs + c))))


# --8<-- [end:wg_epilogue]
