"""Day 016, part seven: the GPT block's head split, (b, s, 3, h, 64) -> (3, b, h, s, 64), by
torch's copy (eager and torch.compile) against `pco.permute_copy`."""

import math

import torch

import pytorch_custom_ops as pco

from ..harness import Case, compiled

SPLIT = (2, 0, 3, 1, 4)


def _split_torch(x):
    return x.permute(SPLIT).contiguous()


def _inputs(shape, dtype, device):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device),)


CASES = [
    Case(
        day="day016",
        op="permute_copy",
        impls={
            "torch": _split_torch,
            "torch_compile": compiled(_split_torch),
            "mojo": lambda x: pco.permute_copy(x, SPLIT),
        },
        make_inputs=_inputs,
        reference=lambda x: _split_torch(x.double()),
        bytes_moved=lambda shape, dtype: 2 * math.prod(shape) * dtype.itemsize,  # read once, write once
        shapes={
            "quick": [(2, 13, 3, 2, 64)],
            # (batch, seq, 3, heads, 64) of the block's shapes: 8 x 1024 x 768, 32 x 128 x 1024, 4 x 2048 x 1024
            "full": [(8, 1024, 3, 12, 64), (32, 128, 3, 16, 64), (4, 2048, 3, 16, 64)],
        },
        dtypes={"cpu": [torch.float32], "cuda": [torch.float32, torch.bfloat16]},
        cuda_only=("torch_compile",),
    )
]
