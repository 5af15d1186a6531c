"""Day 020's GPT: GPT-2's shape, in one file, built from gpu-days kernels or from torch.

    tokens -> token + position embedding -> n_layer x [x + attn(ln1(x)); x + mlp(ln2(x))]
           -> ln_f -> logits = x @ wte^T (the output head shares the token embedding)

Each residual add is done by the LayerNorm after it: `x, h = ln(x, delta)` returns the
stream x + delta and its normalisation (a block hands its MLP output to the next block's
ln_1, the last one to ln_f). gpu-days fuses the pair in one kernel each way
(`MojoAddLayerNorm`), which under autocast also writes h in bf16 and reads its gradient
in bf16; torch's build composes the same add and `nn.LayerNorm`.

`GPT(config, impl="gpu_days")` runs every LayerNorm, linear layer, attention, softmax and the
loss on gpu-days ops; `impl="torch"` is the same model in torch, with the same parameter names,
so one state_dict loads into either. What each impl uses:

| part | gpu_days | torch |
|---|---|---|
| residual add + LayerNorm | `MojoAddLayerNorm` (day 013's kernels, fused add) | `x + delta`, `nn.LayerNorm` |
| linear layers, output head | `MojoLinear` / `linear` (day 019; the bias in the epilogue) | `nn.Linear` / `F.linear` |
| MLP: c_fc, GELU, c_mlp_proj | `mlp` (day 019's GEMM, GELU and its gradient in the epilogues) | `nn.Linear`, `F.gelu` |
| attention, CUDA, bf16/fp16 | `flash_attention_qkvpacked` (day 017) | SDPA |
| attention, otherwise | `gemm_batched` + `softmax` (days 014, 012) | SDPA |
| loss | `cross_entropy` (day 020: one pass per row, fused gradient) | `F.cross_entropy` |

Embeddings are torch in both (gpu_days asks for the token lookup's gradient as sparse
rows). Neither build copies q, k or v out of the QKV projection's output: SDPA and day
017's kernels read them through strides, and both write the attention output as (batch,
seq, heads, head_dim), so merging the heads is a view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import pytorch_custom_ops as pco

IMPLS = ("torch", "gpu_days")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 256  # the longest context
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    eps: float = 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig: {name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


CONFIGS = {
    "tiny": GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64),  # CPU tests
    "small": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),  # learns in minutes on an H100
    "gpt2": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),  # 124M, throughput
}


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"GPT: impl must be one of {IMPLS}, got {impl!r}")


class AddLayerNorm(nn.LayerNorm):
    """torch's build of `ln(x, delta)`: (x + delta, LayerNorm(x + delta)); x alone when
    delta is None. The same parameters as `nn.LayerNorm`."""

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None):
        x = x if delta is None else x + delta
        return x, super().forward(x)


def _layer_norm(impl: str, d: int, eps: float) -> nn.Module:
    return pco.MojoAddLayerNorm(d, eps=eps) if impl == "gpu_days" else AddLayerNorm(d, eps=eps)


def _linear(impl: str, d_in: int, d_out: int) -> nn.Module:
    return pco.MojoLinear(d_in, d_out) if impl == "gpu_days" else nn.Linear(d_in, d_out)


def causal_attention(qkv: torch.Tensor, impl: str) -> torch.Tensor:
    """Causal attention of q, k, v packed as (batch, seq, 3, heads, head_dim), the QKV
    projection's output; returns (batch, seq, heads, head_dim)."""
    if impl == "gpu_days" and qkv.is_cuda and qkv.dtype in (torch.bfloat16, torch.float16):
        return pco.flash_attention_qkvpacked(qkv, causal=True)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (batch, heads, seq, head_dim) views
    if impl == "torch":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    # the composition a user writes without a fused kernel: masked scores, softmax, P V
    b, h, s, hd = q.shape
    mask = _causal_mask(s, q.dtype, q.device)
    scores = pco.gemm_batched(
        q.reshape(b * h, s, hd), k.reshape(b * h, s, hd), mask, 1.0 / math.sqrt(hd), 1.0, False, True
    )
    p = pco.softmax(scores, -1)
    return pco.gemm_batched(p, v.reshape(b * h, s, hd)).view(b, h, s, hd).transpose(1, 2)


_masks: dict = {}


