# Day 012: the softmax family at (close to) the speed of memory.
#
# Day 009 read every row twice, one element per thread at a time, and reached 33-40%
# of the H100's copy bandwidth. Here a row that fits is read ONCE into registers
# with 16-byte vector loads, reduced there (max, then sum of exp), and written once:
# 2 bytes moved per byte of output, the least a softmax can move. Small rows get one
# warp each (several rows per block, shuffles only); medium rows one block each;
# rows too long for the registers get a looped kernel (one block per row, the row
# cached in shared memory); rows too long for one block's shared memory (vocabulary
# sizes) are split over a thread-block cluster of 2-8 CTAs that holds the whole row
# on chip and merges the partial (max, sum) pairs through distributed shared memory
# (only rows too long even for 8 CTAs read their uncached tail twice).
# The same layouts serve log_softmax and the two backwards.

from extensibility import register, InputTensor, OutputTensor
from max.gpu import (
    MAX_THREADS_PER_BLOCK_METADATA,
    WARP_SIZE,
    barrier,
    block_idx,
    lane_id,
    thread_idx,
    warp_id,
)
from max.gpu.primitives import warp
from max.gpu.host import DeviceContext
from max.gpu.memory import external_memory
from max.gpu.primitives.cluster import (
    block_rank_in_cluster,
    cluster_arrive,
    cluster_sync,
    cluster_wait,
    load_cluster_smem,
)
from std.math import isnan, log

# float64 to 1 ulp (Mojo 1.2's own exp is ~3e-13 off); std.math.exp for the rest
from days.day009.exp_f64 import exp
from std.memory import stack_allocation
from std.sys import size_of
from std.utils.static_tuple import StaticTuple

from days.day009.online_softmax import (
    CPU_CHUNK,
    accum_dtype,
    block_combine,
    combine,
    finite,
    nan_value,
    row_max_sum_cpu,
    warp_combine,
)

# Since day 016 the launch (which kernel, grid, block, shared memory, cluster) is
# chosen in Python: pytorch_custom_ops/softmax_family.py. This file keeps the kernels
# and the CPU path; the execute GPU branches only say where the launch went.

comptime SharedPtr[acc: DType] = Pointer[
    Scalar[acc], MutUntrackedOrigin, address_space=AddressSpace.SHARED
]


# --8<-- [start:group_reduce]
@always_inline
def merge[
    acc: DType, IS_MAX: Bool
](a: Scalar[acc], b: Scalar[acc]) -> Scalar[acc]:
    comptime if IS_MAX:
        # NaN-sticky: the hardware max drops a NaN, torch's softmax propagates it
        if a != a:
            return a
        if b != b:
            return b
        return max(a, b)
    else:
        return a + b


