# Day 009: online softmax as a MAX custom op.
#
# One pass over the row keeps a running max `m` and a running sum `s` of
# exp(x - m); when a bigger value arrives the sum is rescaled by exp(m_old - m_new).
# Partial (m, s) pairs from different threads combine with the same identity, so
# the GPU path gives each row one block, lets every thread scan a strided slice,
# then merges the pairs with warp shuffles and one round through shared memory.
# A second pass writes exp(x - m) / s. Inputs of any float dtype; the math runs
# in float32 (float64 for float64 inputs).

from extensibility import register, InputTensor, OutputTensor
from max.gpu import thread_idx, block_idx, barrier, WARP_SIZE, lane_id, warp_id
from max.gpu.primitives import warp
from max.gpu.host import DeviceContext
from std.memory import stack_allocation

# float64 to 1 ulp (Mojo 1.2's own exp is ~3e-13 off); std.math.exp for the rest
from days.day009.exp_f64 import exp


def accum_dtype[dtype: DType]() -> DType:
    """Accumulate in float64 for float64 inputs, float32 for everything else."""
    return DType.float64 if dtype == DType.float64 else DType.float32


# --8<-- [start:combine]
@always_inline
def rescale[
    acc: DType
](m_old: Scalar[acc], m_new: Scalar[acc]) -> Scalar[
    acc
] where acc.is_floating_point():
    """Return exp(m_old - m_new), or 0 when m_old is -inf.

    An empty or fully masked partial has m = -inf; the plain formula would
    give exp(-inf - -inf) = exp(nan) there.
    """
    if m_old == Scalar[acc].MIN:
        return 0
    return exp(m_old - m_new)


@always_inline
def combine[
    acc: DType
](
    m_a: Scalar[acc], s_a: Scalar[acc], m_b: Scalar[acc], s_b: Scalar[acc]
) -> Tuple[Scalar[acc], Scalar[acc]] where acc.is_floating_point():
    """Merge two (running max, running sum) pairs into one."""
    if m_a != m_a or m_b != m_b:  # NaN stays NaN: Mojo's max() would drop it
        return (m_a + m_b, s_a + s_b)
    var m = max(m_a, m_b)
    return (m, s_a * rescale(m_a, m) + s_b * rescale(m_b, m))


@always_inline
def finite[acc: DType](m: Scalar[acc]) -> Bool:
    """False for a row max of -inf (fully masked row), +inf or NaN: torch's softmax
    gives a NaN row there, while exp() here maps NaN to inf (Mojo 1.2), so such rows
    are written as NaN explicitly."""
    return m > Scalar[acc].MIN and m < Scalar[acc].MAX


@always_inline
def nan_value[acc: DType]() -> Scalar[acc] where acc.is_floating_point():
    return Scalar[acc].MIN - Scalar[acc].MIN  # -inf - -inf


# --8<-- [end:combine]


# --8<-- [start:block_combine]
@always_inline
def warp_combine[
    acc: DType
](m_in: Scalar[acc], s_in: Scalar[acc]) -> Tuple[
    Scalar[acc], Scalar[acc]
] where acc.is_floating_point():
    """Butterfly over the 32 lanes: every lane ends with the warp's merged pair.
    """
    var m = m_in
    var s = s_in
    comptime for k in range(5):
        var m_other = warp.shuffle_xor(m, UInt32(1 << k))
        var s_other = warp.shuffle_xor(s, UInt32(1 << k))
        m, s = combine(m, s, m_other, s_other)
    return (m, s)


