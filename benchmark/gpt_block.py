"""A small GPT-2-style transformer block, built twice with the same parameters: from
gpu-days' modules and ops, and from torch's. Day 016's model benchmark times the two.

    x -> LayerNorm -> QKV linear -> causal attention -> output projection -> + x
      -> LayerNorm -> linear -> GELU (tanh) -> linear -> + (pre-LN, as in GPT-2)

Attention is written as a user would without a fused kernel: scores = Q K^T / sqrt(64)
plus a causal mask (-inf above the diagonal), a row softmax, then P V, with 64-wide heads.
The two builds differ only in the ops in `Ops`: gpu-days' build uses MojoLayerNorm and
MojoGEMM, and adds the mask inside the batched GEMM (its `c` input, beta = 1, read as a
broadcast (1, s, s) row block); torch's uses nn.LayerNorm, nn.Linear and torch.baddbmm,
the same single call in cuBLAS (it copies the mask into the output, then beta = 1). Each
linear adds its bias inside its GEMM in both builds (MojoGEMM's c, cuBLAS's addmm); GELU
and the residual adds are torch ops in both. The heads' split and merge are two copies in
both: torch's `.permute(...).contiguous()`, and day 016's `permute_copy` in gpu-days'
(since part seven; torch's generic copy ran them at ~1.2 TB/s). The split's backward
stacks the three gradients first in torch's build; gpu-days' `permute_unbind` gathers
them in the same single copy (part ten).

It lives in benchmark/ rather than pytorch_custom_ops/: it is a workload for measuring
the ops, not an op, and the package should not grow a model API by accident.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import pytorch_custom_ops as pco

HEAD_DIM = 64
MLP_RATIO = 4


@dataclass(frozen=True)
class Ops:
    """What differs between the builds."""

    name: str
    layer_norm: type[nn.Module]
    linear: type[nn.Module]
    scores: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]  # (q, k, mask, scale)
    softmax: Callable[[torch.Tensor], torch.Tensor]  # over the last dim
    bmm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (p, v) -> p @ v
    # x.permute(dims).contiguous(): the heads' merge; ... .unbind(0): their split
    permute: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]
    permute_unbind: Callable[[torch.Tensor, tuple[int, ...]], tuple[torch.Tensor, ...]]
    # fused: the second residual add goes into the LayerNorm after it (layer_norm is an
    # add-LayerNorm: ln(x, delta) -> (x + delta, normalised)), and the MLP is one `mlp`
    # call with GELU in its GEMMs' epilogues (day 020's GPT-2 block)
    fused: bool = False


GPU_DAYS = Ops(
    name="gpu_days",
    layer_norm=pco.MojoLayerNorm,
    linear=pco.MojoGEMM,
    scores=lambda q, k, mask, scale: pco.gemm_batched(q, k, mask, scale, 1.0, False, True),
    softmax=lambda s: pco.softmax(s, -1),
    bmm=pco.gemm_batched,
    permute=pco.permute_copy,
    permute_unbind=pco.permute_unbind,
)
TORCH = Ops(
    name="torch",
    layer_norm=nn.LayerNorm,
    linear=nn.Linear,
    scores=lambda q, k, mask, scale: torch.baddbmm(mask, q, k.mT, alpha=scale),
    softmax=lambda s: torch.softmax(s, -1),
    bmm=torch.bmm,
    permute=lambda x, dims: x.permute(dims).contiguous(),
    permute_unbind=lambda x, dims: x.permute(dims).contiguous().unbind(0),
)
GPU_DAYS_FUSED = Ops(
    name="gpu_days_fused",
    layer_norm=pco.MojoAddLayerNorm,
    linear=pco.MojoLinear,
    scores=GPU_DAYS.scores,
    softmax=GPU_DAYS.softmax,
    bmm=GPU_DAYS.bmm,
    permute=GPU_DAYS.permute,
    permute_unbind=GPU_DAYS.permute_unbind,
    fused=True,
)
BUILDS = {ops.name: ops for ops in (GPU_DAYS, GPU_DAYS_FUSED, TORCH)}


def causal_mask(seq: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(1, seq, seq): 0 on and below the diagonal, -inf above; added to the scores."""
    full = torch.full((seq, seq), -math.inf, dtype=dtype, device=device)
    return torch.triu(full, diagonal=1).unsqueeze(0)