@always_inline
def group_reduce[
    acc: DType, IS_MAX: Bool, G: Int
](v: Scalar[acc], red: SharedPtr[acc]) -> Scalar[acc]:
    """Max or sum over the G threads that own one row; every one of them gets it.

    G = 32: one warp, butterfly shuffles only, no barrier. G < 32 (8 or 16: 32 / G
    rows a warp): the butterfly's first log2(G) stages, which stay inside the group.
    G > 32 (G = block size): each warp's result goes through shared memory `red`
    (G // 32 slots), one barrier.
    """
    var r = v
    comptime for k in range(5):
        comptime if (1 << k) < G:
            r = merge[acc, IS_MAX](r, warp.shuffle_xor(r, UInt32(1 << k)))
    comptime if G > WARP_SIZE:
        if lane_id() == 0:
            red[unsafe_offset=warp_id()] = r
        barrier()
        r = red[unsafe_offset=0]
        comptime for w in range(1, G // WARP_SIZE):
            r = merge[acc, IS_MAX](r, red[unsafe_offset=w])
    return r


# --8<-- [end:group_reduce]


@always_inline
def group_row[G: Int, BLOCK: Int](rows: Int) -> Tuple[Int, Bool, Bool]:
    """(row, live, leave) for this thread's group of G: the row it owns (BLOCK // G
    rows a block), whether that row exists, and whether the thread may return at once.
    Threads leave only with their whole warp (G <= 32) or block (G = BLOCK), since the
    reductions need every lane: a group narrower than a warp (G < 32) past the last row
    redoes the last row and stores nothing (day 016, part ten: 128-wide rows of
    attention scores in 16 lanes each instead of half a warp)."""
    var row = block_idx.x * (BLOCK // G) + thread_idx.x // G
    var first = (
        row - (thread_idx.x % WARP_SIZE) // G
    )  # the warp's first row (G <= 32)
    return (min(row, rows - 1), row < rows, first >= rows)


@always_inline
def load_vec[
    dtype: DType, W: Int
](p: Pointer[Scalar[dtype], MutAnyOrigin], i: Int) -> SIMD[dtype, W]:
    comptime if W == 1:
        return p[unsafe_offset=i]
    else:
        return p.unsafe_offset(i).unsafe_load[
            width=W, alignment=W * size_of[dtype]()
        ]()


@always_inline
def store_vec[
    dtype: DType, W: Int
](p: Pointer[Scalar[dtype], MutAnyOrigin], i: Int, v: SIMD[dtype, W]):
    comptime if W == 1:
        p[unsafe_offset=i] = v[0]
    else:
        p.unsafe_offset(i).unsafe_store[alignment=W * size_of[dtype]()](0, v)


@always_inline
def load_shared[
    dtype: DType, W: Int
](p: SharedPtr[dtype], i: Int) -> SIMD[dtype, W]:
    return p.unsafe_offset(i).unsafe_load[
        width=W, alignment=W * size_of[dtype]()
    ]()


@always_inline
def store_shared[
    dtype: DType, W: Int
](p: SharedPtr[dtype], i: Int, v: SIMD[dtype, W]):
    p.unsafe_offset(i).unsafe_store[alignment=W * size_of[dtype]()](0, v)


@always_inline
def poisoned[acc: DType, L: Int](x: SIMD[acc, L]) -> Bool:
    """A NaN or +inf makes torch's softmax row NaN (exp(inf - inf)).

    `isnan`, not `x.ne(x)`: the GPU build folded that comparison to false (the PTX had
    only the +inf test), so a vector of NaNs was skipped as if it were -inf.
    """
    return isnan(x).reduce_or() or x.eq(Scalar[acc].MAX).reduce_or()


# --8<-- [start:forward_registers]
# the block size bounds the registers ptxas may use (it spills rather than fail to launch)
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLOCK))
)
def softmax_rows_kernel[
    dtype: DType, LOG: Bool, W: Int, NV: Int, G: Int, BLOCK: Int
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    src: Pointer[Scalar[dtype], MutAnyOrigin],
    rows: Int64,
    cols: Int64,
) where dtype.is_floating_point():
    """A row of cols <= G * NV * W elements lives in the registers of G threads.

    Thread t of the row holds vectors v = 0..NV-1 at columns (v * G + t) * W, so a
    warp's loads are contiguous (coalesced) for every v. W divides cols (the host
    picks W = 1 otherwise), so a vector is either wholly inside the row or outside.
    """
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    comptime assert (
        G <= WARP_SIZE and WARP_SIZE % G == 0 or G == BLOCK
    ), "a row is part of a warp, one warp or one block"
    comptime L = W * NV
    var red_m = stack_allocation[
        max(G // WARP_SIZE, 1), Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var red_s = stack_allocation[
        max(G // WARP_SIZE, 1), Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var slot = group_row[G, BLOCK](Int(rows))
    if slot[2]:  # the whole warp (G <= 32) or block leaves: no barrier follows
        return
    var row = slot[0]
    var live = slot[1]
    var t = thread_idx.x % G
    var n = Int(cols)
    var base = row * n

    # 1. one read: the row into registers, kept in the input dtype (half the
    #    registers for bf16); padding is -inf, which exp() maps to 0
    var xs = SIMD[dtype, L](Scalar[dtype].MIN)
    comptime for v in range(NV):
        var c = (v * G + t) * W
        if c < n:
            xs = xs.insert[offset=v * W](load_vec[dtype, W](src, base + c))

    # 2. the row max (NaN-sticky), then the sum of exp(x - max), from registers
    var m = nan_value[acc]() if poisoned(xs) else xs.reduce_max().cast[acc]()
    m = group_reduce[acc, True, G](m, red_m)
    var part = Scalar[acc](0)
    comptime for v in range(NV):
        part += exp(xs.slice[W, offset=v * W]().cast[acc]() - m).reduce_add()
    var s = group_reduce[acc, False, G](part, red_s)

    # 3. one write; exp() is recomputed rather than kept: registers are the
    #    scarce resource here, the special-function units are not
    # log_softmax as (x - max) - log(sum): x - max is exact for close values however
    # large; x - (max + log(sum)) lost log(sum) in max's rounding (a row of -1e9 gave 0)
    var log_s = log(s)
    var inv = 1 / s
    comptime for v in range(NV):
        var c = (v * G + t) * W
        if c < n:
            var x = xs.slice[W, offset=v * W]().cast[acc]()
            var y: SIMD[acc, W]
            comptime if LOG:
                y = (x - m) - log_s
            else:
                y = exp(x - m) * inv
            if not finite(m):  # masked (-inf), NaN or +inf row: NaN like torch
                y = SIMD[acc, W](nan_value[acc]())
            if live:
                store_vec[dtype, W](dst, base + c, y.cast[dtype]())


# --8<-- [end:forward_registers]


# --8<-- [start:backward_registers]
# the block size bounds the registers ptxas may use (it spills rather than fail to launch)
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLOCK))
)
def softmax_backward_rows_kernel[
    dtype: DType, LOG: Bool, W: Int, NV: Int, G: Int, BLOCK: Int
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    grad: Pointer[Scalar[dtype], MutAnyOrigin],
    fwd_out: Pointer[Scalar[dtype], MutAnyOrigin],
    rows: Int64,
    cols: Int64,
) where dtype.is_floating_point():
    """Grad_input from grad_output g and the forward's output y, both in registers.

    softmax:     dx = y * (g - sum(g * y))
    log_softmax: dx = g - exp(y) * sum(g)
    """
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    comptime assert (
        G <= WARP_SIZE and WARP_SIZE % G == 0 or G == BLOCK
    ), "a row is part of a warp, one warp or one block"
    comptime L = W * NV
    var red = stack_allocation[
        max(G // WARP_SIZE, 1), Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var slot = group_row[G, BLOCK](Int(rows))
    if slot[2]:
        return
    var row = slot[0]
    var live = slot[1]
    var t = thread_idx.x % G
    var n = Int(cols)
    var base = row * n
    var gs = SIMD[dtype, L](0)
    var ys = SIMD[dtype, L](0)
    comptime for v in range(NV):
        var c = (v * G + t) * W
        if c < n:
            gs = gs.insert[offset=v * W](load_vec[dtype, W](grad, base + c))
            ys = ys.insert[offset=v * W](load_vec[dtype, W](fwd_out, base + c))
    var part = Scalar[acc](0)
    comptime for v in range(NV):
        var g = gs.slice[W, offset=v * W]().cast[acc]()
        comptime if LOG:
            part += g.reduce_add()
        else:
            part += (g * ys.slice[W, offset=v * W]().cast[acc]()).reduce_add()
    var s = group_reduce[acc, False, G](part, red)
    comptime for v in range(NV):
        var c = (v * G + t) * W
        if c < n:
            var g = gs.slice[W, offset=v * W]().cast[acc]()
            var y = ys.slice[W, offset=v * W]().cast[acc]()
            var dx: SIMD[acc, W]
            comptime if LOG:
                dx = g - exp(y) * s
            else:
                dx = y * (g - s)
            if live:
                store_vec[dtype, W](dst, base + c, dx.cast[dtype]())


# --8<-- [end:backward_registers]


# --8<-- [start:forward_looped]
comptime UNROLL = 4  # loads in flight per thread in the first pass

# How much of a row the looped kernels cache is the launch's choice, not theirs: the
# plan sizes the dynamic shared memory and passes the element count it made room for
# (`cached`, a multiple of W, at most cols), so one formula (`cached_count` in
# pytorch_custom_ops/softmax_family.py) decides both.


@always_inline
def fold_and_cache[
    dtype: DType, W: Int, BLOCK: Int
](
    src: Pointer[Scalar[dtype], MutAnyOrigin],
    base: Int,
    n: Int,
    cache: SharedPtr[dtype],
    cached: Int,
) -> Tuple[
    Scalar[accum_dtype[dtype]()], Scalar[accum_dtype[dtype]()]
] where dtype.is_floating_point():
    """One read of src[base : base + n]: this thread's online (max, sum) pair.

    UNROLL vectors per thread are in flight at once. Elements c < cached are also
    copied to cache[c]; a later pass of the same BLOCK threads reads them back.
    """
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var m = Scalar[acc].MIN
    var s = Scalar[acc](0)
    comptime STEP = BLOCK * W
    for c0 in range(thread_idx.x * W, n, STEP * UNROLL):
        var xs = SIMD[dtype, W * UNROLL](0)
        comptime for u in range(UNROLL):
            var c = c0 + u * STEP
            if c < n:
                xs = xs.insert[offset=u * W](load_vec[dtype, W](src, base + c))
        comptime for u in range(UNROLL):
            var c = c0 + u * STEP
            if c < n:
                var raw = xs.slice[W, offset=u * W]()
                if c < cached:
                    store_shared[dtype, W](cache, c, raw)
                var x = raw.cast[acc]()
                if poisoned(x):
                    m = nan_value[acc]()
                var vm = x.reduce_max()
                if vm > Scalar[acc].MIN:  # an all -inf vector adds nothing
                    m, s = combine(m, s, vm, exp(x - vm).reduce_add())
    return (m, s)


@always_inline
def write_normalised[
    dtype: DType, LOG: Bool, W: Int, BLOCK: Int
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    src: Pointer[Scalar[dtype], MutAnyOrigin],
    base: Int,
    n: Int,
    cache: SharedPtr[dtype],
    cached: Int,
    m: Scalar[accum_dtype[dtype]()],
    s: Scalar[accum_dtype[dtype]()],
) where dtype.is_floating_point():
    """Write dst[base : base + n] from the row's (max, sum): elements c < cached come
    from the cache that fold_and_cache filled, the rest from src again."""
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var log_s = log(s)
    var inv = 1 / s
    for c in range(thread_idx.x * W, n, BLOCK * W):
        var raw = load_shared[dtype, W](cache, c) if c < cached else load_vec[
            dtype, W
        ](src, base + c)
        var x = raw.cast[acc]()
        var y: SIMD[acc, W]
        comptime if LOG:
            y = (x - m) - log_s
        else:
            y = exp(x - m) * inv
        if not finite(m):
            y = SIMD[acc, W](nan_value[acc]())
        store_vec[dtype, W](dst, base + c, y.cast[dtype]())


# the block size bounds the registers ptxas may use (it spills rather than fail to launch)
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLOCK))
)
def softmax_looped_kernel[
    dtype: DType, LOG: Bool, W: Int, BLOCK: Int
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    src: Pointer[Scalar[dtype], MutAnyOrigin],
    cols: Int64,
    cached: Int64,
) where dtype.is_floating_point():
    """Rows too long for registers: one block per row, its head cached in shared memory.

    Pass 1 reads the row, keeps an online (max, sum) pair per thread and copies the
    first `cached` elements to shared memory (the launch gives it room for them,
    cached * size_of[dtype] bytes); day009's block_combine merges the
    pairs. Pass 2 normalises, reading the cached head from shared memory and only
    the tail from global memory again. Each thread re-reads exactly what it cached,
    so no barrier guards the cache.
    """
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var red_m = stack_allocation[
        BLOCK // WARP_SIZE, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var red_s = stack_allocation[
        BLOCK // WARP_SIZE, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var cache = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16
    ]()
    var n = Int(cols)
    var base = block_idx.x * n
    var m, s = fold_and_cache[dtype, W, BLOCK](src, base, n, cache, Int(cached))
    m, s = block_combine[acc, BLOCK](m, s, red_m, red_s)
    write_normalised[dtype, LOG, W, BLOCK](
        dst, src, base, n, cache, Int(cached), m, s
    )


