"""Day 017: FlashAttention forward and backward in Triton.

    from days.day017.flash_attention import attention_forward, attention_backward
    o, lse2 = attention_forward(q, k, v, causal=True, scale=None)        # o: (B, Hq, Lq, D)
    dq, dk, dv = attention_backward(do, q, k, v, o, lse2, causal=True, scale=None)

The torch op with autograd is `pytorch_custom_ops.flash_attention` (it calls these). Inputs are laid
out like `F.scaled_dot_product_attention`'s: q (B, Hq, Lq, D), k and v (B, Hkv, Lk, D) with Hq a
multiple of Hkv (grouped-query attention: q head h reads kv head h // (Hq // Hkv)).

`causal=True` masks like SDPA's `is_causal=True` for any lengths: query i sees keys j <= i
("top-left" alignment). Every query sees key 0, so no row is ever fully masked; with Lq > Lk the
queries i >= Lk - 1 see every key, with Lq < Lk the keys j >= Lq are seen by no query (their dK and
dV are 0).

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1): same source, so the
tests exercise the real tiling and masking.
"""

from __future__ import annotations

import math
import os

import torch

from pytorch_custom_ops.attention_checks import check_qkv

# Triton reads TRITON_INTERPRET when @triton.jit decorates a function: set it before the
# decorators below, and only without CUDA (compiled Triton cannot run here anyway).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

OP = "flash_attention"
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (32, 64, 128, 256)  # tl.arange needs powers of 2; 16 is below tl.dot's minimum K
LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)); exp2 is the hardware instruction


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_ready() -> bool:
    """Whether Triton's own @triton.jit library (tl.max, tl.cdiv, ...) is interpreted too.
    Triton decorates it once, when triton.language is first imported: if that happened
    before TRITON_INTERPRET=1 was set (torch.compile imports triton, for one), our kernels
    are interpreted but what they call is not, and a launch fails deep inside Triton."""
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(getattr(standard, "max", None), InterpretedFunction)


# ----------------------------------------------------------------------------- checks


def check_inputs(q, k, v, causal=False, scale=None) -> None:
    """Raise TypeError/ValueError naming the op and the problem; shapes, dtypes, devices only."""

    def on_cuda(t):
        if t.device.type == "cuda" or t.device.type == "meta":
            return
        if not interpreting():
            raise ValueError(f"{OP}: the Triton kernels need CUDA tensors, got {t.device} (or set TRITON_INTERPRET=1)")
        if not interpreter_ready():
            raise RuntimeError(
                f"{OP}: {t.device} tensors run in Triton's interpreter, but triton was imported before "
                "TRITON_INTERPRET=1 was set (torch.compile imports it, for one): set TRITON_INTERPRET=1 in the "
                "environment before Python starts"
            )

    check_qkv(OP, q, k, v, causal, HEAD_DIMS, on_cuda)
    resolve_scale(scale, q.shape[-1])