@always_inline
def block_combine[
    acc: DType, BLOCK: Int
](
    m_in: Scalar[acc],
    s_in: Scalar[acc],
    red_m: Pointer[
        Scalar[acc], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
    red_s: Pointer[
        Scalar[acc], MutUntrackedOrigin, address_space=AddressSpace.SHARED
    ],
) -> Tuple[Scalar[acc], Scalar[acc]] where acc.is_floating_point():
    """Merge every thread's (max, sum) pair; all BLOCK threads get the block's pair.

    Warps merge by butterfly shuffles (every lane ends with its warp's pair), then
    each warp's pair goes through shared memory (`red_m`/`red_s`, BLOCK // 32 slots).
    """
    comptime NW = BLOCK // WARP_SIZE
    var m, s = warp_combine(m_in, s_in)
    comptime if NW > 1:
        if lane_id() == 0:
            red_m[unsafe_offset=warp_id()] = m
            red_s[unsafe_offset=warp_id()] = s
        barrier()
        # every warp merges the NW pairs with the same butterfly (log2(32) steps
        # instead of NW - 1 serial combines, each with two exp())
        var lane = lane_id()
        m = red_m[unsafe_offset=lane] if lane < NW else Scalar[acc].MIN
        s = red_s[unsafe_offset=lane] if lane < NW else Scalar[acc](0)
        m, s = warp_combine(m, s)
    return (m, s)


# --8<-- [end:block_combine]


# --8<-- [start:gpu_kernel]
def online_softmax_kernel[
    dtype: DType, BLOCK: Int
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    src: Pointer[Scalar[dtype], MutAnyOrigin],
    cols: Int64,
) where dtype.is_floating_point():
    """One block per row. Launch with grid_dim=rows, block_dim=BLOCK."""
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    comptime NW = BLOCK // WARP_SIZE
    var red_m = stack_allocation[
        NW, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var red_s = stack_allocation[
        NW, Scalar[acc], address_space=AddressSpace.SHARED
    ]()
    var n = Int(cols)
    var base = block_idx.x * n

    # 1. each thread: one pass over its strided slice of the row
    var m = Scalar[acc].MIN
    var s = Scalar[acc](0)
    for c in range(thread_idx.x, n, BLOCK):
        var x = src[unsafe_offset=base + c].cast[acc]()
        m, s = combine(m, s, x, Scalar[acc](1))

    # 2. merge the pairs: warp shuffles, then one round through shared memory
    m, s = block_combine[acc, BLOCK](m, s, red_m, red_s)

    # 4. second pass: normalise
    var inv = 1 / s if finite(m) else nan_value[acc]()  # NaN row
    for c in range(thread_idx.x, n, BLOCK):
        var x = src[unsafe_offset=base + c].cast[acc]()
        dst[unsafe_offset=base + c] = (exp(x - m) * inv).cast[dtype]()


# --8<-- [end:gpu_kernel]


# --8<-- [start:cpu_row]
comptime CPU_CHUNK = 256


def row_max_sum_cpu[
    dtype: DType
](src: Pointer[Scalar[dtype], MutAnyOrigin], base: Int, n: Int) -> Tuple[
    Scalar[accum_dtype[dtype]()], Scalar[accum_dtype[dtype]()]
] where dtype.is_floating_point():
    """The (max, sum of exp(x - max)) pair of one row on the CPU. Chunks play the part
    of GPU threads: summing a long row straight through in float32 drifts (6.6e-5
    relative error at n = 70000), while per-chunk partials merged with `combine`
    stay near float32 rounding."""
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var m = Scalar[acc].MIN
    var s = Scalar[acc](0)
    for start in range(0, n, CPU_CHUNK):
        var chunk_m = Scalar[acc].MIN
        var chunk_s = Scalar[acc](0)
        for c in range(start, min(start + CPU_CHUNK, n)):
            chunk_m, chunk_s = combine(
                chunk_m,
                chunk_s,
                src[unsafe_offset=base + c].cast[acc](),
                Scalar[acc](1),
            )
        m, s = combine(m, s, chunk_m, chunk_s)
    return (m, s)


def online_softmax_row_cpu[
    dtype: DType
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    src: Pointer[Scalar[dtype], MutAnyOrigin],
    base: Int,
    n: Int,
) where dtype.is_floating_point():
    """One row on the CPU: the row's (max, sum) pair, then normalise."""
    comptime acc = accum_dtype[dtype]()
    comptime assert acc.is_floating_point()
    var m, s = row_max_sum_cpu(src, base, n)
    var inv = 1 / s if finite(m) else nan_value[acc]()  # NaN row
    for c in range(n):
        var x = src[unsafe_offset=base + c].cast[acc]()
        dst[unsafe_offset=base + c] = (exp(x - m) * inv).cast[dtype]()


# --8<-- [end:cpu_row]


@register("online_softmax")
struct OnlineSoftmax:
    """Softmax over the last dim of a contiguous (rows, cols) tensor."""

    @staticmethod
    def execute[
        target: StaticString,
        dtype: DType,
        BLOCK: Int,
    ](
        output: OutputTensor[dtype=dtype, rank=2, ...],
        x: InputTensor[dtype=dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert (
            dtype.is_floating_point()
        ), "online_softmax: float dtypes only"
        comptime assert (
            BLOCK % 32 == 0 and 32 <= BLOCK and BLOCK <= 1024
        ), "online_softmax: BLOCK must be a multiple of 32 in [32, 1024]"
        if output.shape() != x.shape():
            raise Error(
                "online_softmax: output shape ",
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
            # since day016 pytorch_custom_ops launches online_softmax_kernel itself, on
            # torch's stream (its launch plan in pytorch_custom_ops/softmax.py)
            raise Error(
                "online_softmax: on a GPU this op is launched by"
                " pytorch_custom_ops (direct launch)"
            )
        else:
            for r in range(rows):
                online_softmax_row_cpu(dst, src, r * cols, cols)
