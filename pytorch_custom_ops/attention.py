"""Day 018: FlashAttention for Hopper in Mojo, as a torch op with autograd.

    o = pco.attention(q, k, v, causal=True)          # like F.scaled_dot_product_attention
    attn = pco.MojoAttention(causal=True); o = attn(q, k, v)

q is (batch, heads, Lq, head_dim), k and v (batch, kv_heads, Lk, head_dim) with heads a
multiple of kv_heads (grouped-query attention), as day 017's op takes them. float16 or
bfloat16, head_dim 64 or 128, any lengths; `causal` masks like SDPA's `is_causal` (query
i sees keys j <= i), `scale` defaults to 1/sqrt(head_dim).

On CUDA both directions are day 018's Mojo kernels (days/day018/attention_fwd.mojo and
attention_bwd.mojo: TMA, wgmma, a producer warpgroup), launched on torch's current stream
by the direct path. The forward saves the row log-sum-exp in the log2 domain (as day 017's
Triton forward does); the backward rebuilds P from it in two passes (dK/dV, then dQ).

On the CPU (CI, no GPU) both directions are plain float32 torch math from the same saved
tensors (out, lse2): a simple reference path that checks shapes, masks, GQA and the lse2
convention the GPU backward relies on, not the Mojo kernel.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import direct, eager, fallback
from .attention_checks import check_qkv
from .attention_gpu import (
    HEAD_DIMS,
    LOG2E,
    attention_bwd_gpu,
    attention_gpu,
    bwd_version,
    dq32_shape,
    dq_work_counter,
    pairs_rows,
    tma_ready,
)
from .contract import as_float
from .flash_attention import attention_backward_with, attention_outputs_like, setup_attention_context

OP = "attention"


# -- checks -------------------------------------------------------------------------------------
def check_attention_args(q, k, v, causal, scale) -> float:
    """Raise TypeError/ValueError naming the problem; return the scale to use."""
    check_qkv(OP, q, k, v, causal, HEAD_DIMS)
    d = q.shape[-1]
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{OP}: scale must be a positive finite number or None, got {scale!r}")
    return float(scale)


# -- the CPU path: float32 math ----------------------------------------------------------------
def _scores(q, k, causal, scale):
    """(s in the log2 domain, float32, masked), with k's heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    s = (q.float() @ kf.transpose(-2, -1)) * (scale * LOG2E)
    if causal:
        lq, lk = q.shape[2], k.shape[2]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _forward_math(q, k, v, causal, scale):
    s = _scores(q, k, causal, scale)
    lse2 = torch.logsumexp(s * math.log(2), dim=-1) * LOG2E
    p = torch.exp2(s - lse2[..., None])
    group = q.shape[1] // k.shape[1]
    out = p @ v.float().repeat_interleave(group, dim=1)
    return out.to(q.dtype), lse2


