"""`mlp`: GPT-2's MLP as one torch function with its own backward, and `MojoMLP`, its module.

    y = gelu_tanh(x @ fc_weight.T + fc_bias) @ proj_weight.T + proj_bias

On CUDA in bfloat16/float16 (widths multiples of 8; unaligned operands are copied) it is
four launches of day 019's GEMM with fused epilogues, and no GELU kernel either way:

    forward   h = gelu(x W1^T + b1), and d =      one launch writes both (BIAS + GELU):
              gelu'(x W1^T + b1)                  the derivative, not the pre-activation
              y = h W2^T + b2                     b2 as a broadcast c
    backward  dpre = (dy W2) * d                  one launch: GELU_GRAD reads d as c
              dW2 = dy^T h, dW1 = dpre^T x, dx = dpre W1, and the two bias column sums

Day 019's part 23 moved the backward's epilogue to the product's idle producer warps.
AUTO has them multiply by the saved d where the GELU layer's rule holds (K <= 1024, two
rounds of tiles): 2-4% faster than the consumers on the H200. The other form saves pre,
and the warps compute gelu'(pre) themselves (FROM_PRE). It lost by more than its forward
gains, so only `gelu_on_epilogue_warps` asks for it.

Composed from `linear` and `F.gelu`, the same layer runs torch's GELU forward (read pre,
write h) and backward (read dh and pre, write dpre) as kernels of their own: about
2 ms of a GPT-2 124M training step on the H100 (day 020). Saving GELU's derivative
instead of its input leaves the backward's epilogue one multiply a value: with the
input, it recomputed the derivative (an exp and a reciprocal a value) while the tensor
cores waited, and lost to the separate kernel. The backward keeps d and h, as much as
the composition's autograd keeps (GELU's input, the second product's).

Everywhere else (the CPU, float32/float64, other widths, torch.compile tracing) it is
that composition, `linear(linear(x, W1, b1, "gelu_tanh"), W2, b2)`: the same results.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import torch

from . import direct, eager, programs
from .contract import OpSpec, TensorArg
from .gemm import MojoGEMM, _alpha_beta, column_sum, gemm
from .gemm_gpu import (
    PINGPONG_KERNEL,
    PP_EPI_WARPS_CONFIGS,
    TC_DTYPES,
    gelu_grad_on_epilogue_warps,
    pingpong_launch,
)
from .layer_norm import LN_SUM_PARTIALS
from .linear import _fused_forward, aligned16, check_linear_args, linear, linear_tile
from .master_weights import bias_grad, cast_parameters, grad_destination, weight_grad
from .mojo_op import MojoOp

# dpre = (dy @ W2) * d, d = gelu_tanh'(pre) saved by the forward: W2 is (out, hidden) as
# nn.Linear stores it, read in place. FROM_PRE: the forward saved pre itself, and the
# product's epilogue warps compute gelu_tanh'(pre) (day 019, part 23).
GELU_GRAD_PRODUCT = OpSpec(
    name="gelu_grad_product",
    outputs=(TensorArg("grad_pre", ("rows", "hidden")),),
    inputs=(
        TensorArg("grad", ("rows", "out_features")),
        TensorArg("weight", ("out_features", "hidden")),
        TensorArg("saved", ("rows", "hidden")),  # the derivative, or with FROM_PRE pre
        TensorArg("alpha_beta", (2,), dtype=torch.float32),
    ),
    params={"FROM_PRE": False},
)


def _with_sums(dtype: torch.dtype | None) -> OpSpec:
    """GELU_GRAD_PRODUCT that also returns grad_pre's column sums, fc's bias gradient, in
    `dtype` (None: the op's; float32 for a float32 master bias, master_weights.py)."""
    sums = TensorArg("grad_bias", ("hidden",), dtype)
    return replace(GELU_GRAD_PRODUCT, name="gelu_grad_product_sums", outputs=(*GELU_GRAD_PRODUCT.outputs, sums))


def _tile(m: int, n: int, k: int, device: int) -> tuple[str, int, int]:
    """The product's tile: the fused GELU layer's rule (its c over 192 columns a consumer
    spilled)."""
    return linear_tile(m, n, k, device, gelu=True)


def sums_fuse(grad: torch.Tensor, weight: torch.Tensor, from_pre: bool = False) -> bool:
    """The product's launch can also sum its columns: only the epilogue through shared
    memory and TMA stores does (days/day019/tma_store.mojo), and AUTO picks it here; the
    epilogue warps (`from_pre`) always do."""
    (m, k), n = grad.shape, weight.shape[1]
    return from_pre or _tile(m, n, k, grad.get_device())[0].endswith("_tma")


def saves_pre(x2: torch.Tensor, fc_weight: torch.Tensor, proj_weight: torch.Tensor) -> bool:
    """Whether the forward saves GELU's input rather than its derivative: where the
    backward's product takes the derivative on its epilogue warps (gemm_gpu's
    gelu_grad_on_epilogue_warps). The forward and its context both ask, under the same
    plan settings."""
    m, hidden, out = x2.shape[0], fc_weight.shape[0], proj_weight.shape[0]
    return gelu_grad_on_epilogue_warps(m, hidden, out, x2.dtype, x2.get_device())


# --8<-- [start:plan]
@direct.plan(PINGPONG_KERNEL, LN_SUM_PARTIALS)
def gelu_grad_product_gpu(outputs, inputs, params) -> list[direct.Launch]:
    (out, *sums), (grad, weight, saved, alpha_beta) = outputs, inputs
    (m, k), n = grad.shape, weight.shape[1]
    from_pre = params.get("FROM_PRE", False)
    # GELU's derivative from its input: the epilogue warps' tile (pingpong_launch checks)
    kind, bm, bn = ("coop_tma", *PP_EPI_WARPS_CONFIGS[0][:2]) if from_pre else _tile(m, n, k, out.get_device())
    # grad (M, K) is k-contiguous, weight (K, N) n-contiguous: neither transposed; the
    # derivative is c, full (rows of N), which the epilogue reads a pair (4 bytes) at a
    # time; pre, 16 bytes at a time (gelu_grad_tile)
    sizes = (m, n, k, 1, 0, n, 1)
    return pingpong_launch(
        grad,
        weight,
        out,
        saved,
        alpha_beta,
        None,
        None,
        sizes,
        False,
        False,
        kind,
        bm,
        bn,
        gelu_grad=True,
        column_sums=sums[0] if sums else None,  # only where sums_fuse: else pingpong_launch refuses
        epi_warps=True,  # where the rule (and the tile, and the derivative's rows) allow
        gelu_grad_pre=from_pre,
    )


# --8<-- [end:plan]
_gelu_grad_product = MojoOp(GELU_GRAD_PRODUCT, gpu=gelu_grad_product_gpu)
_gelu_grad_product_sums = {
    dtype: MojoOp(_with_sums(dtype), gpu=gelu_grad_product_gpu) for dtype in (None, torch.float32)
}


# -- the fused path ---------------------------------------------------------------------
def _project(h, proj_weight, proj_bias):
    """h W2^T + b2, the bias as gemm's broadcast c (MojoGEMM's way): at 16384 x 3072 -> 768
    on the H100 115 us against 122 with the BIAS epilogue (day 020)."""
    return gemm(h, proj_weight, proj_bias, 1.0, 0.0 if proj_bias is None else 1.0, False, True)


def _forward(x2, fc_weight, fc_bias, proj_weight, proj_bias, *_masters):
    """(y, h, d) for 2-D x2: h = gelu(pre), d = gelu'(pre) (or pre itself: `saves_pre`),
    y = h W2^T + b2, pre = x W1^T + b1. `_masters`: the float32 parameters the four stand
    for (master_weights.py), or Nones: inputs for autograd only."""
    derivative = not saves_pre(x2, fc_weight, proj_weight)
    h, d = _fused_forward(x2, fc_weight, fc_bias, "gelu_tanh", None, save_pre=True, derivative=derivative)
    return _project(h, proj_weight, proj_bias), h, d


def _forward_no_grad(x2, fc_weight, fc_bias, proj_weight, proj_bias):
    h, _ = _fused_forward(x2, fc_weight, fc_bias, "gelu_tanh", None, save_pre=False)
    return _project(h, proj_weight, proj_bias)


def _setup_context(ctx, inputs, output):
    x2, fc_weight, _fc_bias, proj_weight, _proj_bias = inputs[:5]
    _y, h, d = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(h, d)
    ctx.save_for_backward(x2, fc_weight, proj_weight, h, d)
    ctx.from_pre = saves_pre(x2, fc_weight, proj_weight)  # d is pre
    ctx.masters = inputs[5:9]  # parameters: where their gradients go may be named (grad_destination)


def _backward(ctx, g, _grad_h, _grad_d):
    if g is None:
        return (None,) * 9
    x2, fc_weight, proj_weight, h, d = ctx.saved_tensors
    # x, fc_weight, fc_bias, proj_weight, proj_bias, then the four parameters' float32
    # masters (master_weights.py): each parameter's gradient goes to one of its two slots
    need = ctx.needs_input_grad
    grads = [None] * 9

    def layer(dy, inp, w: int, b: int):  # a layer's weight and bias gradients (slots w, b)
        if need[w]:
            grads[w] = gemm(dy, inp, transpose_a=True)  # dy^T input: (out, rows) @ (rows, in)
        if need[w + 4]:
            grads[w + 4] = weight_grad(dy, inp, grad_destination(ctx.masters[w - 1]))  # the same, in float32
        if need[b] and grads[b] is None:  # False for a None bias
            grads[b] = column_sum(dy)
        if need[b + 4] and grads[b + 4] is None:
            grads[b + 4] = bias_grad(dy)

    g = aligned16(g)
    layer(g, h, 3, 4)
    if need[0] or any(need[i] for i in (1, 2, 5, 6)):
        args = [g, proj_weight, d, _alpha_beta(1.0, 0.0, g.device)]
        params = {"FROM_PRE": ctx.from_pre}
        # fc's bias gradient (slot 2, or 6: its float32 master) from the product's own
        # epilogue where it can: the product is not read again for it
        slot = 6 if need[6] else 2 if need[2] else None
        if slot is not None and sums_fuse(g, proj_weight, ctx.from_pre):
            op = _gelu_grad_product_sums[torch.float32 if slot == 6 else None]

            def impl():
                return _torch_product(*args[:3], slot == 6, ctx.from_pre)

            dpre, grads[slot] = op(args, torch_impl=impl, params=params)
        else:
            (dpre,) = _gelu_grad_product(args, params=params)
        if need[0]:
            grads[0] = gemm(dpre, fc_weight)  # (rows, hidden) @ (hidden, in)
        layer(dpre, x2, 1, 2)
    return tuple(grads)


def _torch_product(g, proj_weight, saved, float32_sums: bool, from_pre: bool) -> list[torch.Tensor]:
    """What _gelu_grad_product_sums computes, by torch (its fallback)."""
    dh = g @ proj_weight
    dpre = torch.ops.aten.gelu_backward(dh, saved, approximate="tanh") if from_pre else dh * saved
    sums = dpre.sum(0, dtype=torch.float32)
    return [dpre, sums if float32_sums else sums.to(dpre.dtype)]


# the key: the tensors given, and which are None (every other argument is a tensor)
_graded_replayed = programs.replayed_forward("mlp", _forward, programs.present, single=False)
_no_grad_replayed = programs.replayed_forward("mlp_y", _forward_no_grad, programs.present)
_fused_autograd = eager.function("FusedMLP", _graded_replayed, _setup_context, _backward, programs=True)


# -- public API -------------------------------------------------------------------------
def check_mlp_args(x, fc_weight, fc_bias, proj_weight, proj_bias) -> None:
    with _layer("the first layer (fc_weight, fc_bias)"):
        check_linear_args(x, fc_weight, fc_bias, None, None)
    if not isinstance(proj_weight, torch.Tensor):
        raise TypeError(f"mlp: 'proj_weight' must be a torch.Tensor, got {type(proj_weight).__name__}")
    if proj_weight.dim() != 2 or proj_weight.shape[1] != fc_weight.shape[0]:
        raise ValueError(
            f"mlp: proj_weight must be (out_features, {fc_weight.shape[0]}) to take fc's "
            f"{fc_weight.shape[0]} features, got shape {tuple(proj_weight.shape)}"
        )
    # the second layer's checks, on a stand-in for its input (one element, broadcast)
    hidden = x.new_empty(1).expand(*x.shape[:-1], fc_weight.shape[0])
    with _layer("the second layer (proj_weight, proj_bias)"):
        check_linear_args(hidden, proj_weight, proj_bias, None, None)


@contextlib.contextmanager
def _layer(which: str):
    """linear's messages say 'weight' and 'bias': name the mlp's layer they are about."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"mlp, {which}: {exc}") from None


def _fusable_mlp(x2, fc_weight, proj_weight) -> bool:
    """The fused path applies: CUDA, 16-bit floats, every width a multiple of 8 (16-byte
    rows), some rows. Alignment is not asked: unaligned operands are copied."""
    widths = (x2.shape[1], fc_weight.shape[0], proj_weight.shape[0])
    return x2.is_cuda and x2.dtype in TC_DTYPES and x2.shape[0] > 0 and all(w > 0 and w % 8 == 0 for w in widths)


def mlp(
    x: torch.Tensor,
    fc_weight: torch.Tensor,
    fc_bias: torch.Tensor | None,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor | None,
) -> torch.Tensor:
    """gelu_tanh(x @ fc_weight.T + fc_bias) @ proj_weight.T + proj_bias, weights as nn.Linear's."""
    low = eager.autocast_dtype(x)
    params = (fc_weight, fc_bias, proj_weight, proj_bias)
    masters = (None,) * 4
    if low is not None:  # matrix products: the autocast dtype, as F.linear (then checked)
        (x,) = eager.cast_floats(low, x)
        # float32 parameters may get float32 gradients from the kernels (master_weights.py)
        params, masters = cast_parameters(low, x, *params)
    fc_weight, fc_bias, proj_weight, proj_bias = params
    check_mlp_args(x, *params)
    way = eager.route(x, *params, *masters)
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # not -1: K may be 0
    if way is eager.OP or not _fusable_mlp(x2, fc_weight, proj_weight):
        # the composition from the float32 parameters: linear casts (and keeps masters) itself
        fc_weight, fc_bias, proj_weight, proj_bias = (
            p if m is None else m for p, m in zip(params, masters, strict=True)
        )
        return linear(linear(x, fc_weight, fc_bias, "gelu_tanh"), proj_weight, proj_bias)
    x2, fc_weight, fc_bias, proj_weight, proj_bias = map(aligned16, (x2, fc_weight, fc_bias, proj_weight, proj_bias))
    if way is eager.AUTOGRAD:
        y = _fused_autograd(x2, fc_weight, fc_bias, proj_weight, proj_bias, *masters)[0]
    else:
        y = _no_grad_replayed(x2, fc_weight, fc_bias, proj_weight, proj_bias)
    return y.view(*x.shape[:-1], proj_weight.shape[0])


class MojoMLP(torch.nn.Module):
    """GPT-2's MLP: `fc` (in -> hidden), tanh GELU, `proj` (hidden -> out), as `mlp`.
    The two layers are MojoGEMM modules (nn.Linear's parameters and initialisation)."""

    def __init__(
        self, in_features: int, hidden: int, out_features: int | None = None, bias=True, device=None, dtype=None
    ):
        super().__init__()
        out_features = in_features if out_features is None else out_features
        self.fc = MojoGEMM(in_features, hidden, bias, device=device, dtype=dtype)
        self.proj = MojoGEMM(hidden, out_features, bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mlp(x, self.fc.weight, self.fc.bias, self.proj.weight, self.proj.bias)
