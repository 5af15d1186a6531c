"""Seeded random problems for the GPU ops (gemm, linear, mlp, attention) across their plans' regimes.

The days' tests pin one problem per branch of a launch plan. Here each seed draws a
problem inside one regime of AUTO's rules (few tiles, one round with a long K, split-K,
short K, narrow outputs, a few tokens, big grids, tiny sizes), then random sizes (odd, or
multiples of 8 where the TMA paths take them), dtype, transposes, batch and epilogue, and
checks it against float64 with the days' own checks (gradients too for linear, mlp and
attention).

CPU (CI): the draws reach every regime's kernel (the launch plan runs on CPU tensors).
CUDA (strict): every draw against float64.
"""

from __future__ import annotations

import random

import pytest
import torch

import pytorch_custom_ops as pco
from days.day014.test_day014_gemm import check, rand, stored
from days.day014.test_day014_launch_plan import choice, plan
from days.day018.test_day018_attention import close as attention_close
from days.day018.test_day018_attention import make, reference
from days.day019.test_day019_linear import check_grads, close, inputs
from days.day019.test_day019_linear import reference as linear_reference
from days.day020.test_day020_mlp import check as mlp_check
from days.day020.test_day020_mlp import make as mlp_make

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
MAX_MACS = 2.5e10  # keeps each float64 reference at about a millisecond

# regime -> ((m range), (n range), (k range)); sizes are drawn log-uniformly inside
REGIMES = {
    "tiny": ((1, 300), (1, 300), (1, 300)),
    "narrow": ((256, 4096), (1, 64), (64, 2048)),
    "few_tiles": ((128, 1100), (128, 1100), (1024, 8192)),
    "one_round_long_k": ((1200, 2400), (600, 1300), (4096, 17000)),
    "split_k": ((500, 1100), (500, 1100), (8192, 20000)),
    "short_k": ((2000, 8192), (1000, 4000), (1, 128)),
    "big": ((2000, 6000), (2000, 5000), (500, 3000)),
    "few_tokens": ((1, 600), (700, 3100), (700, 3100)),
}
GEMM_SEEDS = range(64)


