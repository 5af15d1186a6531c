# Day 019, part 9: float32 GEMMs on tensor cores (3xTF32), the split.
#
# The H100's float32 SIMT peak is ~67 TFLOP/s; its tf32 tensor cores do ~495. tf32
# keeps float32's exponent but only 10 of its 23 mantissa bits, so one tf32 product is
# ~1e-3 off. Splitting each operand into two tf32 numbers, x = hi + lo with
# hi = tf32(x) and lo = tf32(x - hi), keeps ~21 bits, and
#     a b = hi_a hi_b + hi_a lo_b + lo_a hi_b (+ lo_a lo_b, ~2^-22 relative: dropped)
# costs three tf32 products: still ~2.5x float32's SIMT peak. Version 3's TMA kernel
# runs the three passes (gemm_v3_tma.mojo, float32); this kernel writes the planes it
# reads: (batch, 2, MN, K) float32, k-major (wgmma's tf32 form reads k-major tiles
# only), so it also transposes an operand stored the other way.

from max.gpu import barrier, block_idx, thread_idx
from std.memory import bitcast, stack_allocation
from std.sys._assembly import inlined_assembly

comptime SPLIT_TILE = 32  # a block's tile: 32 x 32 elements
comptime SPLIT_THREADS = 256  # 32 x 8: each thread moves 4 elements


@always_inline
def to_tf32(x: Float32) -> Float32:
    """x rounded to tf32 (10 mantissa bits, to nearest, ties away), as float32 bits.
    """
    var bits = inlined_assembly[
        "cvt.rna.tf32.f32 $0, $1;", UInt32, constraints="=r,f"
    ](x)
    return bitcast[DType.float32, 1](SIMD[DType.uint32, 1](bits))[0]


@always_inline
def store_split(
    planes: Pointer[Float32, MutAnyOrigin], at: Int, plane: Int, x: Float32
):
    """hi = tf32(x) at `at` in plane 0, lo = tf32(x - hi) one plane further."""
    var hi = to_tf32(x)
    planes[unsafe_offset=at] = hi
    planes[unsafe_offset=at + plane] = to_tf32(x - hi)  # x - hi is exact


# --8<-- [start:split]
def tf32_split_kernel[
    K_CONTIG: Bool
](
    planes: Pointer[Float32, MutAnyOrigin],
    src: Pointer[Float32, MutAnyOrigin],
    mn: Int64,
    k: Int64,
    kp: Int64,
    src_bs: Int64,
):
    """Launch with grid (ceil(K/32), ceil(MN/32), batch), 256 threads.

    Operand element (i, kk) (i < MN, kk < K) is src[bt*src_bs + i*K + kk] when
    K_CONTIG, else src[bt*src_bs + kk*MN + i]. It goes to planes[(2 bt + p) * MN * KP
    + i * KP + kk]: p = 0 its hi, p = 1 its lo. Rows are KP >= K long (KP % 4 == 0:
    the tensor maps need 16-byte rows); columns K..KP are not written (the maps stop
    at K, and TMA fills zeros beyond)."""
    var MN = Int(mn)
    var K = Int(k)
    var KP = Int(kp)
    var bt = block_idx.z
    var k0 = block_idx.x * SPLIT_TILE
    var i0 = block_idx.y * SPLIT_TILE
    var tx = thread_idx.x % SPLIT_TILE
    var ty = thread_idx.x // SPLIT_TILE
    var s = src.unsafe_offset(bt * Int(src_bs))
    var plane = MN * KP
    var out = planes.unsafe_offset(2 * bt * plane)
    comptime ROWS = SPLIT_THREADS // SPLIT_TILE  # 8 rows a pass
    comptime if K_CONTIG:  # rows of the tile run along k in memory: no transpose
        comptime for r in range(SPLIT_TILE // ROWS):
            var i = i0 + ty + r * ROWS
            var kk = k0 + tx
            if i < MN and kk < K:
                store_split(
                    out, i * KP + kk, plane, s[unsafe_offset=i * K + kk]
                )
    else:
        # read 32 k rows of 32 contiguous i, write 32 i rows of 32 k: through shared
        # memory, rows padded to 33 so the column reads hit 32 different banks
        var tile = stack_allocation[
            SPLIT_TILE * (SPLIT_TILE + 1),
            Float32,
            address_space=AddressSpace.SHARED,
        ]()
        comptime for r in range(SPLIT_TILE // ROWS):
            var kr = ty + r * ROWS
            var kk = k0 + kr
            var i = i0 + tx
            var v = Float32(0)
            if kk < K and i < MN:
                v = s[unsafe_offset=kk * MN + i]
            tile[unsafe_offset=kr * (SPLIT_TILE + 1) + tx] = v
        barrier()
        comptime for r in range(SPLIT_TILE // ROWS):
            var ir = ty + r * ROWS
            var i = i0 + ir
            var kk = k0 + tx
            if i < MN and kk < K:
                store_split(
                    out,
                    i * KP + kk,
                    plane,
                    tile[unsafe_offset=tx * (SPLIT_TILE + 1) + ir],
                )


# --8<-- [end:split]
