# Day 016, part seven: a permuted copy, for the attention's head split and merge.
#
# dst is a contiguous (n0, n1, n2, n3, d) tensor and
#     dst[i0, i1, i2, i3, e] = src[i0 s0 + i1 s1 + i2 s2 + i3 s3 + e]
# with the last dim contiguous in both: x.permute(dims).contiguous() for any dims
# that keep the last dim last. The attention's head split is one such copy
# ((b, s, 3, h, hd) -> (3, b, h, s, hd)) and the merge another ((b, h, s, hd) ->
# (b, s, h, hd)). torch's generic copy moved them at ~1.2 TB/s on the H100 (day
# 016's per-kernel profile); each row of d elements here moves as 16-byte vectors.

from extensibility import register, InputTensor, OutputTensor
from max.gpu import thread_idx, block_idx, grid_dim
from max.gpu.host import DeviceContext
from std.sys import size_of
from std.utils import IndexList

comptime PERMUTE_THREADS = 256
# vectors a thread moves, all loaded before any is stored (a store may alias a later
# load as far as the compiler knows, so a plain loop would wait on each load in turn)
comptime PERMUTE_UNROLL = 4
comptime PERMUTE_CHUNK = PERMUTE_THREADS * PERMUTE_UNROLL  # vectors a block moves


# --8<-- [start:gpu_kernel]
def permute_copy_kernel[
    dtype: DType, VW: Int
](
    dst: Pointer[Scalar[dtype], MutAnyOrigin],
    src0: Pointer[Scalar[dtype], MutAnyOrigin],
    src1: Pointer[Scalar[dtype], MutAnyOrigin],
    src2: Pointer[Scalar[dtype], MutAnyOrigin],
    n0: Int64,
    n1: Int64,
    n2: Int64,
    n3: Int64,
    d: Int64,
    s0: Int64,
    s1: Int64,
    s2: Int64,
    s3: Int64,
    pick: Int64,
):
    """Launch with grid (ceil(n2 n3 d / VW / PERMUTE_CHUNK), min(n1, 65535),
    min(n0, 65535)) and PERMUTE_THREADS threads. For each (i0, i1), dst's n2 x n3 x d
    elements are one contiguous run, and block x copies its PERMUTE_CHUNK vectors of VW
    elements (VW > 1: d and every stride are multiples of VW, all pointers 16-byte
    aligned; the launch plan checks, and that a run has < 2^31 vectors). So every block
    moves the same bytes, whether the rows are long (the heads' split: s x 64 per head)
    or short (the merge: heads x 64 per token).

    Three sources: index `pick` of (i0, i1, i2, i3) chooses src0, src1 or src2 (index 2
    and up: src2). One tensor passes itself three times; the gradient of a split into
    pieces (the heads' q, k, v, separate tensors) passes each piece and a stride 0 for
    the picking dim, and is gathered in one pass instead of stacked first (day 016,
    part ten)."""
    comptime ALIGN = VW * size_of[dtype]()
    var vecs = Int32(d) // Int32(VW)  # vectors per innermost row
    var per_row = Int32(n3) * vecs  # vectors per (i0, i1, i2)
    var run = Int(n2) * Int(per_row)  # vectors per (i0, i1)
    var first = block_idx.x * PERMUTE_CHUNK + thread_idx.x
    var sel = Int32(pick)
    for i0 in range(block_idx.z, Int(n0), grid_dim.z):
        for i1 in range(block_idx.y, Int(n1), grid_dim.y):
            var out_run = (i0 * Int(n1) + i1) * run * VW
            var in_run = i0 * Int(s0) + i1 * Int(s1)
            # the source, where i0 or i1 picks it (the same for the whole run)
            var outer = Int32(i0) if sel == 0 else Int32(i1)
            var vals = Array[SIMD[dtype, VW], PERMUTE_UNROLL](fill=0)
            comptime for u in range(PERMUTE_UNROLL):
                var j = first + u * PERMUTE_THREADS
                if j < run:
                    # 32-bit: the run's index splits with two cheap divisions
                    var i2 = Int32(j) // per_row
                    var k = Int32(j) - i2 * per_row
                    var i3 = k // vecs
                    var e = (k - i3 * vecs) * Int32(VW)
                    var which = outer if sel < 2 else (i2 if sel == 2 else i3)
                    var src = src0 if which == 0 else (
                        src1 if which == 1 else src2
                    )
                    vals[u] = src.unsafe_load[width=VW, alignment=ALIGN](
                        in_run + Int(i2) * Int(s2) + Int(i3) * Int(s3) + Int(e)
                    )
            comptime for u in range(PERMUTE_UNROLL):
                var j = first + u * PERMUTE_THREADS
                if j < run:
                    dst.unsafe_store[alignment=ALIGN](out_run + j * VW, vals[u])


# --8<-- [end:gpu_kernel]


@register("permute_copy")
struct PermuteCopy:
    """The permuted copy of a contiguous rank-5 x: x.permute(P0, P1, P2, P3, 4).
    """

    @staticmethod
    def execute[
        target: StaticString,
        dtype: DType,
        P0: Int,
        P1: Int,
        P2: Int,
        P3: Int,
    ](
        output: OutputTensor[dtype=dtype, rank=5, ...],
        x: InputTensor[dtype=dtype, rank=5, ...],
        ctx: DeviceContext,
    ) raises:
        var sizes = IndexList[5](
            x.dim_size(0),
            x.dim_size(1),
            x.dim_size(2),
            x.dim_size(3),
            x.dim_size(4),
        )
        var strides = IndexList[5](0, 0, 0, 0, 1)  # x's, contiguous
        comptime for i in range(3, -1, -1):
            strides[i] = strides[i + 1] * sizes[i + 1]
        var perm = IndexList[4](P0, P1, P2, P3)
        comptime for i in range(4):
            if output.dim_size(i) != sizes[perm[i]]:
                raise Error(
                    "permute_copy: output shape does not match the permutation"
                )
        if output.dim_size(4) != sizes[4]:
            raise Error("permute_copy: the last dim must stay last")
        comptime if target == "gpu":
            raise Error(
                "permute_copy: on a GPU this op is launched by"
                " pytorch_custom_ops (direct launch)"
            )
        else:
            var dst = output.unsafe_ptr()
            var src = x.unsafe_ptr()
            var d = sizes[4]
            var at = 0
            for i0 in range(output.dim_size(0)):
                for i1 in range(output.dim_size(1)):
                    for i2 in range(output.dim_size(2)):
                        for i3 in range(output.dim_size(3)):
                            var base = (
                                i0 * strides[P0]
                                + i1 * strides[P1]
                                + i2 * strides[P2]
                                + i3 * strides[P3]
                            )
                            for e in range(d):
                                dst[unsafe_offset=at] = src[
                                    unsafe_offset=base + e
                                ]
                                at += 1
