# Day 016, part eighteen: two ops that took two launches, in one.
#
# The overhead budget is 15 us of host time a call. A launch costs ~4 us of it and
# a tensor from torch's allocator ~2. The op over budget (the layer norm's backward)
# and the one closest to it (the long softmax) were two launches and a workspace.
#
# 1. The layer norm's backward, for a few rows. Day 013's is two kernels: grad_x
#    with per-block column sums into a workspace, then the sums of those partials
#    (two launches, four tensors). But the column sums need no partials when every
#    row can be read again:
#        grad_weight = sum over rows of dy * xhat,  grad_bias = sum over rows of dy,
#    with xhat = (x - mean) * rstd from the forward's saved statistics. So the grid
#    has two kinds of blocks, and no block waits for another:
#      - blocks [0, col_blocks) each own COL_THREADS vectors of columns and sum them
#        over every row (no workspace, no counter, one fixed order of additions);
#      - the others compute grad_x, day 013's `backward_row` without column sums.
#    The price is reading dy and x twice, and a column block's walk over every row.
#    For a few rows both sit in L2 and the walk is short; the plan sends larger
#    inputs to day 013's two kernels (pytorch_custom_ops/layer_norm.py,
#    ONE_LAUNCH_ROWS, measured there).
# 2. The long softmax when a row gets one block (rows of at most one tile, or more
#    rows than the GPU has blocks): day 015's fused pipeline folds (max, sum) per
#    block into a workspace, then merges the pairs and normalizes. With one block a
#    row there is nothing to merge: the same block normalizes right after its fold.
#
# Part nineteen: a linear layer's backward in one launch (float32 / float64).
# 3. MojoGEMM's backward node was three ops: dX = dY W and dW = dY^T X (day 014's
#    SIMT kernel, a launch each) and the bias gradient, the column sums of dY
#    (torch's sum). With a few tiles each, the GPU finishes them in ~14 us and the
#    host takes ~33 us to issue them. The three are independent, so one grid holds
#    them all: the first blocks are dX's tiles, then dW's, then column blocks of the
#    bias gradient (day 013's `column_slice_sum` over every row).

from max.gpu import (
    WARP_SIZE,
    lane_id,
    warp_id,
    thread_idx,
    block_idx,
    grid_dim,
    barrier,
    MAX_THREADS_PER_BLOCK_METADATA,
)
from max.gpu.memory import external_memory
from std.math import ceildiv
from std.sys import size_of
from std.utils import StaticTuple

from days.day009.online_softmax import accum_dtype
from days.day013.column_sums import column_slice_sum, column_smem
from days.day013.layer_norm import ADD_GRAD, WRITE_LOW, backward_row
from days.day014.gemm_common import accum_dtype as gemm_accum
from days.day014.gemm_v1_simt import SIMT_THREADS, simt_smem, simt_tile
from days.day015.long_softmax import (
    Normalize,
    OnlineFold,
    block_combine,
    inverse_sum,
)
from days.day015.multiblock_reduce import PARTIAL, Ptr, visit_slice
from days.day015.multiblock_reduce import accum_dtype as fold_dtype

# threads across one row of a column block: 8 x 16 bytes, a 128-byte line
comptime COL_THREADS = 8
comptime COL_UNROLL = 4  # rows a thread loads before it adds any of them