# --8<-- [end:forward_looped]


@always_inline
def dot_and_cache[
    dtype: DType, LOG: Bool, W: Int, BLOCK: Int
](
    grad: Pointer[Scalar[dtype], MutAnyOrigin],
    fwd_out: Pointer[Scalar[dtype], MutAnyOrigin],
    base: Int,
    n: Int,
    g_cache: SharedPtr[dtype],
    y_cache: SharedPtr[dtype],
    cached: Int,
) -> Scalar[accum_dtype[dtype]()] where dtype.is_floating_point():
    """One read of grad and fwd_out over [base, base + n): this thread's part of
    sum(g * y) (log_softmax: sum(g)); elements c < cached are copied to the caches.
    """
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    comptime STEP = BLOCK * W
    var part = Scalar[acc](0)
    for c0 in range(thread_idx.x * W, n, STEP * UNROLL):
        var gs = SIMD[dtype, W * UNROLL](0)
        var ys = SIMD[dtype, W * UNROLL](0)
        comptime for u in range(UNROLL):
            var c = c0 + u * STEP
            if c < n:
                gs = gs.insert[offset=u * W](load_vec[dtype, W](grad, base + c))
                ys = ys.insert[offset=u * W](
                    load_vec[dtype, W](fwd_out, base + c)
                )
        comptime for u in range(UNROLL):
            var c = c0 + u * STEP
            if c < n and c < cached:
                store_shared[dtype, W](g_cache, c, gs.slice[W, offset=u * W]())
                store_shared[dtype, W](y_cache, c, ys.slice[W, offset=u * W]())
        comptime if LOG:
            part += gs.cast[acc]().reduce_add()  # padding is 0
        else:
            part += (gs.cast[acc]() * ys.cast[acc]()).reduce_add()
    return part


