"""Day 020: cross-entropy over a vocabulary, forward + backward, the fused Mojo kernel
against F.cross_entropy (eager and torch.compile).

`cross_entropy_train` returns (loss, gradient of the logits) for a mean loss; its
effective bandwidth counts the least any implementation moves: the logits read once and
their gradient written once (2 N V bytes per element size). `cross_entropy` is the
forward alone, without autograd (the logits read once)."""

import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco

from ..harness import Case, compiled

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


def _reference(logits, targets):
    return _train(F.cross_entropy)(logits.double(), targets)


CASES = [
    Case(
        day="day020",
        op="cross_entropy_train",
        impls={
            "torch": _train(F.cross_entropy),
            "torch_compile": _train(compiled(F.cross_entropy)),
            "mojo_fused": _train(pco.cross_entropy),
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