class GPTBlock(nn.Module):
    """One pre-LN block of width `d` (a multiple of 64: d // 64 heads of 64)."""

    def __init__(self, d: int, ops: Ops | str = "torch", *, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        if isinstance(ops, str):
            if ops not in BUILDS:
                raise ValueError(f"GPTBlock: unknown build {ops!r}; known: {sorted(BUILDS)}")
            ops = BUILDS[ops]
        if d <= 0 or d % HEAD_DIM:
            raise ValueError(f"GPTBlock: d={d} must be a positive multiple of the head size {HEAD_DIM}")
        self.ops = ops
        self.d, self.heads = d, d // HEAD_DIM
        f = {"device": device, "dtype": dtype}
        self.ln1 = ops.layer_norm(d, eps=eps, **f)
        self.qkv = ops.linear(d, 3 * d, **f)
        self.proj = ops.linear(d, d, **f)
        self.ln2 = ops.layer_norm(d, eps=eps, **f)
        self.fc1 = ops.linear(d, MLP_RATIO * d, **f)
        self.fc2 = ops.linear(MLP_RATIO * d, d, **f)
        self.label_stages = False  # True: each stage is a torch.profiler range (benchmark.model_profile)

    def _stage(self, name: str):
        return torch.profiler.record_function(f"block.{name}") if self.label_stages else nullcontext()

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (batch, seq, d). `mask`: causal_mask(seq, ...), made here when not given
        (a benchmark passes one made once, so that no call allocates it)."""
        if x.dim() != 3 or x.shape[-1] != self.d:
            raise ValueError(f"GPTBlock: expected (batch, seq, {self.d}), got {tuple(x.shape)}")
        if mask is None:
            mask = causal_mask(x.shape[1], x.dtype, x.device)
        with self._stage("ln1"):
            a = self.ln1(x)[1] if self.ops.fused else self.ln1(x)
        o = self._attention(a, mask)
        if self.ops.fused:
            with self._stage("proj_residual_ln2"):
                x, a = self.ln2(x, self.proj(o))
            with self._stage("mlp_residual"):
                return x + pco.mlp(a, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)
        with self._stage("proj_residual"):
            x = x + self.proj(o)
        with self._stage("ln2"):
            a = self.ln2(x)
        with self._stage("fc1"):
            a = self.fc1(a)
        with self._stage("gelu"):
            a = F.gelu(a, approximate="tanh")
        with self._stage("fc2_residual"):
            return x + self.fc2(a)

    def _attention(self, a: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The heads' causal attention of the normalised input, heads merged: (b, s, d)."""
        b, s, d = a.shape
        h, hd = self.heads, HEAD_DIM
        with self._stage("qkv"):
            qkv = self.qkv(a)
        with self._stage("split_heads"):  # one copy: (b, s, 3, h, hd) -> 3 x (b, h, s, hd)
            q, k, v = (t.view(b * h, s, hd) for t in self.ops.permute_unbind(qkv.view(b, s, 3, h, hd), (2, 0, 3, 1, 4)))
        with self._stage("scores"):
            scores = self.ops.scores(q, k, mask, 1.0 / math.sqrt(hd))
        with self._stage("softmax"):
            p = self.ops.softmax(scores)
        with self._stage("pv"):
            o = self.ops.bmm(p, v)
        with self._stage("merge_heads"):  # one copy: (b, h, s, hd) -> (b, s, h, hd)
            return self.ops.permute(o.view(b, h, s, hd), (0, 2, 1, 3)).view(b, s, d)


def make_block(d: int, ops: Ops | str, dtype: torch.dtype, device, seed: int = 0) -> GPTBlock:
    """A block with seeded random parameters (`randomize_`), rounded to `dtype`: the same
    seed gives the same parameters in every build."""
    block = GPTBlock(d, ops, dtype=torch.float64)
    randomize_(block, seed)
    return block.to(device=device, dtype=dtype)


def randomize_(block: GPTBlock, seed: int) -> None:
    """Seeded random parameters: linear weights ~ N(0, 1/in), and no LayerNorm at its
    identity init (weight 1, bias 0), so every gradient is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.startswith("ln") and name.endswith("weight"):
                r = 1 + 0.2 * r
            elif name.endswith("weight"):
                r = r / math.sqrt(p.shape[1])
            else:
                r = 0.1 * r
            p.copy_(r)


def loss_of(y: torch.Tensor) -> torch.Tensor:
    """The scalar the forward + backward benchmark differentiates."""
    return y.float().pow(2).mean()


def train_step(block: nn.Module, x: torch.Tensor, mask: torch.Tensor, params: list[torch.Tensor]):
    """Forward + backward: (output, grad of x, grads of `params`). torch.autograd.grad
    returns new tensors, so repeated steps never accumulate into .grad."""
    y = block(x, mask)
    return (y, *torch.autograd.grad(loss_of(y), [x, *params]))


# -- correctness: both builds against the same block in float64 -----------------------------
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2, torch.float64: 1e-10}


class BlockMismatch(AssertionError):
    """A build of the block disagrees with the float64 reference beyond the tolerance."""


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (inf when got holds NaN or inf)."""
    err = (got.double() - want).abs().max().item()
    return err / max(want.abs().max().item(), 1e-30) if math.isfinite(err) else math.inf


def make_input(shape: tuple[int, int, int], dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed + 1)
    return torch.randn(shape, generator=g, device=device).to(dtype)


def reference(x: torch.Tensor, seed: int = 0) -> tuple[list[torch.Tensor], list[str]]:
    """A train step of the block in float64 on `x`, with the parameters of `make_block(seed)`
    rounded to x's dtype (so only the arithmetic differs), and the names of its outputs."""
    block = make_block(x.shape[-1], TORCH, x.dtype, x.device, seed).double()
    xd = x.double().requires_grad_()
    want = train_step(block, xd, causal_mask(x.shape[1], torch.float64, x.device), list(block.parameters()))
    names = ["output", "grad x"] + [f"grad {n}" for n, _ in block.named_parameters()]
    return [w.detach() for w in want], names


def check(got, want, names, dtype, what: str) -> float:
    """Raise BlockMismatch naming the worst tensor; return the largest relative error."""
    errs = [relative_error(g, w) for g, w in zip(got, want, strict=True)]
    worst = max(range(len(errs)), key=errs.__getitem__)
    if not errs[worst] <= TOLERANCE[dtype]:
        raise BlockMismatch(
            f"{what}: {names[worst]} differs from the float64 block: relative error {errs[worst]:.3g} "
            f"> {TOLERANCE[dtype]:g} ({dtype})"
        )
    return errs[worst]