@always_inline
def write_backward[
    dtype: DType, LOG: Bool, W: Int, BLOCK: Int
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    grad: Pointer[Scalar[dtype], MutAnyOrigin],
    fwd_out: Pointer[Scalar[dtype], MutAnyOrigin],
    base: Int,
    n: Int,
    g_cache: SharedPtr[dtype],
    y_cache: SharedPtr[dtype],
    cached: Int,
    s: Scalar[accum_dtype[dtype]()],
) where dtype.is_floating_point():
    """Write grad_input over [base, base + n) from the row's sum s: cached elements
    from shared memory, the rest from global memory again."""
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    for c in range(thread_idx.x * W, n, BLOCK * W):
        var hit = c < cached
        var g = (
            load_shared[dtype, W](g_cache, c) if hit else load_vec[dtype, W](
                grad, base + c
            )
        ).cast[acc]()
        var y = (
            load_shared[dtype, W](y_cache, c) if hit else load_vec[dtype, W](
                fwd_out, base + c
            )
        ).cast[acc]()
        var dx: SIMD[acc, W]
        comptime if LOG:
            dx = g - exp(y) * s
        else:
            dx = y * (g - s)
        store_vec[dtype, W](dst, base + c, dx.cast[dtype]())


# the block size bounds the registers ptxas may use (it spills rather than fail to launch)
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLOCK))
)
def softmax_backward_looped_kernel[
    dtype: DType, LOG: Bool, W: Int, BLOCK: Int
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    grad: Pointer[Scalar[dtype], MutAnyOrigin],
    fwd_out: Pointer[Scalar[dtype], MutAnyOrigin],
    cols: Int64,
    cached: Int64,
) where dtype.is_floating_point():
    """The backward for rows too long for registers: a sum pass that also caches the
    heads (`cached` elements each) of grad_output and output in shared memory, then
    the write pass. The launch gives it 2 * cached * size_of[dtype] bytes."""
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var red = stack_allocation[
        BLOCK // WARP_SIZE, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var g_cache = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16
    ]()
    var n = Int(cols)
    var head = Int(cached)
    # cached is a multiple of W: y_cache stays 16-byte aligned
    var y_cache = g_cache.unsafe_offset(head)
    var base = block_idx.x * n
    var part = dot_and_cache[dtype, LOG, W, BLOCK](
        grad, fwd_out, base, n, g_cache, y_cache, head
    )
    var s = group_reduce[acc, False, BLOCK](part, red)
    write_backward[dtype, LOG, W, BLOCK](
        dst, grad, fwd_out, base, n, g_cache, y_cache, head, s
    )


