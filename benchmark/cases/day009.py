"""Day 009: online softmax (Mojo) vs torch.softmax (eager and torch.compile)."""

import torch

import pytorch_custom_ops as pco

from ..harness import Case, compiled


def _inputs(shape, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(3).to(dtype),)


CASES = [
    Case(
        day="day009",
        op="softmax",
        impls={
            "torch": lambda x: torch.softmax(x, dim=-1),
            "torch_compile": compiled(lambda x: torch.softmax(x, dim=-1)),
            "mojo_online": lambda x: pco.online_softmax(x, dim=-1),
        },
        make_inputs=_inputs,
        reference=lambda x: torch.softmax(x.double(), dim=-1),
        # effective bandwidth: read the input once, write the output once
        bytes_moved=lambda shape, dtype: 2 * shape[0] * shape[1] * dtype.itemsize,
        shapes={
            "quick": [(64, 1000), (512, 1024), (256, 4096)],
            "full": [(4096, 128), (4096, 1024), (4096, 4096), (4096, 16384), (32768, 4096), (4096, 32000)],
        },
        dtypes={"cpu": [torch.float32], "cuda": [torch.float32, torch.bfloat16]},
        cuda_only=("torch_compile",),
    )
]
