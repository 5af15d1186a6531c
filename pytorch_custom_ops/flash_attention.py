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
    return attention_outputs_like(q)


@torch.library.custom_op("gpu_days::flash_attention_backward", mutates_args=())
def _flash_attention_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    return _day().attention_backward(grad_out, q, k, v, out, lse, causal, scale)


@_flash_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, causal, scale):
    _day().check_inputs(q, k, v, causal, scale)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def setup_attention_context(ctx, inputs, output):
    """Save what every attention backward reads (day 017's and day 018's ops)."""
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale
    ctx.set_materialize_grads(False)  # no zero-filled gradient for lse (backwards take grad_out None)
    ctx.mark_non_differentiable(lse)


def attention_backward_with(run):
    """The autograd backward of an op saved by `setup_attention_context`:
    `run(grad_out, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)` computes the gradients."""

    def backward(ctx, grad_out, _grad_lse):
        if grad_out is None:  # only lse got a gradient, and lse is not differentiable
            return None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = run(grad_out, q, k, v, out, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None

    return backward


def _forward_eager(q, k, v, causal, scale):
    return _day().attention_forward(q, k, v, causal, scale)


_backward = attention_backward_with(torch.ops.gpu_days.flash_attention_backward)
_backward_eager = attention_backward_with(lambda *args: _day().attention_backward(*args))


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