def resolve_scale(scale, head_dim: int) -> float:
    """`scale` or the default 1/sqrt(head_dim). Positive: the kernels take the row max of the
    unscaled scores and scale it afterwards, which is only the max of the scaled ones if scale > 0."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{OP}: scale must be a positive finite number or None, got {scale!r}")
    return float(scale)


def empty_in_layout_of(t: torch.Tensor) -> torch.Tensor:
    """An empty (B, H, L, D) tensor laid out as `t` is: (B, L, H, D) in memory when t's seq
    stride is the larger (t is a transposed view, as q is in `x.view(B, L, H, D).transpose(1, 2)`),
    else (B, H, L, D). SDPA's outputs follow q's layout the same way, so a caller's
    `o.transpose(1, 2).reshape(B, L, H * D)` is a view, not a copy."""
    b, h, length, d = t.shape
    if t.stride(1) < t.stride(2):
        return torch.empty((b, length, h, d), dtype=t.dtype, device=t.device).transpose(1, 2)
    return torch.empty((b, h, length, d), dtype=t.dtype, device=t.device)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    # The kernels index (batch, head, seq) through strides but read head_dim as contiguous, which
    # lets every load be a wide vector load. Other layouts are copied (once per call).
    return t if t.stride(-1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    # The interpreter's tl.dot multiplies bfloat16 bit patterns as integers (Triton 3.9): it gets
    # float32 operands instead. On a GPU UPCAST is False and this is a plain tensor-core dot.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)


# --8<-- [start:fwd_tile]
@triton.jit
def _fwd_tile(
    acc, m_i, l_i, q, k_ptrs, v_ptrs, offs_m, offs_n, start_n, Lk, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # One K/V tile of the online softmax. acc, m_i, l_i: the running sum of p @ V, row max and
    # row sum, all relative to m_i (log2 domain: m_i is a max of scores * scale * log2(e)).
    cols = start_n + offs_n
    if MASKED:  # the ragged end of K/V, or a tile that crosses the causal diagonal
        k = tl.load(k_ptrs, mask=(cols < Lk)[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=(cols < Lk)[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = _mma(q, tl.trans(k), None, UPCAST)
    if MASKED:
        keep = (cols < Lk)[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, -float("inf"))
    # scale > 0, so max(s) * scale is the max of the scaled scores; s * scale - m is one FMA.
    # m_new is finite: every row sees key 0 in the first tile it visits (see the module doc).
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)  # rescales what was summed against the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST)
    return acc, m_new, l_i


# --8<-- [end:fwd_tile]


# --8<-- [start:fwd_kernel]
@triton.jit
def _fwd_kernel(
    Q, K, V, Out, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    Lq, Lk, GROUP, qk_scale, LQ_KEY, LK_KEY,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    # Program (m block, head, batch) owns BLOCK_M query rows and loops over the K/V tiles, never
    # writing a score to memory. LQ_KEY, LK_KEY: the autotuner's key only (sequence buckets).
    n_blocks = tl.num_programs(0)
    # Causal blocks near the end have the most tiles: start them first, so short ones fill the tail.
    pid_m = n_blocks - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)  # int64: batch * stride can pass 2**31 elements
    kv_head = head // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    q_ptrs = Q + batch * stride_qb + head.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=(offs_m < Lq)[:, None], other=0.0)
    k_base = K + batch * stride_kb + kv_head.to(tl.int64) * stride_kh + offs_d[None, :]
    v_base = V + batch * stride_vb + kv_head.to(tl.int64) * stride_vh + offs_d[None, :]

    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # Tiles [0, n_full) need no mask: inside K/V and, if causal, left of the diagonal for every
    # row of the block (tile end <= start_m + 1). Tiles [n_full, hi) are masked; causal ones past
    # the block's last row (start_m + BLOCK_M) are skipped altogether.
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, Lk)
        n_full = tl.minimum((start_m + 1) // BLOCK_N, Lk // BLOCK_N) * BLOCK_N
    else:
        hi = Lk
        n_full = (Lk // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        rows = (start_n + offs_n)[:, None]
        acc, m_i, l_i = _fwd_tile(
            acc, m_i, l_i, q, k_base + rows * stride_kn, v_base + rows * stride_vn, offs_m, offs_n, start_n, Lk,
            qk_scale, False, CAUSAL, UPCAST,
        )  # fmt: skip
    for start_n in range(n_full, hi, BLOCK_N):
        rows = (start_n + offs_n)[:, None]
        acc, m_i, l_i = _fwd_tile(
            acc, m_i, l_i, q, k_base + rows * stride_kn, v_base + rows * stride_vn, offs_m, offs_n, start_n, Lk,
            qk_scale, True, CAUSAL, UPCAST,
        )  # fmt: skip

    # l_i >= 1 (the max term contributes exp2(0)), so no division by zero, even for padding rows.
    acc = acc / l_i[:, None]
    o_ptrs = Out + batch * stride_ob + head.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=(offs_m < Lq)[:, None])
    # The log-sum-exp in the log2 domain, what the backward needs to rebuild P = exp2(s * scale - lse2).
    lse_ptrs = LSE + (batch * tl.num_programs(1) + head) * Lq + offs_m
    tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=offs_m < Lq)


# --8<-- [end:fwd_kernel]


# --8<-- [start:bwd_preprocess]
@triton.jit
def _bwd_preprocess(
    Out, DO, DELTA, stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom, Lq,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    # delta_i = sum_d dO_id * O_id = sum_j P_ij dP_ij: the row term of the softmax backward,
    # computed once here instead of once per K/V tile in both backward kernels.
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = (offs_m < Lq)[:, None]
    o = tl.load(Out + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :], mask=row_ok)
    do = tl.load(
        DO + batch * stride_dob + head * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :], mask=row_ok
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + (batch * tl.num_programs(1) + head) * Lq + offs_m, delta, mask=offs_m < Lq)


# --8<-- [end:bwd_preprocess]


# --8<-- [start:dkdv_tile]
@triton.jit
def _dkdv_tile(
    dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, offs_n, start_m, Lq, qk_scale,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # One Q block against this program's K/V tile, in the transposed orientation (keys are rows)
    # so that every dot has the tile's BLOCK_N rows as its M dimension and dK, dV accumulate
    # without transposes:  sT = K Q^T,  pT = exp2(sT * scale - lse2),  dV += pT dO,
    # dpT = V dO^T,  dsT = pT (dpT - delta),  dK += dsT Q  (times scale, applied once at the end).
    offs_m = start_m + tl.arange(0, BLOCK_M)
    if MASKED:  # rows past Lq read 0 (q, dO, delta) and lse 0: their pT is 1 but dO = 0 and
        row_ok = offs_m < Lq  # dpT - delta = 0, so they add nothing even before the mask below
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + offs_m, mask=row_ok, other=0.0)
    else:
        q = tl.load(q_ptrs)
        do = tl.load(do_ptrs)
        lse = tl.load(lse_ptr + offs_m)
        delta = tl.load(delta_ptr + offs_m)
    sT = _mma(k, tl.trans(q), None, UPCAST)
    sT = sT * qk_scale - lse[None, :]
    if MASKED:  # mask before exp2: a masked (future) score may be large enough to overflow
        keep = row_ok[None, :]
        if CAUSAL:
            keep = keep & (offs_n[:, None] <= offs_m[None, :])
        sT = tl.where(keep, sT, -float("inf"))
    pT = tl.exp2(sT)
    dv = _mma(pT.to(do.dtype), do, dv, UPCAST)
    dpT = _mma(v, tl.trans(do), None, UPCAST)
    dsT = pT * (dpT - delta[None, :])
    dk = _mma(dsT.to(q.dtype), q, dk, UPCAST)
    return dk, dv


# --8<-- [end:dkdv_tile]


# --8<-- [start:dkdv_kernel]
@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    Hq, Lq, Lk, GROUP, qk_scale, sm_scale, LQ_KEY, LK_KEY,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    # Program (n block, kv head, batch) owns BLOCK_N keys: it holds K, V, dK, dV for them and loops
    # over every query block of every q head that reads this kv head (GROUP of them with GQA). No
    # other program writes these dK, dV rows, so there are no atomics.
    pid_n = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # Key rows past Lk read 0; they only feed their own dK, dV rows, which are not stored.
    n_ok = (offs_n < Lk)[:, None]
    kvh = kv_head.to(tl.int64)
    k = tl.load(K + batch * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :], mask=n_ok)
    v = tl.load(V + batch * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :], mask=n_ok)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    # Query blocks: causal ones start at the block holding query start_n (earlier queries see none
    # of these keys) and need the causal mask while they start before start_n + BLOCK_N - 1.
    if CAUSAL:
        m_lo = (start_n // BLOCK_M) * BLOCK_M
        m_mid = tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M
    else:
        m_lo = 0
        m_mid = 0
    m_full = (Lq // BLOCK_M) * BLOCK_M  # blocks from here on are ragged (masked loads)
    for g in range(0, GROUP):
        head = kv_head * GROUP + g
        q_base = Q + batch * stride_qb + head.to(tl.int64) * stride_qh + offs_d[None, :]
        do_base = DO + batch * stride_dob + head.to(tl.int64) * stride_doh + offs_d[None, :]
        row0 = (batch * Hq + head) * Lq
        lse_ptr = LSE + row0
        delta_ptr = DELTA + row0
        for start_m in range(m_lo, tl.minimum(m_mid, Lq), BLOCK_M):  # across the diagonal
            rows = (start_m + tl.arange(0, BLOCK_M))[:, None]
            dk, dv = _dkdv_tile(
                dk, dv, k, v, q_base + rows * stride_qm, do_base + rows * stride_dom, lse_ptr, delta_ptr, offs_n,
                start_m, Lq, qk_scale, BLOCK_M, True, CAUSAL, UPCAST,
            )  # fmt: skip
        for start_m in range(m_mid, m_full, BLOCK_M):  # the bulk: no masks
            rows = (start_m + tl.arange(0, BLOCK_M))[:, None]
            dk, dv = _dkdv_tile(
                dk, dv, k, v, q_base + rows * stride_qm, do_base + rows * stride_dom, lse_ptr, delta_ptr, offs_n,
                start_m, Lq, qk_scale, BLOCK_M, False, CAUSAL, UPCAST,
            )  # fmt: skip
        for start_m in range(tl.maximum(m_mid, m_full), Lq, BLOCK_M):  # the ragged last block
            rows = (start_m + tl.arange(0, BLOCK_M))[:, None]
            dk, dv = _dkdv_tile(
                dk, dv, k, v, q_base + rows * stride_qm, do_base + rows * stride_dom, lse_ptr, delta_ptr, offs_n,
                start_m, Lq, qk_scale, BLOCK_M, True, CAUSAL, UPCAST,
            )  # fmt: skip

    dk = dk * sm_scale  # d scores / d k carries the softmax scale once
    dk_ptrs = DK + batch * stride_dkb + kvh * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
    dv_ptrs = DV + batch * stride_dvb + kvh * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :]
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=n_ok)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=n_ok)


# --8<-- [end:dkdv_kernel]


# --8<-- [start:dq_tile]
@triton.jit
def _dq_tile(
    dq, q, do, lse, delta, k_ptrs, v_ptrs, offs_m, offs_n, start_n, Lk, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # s = Q K^T, p = exp2(s * scale - lse2), dp = dO V^T, ds = p (dp - delta), dQ += ds K.
    cols = start_n + offs_n
    if MASKED:
        k = tl.load(k_ptrs, mask=(cols < Lk)[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=(cols < Lk)[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = _mma(q, tl.trans(k), None, UPCAST)
    s = s * qk_scale - lse[:, None]
    if MASKED:
        keep = (cols < Lk)[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, -float("inf"))
    p = tl.exp2(s)
    dp = _mma(do, tl.trans(v), None, UPCAST)
    ds = p * (dp - delta[:, None])
    return _mma(ds.to(k.dtype), k, dq, UPCAST)


# --8<-- [end:dq_tile]


# --8<-- [start:dq_kernel]
@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm,
    Lq, Lk, GROUP, qk_scale, sm_scale, LQ_KEY, LK_KEY,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    # Program (m block, head, batch) owns BLOCK_M query rows and loops over K/V tiles like the
    # forward, accumulating dQ in registers: the mirror image of _dkdv_kernel, again no atomics.
    n_blocks = tl.num_programs(0)
    pid_m = n_blocks - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    kv_head = head // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < Lq
    hq = head.to(tl.int64)
    q = tl.load(Q + batch * stride_qb + hq * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=m_ok[:, None], other=0.0)  # fmt: skip
    do = tl.load(DO + batch * stride_dob + hq * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
                 mask=m_ok[:, None], other=0.0)  # fmt: skip
    row0 = (batch * tl.num_programs(1) + head) * Lq
    lse = tl.load(LSE + row0 + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + row0 + offs_m, mask=m_ok, other=0.0)
    k_base = K + batch * stride_kb + kv_head.to(tl.int64) * stride_kh + offs_d[None, :]
    v_base = V + batch * stride_vb + kv_head.to(tl.int64) * stride_vh + offs_d[None, :]
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    if CAUSAL:  # the same split as the forward's
        hi = tl.minimum(start_m + BLOCK_M, Lk)
        n_full = tl.minimum((start_m + 1) // BLOCK_N, Lk // BLOCK_N) * BLOCK_N
    else:
        hi = Lk
        n_full = (Lk // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        rows = (start_n + offs_n)[:, None]
        dq = _dq_tile(
            dq, q, do, lse, delta, k_base + rows * stride_kn, v_base + rows * stride_vn, offs_m, offs_n, start_n,
            Lk, qk_scale, False, CAUSAL, UPCAST,
        )  # fmt: skip
    for start_n in range(n_full, hi, BLOCK_N):
        rows = (start_n + offs_n)[:, None]
        dq = _dq_tile(
            dq, q, do, lse, delta, k_base + rows * stride_kn, v_base + rows * stride_vn, offs_m, offs_n, start_n,
            Lk, qk_scale, True, CAUSAL, UPCAST,
        )  # fmt: skip

    dq = dq * sm_scale
    dq_ptrs = DQ + batch * stride_dqb + hq * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=m_ok[:, None])


# --8<-- [end:dq_kernel]


# ----------------------------------------------------------------------------- configs

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head dim. The first is the fixed
# config for small problems (no autotuning: tuning a 0.1 ms call costs more than it saves); the
# autotuner times them all for the rest. Chosen for the H100 (227 KiB of shared memory a block,
# 255 registers a thread) from what `python -m days.day017.compile_check` reported with
# Triton 3.6 for sm_90: no config past the shared memory, (almost) none spilling registers.
CONFIGS: dict[str, dict[int, list[tuple[int, int, int, int]]]] = {
    "fwd": {
        32: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3)],
        64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4)],
        128: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2)],  # the last spills 4 bytes
        256: [(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2)],
    },
    "dkdv": {  # BLOCK_N keys per program, BLOCK_M queries per step
        32: [(32, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 3)],
        64: [(32, 64, 4, 3), (64, 128, 8, 3), (32, 128, 8, 4), (16, 128, 8, 3)],
        128: [(32, 64, 4, 3), (32, 128, 8, 3), (64, 64, 8, 3), (32, 128, 8, 4)],
        256: [(16, 32, 8, 2), (32, 32, 8, 2)],  # BLOCK_N 32 < wgmma's 64 rows: mma.sync, but no spills
    },
    "dq": {  # BLOCK_M queries per program, BLOCK_N keys per step
        32: [(64, 32, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3)],
        64: [(64, 32, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3), (128, 32, 8, 4)],
        128: [(64, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
        256: [(64, 16, 8, 2), (64, 32, 8, 2), (32, 32, 8, 2)],
    },
}
# The interpreter: small tiles with BLOCK_M != BLOCK_N, so that tiny test shapes still span
# several tiles and cross the causal diagonal inside a tile.
INTERPRETER_CONFIGS = {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}
SMALL_WORK = 2**28  # batch * heads * Lq * Lk * head_dim below this: the fixed config
PREPROCESS_BLOCK_M = 64


def _config(spec: tuple[int, int, int, int]) -> triton.Config:
    bm, bn, warps, stages = spec
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


def _prune(kernel: str):
    def prune(configs, named_args, **kwargs):
        # This head dim's configs, minus tiles taller than the (bucketed) sequences they tile.
        specs = CONFIGS[kernel][kwargs["HEAD_DIM"]]
        lq, lk = named_args["LQ_KEY"], named_args["LK_KEY"]
        kept = [s for s in specs if s[0] <= max(64, lq) and s[1] <= max(64, lk)] or specs[:1]
        return [_config(s) for s in kept]

    return prune


_ALL = {name: [_config(s) for per_dim in table.values() for s in per_dim] for name, table in CONFIGS.items()}
_KEY = ["LQ_KEY", "LK_KEY", "HEAD_DIM", "CAUSAL"]
_KERNELS = {"fwd": _fwd_kernel, "dkdv": _dkdv_kernel, "dq": _dq_kernel}
_AUTOTUNED = {
    name: triton.autotune(configs=_ALL[name], key=_KEY, prune_configs_by={"early_config_prune": _prune(name)})(fn)
    for name, fn in _KERNELS.items()
}


# The autotuner's pick per key, once it has run for that key; REUSE_PICKS off: every call
# goes through the autotuner (its cache gives the same pick; for A/B timing)
_PICKED: dict[tuple, triton.Config] = {}
REUSE_PICKS = True


def _bucket(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def last_configs() -> dict[str, triton.Config | None]:
    """What the autotuner picked on its last call of each kernel (None before the first)."""
    return {name: getattr(fn, "best_config", None) for name, fn in _AUTOTUNED.items()}


def _launch(name: str, grid, args: tuple, meta: dict, work: int, config) -> None:
    """Run kernel `name` with `config` (BLOCK_M, BLOCK_N, num_warps, num_stages), else the
    interpreter's config, the fixed one for small work, or the autotuner's pick."""
    if config is None and interpreting():
        config = INTERPRETER_CONFIGS[name]
    if config is None and work < SMALL_WORK:
        config = CONFIGS[name][meta["HEAD_DIM"]][0]
    if config is None:
        tuned = _AUTOTUNED[name]
        # the autotuner's own key: the _KEY values (the sequence buckets end `args`) and the
        # tensors' dtypes, all q's but the float32 statistics
        key = (name, args[-2], args[-1], meta["HEAD_DIM"], meta["CAUSAL"], meta["UPCAST"], args[0].dtype)
        picked = _PICKED.get(key) if REUSE_PICKS else None
        if picked is None:
            tuned[lambda c: grid(c["BLOCK_M"], c["BLOCK_N"])](*args, **meta)
            _PICKED[key] = tuned.best_config  # what this call ran: the pick for its key
            return
        # a key seen before: its config straight to the kernel, without the autotuner's
        # Python around every launch (day 020, part 13)
        _KERNELS[name][grid(picked.kwargs["BLOCK_M"], picked.kwargs["BLOCK_N"])](*args, **meta, **picked.all_kwargs())
        return
    bm, bn, warps, stages = config
    for label, b in (("BLOCK_M", bm), ("BLOCK_N", bn)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{OP}: {label} must be a power of 2 >= 16 (tl.dot's minimum), got {b}")
    _KERNELS[name][grid(bm, bn)](*args, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _check_offsets(*tensors: torch.Tensor) -> None:
    # Batch and head offsets are int64 in the kernels; the offset inside one (batch, head) slice
    # is int32 to keep address math cheap.
    for t in tensors:
        if (t.shape[2] - 1) * t.stride(2) + t.shape[3] >= 2**31:
            raise ValueError(f"{OP}: a (batch, head) slice of shape {tuple(t.shape)} spans 2**31 elements or more")


# ----------------------------------------------------------------------------- launchers


# --8<-- [start:forward]
def attention_forward(q, k, v, causal: bool = False, scale: float | None = None, config=None):
    """(o, lse2): softmax(q k^T * scale [+ causal mask]) v, and the row log-sum-exp in the log2
    domain (float32, (B, Hq, Lq)), which the backward uses to rebuild P tile by tile. o is laid
    out as q is (`empty_in_layout_of`)."""
    check_inputs(q, k, v, causal, scale)
    qk_scale = resolve_scale(scale, q.shape[-1]) * LOG2E
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    (b, hq, lq, d), hkv, lk = q.shape, k.shape[1], k.shape[2]
    o = empty_in_layout_of(q)
    lse = torch.empty((b, hq, lq), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    _check_offsets(q, k, v, o)
    args = (q, k, v, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o))
    args += (lq, lk, hq // hkv, qk_scale, _bucket(lq), _bucket(lk))
    meta = {"HEAD_DIM": d, "CAUSAL": causal, "UPCAST": _upcast(q)}
    _launch("fwd", lambda bm, bn: (triton.cdiv(lq, bm), hq, b), args, meta, b * hq * lq * lk * d, config)
    return o, lse


# --8<-- [end:forward]


# --8<-- [start:backward]
def attention_backward(do, q, k, v, o, lse, causal: bool = False, scale: float | None = None, configs=None, grads=None):
    """(dq, dk, dv) from the forward's inputs, output o and lse2, each laid out as its input
    (`empty_in_layout_of`), or written into `grads`, three tensors of q's, k's and v's shapes
    with unit last stride (e.g. views into one packed gradient). `configs`: optional
    {"dkdv": (BLOCK_M, BLOCK_N, warps, stages), "dq": (...)} overriding the automatic choice."""
    check_inputs(q, k, v, causal, scale)
    for name, t, dtype in (("o", o, q.dtype), ("grad_output", do, q.dtype), ("lse", lse, torch.float32)):
        want = tuple(q.shape) if name != "lse" else tuple(q.shape[:3])
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != dtype or t.device != q.device:
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{OP} backward: {name} must be {want} {dtype} on {q.device}, got {got}")
    sm_scale = resolve_scale(scale, q.shape[-1])
    q, k, v, o, do = (_unit_last_stride(t) for t in (q, k, v, o, do))
    lse = lse.contiguous()
    (b, hq, lq, d), hkv, lk = q.shape, k.shape[1], k.shape[2]
    if grads is None:
        dq, dk, dv = (empty_in_layout_of(t) for t in (q, k, v))
    else:
        dq, dk, dv = grads
        for name, g, t in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
            if g.shape != t.shape or g.dtype != t.dtype or g.device != t.device or g.stride(-1) != 1:
                raise ValueError(
                    f"{OP} backward: {name} must be {tuple(t.shape)} {t.dtype} on {t.device} with unit last "
                    f"stride, got {tuple(g.shape)} {g.dtype} on {g.device} strides {g.stride()}"
                )
    if dq.numel() == 0:  # no query: no gradient reaches k or v
        return dq, dk.zero_(), dv.zero_()
    _check_offsets(q, k, v, o, do, dq, dk, dv)
    configs = configs or {}
    upcast = _upcast(q)
    delta = torch.empty_like(lse)
    grid = (triton.cdiv(lq, PREPROCESS_BLOCK_M), hq, b)
    _bwd_preprocess[grid](o, do, delta, *_strides(o), *_strides(do), lq, HEAD_DIM=d, BLOCK_M=PREPROCESS_BLOCK_M)

    common = (*_strides(q), *_strides(k), *_strides(v), *_strides(do))
    tail = (lq, lk, hq // hkv, sm_scale * LOG2E, sm_scale, _bucket(lq), _bucket(lk))
    meta = {"HEAD_DIM": d, "CAUSAL": causal, "UPCAST": upcast}
    work = b * hq * lq * lk * d
    args = (q, k, v, do, lse, delta, dk, dv, *common, *_strides(dk), *_strides(dv), hq, *tail)
    _launch("dkdv", lambda bm, bn: (triton.cdiv(lk, bn), hkv, b), args, meta, work, configs.get("dkdv"))
    args = (q, k, v, do, lse, delta, dq, *common, *_strides(dq), *tail)
    _launch("dq", lambda bm, bn: (triton.cdiv(lq, bm), hq, b), args, meta, work, configs.get("dq"))
    return dq, dk, dv


# --8<-- [end:backward]


def _upcast(t: torch.Tensor) -> bool:
    return interpreting() and t.dtype == torch.bfloat16


def attention_reference(q, k, v, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v in q's dtype by plain torch ops (materializes Lq x Lk),
    with the same causal convention and GQA head mapping as the kernels."""
    scale = resolve_scale(scale, q.shape[-1])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v