# --8<-- [start:forward_cluster]
# The launch picks the cluster size C (2, 4 or 8), the slice each CTA holds and
# BLOCK (512, or 1024 when a slice fills an SM's shared memory): see
# cluster_size_for in pytorch_custom_ops/softmax_family.py.
comptime CLUSTER_MAX_THREADS = 1024


# two @__llvm_metadata: the cluster shape becomes `.reqnctapercluster C, 1, 1` in
# the PTX; the declared 1024 threads (launched with BLOCK = 512, or 1024 when a CTA
# has its SM alone) cap ptxas at 64 registers per thread, so two CTAs can share an SM
@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](
        Int32(CLUSTER_MAX_THREADS)
    ),
    `nvvm.cluster_dim`=StaticTuple[Int32, 3](Int32(C), 1, 1),
)
def softmax_cluster_kernel[
    dtype: DType, LOG: Bool, W: Int, BLOCK: Int, C: Int
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    src: Pointer[Scalar[dtype], MutAnyOrigin],
    cols: Int64,
    slice_len: Int64,
) where dtype.is_floating_point():
    """A long row split over a cluster of C CTAs: the whole row stays on chip.

    CTA r of the cluster reads its slice, [r * slice_len, (r + 1) * slice_len),
    once into shared memory while folding its (max, sum) pair (the looped kernel's
    pass 1 with everything cached). It publishes the pair in shared memory; after a cluster
    barrier every warp reads the C pairs through distributed shared memory and
    merges them. Then each CTA writes its slice from shared memory: N bytes read,
    N written. Launch with grid_dim = rows * C, cluster_dim = C.
    """
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    comptime assert size_of[acc]() == 4, "DSMEM loads here are 32-bit"
    comptime assert C <= WARP_SIZE
    var red_m = stack_allocation[
        BLOCK // WARP_SIZE, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var red_s = stack_allocation[
        BLOCK // WARP_SIZE, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var pair = stack_allocation[
        2, Scalar[acc], address_space=AddressSpace.SHARED, alignment=8
    ]()  # this CTA's (max, sum), read by the whole cluster
    var cache = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16
    ]()
    var n = Int(cols)
    var rank = Int(block_rank_in_cluster())
    var lo = min(rank * Int(slice_len), n)
    var count = min(lo + Int(slice_len), n) - lo
    var base = (block_idx.x // C) * n + lo
    var m, s = fold_and_cache[dtype, W, BLOCK](src, base, count, cache, count)
    m, s = block_combine[acc, BLOCK](m, s, red_m, red_s)
    if thread_idx.x == 0:
        pair[unsafe_offset=0] = m
        pair[unsafe_offset=1] = s
    cluster_sync()  # release the pairs, and every CTA of the cluster has started
    var lane = lane_id()
    var peer = SIMD[acc, 2](Scalar[acc].MIN, 0)
    if lane < C:
        peer = load_cluster_smem[acc, 2](pair, UInt32(lane))
    m, s = warp_combine(peer[0], peer[1])
    # this CTA has read its peers; it may not exit (and free its shared memory)
    # before they have read it: arrive now, wait at the very end
    cluster_arrive()
    write_normalised[dtype, LOG, W, BLOCK](
        dst, src, base, count, cache, count, m, s
    )
    cluster_wait()


# --8<-- [end:forward_cluster]


@__llvm_metadata(
    MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](
        Int32(CLUSTER_MAX_THREADS)
    ),
    `nvvm.cluster_dim`=StaticTuple[Int32, 3](Int32(C), 1, 1),
)
def softmax_backward_cluster_kernel[
    dtype: DType, LOG: Bool, W: Int, BLOCK: Int, C: Int
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    grad: Pointer[Scalar[dtype], MutAnyOrigin],
    fwd_out: Pointer[Scalar[dtype], MutAnyOrigin],
    cols: Int64,
    slice_len: Int64,
) where dtype.is_floating_point():
    """The backward over a cluster: each CTA caches its slices of grad_output and
    output, the partial sums meet through distributed shared memory, then each CTA
    writes its slice of grad_input from shared memory (2N read, N written)."""
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    comptime assert size_of[acc]() == 4, "DSMEM loads here are 32-bit"
    comptime assert C <= WARP_SIZE
    var red = stack_allocation[
        BLOCK // WARP_SIZE, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var total = stack_allocation[
        1, Scalar[acc], address_space=AddressSpace.SHARED, alignment=4
    ]()  # this CTA's partial sum, read by the whole cluster
    var g_cache = external_memory[
        Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16
    ]()
    var n = Int(cols)
    var rank = Int(block_rank_in_cluster())
    var lo = min(rank * Int(slice_len), n)
    var count = min(lo + Int(slice_len), n) - lo
    # slice is a multiple of W: y_cache stays 16-byte aligned
    var y_cache = g_cache.unsafe_offset(Int(slice_len))
    var base = (block_idx.x // C) * n + lo
    var part = dot_and_cache[dtype, LOG, W, BLOCK](
        grad, fwd_out, base, count, g_cache, y_cache, count
    )
    var s = group_reduce[acc, False, BLOCK](part, red)
    if thread_idx.x == 0:
        total[unsafe_offset=0] = s
    cluster_sync()
    var lane = lane_id()
    var peer = Scalar[acc](0)
    if lane < C:
        peer = load_cluster_smem[acc, 1](total, UInt32(lane))[0]
    s = warp.sum(peer)
    cluster_arrive()  # see softmax_cluster_kernel
    write_backward[dtype, LOG, W, BLOCK](
        dst, grad, fwd_out, base, count, g_cache, y_cache, count, s
    )
    cluster_wait()


# --8<-- [start:cpu]
def softmax_rows_cpu[
    dtype: DType, LOG: Bool
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    src: Pointer[Scalar[dtype], MutAnyOrigin],
    rows: Int,
    cols: Int,
) where dtype.is_floating_point():
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    for r in range(rows):
        var base = r * cols
        var m, s = row_max_sum_cpu(src, base, cols)
        var log_s = log(s)
        for c in range(cols):
            var x = src[unsafe_offset=base + c].cast[acc]()
            var y: Scalar[acc]
            comptime if LOG:
                y = (x - m) - log_s
            else:
                y = exp(x - m) / s
            if not finite(m):
                y = nan_value[acc]()
            dst[unsafe_offset=base + c] = y.cast[dtype]()


def softmax_backward_rows_cpu[
    dtype: DType, LOG: Bool
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    grad: Pointer[Scalar[dtype], MutAnyOrigin],
    fwd_out: Pointer[Scalar[dtype], MutAnyOrigin],
    rows: Int,
    cols: Int,
) where dtype.is_floating_point():
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    for r in range(rows):
        var base = r * cols
        var s = Scalar[acc](0)
        for start in range(
            0, cols, CPU_CHUNK
        ):  # chunked, like the forward's sums
            var chunk = Scalar[acc](0)
            for c in range(start, min(start + CPU_CHUNK, cols)):
                var g = grad[unsafe_offset=base + c].cast[acc]()
                comptime if LOG:
                    chunk += g
                else:
                    chunk += g * fwd_out[unsafe_offset=base + c].cast[acc]()
            s += chunk
        for c in range(cols):
            var g = grad[unsafe_offset=base + c].cast[acc]()
            var y = fwd_out[unsafe_offset=base + c].cast[acc]()
            var dx: Scalar[acc]
            comptime if LOG:
                dx = g - exp(y) * s
            else:
                dx = y * (g - s)
            dst[unsafe_offset=base + c] = dx.cast[dtype]()


# --8<-- [end:cpu]


comptime GPU_LAUNCH_MOVED = (
    ": on a GPU this op is launched by pytorch_custom_ops (direct launch)"
)


def run_forward[
    target: StaticString, dtype: DType, LOG: Bool
](
    name: StaticString,
    output: OutputTensor[dtype=dtype, rank=2, ...],
    x: InputTensor[dtype=dtype, rank=2, ...],
    ctx: DeviceContext,
) raises:
    comptime assert (
        dtype.is_floating_point()
    ), "softmax family: float dtypes only"
    if output.shape() != x.shape():
        raise Error(
            name,
            ": output shape ",
            output.shape(),
            " != input shape ",
            x.shape(),
        )
    var rows = x.dim_size(0)
    var cols = x.dim_size(1)
    if rows == 0 or cols == 0:
        return
    var dst = output.unsafe_ptr()
    var src = x.unsafe_ptr()
    comptime if target == "gpu":
        raise Error(name, GPU_LAUNCH_MOVED)
    else:
        softmax_rows_cpu[dtype, LOG](dst, src, rows, cols)


def run_backward[
    target: StaticString, dtype: DType, LOG: Bool
](
    name: StaticString,
    grad_input: OutputTensor[dtype=dtype, rank=2, ...],
    grad_output: InputTensor[dtype=dtype, rank=2, ...],
    output: InputTensor[dtype=dtype, rank=2, ...],
    ctx: DeviceContext,
) raises:
    comptime assert (
        dtype.is_floating_point()
    ), "softmax family: float dtypes only"
    if (
        grad_input.shape() != grad_output.shape()
        or output.shape() != grad_output.shape()
    ):
        raise Error(
            name,
            ": shapes differ: grad_input ",
            grad_input.shape(),
            ", grad_output ",
            grad_output.shape(),
            ", output ",
            output.shape(),
        )
    var rows = grad_output.dim_size(0)
    var cols = grad_output.dim_size(1)
    if rows == 0 or cols == 0:
        return
    var dst = grad_input.unsafe_ptr()
    var g = grad_output.unsafe_ptr()
    var y = output.unsafe_ptr()
    comptime if target == "gpu":
        raise Error(name, GPU_LAUNCH_MOVED)
    else:
        softmax_backward_rows_cpu[dtype, LOG](dst, g, y, rows, cols)


@register("softmax")
struct Softmax:
    """Softmax over the last dim of a contiguous (rows, cols) tensor."""

    @staticmethod
    def execute[
        target: StaticString, dtype: DType
    ](
        output: OutputTensor[dtype=dtype, rank=2, ...],
        x: InputTensor[dtype=dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        run_forward[target, dtype, False]("softmax", output, x, ctx)


@register("log_softmax")
struct LogSoftmax:
    """Log-softmax over the last dim, computed as x - max - log(sum(exp(x - max))).
    """

    @staticmethod
    def execute[
        target: StaticString, dtype: DType
    ](
        output: OutputTensor[dtype=dtype, rank=2, ...],
        x: InputTensor[dtype=dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        run_forward[target, dtype, True]("log_softmax", output, x, ctx)


@register("softmax_backward")
struct SoftmaxBackward:
    """Softmax backward: grad_input = output * (grad_output - sum(grad_output * output)).
    """

    @staticmethod
    def execute[
        target: StaticString, dtype: DType
    ](
        grad_input: OutputTensor[dtype=dtype, rank=2, ...],
        grad_output: InputTensor[dtype=dtype, rank=2, ...],
        output: InputTensor[dtype=dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        run_backward[target, dtype, False](
            "softmax_backward", grad_input, grad_output, output, ctx
        )


@register("log_softmax_backward")
struct LogSoftmaxBackward:
    """Log-softmax backward: grad_input = grad_output - exp(output) * sum(grad_output).
    """

    @staticmethod
    def execute[
        target: StaticString, dtype: DType
    ](
        grad_input: OutputTensor[dtype=dtype, rank=2, ...],
        grad_output: InputTensor[dtype=dtype, rank=2, ...],
        output: InputTensor[dtype=dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        run_backward[target, dtype, True](
            "log_softmax_backward", grad_input, grad_output, output, ctx
        )
