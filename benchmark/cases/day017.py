"""Day 017: FlashAttention (Triton) against torch's scaled_dot_product_attention backends.

Ops: attention_{fwd,fwd_bwd}_d{64,128}[_causal], one per (pass, head dim, mask), so that each
plot is TFLOP/s against sequence length. Shapes are (batch, heads, seq, head_dim) with
batch x seq = 16384 tokens and heads x head_dim = 2048 (a model dimension of 2048: 32 heads of
64 or 16 heads of 128), the FlashAttention papers' setup. bfloat16.

FLOPs count the visible (query, key) pairs: Lq x Lk, or Lq (Lq + 1) / 2 when causal. Forward
4 x pairs x head_dim per head (two matmuls), forward + backward 3.5x that (the backward's five
matmuls, the recomputation of Q K^T included, are 2.5x the forward: the papers' convention).

Impls: `triton` (pco.flash_attention), `torch` (SDPA's default dispatch, the speedup baseline),
`sdpa_flash`, `sdpa_cudnn`, `sdpa_efficient`, `sdpa_math` (each backend forced with
torch.nn.attention.sdpa_kernel; NA where it cannot run), and `naive` (matmul, softmax, matmul in
bf16, materializing the scores). `sdpa_math` and `naive` need O(seq^2) memory and time: they
are skipped above seq 4096 to keep the whole sweep within a few minutes of GPU time.
`fwd_bwd` impls return (out, dq, dk, dv): every one is checked against a float64 reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco

from ..harness import Case, SkipShape

TOKENS, MODEL_DIM = 16384, 2048
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
O_N2_MAX_SEQ = 4096  # sdpa_math and naive: O(seq^2) memory, skipped above this
REFERENCE_CHUNK = 2**27  # float64 score elements per chunk of (batch x head) slices: 1 GiB


def shapes_for(head_dim: int) -> list[tuple[int, int, int, int]]:
    return [(TOKENS // s, MODEL_DIM // head_dim, s, head_dim) for s in SEQS]


def pairs(seq: int, causal: bool) -> int:
    return seq * (seq + 1) // 2 if causal else seq * seq


def flops(shape, causal: bool, backward: bool) -> int:
    b, h, s, d = shape
    fwd = 4 * b * h * pairs(s, causal) * d
    return fwd * 7 // 2 if backward else fwd


# ----------------------------------------------------------------------------- implementations


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attn(q, k, v, causal):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return attn


def _naive(q, k, v, causal):
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _o_n2(attn):
    def run(q, k, v, causal):
        if q.shape[2] > O_N2_MAX_SEQ:
            raise SkipShape(f"skipped above seq {O_N2_MAX_SEQ}: O(seq^2) memory and time")
        return attn(q, k, v, causal)

    return run


ATTENTION = {
    "triton": lambda q, k, v, causal: pco.flash_attention(q, k, v, causal=causal),
    "torch": _sdpa(None),
    "sdpa_flash": _sdpa("FLASH_ATTENTION"),
    "sdpa_cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa_efficient": _sdpa("EFFICIENT_ATTENTION"),
    "sdpa_math": _o_n2(_sdpa("MATH")),
    "naive": _o_n2(_naive),
}
CUDA_ONLY = ("sdpa_cudnn", "sdpa_efficient")
IMPLS_FOR_TIMING = {name: ATTENTION[name] for name in ("triton", "sdpa_flash", "sdpa_cudnn")}  # day 018's rivals


def _forward_impl(attn, causal):
    return lambda q, k, v: attn(q, k, v, causal)


def _fwd_bwd_impl(attn, causal):
    def run(q, k, v, do):
        out = attn(q, k, v, causal)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    return run


# ----------------------------------------------------------------------------- inputs, reference


def _inputs(backward: bool):
    def make(shape, dtype, device):
        g = torch.Generator(device=device).manual_seed(shape[2])
        q, k, v = (torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(3))
        if not backward:
            return q, k, v
        do = torch.randn(shape, generator=g, device=device, dtype=dtype)
        return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do

    return make


def reference(q, k, v, do=None, causal: bool = False):
    """float64 out (and dq, dk, dv when `do` is given), in chunks of (batch, head) slices so that
    seq 16384 fits: the backward by its formulas, dS = P (dP - rowsum(dO O))."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    scale = d**-0.5
    flat = [x.detach().reshape(b * h, x.shape[2], d) for x in ((q, k, v) if do is None else (q, k, v, do))]
    like = [flat[0]] if do is None else [flat[0], flat[0], flat[1], flat[2]]  # out, dq, dk, dv
    outs = [torch.empty(x.shape, dtype=torch.float64, device=x.device) for x in like]
    keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril() if causal else None
    step = max(1, REFERENCE_CHUNK // (lq * lk))
    for i in range(0, b * h, step):
        qq, kk, vv, *rest = (x[i : i + step].double() for x in flat)
        s = qq @ kk.transpose(-2, -1) * scale
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        p = torch.softmax(s, dim=-1)
        del s
        o = p @ vv
        outs[0][i : i + step] = o
        if rest:
            (dd,) = rest
            outs[3][i : i + step] = p.transpose(-2, -1) @ dd
            ds = p * (dd @ vv.transpose(-2, -1) - (dd * o).sum(-1, keepdim=True))
            del p
            outs[1][i : i + step] = ds @ kk * scale
            outs[2][i : i + step] = ds.transpose(-2, -1) @ qq * scale
    outs = [x.view(t.shape) for x, t in zip(outs, (q, q, k, v), strict=False)]
    return outs[0] if do is None else tuple(outs)


# ----------------------------------------------------------------------------- cases


def _case(head_dim: int, causal: bool, backward: bool, day: str = "day017", attention=None) -> Case:
    """One op's case; day 018 reuses it with its own impls (`attention`: name -> fn(q, k, v, causal))."""
    attention = ATTENTION if attention is None else attention
    op = f"attention_{'fwd_bwd' if backward else 'fwd'}_d{head_dim}{'_causal' if causal else ''}"
    impl = _fwd_bwd_impl if backward else _forward_impl
    quick = [(1, 2, 48, head_dim)] if head_dim <= 64 else [(1, 1, 40, head_dim)]
    return Case(
        day=day,
        op=op,
        impls={name: impl(attn, causal) for name, attn in attention.items()},
        make_inputs=_inputs(backward),
        reference=lambda *inputs: reference(*inputs, causal=causal),
        flops=lambda shape: flops(shape, causal, backward),
        shapes={"quick": quick, "full": shapes_for(head_dim)},
        dtypes={"cpu": [torch.bfloat16], "cuda": [torch.bfloat16]},
        cuda_only=CUDA_ONLY,
        # bf16 in, bf16 out: P and dS are rounded to bf16 before their matmuls (every impl)
        tolerance={torch.bfloat16: 3e-2, torch.float16: 5e-3},
    )


CASES = [_case(d, causal, bwd) for bwd in (False, True) for d in (64, 128) for causal in (False, True)]
