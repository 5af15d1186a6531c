"""Day 017: FlashAttention (Triton) as a torch op with autograd.

    o = pco.flash_attention(q, k, v, causal=True)        # like F.scaled_dot_product_attention
    o = torch.ops.gpu_days.flash_attention(q, k, v, True, None)

q is (batch, heads, Lq, head_dim), k and v (batch, kv_heads, Lk, head_dim); heads a multiple of
kv_heads (grouped-query attention). float16 or bfloat16, head_dim 32, 64, 128 or 256, any lengths.
`causal` masks as SDPA's `is_causal` does (query i sees keys j <= i), `scale` defaults to
1/sqrt(head_dim). The kernels live in days/day017/flash_attention.py and are imported on first
use (they import Triton); they launch on torch's current stream, so CUDA graphs capture them.

Two ops are registered: `gpu_days::flash_attention` returns (out, lse) and saves what the backward
needs; `gpu_days::flash_attention_backward` computes (dq, dk, dv). Both have fake (meta)
implementations, so `torch.compile(fullgraph=True)` traces them without running Triton.
Outputs and gradients are laid out as their inputs are, as SDPA's: q made by
`x.view(B, L, H, D).transpose(1, 2)` gives an out whose `transpose(1, 2).reshape(B, L, H * D)`
is a view.

    o = pco.flash_attention_qkvpacked(qkv, causal=True)   # qkv (B, L, 3, H, D) -> o (B, L, H, D)

takes a transformer's fused QKV projection as it comes, `qkv_proj(x).view(B, L, 3, H, D)`:
the kernels read q, k and v in place through strides and write the gradient as one
(B, L, 3, H, D) tensor, so neither direction copies (the three-tensor op's autograd has to
stack dq, dk, dv and lay them out again: two copies of the activations per layer).
Eager calls skip the dispatcher, as every gpu-days op does (pytorch_custom_ops/eager.py).
(cProfile of a training step on the H100 put ~0.7 ms a call inside torch.library's
custom-op frame; the step time did not change measurably without it, so that time was
the profiler's attribution of launch time, not the dispatcher's.)
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from . import eager

_DAY = "days.day017.flash_attention"


def _day():
    # Imported on first use: it imports Triton (and sets TRITON_INTERPRET=1 without CUDA).
    return importlib.import_module(_DAY)


@torch.library.custom_op("gpu_days::flash_attention", mutates_args=())
def _flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None) -> tuple[Tensor, Tensor]:
    return _day().attention_forward(q, k, v, causal, scale)


def attention_outputs_like(q: Tensor) -> tuple[Tensor, Tensor]:
    """Empty (out, lse) of an attention forward, for the fake implementations (day 017's
    and day 018's ops): out like q, lse float32 (batch, heads, Lq)."""
    b, h, lq, d = q.shape
    return q.new_empty((b, h, lq, d)), q.new_empty((b, h, lq), dtype=torch.float32)


@_flash_attention.register_fake
def _(q, k, v, causal, scale):
    _day().check_inputs(q, k, v, causal, scale)
    _, lse = attention_outputs_like(q)
    return _day().empty_in_layout_of(q), lse  # the real op's strides: compiled code reads through them


@torch.library.custom_op("gpu_days::flash_attention_backward", mutates_args=())
def _flash_attention_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    return _day().attention_backward(grad_out, q, k, v, out, lse, causal, scale)


@_flash_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, causal, scale):
    _day().check_inputs(q, k, v, causal, scale)
    return tuple(_day().empty_in_layout_of(t) for t in (q, k, v))


def setup_attention_context(ctx, inputs, output):
    """Save what every attention backward reads (day 017's and day 018's ops, and the packed
    one): the tensor inputs (q, k, v, or qkv), then out and lse."""
    *tensors, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(*tensors, out, lse)
    ctx.inputs = len(tensors)
    ctx.causal, ctx.scale = causal, scale
    ctx.set_materialize_grads(False)  # no zero-filled gradient for lse (backwards take grad_out None)
    ctx.mark_non_differentiable(lse)


def attention_backward_with(run, op: str):
    """The autograd backward of an op saved by `setup_attention_context`:
    `run(grad_out, *tensor inputs, out, lse, causal, scale)` computes the gradients of the
    tensor inputs ((dq, dk, dv), or d(qkv) for the packed op). No double backward."""

    def backward(ctx, grad_out, _grad_lse):
        if grad_out is None:  # only lse got a gradient, and lse is not differentiable
            return (None,) * (ctx.inputs + 2)
        eager.refuse_double_backward(op)
        grads = run(grad_out, *ctx.saved_tensors, ctx.causal, ctx.scale)
        return (*((grads,) if isinstance(grads, Tensor) else grads), None, None)

    return backward


def _forward_eager(q, k, v, causal, scale):
    return _day().attention_forward(q, k, v, causal, scale)


