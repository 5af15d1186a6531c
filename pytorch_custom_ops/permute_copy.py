"""`permute_copy(x, dims)`: `x.permute(dims).contiguous()` by day 016's Mojo kernel, for
permutations that keep the last dim last (rank 1 to 5).

A model's attention splits its fused QKV projection into heads and merges them back:

    q, k, v = permute_copy(qkv.view(b, s, 3, h, hd), (2, 0, 3, 1, 4))   # (3, b, h, s, hd)
    o = permute_copy(o.view(b, h, s, hd), (0, 2, 1, 3)).view(b, s, h * hd)

torch's generic copy kernel moves such permutations at ~1.2 TB/s on the H100 (day 016's
per-kernel profile of the GPT block); this kernel moves each row of the last dim as
16-byte vectors. The gradient is the inverse permutation, by the same kernel, written in
x's own layout, so a `view` before the copy costs nothing in backward either. A
non-contiguous `x` is made contiguous first (one copy more).
"""

from __future__ import annotations

from functools import cache

import torch

from . import direct, eager, programs
from .contract import FLOAT_DTYPES, OpSpec, TensorArg, as_int_list, check_float_tensor
from .gpu_kernels import KernelFamily
from .mojo_op import MojoOp

RANK = 5  # the kernel's rank: smaller tensors get leading dims of 1
THREADS = 256  # PERMUTE_THREADS in days/day016/permute_copy.mojo
CHUNK = THREADS * 4  # PERMUTE_CHUNK there: the vectors one block moves
MAX_GRID_YZ = 65535  # the kernel loops over the rest