def _size(r: random.Random, lo: int, hi: int, aligned: bool) -> int:
    s = round(lo * (hi / lo) ** r.random())
    return max(8, s // 8 * 8) if aligned and s >= 8 else s


def gemm_draw(seed: int) -> dict:
    """One problem: sizes in the seed's regime, then dtype, layout, batch and epilogue."""
    r = random.Random(seed)
    regime = list(REGIMES)[seed % len(REGIMES)]
    aligned = r.random() < 0.7  # 16-byte rows: the TMA and wgmma paths
    m, n, k = (_size(r, lo, hi, aligned) for lo, hi in REGIMES[regime])
    batch = r.choice([None, None, 2, 3]) if m * n * k < 4e9 else None
    k = max(1, min(k, int(MAX_MACS / (m * n * (batch or 1)))))
    c_kind = r.choice(["none", "row", "full"])
    return {
        "regime": regime,
        "sizes": (m, n, k),
        "dtype": r.choice([BF16, BF16, FP16, FP32]),
        "ta": r.random() < 0.5,
        "tb": r.random() < 0.5,
        "batch": batch,
        "c_kind": c_kind,
        "alpha": r.choice([1.0, 0.5, -1.25]),
        "beta": 0.0 if c_kind == "none" else r.choice([1.0, -0.75]),
    }


def _c_shape(d: dict) -> tuple[int, ...] | None:
    m, n, _ = d["sizes"]
    lead = () if d["batch"] is None else (d["batch"],)
    return {"none": None, "row": (*(1,) * len(lead), 1, n), "full": (*lead, m, n)}[d["c_kind"]]


def test_gemm_draws_reach_every_regimes_kernels():
    """The sweep is only as good as its spread: the plans of its draws (on CPU tensors,
    132 SMs) must include each kind of kernel AUTO runs."""
    seen = set()
    for seed in GEMM_SEEDS:
        d = gemm_draw(seed)
        m, n, k = d["sizes"]
        launch = plan(m, n, k, d["dtype"], d["ta"], d["tb"], d["batch"], _c_shape(d))
        seen.add(choice(launch).split()[0])
    assert {"splitk", "clustersplit", "pingpong", "coop", "tma", "tf32x3", "mma", "simt"} <= seen, seen


@needs_cuda
@pytest.mark.parametrize("seed", GEMM_SEEDS)
def test_cuda_gemm_random_problem(seed):
    d = gemm_draw(seed)
    (m, n, k), dtype, ta, tb, batch = d["sizes"], d["dtype"], d["ta"], d["tb"], d["batch"]
    torch.manual_seed(seed)
    lead = () if batch is None else (batch,)
    a, b = rand(*lead, m, k, device="cuda", dtype=dtype), rand(*lead, k, n, device="cuda", dtype=dtype)
    shape = _c_shape(d)
    c = None if shape is None else rand(*shape, device="cuda", dtype=dtype)
    fn = pco.gemm_batched if batch else pco.gemm
    y = fn(stored(a, ta), stored(b, tb), c, alpha=d["alpha"], beta=d["beta"], transpose_a=ta, transpose_b=tb)
    check(y, a, b, c, d["alpha"], d["beta"])


def linear_draw(seed: int) -> dict:
    """Every third draw is big (thousands of tokens, wide outputs: two rounds of tiles and
    more, where the GELU epilogue moves to the producer's idle warps)."""
    r = random.Random(1000 + seed)
    aligned = r.random() < 0.7
    big = seed % 3 == 0
    tokens = _size(r, 4096, 8192, aligned) if big else _size(r, 1, 8192, aligned)
    split = r.choice([1, 2, 3]) if tokens % 3 == 0 else 1
    return {
        "lead": (split, tokens // split) if split > 1 else (tokens,),
        "d_in": _size(r, 256, 1024, aligned) if big else _size(r, 16, 3072, aligned),
        "d_out": _size(r, 2048, 4096, aligned) if big else _size(r, 16, 3072, aligned),
        "dtype": r.choice([BF16, FP16, FP32]),
        "bias": r.random() < 0.7,
        "activation": r.choice([None, "gelu_tanh"]),
        "residual": r.random() < 0.4,
    }


@needs_cuda
@pytest.mark.parametrize("seed", range(24))
def test_cuda_linear_random_problem_with_grads(seed):
    d = linear_draw(seed)
    x, w, b, res = inputs(d["lead"], d["d_in"], d["d_out"], d["dtype"], "cuda", seed=seed)
    b = b if d["bias"] else None
    res = res if d["residual"] else None
    leaves = [t.requires_grad_() for t in (x, w, b, res) if t is not None]
    y = pco.linear(x, w, b, d["activation"], res)
    close(y, linear_reference(x, w, b, d["activation"], res), d["dtype"])
    check_grads(y, leaves, d["bias"], d["activation"], d["residual"], d["dtype"])


def mlp_draw(seed: int) -> dict:
    """Every other draw is big: GPT-2's MLP at thousands of tokens (the epilogue warps)."""
    r = random.Random(3000 + seed)
    aligned = r.random() < 0.8  # the fused path needs 16-byte rows; others take the composition
    big = seed % 2 == 0
    d = _size(r, 512, 1024, aligned) if big else _size(r, 64, 1024, aligned)
    return {
        "lead": (_size(r, 4096, 8192, aligned) if big else _size(r, 1, 4096, aligned),),
        "d_in": d,
        "hidden": 4 * d if r.random() < 0.7 else _size(r, 64, 4096, aligned),
        "d_out": d if r.random() < 0.7 else _size(r, 64, 1024, aligned),
        "dtype": r.choice([BF16, FP16]),
        "bias": r.random() < 0.8,
    }


@needs_cuda
@pytest.mark.parametrize("seed", range(16))
def test_cuda_mlp_random_problem_with_grads(seed):
    d = mlp_draw(seed)
    leaves = mlp_make(d["lead"], d["d_in"], d["hidden"], d["d_out"], d["dtype"], "cuda", seed=seed, bias=d["bias"])
    mlp_check(leaves, d["dtype"])


def attention_draw(seed: int) -> dict:
    r = random.Random(2000 + seed)
    hkv = r.choice([1, 2, 4])
    lq = r.choice([1, 7]) if r.random() < 0.1 else _size(r, 8, 2600, False)
    return {
        "shape": (
            r.choice([1, 2, 3]),
            hkv * r.choice([1, 1, 2, 3]),  # query heads: a multiple of the key heads (GQA)
            hkv,
            lq,
            lq if r.random() < 0.6 else _size(r, 1, 2600, False),
            r.choice([64, 128]),
        ),
        "causal": r.random() < 0.5,
        "dtype": r.choice([BF16, FP16]),
    }


@needs_cuda
@pytest.mark.parametrize("seed", range(24))
def test_cuda_attention_random_problem_with_grads(seed):
    d = attention_draw(seed)
    q, k, v = (t.requires_grad_() for t in make(*d["shape"], d["dtype"], "cuda", seed=seed))
    out = pco.attention(q, k, v, causal=d["causal"])
    ref = reference(q, k, v, d["causal"])
    attention_close(out, ref, d["dtype"])
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g.double())
    for a, w in zip(got, want, strict=True):
        attention_close(a, w, d["dtype"], factor=2)