_backward = attention_backward_with(torch.ops.gpu_days.flash_attention_backward, "flash_attention")
_backward_eager = attention_backward_with(lambda *args: _day().attention_backward(*args), "flash_attention")


_flash_attention.register_autograd(_backward, setup_context=setup_attention_context)
_autograd = eager.function("FlashAttention", _forward_eager, setup_attention_context, _backward_eager)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None) -> Tensor:
    """softmax(q @ k^T * scale [+ causal mask]) @ v by day017's Triton FlashAttention kernels,
    differentiable (dq, dk, dv by the Triton backward). Same layout and causal convention as
    `torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
    enable_gqa=True)`."""
    args = (q, k, v, causal, scale)
    return eager.call((q, k, v), args, eager=_forward_eager, autograd=_autograd, op=_op, check=_check)[0]


def _op(*args):
    return torch.ops.gpu_days.flash_attention(*args)


def _check(q, k, v, causal, scale):
    if not torch.compiler.is_compiling():  # our message before the dispatcher's schema error
        _day().check_inputs(q, k, v, causal, scale)


# -- packed q, k, v -------------------------------------------------------------------------
# --8<-- [start:qkvpacked]
def unpack_qkv(qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as (B, H, L, D) views of a (B, L, 3, H, D) tensor: no copy."""
    return tuple(qkv.select(2, i).transpose(1, 2) for i in range(3))


def check_qkvpacked(qkv, causal, scale) -> None:
    """Raise TypeError/ValueError naming the problem (the packing, then day 017's checks)."""
    _check_packing(qkv)
    _day().check_inputs(*unpack_qkv(qkv), causal, scale)


def _check_packing(qkv) -> None:
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"flash_attention_qkvpacked: qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(
            f"flash_attention_qkvpacked: qkv must be (batch, seq, 3, heads, head_dim), got shape {tuple(qkv.shape)}"
        )


@torch.library.custom_op("gpu_days::flash_attention_qkvpacked", mutates_args=())
def _qkvpacked(qkv: Tensor, causal: bool, scale: float | None) -> tuple[Tensor, Tensor]:
    return _packed_forward(qkv, causal, scale)


def _packed_forward(qkv, causal, scale):
    """(out (B, L, H, D), lse (B, H, L) float32). attention_forward checks q, k and v."""
    _check_packing(qkv)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    o, lse = _day().attention_forward(*unpack_qkv(qkv), causal, scale)
    return o.transpose(1, 2), lse  # o follows q's (B, L, H, D) layout: this is contiguous


@_qkvpacked.register_fake
def _(qkv, causal, scale):
    check_qkvpacked(qkv, causal, scale)
    b, length, _, h, d = qkv.shape
    return qkv.new_empty((b, length, h, d)), qkv.new_empty((b, h, length), dtype=torch.float32)


@torch.library.custom_op("gpu_days::flash_attention_qkvpacked_backward", mutates_args=())
def _qkvpacked_backward(
    grad_out: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float | None
) -> Tensor:
    return _packed_backward(grad_out, qkv, out, lse, causal, scale)


def _packed_backward(grad_out, qkv, out, lse, causal, scale):
    """d(qkv), (B, L, 3, H, D) contiguous: the three gradients written in place."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    grads = unpack_qkv(dqkv)
    _day().attention_backward(
        grad_out.transpose(1, 2), *unpack_qkv(qkv), out.transpose(1, 2), lse, causal, scale, grads=grads
    )
    return dqkv


@_qkvpacked_backward.register_fake
def _(grad_out, qkv, out, lse, causal, scale):
    check_qkvpacked(qkv, causal, scale)
    return qkv.new_empty(qkv.shape)


_qkvpacked.register_autograd(
    attention_backward_with(torch.ops.gpu_days.flash_attention_qkvpacked_backward, "flash_attention_qkvpacked"),
    setup_context=setup_attention_context,
)
_packed_autograd = eager.function(
    "FlashAttentionQKVPacked",
    _packed_forward,
    setup_attention_context,
    attention_backward_with(_packed_backward, "flash_attention_qkvpacked"),
)


def flash_attention_qkvpacked(qkv: Tensor, causal: bool = False, scale: float | None = None) -> Tensor:
    """`flash_attention` of q, k, v packed as qkv (batch, seq, 3, heads, head_dim), the layout of
    a fused QKV projection's output viewed as `.view(batch, seq, 3, heads, head_dim)`. Returns
    (batch, seq, heads, head_dim), contiguous; its gradient reaches qkv as one tensor."""
    args = (qkv, causal, scale)
    way = dict(eager=_packed_forward, autograd=_packed_autograd, op=_packed_op, check=_packed_check)
    return eager.call((qkv,), args, **way)[0]


def _packed_op(*args):
    return torch.ops.gpu_days.flash_attention_qkvpacked(*args)


def _packed_check(qkv, causal, scale):
    if not torch.compiler.is_compiling():
        check_qkvpacked(qkv, causal, scale)


# --8<-- [end:qkvpacked]
