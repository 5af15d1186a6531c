"""Day 020: cross-entropy over a vocabulary, forward + backward, the fused Mojo kernel
against F.cross_entropy (eager and torch.compile); and the residual add fused into the
LayerNorm after it (`add_layer_norm`), forward + backward.

`cross_entropy_train` returns (loss, gradient of the logits) for a mean loss; its
effective bandwidth counts the least any implementation moves: the logits read once and
their gradient written once (2 N V bytes per element size). `mojo_fused` is what
`pco.cross_entropy` does (one pass since part 11), `mojo_two_pass` the forward and the
backward kernels of parts 2-9. `cross_entropy` is the
forward alone, without autograd (the logits read once).

`add_layer_norm_train` is one pre-LN step of a GPT's residual stream under autocast: a
float32 stream x and a branch output delta in the case's dtype give s = x + delta and
y = LayerNorm(s) in that dtype; backward takes dy (the dtype) and ds (float32) and returns
the gradients of x, delta, weight and bias. Its bytes are what one pass each way must
move: forward x, delta in, s, y out; backward dy, s, ds in, dx, ddelta out.

`mlp_train` is GPT-2's MLP (d -> 4d, tanh GELU, 4d -> d) forward and backward, every
gradient: `pco.mlp` (GELU and its gradient in day 019's GEMM epilogues) against torch's
two linear layers and GELU, eager and compiled. Its flops are the six products."""

import importlib

import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco

from ..harness import Case, compiled
from .day013 import _params

# the module itself: `pytorch_custom_ops.cross_entropy` is also the function's name there
ce_module = importlib.import_module("pytorch_custom_ops.cross_entropy")

VOCAB_SHAPES = {"quick": [(4, 301), (7, 1000)], "full": [(8192, 50304), (4096, 128256), (16384, 32000)]}
DTYPES = {"cpu": [torch.float32], "cuda": [torch.bfloat16, torch.float32]}


def _inputs(shape, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    rows, vocab = shape
    logits = torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(2).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g, device=device)
    targets[::97] = -100  # a few ignored rows, as padding would give
    return logits, targets


def _train(loss_fn):
    def run(logits, targets):
        x = logits.detach().requires_grad_()
        loss = loss_fn(x, targets)
        loss.backward()
        return loss, x.grad

    return run


def _two_pass(logits, targets):
    """pco.cross_entropy as before day020 part 11: the gradient written by the backward."""
    ce_module.ONE_PASS = False
    try:
        return pco.cross_entropy(logits, targets)
    finally:
        ce_module.ONE_PASS = True


def _reference(logits, targets):
    return _train(F.cross_entropy)(logits.double(), targets)


NORM_SHAPES = {"quick": [(64, 768), (33, 1000)], "full": [(16384, 768), (8192, 1024), (4096, 4096)]}


