"""`permute_unbind(x, dims)`: `x.permute(dims).contiguous().unbind(0)`, whose gradient is
one pass of day 016's permute kernel over the pieces' gradients.

The attention's head split is such a call: the fused QKV projection's (b, s, 3, h, hd)
becomes q, k and v, each (b, h, s, hd). Written as `permute_copy(...).unbind(0)`, its
backward first stacks the three gradients into a new (3, b, h, s, hd) tensor (autograd's
backward of unbind) and then copies that into x's layout: two reads and two writes of
the whole gradient. Here the backward hands the three gradients to the kernel as three
sources, picked by the dim of x they came from, and writes x's gradient in one pass
(day 016, part ten: 14.5 + 16.5 us of copies at 32 x 128 x 1024 became one).

On CUDA with at most 3 pieces; elsewhere (the CPU, more pieces, a double backward) the
backward is the composition's, stack then permute_copy: the same values.
"""

from __future__ import annotations

from functools import cache

import torch

from . import eager, programs
from .contract import OpSpec, TensorArg, as_int_list
from .mojo_op import MojoOp
from .permute_copy import RANK, _gather_gpu, _inverse, _padded, _replayed, _split, check_permute_args, permute_copy

MAX_PIECES = 3  # the kernel's sources


@cache
def gather_kernel(perm5: tuple[int, ...], lead: int, pieces: int) -> MojoOp:
    """The gradient of permute_unbind for x padded to rank 5 by `lead` leading dims and
    permuted by `perm5` (permute_copy's rank-5 permutation), from `pieces` gradients, each
    viewed with `lead` leading dims of 1 (rank 4). Params: PICK, the dim of x5 that picks
    the piece; S0..S3, the piece dim whose stride each other dim of x5 takes (-1: none)."""
    inverse = _inverse(list(perm5) + [RANK - 1])  # y5 dim of each x5 dim
    pick = perm5[lead]  # y's dim 0, the pieces' dim
    # x5 dim p is y5 dim a; a > lead is dim a - lead - 1 of a piece, a - 1 of its rank-4 view
    strides_from = tuple(inverse[p] - 1 if inverse[p] > lead else -1 for p in range(RANK - 1))
    x_dims = [pieces if p == pick else 1 if p < lead else f"d{p}" for p in range(RANK)]
    piece_dims = tuple(1 if q < lead else f"d{perm5[q + 1]}" if q < RANK - 2 else f"d{RANK - 1}" for q in range(4))
    spec = OpSpec(
        name="permute_gather",
        outputs=(TensorArg("grad_x", tuple(x_dims)),),
        inputs=tuple(TensorArg(f"piece{i}", piece_dims) for i in range(pieces)),
        params={"PICK": pick, **{f"S{p}": s for p, s in enumerate(strides_from)}},
    )
    return MojoOp(spec, gpu=_gather_gpu)


def _forward(x, dims):
    return _replayed(x, dims).unbind(0)


def _setup_context(ctx, inputs, output):
    x, dims = inputs
    ctx.dims, ctx.x_shape = tuple(p % x.dim() for p in dims), x.shape


def _backward(ctx, *grads):
    dims = ctx.dims
    gathered = (
        len(grads) <= MAX_PIECES
        and all(g is not None and g.is_cuda for g in grads)
        and not torch.is_grad_enabled()  # a double backward needs the composition's graph
    )
    if not gathered:  # (autograd gives zeros, not None, for a piece nobody used)
        return permute_copy(torch.stack(grads), _inverse(dims)), None
    lead = RANK - len(dims)
    pieces = [programs.contiguous(g).view((1,) * lead + tuple(g.shape)) for g in grads]
    op = gather_kernel(_padded(dims), lead, len(grads))
    (dx,) = op(pieces, torch_impl=lambda: [torch.stack(grads).permute(_inverse(dims)).contiguous()])
    return dx.view(ctx.x_shape), None


# permute_copy's key: the same arguments
_forward_replayed = programs.replayed_forward("permute_unbind", _forward, _split, single=False)
_autograd = eager.function("PermuteUnbind", _forward_replayed, _setup_context, _backward, programs=True)


def _op(x, dims):
    return torch.ops.gpu_days.permute_copy(x, dims).unbind(0)


def permute_unbind(x: torch.Tensor, dims) -> tuple[torch.Tensor, ...]:
    """`x.permute(dims).contiguous().unbind(0)`: views of one new tensor, by day 016's Mojo
    kernel. `dims` must keep the last dim last; rank 1 to 5; float dtypes; differentiable,
    the gradient gathered from the pieces' in one pass (see the top of the file)."""
    dims = as_int_list(dims)  # a list of Python ints where it is one (range, numpy ints)
    check_permute_args("permute_unbind", x, dims)  # the eager paths' own checks say permute_copy
    return eager.call((x,), (x, dims), eager=_forward_replayed, autograd=_autograd, op=_op, check=_check_args)


def _check_args(x, dims) -> None:
    check_permute_args("permute_unbind", x, dims)
