"""Float32 master weights under autocast: their gradients written in float32 by the GEMM.

Mixed-precision training keeps float32 parameters and runs the matrix products in bf16.
Composed the usual way, a layer reads `weight.to(bf16)`; autograd then hands the layer's
bf16 gradient to that cast's backward, which converts it to float32 in a kernel of its
own. In day 020's GPT-2 124M step that was 98 conversion kernels (every weight and bias
of the linear layers and the output head), 0.6 ms of a 36.7 ms step on the H100.

Here the fused `linear` and `mlp` take the float32 parameters themselves into their
autograd functions (the bf16 copies they compute with are made outside autograd), and
their backwards return float32 gradients made in float32:

    dW = dH^T X    day 019's GEMM, whose epilogue stores the float32 accumulator itself
                   (F32_OUT, in version 4's cooperative tiles and version 3's 192 x 128;
                   split-K: the kernel that sums the pieces writes float32)
    db = dH^T 1    a column sum with float32 output (day 013's column sums, or cuBLAS
                   through torch.mm's out_dtype for few rows)

    (cast,), (master,) = cast_parameters(torch.bfloat16, x, weight)   # master: weight, or None

A caller that keeps gradients in a buffer of its own (day 020's FlatGrads, averaged across
ranks) names each parameter's slice with `write_grads_into`: dW is then written there, and
autograd makes that slice the .grad as it is, with no copy and no add.
"""

from __future__ import annotations

import weakref

import torch

from . import column_sums, direct, eager
from .contract import PLAIN_TENSORS, OpSpec, TensorArg
from .gemm import _alpha_beta, column_sum, column_sums_serve, gemm, ones_like_rows
from .gemm_gpu import (
    F32_AUTO_TILES,
    PINGPONG_KERNEL,
    PP_F32_CONFIGS,
    SPLIT_K_SUM_KERNEL,
    TC_DTYPES,
    TMA_F32_TILE,
    TMA_KERNEL,
    VERSIONS,
    auto_tile,
    current_version,
    pingpong_launch,
    sm_count,
    tma_launch,
)
from .mojo_op import MojoOp

# the forced versions that have a float32 form: version 4's cooperative tiles with an
# F32_OUT variant, split-K (whose sum kernel writes float32), split-K in a cluster and
# version 3's three-consumer tile (day 019, part 12)
_F32_KINDS = {("coop", bm, bn) for bm, bn, *_ in PP_F32_CONFIGS} | {
    VERSIONS["SPLITK_256x128"],
    VERSIONS["CLUSTER_SPLITK_128x128"],
    ("tma", *TMA_F32_TILE),
}


def wants_masters(x: torch.Tensor) -> bool:
    """A fused layer on x (already in the autocast dtype) may keep float32 masters:
    CUDA, 16-bit, grad mode on, not traced (torch.compile composes the layers)."""
    return (
        x.is_cuda
        and x.dtype in TC_DTYPES
        and torch.is_grad_enabled()
        and x.__class__ in PLAIN_TENSORS
        and not torch.compiler.is_compiling()
    )


def cast_parameters(low: torch.dtype, x: torch.Tensor, *params) -> tuple[list, list]:
    """(casts, masters) of a layer's parameters under autocast to `low`, x already cast:
    split_masters' where the layer may keep masters (wants_masters), else the usual casts
    (eager.cast_floats, inside autograd) and no masters."""
    if wants_masters(x):
        return split_masters(low, *params)
    return list(eager.cast_floats(low, *params)), [None] * len(params)


def split_masters(low: torch.dtype, *params):
    """(casts, masters): each parameter as the layer computes with it (in `low`), and
    the float32 master it stands for (None where autograd should see the cast as usual:
    not float32 or no gradient wanted). A master's cast is made outside autograd: the
    layer's backward returns the master's gradient itself."""
    casts, masters = [], []
    for p in params:
        if p is None or p.dtype == low or not p.is_floating_point():
            casts.append(p)
            masters.append(None)
        elif p.dtype == torch.float32 and p.requires_grad and p.__class__ in PLAIN_TENSORS:
            with torch.no_grad():
                casts.append(p.to(low))
            masters.append(p)
        else:
            casts.append(p.to(low))
            masters.append(None)
    return casts, masters


# -- dW in float32 --------------------------------------------------------------------------
WEIGHT_GRAD = OpSpec(
    name="weight_grad",
    outputs=(TensorArg("grad_weight", ("out_features", "in_features"), dtype=torch.float32),),
    inputs=(
        TensorArg("grad", ("rows", "out_features")),
        TensorArg("x", ("rows", "in_features")),
        TensorArg("alpha_beta", (2,), dtype=torch.float32),
    ),
)