# --8<-- [start:column_sums]
@always_inline
def column_sums[
    dtype: DType, ldtype: DType, acc: DType, VEC: Int, THREADS: Int
](
    grad_weight: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_bias: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_out: Pointer[Scalar[ldtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    mean_in: Pointer[Float32, MutAnyOrigin],
    rstd_in: Pointer[Float32, MutAnyOrigin],
    rows: Int,
    n: Int,
    cb: Int,
):
    """Column block cb: vectors [cb * COL_THREADS, (cb + 1) * COL_THREADS) of
    every row. Thread (lane, seg) adds rows lane, lane + LANES, ... of vector
    cb * COL_THREADS + seg; then the block adds the LANES partial sums of each
    column in lane order. The order never depends on timing: the gradients are
    deterministic. Needs THREADS * VEC * 2 accumulators of shared memory.
    """
    comptime LANES = THREADS // COL_THREADS
    comptime W = COL_THREADS * VEC  # columns of a block
    comptime ALIGN = VEC * size_of[dtype]()
    comptime LALIGN = VEC * size_of[ldtype]()
    comptime SALIGN = min(VEC * size_of[acc](), 16)
    var seg = thread_idx.x % COL_THREADS
    var lane = thread_idx.x // COL_THREADS
    var v = cb * COL_THREADS + seg
    var dw = SIMD[acc, VEC](0)
    var db = SIMD[acc, VEC](0)
    if v < n // VEC:
        var j = v * VEC
        var row = lane
        # COL_UNROLL rows' loads in flight before the first add
        while row + (COL_UNROLL - 1) * LANES < rows:
            var dy = Array[SIMD[ldtype, VEC], COL_UNROLL](
                fill=SIMD[ldtype, VEC](0)
            )
            var xv = Array[SIMD[dtype, VEC], COL_UNROLL](
                fill=SIMD[dtype, VEC](0)
            )
            var mean = SIMD[DType.float32, COL_UNROLL](0)
            var rstd = SIMD[DType.float32, COL_UNROLL](0)
            comptime for u in range(COL_UNROLL):
                var r = row + u * LANES
                dy[u] = grad_out.unsafe_load[width=VEC, alignment=LALIGN](
                    r * n + j
                )
                xv[u] = x.unsafe_load[width=VEC, alignment=ALIGN](r * n + j)
                mean[u] = mean_in[unsafe_offset=r]
                rstd[u] = rstd_in[unsafe_offset=r]
            comptime for u in range(COL_UNROLL):
                var d = dy[u].cast[acc]()
                var xhat = (xv[u].cast[acc]() - mean[u].cast[acc]()) * rstd[
                    u
                ].cast[acc]()
                dw += d * xhat
                db += d
            row += COL_UNROLL * LANES
        while row < rows:
            var d = grad_out.unsafe_load[width=VEC, alignment=LALIGN](
                row * n + j
            ).cast[acc]()
            var xhat = (
                x.unsafe_load[width=VEC, alignment=ALIGN](row * n + j).cast[
                    acc
                ]()
                - mean_in[unsafe_offset=row].cast[acc]()
            ) * rstd_in[unsafe_offset=row].cast[acc]()
            dw += d * xhat
            db += d
            row += LANES
    # [lane][dw of W columns | db of W columns]
    var sh = external_memory[
        Scalar[acc], address_space=AddressSpace.SHARED, alignment=16
    ]()
    sh.unsafe_store[alignment=SALIGN](lane * 2 * W + seg * VEC, dw)
    sh.unsafe_store[alignment=SALIGN](lane * 2 * W + W + seg * VEC, db)
    barrier()
    # thread k < 2 W adds value k of every lane: 4 chains, so the loads overlap
    var k = thread_idx.x
    if k < 2 * W:
        var s = SIMD[acc, 4](0)
        comptime for l in range(LANES):
            s[l % 4] += sh[unsafe_offset=l * 2 * W + k]
        var total = (s[0] + s[1]) + (s[2] + s[3])
        var col = cb * W + k % W
        if col < n:
            if k < W:
                grad_weight[unsafe_offset=col] = total.cast[dtype]()
            else:
                grad_bias[unsafe_offset=col] = total.cast[dtype]()


# --8<-- [end:column_sums]


# --8<-- [start:one_launch_kernel]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(TPR * ROWS))
)
@__name(t"ln_bwd1_{dtype}_{ldtype}_v{VEC}_t{TPR}_i{ITEMS}_r{ROWS}")
def layer_norm_bwd_one_kernel[
    dtype: DType,
    ldtype: DType,
    acc: DType,
    VEC: Int,
    TPR: Int,
    ITEMS: Int,
    ROWS: Int,
](
    grad_x: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_weight: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_bias: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_out: Pointer[Scalar[ldtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    weight: Pointer[Scalar[dtype], MutAnyOrigin],
    mean_in: Pointer[Float32, MutAnyOrigin],
    rstd_in: Pointer[Float32, MutAnyOrigin],
    grad_resid: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_low: Pointer[Scalar[ldtype], MutAnyOrigin],
    rows: Int64,
    cols: Int64,
    flags: Int64,
    col_blocks: Int64,
) where (dtype.is_floating_point() and ldtype.is_floating_point()):
    """grad_x, grad_weight and grad_bias of a layer norm in one launch: blocks
    below col_blocks run `column_sums`, the others are day 013's row workers
    (TPR threads a row, ROWS rows a block, the same tiers) without column sums.
    Launch with TPR * ROWS * VEC * 2 * sizeof(acc) bytes of dynamic shared
    memory (the column blocks' partial sums). Flags as in day 013's kernel.
    float64 stays with day 013's kernels: they re-derive each row's mean in
    float64, and a column block cannot."""
    comptime assert acc == accum_dtype[dtype](), "acc: accum_dtype[dtype]"
    comptime assert dtype != DType.float64, "float64: day 013's kernels"
    var n = Int(cols)
    var first_row_block = Int(col_blocks)
    if block_idx.x < first_row_block:
        column_sums[dtype, ldtype, acc, VEC, TPR * ROWS](
            grad_weight,
            grad_bias,
            grad_out,
            x,
            mean_in,
            rstd_in,
            Int(rows),
            n,
            block_idx.x,
        )
        return
    var t = thread_idx.x % TPR
    var slot = thread_idx.x // TPR
    var add_grad = (flags & ADD_GRAD) != 0
    var write_low = (flags & WRITE_LOW) != 0
    var workers = (grid_dim.x - first_row_block) * ROWS
    var no_sums = external_memory[  # not written: SUMS is False
        Scalar[acc], address_space=AddressSpace.SHARED, alignment=16
    ]()
    for row in range(
        (block_idx.x - first_row_block) * ROWS + slot, Int(rows), workers
    ):
        backward_row[dtype, ldtype, acc, VEC, TPR, ITEMS, False](
            row,
            n,
            t,
            grad_x,
            grad_out,
            x,
            weight,
            mean_in,
            rstd_in,
            grad_resid,
            grad_low,
            add_grad,
            write_low,
            no_sums,
        )


# --8<-- [end:one_launch_kernel]


# --8<-- [start:one_block_softmax]
def one_block_softmax_kernel[
    dtype: DType, VEC: Int, BLOCK: Int
](y: Ptr[dtype], x: Ptr[dtype], n: Int64):
    """Day 015's fused pipeline with one block a row (block r: row r), no workspace:
    stage A's fold over the row, the block's (max, sum) pair, then stage C over the
    row again, last tile first (still in L2). With one block, stage B's merge of the
    pairs is the pair itself (its exp(m - m) is 1), so the output is bit for bit what
    the two launches write."""
    # OnlineFold's and Normalize's accumulator: day 015's accum_dtype
    comptime acc = fold_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var base = block_idx.x * Int(n)
    var fold = OnlineFold[dtype](x.unsafe_offset(base))
    visit_slice[VEC=VEC, BLOCK=BLOCK](fold, Int(n), 0, 1, thread_idx.x)
    var m: Scalar[acc]
    var s: Scalar[acc]
    m, s = block_combine[BLOCK=BLOCK](fold.m, fold.s)
    var out = Normalize[dtype](
        x.unsafe_offset(base),
        y.unsafe_offset(base),
        m,
        inverse_sum[acc](m.cast[PARTIAL](), s.cast[PARTIAL]()),
    )
    visit_slice[VEC=VEC, BLOCK=BLOCK, REVERSE=True](
        out, Int(n), 0, 1, thread_idx.x
    )


# --8<-- [end:one_block_softmax]


# --8<-- [start:gemm_backward_one]
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(SIMT_THREADS))
)
@__name(t"gemm_bwd1_{dtype}_tb{TB}_v{VEC}_m{BM}_k{BK}_t{TM}")
def gemm_backward_one_kernel[
    dtype: DType, TB: Bool, VEC: Bool, BM: Int, BK: Int, TM: Int
](
    grad_a: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_b: Pointer[Scalar[dtype], MutAnyOrigin],
    grad_c: Pointer[Scalar[dtype], MutAnyOrigin],
    g: Pointer[Scalar[dtype], MutAnyOrigin],
    a: Pointer[Scalar[dtype], MutAnyOrigin],
    b: Pointer[Scalar[dtype], MutAnyOrigin],
    alpha_beta: Pointer[Float32, MutAnyOrigin],
    m: Int64,
    n: Int64,
    k: Int64,
):
    """The backward of y = alpha a @ op(b) + c (a: m x k, op(b): k x n; b stored
    n x k when TB) for its gradient g (m x n, packed), in one launch:
        blocks [0, t1)        grad_a = alpha g @ op(b)^T   (m x k), BM x BM tiles
        blocks [t1, t1 + t2)  grad_b = alpha (g^T a or a^T g), the shape of b
        the rest              grad_c = the column sums of g, 32 vectors a block
    alpha_beta holds (alpha, 0). A grid without column blocks leaves grad_c alone
    (no bias). VEC: 16-byte vectors everywhere (the plan checks every operand).
    """
    comptime acc = gemm_accum[dtype]()
    comptime VW = 16 // size_of[dtype]() if VEC else 1
    var M = Int(m)
    var N = Int(n)
    var K = Int(k)
    var t1 = ceildiv(M, BM) * ceildiv(K, BM)
    var t2 = ceildiv(N, BM) * ceildiv(K, BM)
    var id = block_idx.x
    if id >= t1 + t2:  # the bias gradient, every row at once
        var cx = id - t1 - t2
        var total = column_slice_sum[dtype, acc, VW](
            g, N, N, 0, M, cx, column_smem[acc, VW]()
        )
        var col = cx * WARP_SIZE * VW + lane_id() * VW
        if warp_id() == 0 and col < N:
            comptime for e in range(VW):
                grad_c[unsafe_offset=col + e] = total[e].cast[dtype]()
        return
    var as_ = simt_smem[acc, BM, BK]()
    var bs_ = simt_smem[acc, BM, BK]()
    if id < t1:  # g (m x n) times op(b)^T: b itself (n x k) when TB
        simt_tile[dtype, False, not TB, VEC, BM, BM, BK, TM, TM](
            id,
            0,
            grad_a,
            g,
            b,
            g,
            alpha_beta,
            M,
            K,
            N,
            0,
            0,
            0,
            0,
            0,
            N,
            K if TB else N,
            as_,
            bs_,
        )
    elif TB:  # grad_b (n x k) = g^T a
        simt_tile[dtype, True, False, VEC, BM, BM, BK, TM, TM](
            id - t1,
            0,
            grad_b,
            g,
            a,
            g,
            alpha_beta,
            N,
            K,
            M,
            0,
            0,
            0,
            0,
            0,
            N,
            K,
            as_,
            bs_,
        )
    else:  # grad_b (k x n) = a^T g
        simt_tile[dtype, True, False, VEC, BM, BM, BK, TM, TM](
            id - t1,
            0,
            grad_b,
            a,
            g,
            g,
            alpha_beta,
            K,
            N,
            M,
            0,
            0,
            0,
            0,
            0,
            K,
            N,
            as_,
            bs_,
        )


# --8<-- [end:gemm_backward_one]
