"""Day 015: softmax of a few very long rows (up to 2^28 elements): torch (eager and
torch.compile) against the two multi-block Mojo pipelines."""

import torch

import pytorch_custom_ops as pco

from ..harness import Case, compiled
from .day009 import _inputs

CASES = [
    Case(
        day="day015",
        op="long_softmax",
        impls={
            "torch": lambda x: torch.softmax(x, dim=-1),
            "torch_compile": compiled(lambda x: torch.softmax(x, dim=-1)),
            "mojo_four_stage": lambda x: pco.long_softmax(x, dim=-1, pipeline="four_stage"),
            "mojo_fused": lambda x: pco.long_softmax(x, dim=-1, pipeline="fused"),
        },
        make_inputs=_inputs,
        reference=lambda x: torch.softmax(x.double(), dim=-1),
        # effective bandwidth: the least any softmax moves, read x once and write y once
        # (2 N 4 B in fp32). The fused pipeline really moves 3 N 4 B (x read twice), the
        # 4-stage one 5 N 4 B (3 reads + 2 writes), so their DRAM bandwidth is 1.5x and
        # 2.5x the figure here.
        bytes_moved=lambda shape, dtype: 2 * shape[0] * shape[1] * dtype.itemsize,
        shapes={
            "quick": [(1, 1000), (1, 2**16), (4, 20000)],
            "full": [(1, 2**20), (1, 2**24), (1, 2**28), (8, 2**22)],
        },
        dtypes={"cpu": [torch.float32], "cuda": [torch.float32]},
        cuda_only=("torch_compile",),
    )
]