def weight_grad_tile(m: int, n: int, k: int, device_index: int | None) -> tuple[str, int, int]:
    """AUTO's tile among those with a float32 form (a forced version of that set is
    kept; any other is not available in float32 and AUTO's choice runs instead)."""
    forced = VERSIONS[current_version()]
    if forced in _F32_KINDS:
        return forced
    return auto_tile(m, n, k, 1, sm_count(device_index), tiles=F32_AUTO_TILES, device_index=device_index)


@direct.plan(PINGPONG_KERNEL, SPLIT_K_SUM_KERNEL, TMA_KERNEL)
def weight_grad_gpu(outputs, inputs, params) -> list[direct.Launch]:
    (out,), (grad, x, alpha_beta) = outputs, inputs
    (k, m), n = grad.shape, x.shape[1]
    kind, bm, bn = weight_grad_tile(m, n, k, out.get_device())
    # grad (rows, out) and x (rows, in) are both read as stored: op(A) = grad^T, TRANSPOSE_A
    sizes = (m, n, k, 1, 0, 0, 0)
    if kind == "tma":  # one round of version 3's three-consumer tiles (F32_OUT)
        return tma_launch(grad, x, out, out, alpha_beta, sizes, True, False, bm, bn)
    return pingpong_launch(grad, x, out, out, alpha_beta, None, None, sizes, True, False, kind, bm, bn)


_weight_grad = MojoOp(WEIGHT_GRAD, gpu=weight_grad_gpu)


def weight_grad(grad: torch.Tensor, x: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """grad^T x in float32 for 2-D bf16/fp16 CUDA tensors (rows, out) and (rows, in),
    both contiguous, 16-byte aligned, widths multiples of 8 (the fused layers' promise),
    written into `into` when given (`grad_destination`'s: checked there), else a new tensor.
    Under create_graph (a double backward) it is the differentiable composition."""
    if torch.is_grad_enabled() and (grad.requires_grad or x.requires_grad):
        return gemm(grad, x, transpose_a=True).float()
    alpha_beta = _alpha_beta(1.0, 0.0, grad.device)
    if into is None:
        (dw,) = _weight_grad([grad, x, alpha_beta])
        return dw
    if into.shape != (grad.shape[1], x.shape[1]) or into.device != grad.device:
        raise ValueError(
            f"weight_grad: into is {tuple(into.shape)} on {into.device}, the product is "
            f"{grad.shape[1]}x{x.shape[1]} on {grad.device}"
        )
    with direct.planning():  # holds split-K's workspace until its launches are enqueued
        direct.run(weight_grad_gpu([into], [grad, x, alpha_beta], {}), grad.get_device())
    return into


# -- gradients written where the caller keeps them ------------------------------------------------
_destinations: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(param) -> (param, its slice)


def write_grads_into(param: torch.Tensor, view: torch.Tensor) -> None:
    """From now on a fused layer writes `param`'s float32 weight gradient into `view`
    whenever param.grad is None at that moment (backward then hands the view over as the
    .grad), instead of into a new tensor. `view`: float32, param's shape, contiguous,
    16-byte aligned, on param's device. Neither is kept alive by this."""
    if (
        view.dtype != torch.float32
        or view.shape != param.shape
        or not view.is_contiguous()
        or view.data_ptr() % 16
        or view.device != param.device
    ):
        raise ValueError(
            "write_grads_into: the view must be float32, contiguous, 16-byte aligned, with the "
            f"parameter's shape {tuple(param.shape)} and device {param.device}; got {view.dtype} "
            f"{tuple(view.shape)} at address % 16 = {view.data_ptr() % 16} on {view.device}"
        )
    _destinations[id(param)] = (weakref.ref(param), weakref.ref(view))


def grad_destination(master: torch.Tensor | None) -> torch.Tensor | None:
    """Where `master`'s gradient goes (write_grads_into), or None: none named, or .grad is
    already there (a second backward before the grads were used adds into it as usual)."""
    entry = None if master is None else _destinations.get(id(master))
    if entry is None or master.grad is not None:
        return None
    param, view = entry[0](), entry[1]()
    if param is not master or view is None:
        return None
    return view.view(view.shape)  # an alias nobody else holds: autograd adopts it as .grad


def bias_grad(grad: torch.Tensor) -> torch.Tensor:
    """grad.sum(0) in float32 for a 2-D bf16/fp16 CUDA grad, float32 accumulation as
    sum's: day 013's column sums with a float32 output where there are many rows, else
    cuBLAS's 1^T grad with a float32 output (torch.mm's out_dtype)."""
    if torch.is_grad_enabled() and grad.requires_grad:
        return column_sum(grad).float()
    if column_sums_serve(grad):
        return column_sums.column_sums(grad, float32=True)  # day 013's kernels (gemm.column_sum)
    ones = ones_like_rows(grad).view(1, -1)
    return torch.mm(ones, grad, out_dtype=torch.float32).view(-1)