# --8<-- [start:gpu_plan]
PERMUTE_COPY_KERNEL = KernelFamily(
    "days.day016.permute_copy",
    "permute_copy_kernel",
    # dst, src0, src1, src2, n0, n1, n2, n3, d, s0, s1, s2, s3, pick
    args=("ptr",) * 4 + ("i64",) * 10,
    variants=tuple((dtype, vw) for dtype in FLOAT_DTYPES for vw in sorted({1, 16 // dtype.itemsize})),
)


def _launch(out: torch.Tensor, sources: list[torch.Tensor], strides: tuple, pick: int) -> direct.Launch:
    """For each (i0, i1) the output's n2 x n3 x d elements are one contiguous run; a block
    copies CHUNK vectors of it: grid (ceil(run / CHUNK), n1, n0), capped at 65535 in y and
    z (the kernel loops over the rest). 16-byte vectors where the last dim, every stride
    and every address allow them. `sources`: one tensor, or up to three pieces that dim
    `pick` of the output chooses from (its stride then 0)."""
    n0, n1, n2, n3, d = out.shape
    x = sources[0]
    vw = 16 // x.element_size()
    aligned = out.data_ptr() % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in sources)
    if not (aligned and d % vw == 0 and all(s % vw == 0 for s in strides)):
        vw = 1
    run = n2 * n3 * (d // vw)
    if run >= 2**31:  # the kernel splits a run's index in 32 bits
        raise ValueError(f"permute_copy: {n2} x {n3} x {d} elements are too many for one run of the kernel")
    grid = (-(-run // CHUNK), min(n1, MAX_GRID_YZ), min(n0, MAX_GRID_YZ))
    src = [t.data_ptr() for t in sources]
    src += src[-1:] * (3 - len(src))  # the kernel's unused sources: never picked
    args = (out.data_ptr(), *src, n0, n1, n2, n3, d, *strides, pick)
    return direct.Launch(PERMUTE_COPY_KERNEL[x.dtype, vw], grid, THREADS, args)


@direct.plan(PERMUTE_COPY_KERNEL)
def _permute_copy_gpu(outputs, inputs, params) -> list[direct.Launch]:
    (out,), (x,) = outputs, inputs
    perm = (params["P0"], params["P1"], params["P2"], params["P3"])
    return [_launch(out, [x], tuple(x.stride(p) for p in perm), 0)]


@direct.plan(PERMUTE_COPY_KERNEL)
def _gather_gpu(outputs, inputs, params) -> list[direct.Launch]:
    """x's gradient from the gradients of permute_unbind's pieces (each contiguous): dim
    PICK of x (the one the pieces came from) chooses the piece, and every other dim of x
    is a dim of the pieces, at its stride there."""
    (out,), pieces = outputs, inputs
    # params (permute_unbind.gather_kernel): PICK, and S0..S3, the piece dim each dim of x
    # takes its stride from (-1: the picking dim, or a leading 1)
    strides = tuple(0 if s < 0 else pieces[0].stride(s) for s in (params[f"S{p}"] for p in range(4)))
    return [_launch(out, list(pieces), strides, params["PICK"])]


# --8<-- [end:gpu_plan]
@cache
def permute_copy_kernel(perm: tuple[int, int, int, int]) -> MojoOp:
    """The op for one permutation of a contiguous rank-5 tensor's first four dims."""
    dims = tuple(f"d{i}" for i in range(RANK))
    spec = OpSpec(
        name="permute_copy",
        outputs=(TensorArg("output", (*(dims[p] for p in perm), dims[4])),),
        inputs=(TensorArg("x", dims),),
        params={f"P{i}": p for i, p in enumerate(perm)},
    )
    return MojoOp(spec, gpu=_permute_copy_gpu)


def check_permute_args(name: str, x, dims) -> tuple[int, ...]:
    """Validate like torch's permute, with messages that name the op; dims as ints >= 0."""
    check_float_tensor(name, x)
    rank = x.dim()
    if not 1 <= rank <= RANK:
        raise ValueError(f"{name}: 'x' must have rank 1 to {RANK}, got shape {tuple(x.shape)}")
    if not isinstance(dims, (tuple, list)) or not all(isinstance(p, int) and not isinstance(p, bool) for p in dims):
        raise TypeError(f"{name}: dims must be a sequence of ints, got {dims!r}")
    if len(dims) != rank:
        raise ValueError(f"{name}: dims {tuple(dims)} has {len(dims)} entries for a tensor of rank {rank}")
    if any(not -rank <= p < rank for p in dims):
        raise IndexError(f"{name}: dims {tuple(dims)} are out of range for a tensor of rank {rank}")
    norm = tuple(p % rank for p in dims)
    if sorted(norm) != list(range(rank)):
        raise ValueError(f"{name}: dims {tuple(dims)} is not a permutation of 0..{rank - 1}")
    if norm[-1] != rank - 1:
        raise ValueError(f"{name}: the last dim must stay last (dims {tuple(dims)}); use .permute(...).contiguous()")
    return norm


def _padded(dims: tuple[int, ...]) -> tuple[int, int, int, int]:
    """A rank-r permutation as one of the kernel's rank 5 (leading dims of 1 stay put)."""
    lead = RANK - len(dims)
    return tuple(range(lead)) + tuple(p + lead for p in dims[:-1])


def _permute_copy_eager(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    norm = check_permute_args("permute_copy", x, dims)
    shape = tuple(x.shape[p] for p in norm)
    if norm == tuple(range(x.dim())) and x.is_contiguous():
        return x.clone()  # nothing to permute (a fresh tensor, as the op promises)
    perm = _padded(norm)
    x5 = programs.contiguous(x).view((1,) * (RANK - x.dim()) + tuple(x.shape))
    (out,) = permute_copy_kernel(perm)([x5], torch_impl=lambda: [x5.permute(*perm, 4).contiguous()])
    return out.view(shape)


_op = torch.library.custom_op("gpu_days::permute_copy", _permute_copy_eager, mutates_args=())


@_op.register_fake
def _(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    norm = check_permute_args("permute_copy", x, dims)
    return x.new_empty([x.shape[p] for p in norm])


def _inverse(dims) -> tuple[int, ...]:
    inverse = [0] * len(dims)
    for i, p in enumerate(dims):
        inverse[p % len(dims)] = i
    return tuple(inverse)


def _setup_context(ctx, inputs, output):
    # a tuple, not a list: the C++ node and the backward's program take only plain
    # (hashable) attributes; a list sent every grad-mode call through Python (34.5 us
    # against torch's 21.9 on the H100)
    ctx.inverse = _inverse(inputs[1])


def _backward(ctx, grad):
    return permute_copy(grad, ctx.inverse), None


def _split(x, dims):
    """The key of a call (x, dims): dims as a tuple, with each entry's type (a replay skips
    the checks, and True must not find the program of 1)."""
    return [x], tuple((p, p.__class__) for p in dims) if isinstance(dims, (tuple, list)) else dims


_op.register_autograd(_backward, setup_context=_setup_context)
# replayed from C++ where it can be (programs.py): a Python call cost ~19 us of host time
# against torch's permute + copy's ~11, and the eager block lost 0.1-0.2 ms a step by it
_replayed = programs.replayed_forward("permute_copy", _permute_copy_eager, _split)
_autograd = eager.function("PermuteCopy", _replayed, _setup_context, _backward, programs=True)


def permute_copy(x: torch.Tensor, dims) -> torch.Tensor:
    """`x.permute(dims).contiguous()` (a new tensor, always), by day 016's Mojo kernel.
    `dims` must keep the last dim last; rank 1 to 5; float dtypes; differentiable."""
    dims = as_int_list(dims)  # a list of Python ints where it is one (range, numpy ints)
    return eager.call(
        (x,), (x, dims), eager=_replayed, autograd=_autograd, op=torch.ops.gpu_days.permute_copy, check=_check
    )


def _check(x, dims) -> None:
    check_permute_args("permute_copy", x, dims)