def _norm_inputs(shape, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    f32 = torch.float32
    x = torch.randn(shape, generator=g, device=device).mul_(3).add_(1)
    delta = torch.randn(shape, generator=g, device=device).to(dtype)
    w, b = _params(shape[1], f32, device, g)
    dy = torch.randn(shape, generator=g, device=device).to(dtype)
    ds = torch.randn(shape, generator=g, device=device, dtype=f32)
    return x, delta, w, b, dy, ds


def _norm_train(forward):
    """forward(x, delta, w, b) -> (s, y); returns y and the four gradients."""

    def run(x, delta, w, b, dy, ds):
        leaves = [t.detach().requires_grad_() for t in (x, delta, w, b)]
        s, y = forward(*leaves)
        return (y, *torch.autograd.grad((y, s), leaves, (dy, ds)))

    return run


def _torch_add_norm(x, delta, w, b):
    s = x + delta
    return s, F.layer_norm(s, s.shape[-1:], w, b).to(delta.dtype)


def _mojo_add_norm(x, delta, w, b):
    return pco.add_layer_norm(x, delta, x.shape[-1], w, b, out_dtype=delta.dtype)


def _norm_reference(x, delta, w, b, dy, ds):
    return _norm_train(_torch_add_norm)(*(t.double() for t in (x, delta, w, b, dy, ds)))


def _norm_bytes(shape, dtype):
    n, d = shape[0] * shape[1], dtype.itemsize
    low = d if dtype != torch.float32 else 0  # a float32 delta's gradient is dx itself
    return n * (4 + d) * 2 + n * (d + 3 * 4 + low)


MLP_SHAPES = {"quick": [(64, 64), (40, 96)], "full": [(16384, 768), (8192, 1024)]}


def _mlp_inputs(shape, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    n, d = shape

    def rand(*size, scale=1.0):
        return (torch.randn(size, generator=g, device=device) * scale).to(dtype)

    x, dy = rand(n, d), rand(n, d)
    w1, b1 = rand(4 * d, d, scale=d**-0.5), rand(4 * d, scale=0.1)
    w2, b2 = rand(d, 4 * d, scale=(4 * d) ** -0.5), rand(d, scale=0.1)
    return x, w1, b1, w2, b2, dy


def _torch_mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def _mlp_train(forward):
    """forward(x, w1, b1, w2, b2) -> y; returns y and the five gradients."""

    def run(x, w1, b1, w2, b2, dy):
        leaves = [t.detach().requires_grad_() for t in (x, w1, b1, w2, b2)]
        y = forward(*leaves)
        return (y, *torch.autograd.grad(y, leaves, dy))

    return run


CASES = [
    Case(
        day="day020",
        op="add_layer_norm_train",
        impls={
            "torch": _norm_train(_torch_add_norm),
            "torch_compile": _norm_train(compiled(_torch_add_norm)),
            "mojo_fused": _norm_train(_mojo_add_norm),
        },
        make_inputs=_norm_inputs,
        reference=_norm_reference,
        bytes_moved=_norm_bytes,
        shapes=NORM_SHAPES,
        dtypes=DTYPES,
        cuda_only=("torch_compile",),
    ),
    Case(
        day="day020",
        op="mlp_train",
        impls={
            "torch": _mlp_train(_torch_mlp),
            "torch_compile": _mlp_train(compiled(_torch_mlp)),
            "mojo_fused": _mlp_train(pco.mlp),
        },
        make_inputs=_mlp_inputs,
        reference=lambda *ts: _mlp_train(_torch_mlp)(*(t.double() for t in ts)),
        flops=lambda shape: 6 * 2 * shape[0] * shape[1] * 4 * shape[1],
        shapes=MLP_SHAPES,
        dtypes={"cpu": [torch.float32], "cuda": [torch.bfloat16]},
        cuda_only=("torch_compile",),
    ),
    Case(
        day="day020",
        op="cross_entropy_train",
        impls={
            "torch": _train(F.cross_entropy),
            "torch_compile": _train(compiled(F.cross_entropy)),
            "mojo_fused": _train(pco.cross_entropy),
            "mojo_two_pass": _train(_two_pass),
        },
        make_inputs=_inputs,
        reference=_reference,
        bytes_moved=lambda shape, dtype: 2 * shape[0] * shape[1] * dtype.itemsize,
        shapes=VOCAB_SHAPES,
        dtypes=DTYPES,
        cuda_only=("torch_compile",),
    ),
    Case(
        day="day020",
        op="cross_entropy",
        impls={
            "torch": F.cross_entropy,
            "torch_compile": compiled(F.cross_entropy),
            "mojo_fused": pco.cross_entropy,
        },
        make_inputs=_inputs,
        reference=lambda logits, targets: F.cross_entropy(logits.double(), targets),
        bytes_moved=lambda shape, dtype: shape[0] * shape[1] * dtype.itemsize,
        shapes=VOCAB_SHAPES,
        dtypes=DTYPES,
        cuda_only=("torch_compile",),
    ),
]
