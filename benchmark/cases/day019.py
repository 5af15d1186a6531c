"""Day 019: the GEMM ladder past day 014 (version 4, persistent ping-pong) and the fused
linear layer, against cuBLAS / torch eager / torch.compile in the same run.

* `ladder_<pass>`: one GEMM pass of a linear layer (forward x Wᵀ, dX = dY W, dW = dYᵀ X)
  at GPT-2's shapes and at the square shapes, each kernel version forced through
  `pco.gemm_version`, next to cuBLAS (torch.mm) and the op's own choice (mojo_gemm).
  Shapes are tokens x in x out (day 014's LINEAR_SHAPES, plus squares). Compare the
  rungs by kernel_ms: a forced version plans every call.
* `linear_gelu`: y = gelu_tanh(x Wᵀ + b), the MLP's first layer, one fused launch vs
  torch's `F.gelu(F.linear(x, w, b), approximate="tanh")` eager and compiled.
* `linear_residual`: y = x Wᵀ + b + r, the attention and MLP projections.
"""

import math

import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco

from ..harness import Case, compiled
from .day014 import LINEAR_PASSES, LINEAR_SHAPES, linear_pass_case

# (version label, gemm_version name): the rungs compared in every ladder row
RUNGS = {
    "v3_tma_128x128": "TMA_128x128",  # day 014
    "v3_tma_128x256": "TMA_128x256",
    "v4_pingpong_64x256": "PINGPONG_64x256",  # day 019
    "v4_pingpong_128x128": "PINGPONG_128x128",
    "v4_multicast_128x128": "MULTICAST_128x128",
    "v4_coop_128x256": "COOP_128x256",
    "v4_coop_256x128": "COOP_256x128",
    "v4_coop_tma_256x128": "COOP_TMA_256x128",  # part 10: the epilogue stored by TMA
    "v4_coop_tma_128x256": "COOP_TMA_128x256",
    "v4_coop_multicast_256x128": "COOP_MULTICAST_256x128",
    "v4_coop_256x192": "COOP_256x192",
    "v4_streamk_256x128": "STREAMK_256x128",  # part 3
    "v4_splitk_256x128": "SPLITK_256x128",
    "v4_cluster_splitk_128x128": "CLUSTER_SPLITK_128x128",  # part 28: split-K in a cluster
}
LADDER_SHAPES = {
    "quick": LINEAR_SHAPES["quick"],
    "full": [(4096, 4096, 4096), (8192, 8192, 8192), *LINEAR_SHAPES["full"]],
}


def _forced(fn, version: str):
    def run(*args):
        with pco.gemm_version(version):
            return fn(*args)

    return run


def _ladder_case(op: str) -> Case:
    ours = LINEAR_PASSES[op][2]
    # a forced version re-plans every call (gemm_version resets the launch recipes), so
    # its end-to-end time carries host work: compare rungs by kernel_ms. mojo_gemm is
    # the op as users call it (AUTO, recipes on).
    impls = {**{label: _forced(ours, v) for label, v in RUNGS.items()}, "mojo_gemm": ours}
    name = "ladder_" + op.removeprefix("linear_")
    return linear_pass_case(op, day="day019", name=name, impls=impls, shapes=LADDER_SHAPES)


def _layer_inputs(shape, dtype, device):
    tokens, d_in, d_out = shape
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, d_in, generator=g, device=device).to(dtype)
    w = (torch.randn(d_out, d_in, generator=g, device=device) / math.sqrt(d_in)).to(dtype)
    b = torch.randn(d_out, generator=g, device=device).to(dtype)
    r = torch.randn(tokens, d_out, generator=g, device=device).to(dtype)
    return x, w, b, r


def _torch_gelu(x, w, b, r):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def _torch_residual(x, w, b, r):
    return F.linear(x, w, b) + r


LAYER_SHAPES = {
    "quick": [(64, 48, 80), (33, 24, 40)],
    "full": [(8192, 768, 3072), (8192, 768, 2304), (8192, 3072, 768), (8192, 768, 768)],
}


def _layer_case(op: str, torch_fn, ours) -> Case:
    return Case(
        day="day019",
        op=op,
        impls={"torch": torch_fn, "torch_compile": compiled(torch_fn), "mojo_linear": ours},
        make_inputs=_layer_inputs,
        reference=lambda *ts, fn=torch_fn: fn(*(t.double() for t in ts)),
        flops=lambda shape: 2 * math.prod(shape),
        shapes=LAYER_SHAPES,
        dtypes={"cpu": [torch.float32], "cuda": [torch.bfloat16, torch.float16]},
        cuda_only=("torch_compile",),
    )


CASES = [_ladder_case(op) for op in LINEAR_PASSES] + [
    _layer_case("linear_gelu", _torch_gelu, lambda x, w, b, r: pco.linear(x, w, b, "gelu_tanh")),
    _layer_case("linear_residual", _torch_residual, lambda x, w, b, r: pco.linear(x, w, b, residual=r)),
]