def _backward_math(do, q, k, v, out, lse2, causal, scale):
    """dq, dk, dv from P rebuilt with lse2, as the GPU backward does."""
    b, hkv, lk, d = k.shape
    group = q.shape[1] // hkv
    p = torch.exp2(_scores(q, k, causal, scale) - lse2[..., None])
    dof = do.float()
    dv = p.transpose(-2, -1) @ dof
    dp = dof @ v.float().repeat_interleave(group, dim=1).transpose(-2, -1)
    delta = (dof * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = ds @ k.float().repeat_interleave(group, dim=1)
    dk = ds.transpose(-2, -1) @ q.float()
    fold = lambda t: t.view(b, hkv, group, lk, d).sum(2)  # noqa: E731  (GQA: kv heads sum their q heads)
    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


# -- the CUDA path ------------------------------------------------------------------------------
def tma_copy(t: Tensor) -> Tensor:
    """t, or a copy the tensor maps can read. A clone, not .contiguous(): a contiguous
    view 2 bytes past a 16-byte boundary (x[1:]) is its own .contiguous(), and
    cuTensorMapEncodeTiled refused its address."""
    return t if tma_ready(t) else t.clone(memory_format=torch.contiguous_format)


def _forward_cuda(q, k, v, causal, scale):
    q, k, v = (tma_copy(t) for t in (q, k, v))
    b, hq, lq, d = q.shape
    out = torch.empty((b, hq, lq, d), dtype=q.dtype, device=q.device)
    lse2 = torch.empty((b, hq, lq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse2
    launches = attention_gpu([out, lse2], [q, k, v], {"CAUSAL": causal, "SCALE_LOG2": scale * LOG2E})
    direct.run(launches, q.get_device())
    return out, lse2


def _forward_eager(q, k, v, causal, scale):
    s = check_attention_args(q, k, v, causal, scale)
    if q.is_cuda:
        try:
            return _forward_cuda(q, k, v, causal, s)
        except direct.KernelLoadError as exc:
            fallback.fall_back(OP, exc)  # raises in strict mode
    return _forward_math(q, k, v, causal, s)


def _backward_cuda(do, q, k, v, out, lse2, causal, scale):
    q, k, v, do, out = (tma_copy(t) for t in (q, k, v, do, out))
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if q.numel() == 0:  # no query: no gradient reaches k or v
        return torch.empty_like(q), dk.zero_(), dv.zero_()
    version = bwd_version(q.shape[-1], causal, k.shape[2])
    # versions 2 and 6 add dQ into a float32 tensor (one pass), cast at the end: version
    # 2 by torch, version 6 by its own launch (and its delta kernel zeroes the tensor)
    dq32_dims = dq32_shape(q, version)
    dq = None if version == 2 else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dq32 = None
    if dq32_dims:
        dq32 = (torch.empty if version == 6 else torch.zeros)(dq32_dims, dtype=torch.float32, device=q.device)
    # (lse2, delta = rowsum(dO * O)) per row, whole 64-row tiles: written by the first
    # launch for the dK/dV pass
    pairs = torch.empty((*q.shape[:2], pairs_rows(q.shape[2]), 2), dtype=torch.float32, device=q.device)
    params = {"CAUSAL": causal, "SCALE": scale, "VERSION": version}
    work = dq_work_counter(version, q.device)  # version 8's tile scheduler
    outputs = [dq, dk, dv, pairs, dq32, work]
    launches = attention_bwd_gpu(outputs, [q, k, v, do, lse2.contiguous(), out], params)
    direct.run(launches, q.get_device())
    if dq is not None:
        return dq, dk, dv
    return dq32.to(q.dtype, memory_format=torch.contiguous_format), dk, dv


def _backward_eager(do, q, k, v, out, lse2, causal, scale):
    s = check_attention_args(q, k, v, causal, scale)
    if q.is_cuda:
        try:
            return _backward_cuda(do, q, k, v, out, lse2, causal, s)
        except direct.KernelLoadError as exc:
            fallback.fall_back(OP, exc)  # raises in strict mode
    return _backward_math(do.contiguous(), q, k, v, out, lse2, causal, s)


# -- registration -------------------------------------------------------------------------------
@torch.library.custom_op("gpu_days::attention", mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None) -> tuple[Tensor, Tensor]:
    return _forward_eager(q, k, v, causal, scale)


@_attention.register_fake
def _(q, k, v, causal, scale):
    check_attention_args(q, k, v, causal, scale)
    return attention_outputs_like(q)


@torch.library.custom_op("gpu_days::attention_backward", mutates_args=())
def _attention_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    return _backward_eager(grad_out, q, k, v, out, lse, causal, scale)


@_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_backward = attention_backward_with(torch.ops.gpu_days.attention_backward, "attention")
_backward_direct = attention_backward_with(_backward_eager, "attention")


_attention.register_autograd(_backward, setup_context=setup_attention_context)
_autograd = eager.function("MojoAttention", _forward_eager, setup_attention_context, _backward_direct)


def _op(*args):
    return torch.ops.gpu_days.attention(*args)


def _check(q, k, v, causal, scale):
    if not torch.compiler.is_compiling():  # our message before the dispatcher's schema error
        check_attention_args(q, k, v, causal, scale)


# --8<-- [start:api]
def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None) -> Tensor:
    """softmax(q kᵀ · scale [+ causal mask]) v by day 018's Mojo FlashAttention forward,
    differentiable. Takes what `F.scaled_dot_product_attention(q, k, v, is_causal=causal,
    scale=scale, enable_gqa=True)` takes, for head_dim 64 or 128 in bf16/fp16. Under
    torch.autocast float32 inputs are cast to the autocast dtype, as SDPA's are."""
    scale = as_float(scale)  # numpy's floats, as SDPA takes them
    low = eager.autocast_dtype(q)
    if low is not None:
        q, k, v = eager.cast_floats(low, q, k, v)
    args = (q, k, v, causal, scale)
    return eager.call((q, k, v), args, eager=_forward_eager, autograd=_autograd, op=_op, check=_check)[0]


class MojoAttention(torch.nn.Module):
    """`attention` as a module: `MojoAttention(causal=True)(q, k, v)`, a drop-in for a
    model's `F.scaled_dot_product_attention(q, k, v, is_causal=True)`."""

    def __init__(self, causal: bool = False, scale: float | None = None):
        super().__init__()
        self.causal, self.scale = causal, scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attention(q, k, v, self.causal, self.scale)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, scale={self.scale}"


# --8<-- [end:api]