def _causal_mask(seq: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(1, seq, seq): 0 on and below the diagonal, -inf above (made once per shape)."""
    key = (seq, dtype, str(device))
    if key not in _masks:
        full = torch.full((seq, seq), -math.inf, dtype=dtype, device=device)
        _masks[key] = torch.triu(full, diagonal=1).unsqueeze(0)
    return _masks[key]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, impl: str) -> torch.Tensor:
    """Mean cross-entropy of (N, vocab) logits against (N,) class indices."""
    if impl == "torch":
        return F.cross_entropy(logits, targets)
    return pco.cross_entropy(logits, targets)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, impl: str):
        super().__init__()
        d = config.n_embd
        self.impl, self.n_head = impl, config.n_head
        self.ln_1 = _layer_norm(impl, d, config.eps)
        self.c_attn = _linear(impl, d, 3 * d)
        self.c_proj = _linear(impl, d, d)
        self.ln_2 = _layer_norm(impl, d, config.eps)
        self.c_fc = _linear(impl, d, 4 * d)
        self.c_mlp_proj = _linear(impl, 4 * d, d)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream; delta: the previous block's MLP output, not yet added
        (None before the first block). Returns the stream and this block's MLP output."""
        b, s, d = x.shape
        h = self.n_head
        x, y = self.ln_1(x, delta)
        y = causal_attention(self.c_attn(y).view(b, s, 3, h, d // h), self.impl)
        x, y = self.ln_2(x, self.c_proj(y.reshape(b, s, d)))
        return x, self.mlp(y)

    def mlp(self, y: torch.Tensor) -> torch.Tensor:
        if self.impl == "gpu_days":  # one function both ways, with no GELU kernel (day 020, part 5)
            return pco.mlp(y, self.c_fc.weight, self.c_fc.bias, self.c_mlp_proj.weight, self.c_mlp_proj.bias)
        return self.c_mlp_proj(F.gelu(self.c_fc(y), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, impl: str = "torch"):
        super().__init__()
        _check_impl(impl)
        self.config, self.impl = config, impl
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, impl) for _ in range(config.n_layer))
        self.ln_f = _layer_norm(impl, config.n_embd, config.eps)

    @torch.no_grad()
    def init_weights(self, seed: int) -> GPT:
        """GPT-2's initialisation from a seeded generator (the same in both impls): normal
        0.02, residual projections scaled by 1/sqrt(2 n_layer), zero biases, unit norms."""
        g = torch.Generator().manual_seed(seed)
        residual = {"c_proj.weight", "c_mlp_proj.weight"}
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.split(".", 2)[-1] in residual else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """logits (batch, seq, vocab), and the mean loss when `targets` are given."""
        if idx.dim() != 2:
            raise ValueError(f"GPT: idx must be (batch, seq), got shape {tuple(idx.shape)}")
        b, s = idx.shape
        if s > self.config.block_size:
            raise ValueError(f"GPT: sequence of {s} is longer than block_size {self.config.block_size}")
        pos = torch.arange(s, device=idx.device)
        # gpu_days: the lookup's gradient as sparse rows. The output head's dense gradient of
        # the same (tied) table arrives first, and autograd adds the rows into it (an
        # index_add) instead of a dense (vocab, d) lookup gradient, sorted, scattered, then
        # summed. Through F.embedding, not nn.Embedding(sparse=True): DDP would then expect
        # the table's gradient to be sparse, and the sum is dense.
        tokens = F.embedding(idx, self.wte.weight, sparse=self.impl == "gpu_days")
        x, delta = tokens + self.wpe(pos), None
        for block in self.blocks:
            x, delta = block(x, delta)
        x = self.ln_f(x, delta)[1].reshape(b * s, self.config.n_embd)  # not -1: b * s may be 0
        logits = pco.linear(x, self.wte.weight) if self.impl == "gpu_days" else F.linear(x, self.wte.weight)
        loss = None if targets is None else cross_entropy(logits, targets.reshape(-1), self.impl)
        return logits.view(b, s, self.config.vocab_size), loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, *, temperature: float = 1.0, seed: int = 0) -> torch.Tensor:
        """Sample `new_tokens` after `idx` (batch, seq), from a seeded generator."""
        g = torch.Generator(device=idx.device).manual_seed(seed)
        for _ in range(new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            probs = torch.softmax(logits[:, -1].float() / temperature, -1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g)], dim=1)
        return idx


def twins(config: GPTConfig, seed: int, device="cpu", dtype=torch.float32) -> dict[str, GPT]:
    """Both impls with the same initial parameters."""
    ref = GPT(config, "torch").init_weights(seed)
    models = {"torch": ref, "gpu_days": GPT(config, "gpu_days")}
    models["gpu_days"].load_state_dict(ref.state_dict())
    return {k: m.to(device=device, dtype=dtype) for k, m in models.items()}
