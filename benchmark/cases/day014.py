"""Day 014: GEMM (Mojo) vs torch.matmul (cuBLAS), square and batched, fp32 and bf16.

Shapes are (M, N, K) and (batch, M, N, K): C = A @ B with A (M, K), B (K, N), both
row-major (no transposes; the gpu_check binary times the other layouts). FLOPs =
2·batch·M·N·K. "% of cuBLAS" is 100 x speedup_vs_torch: the torch baseline is cuBLAS.
The fp32 baseline is true fp32: TF32 is switched off (torch's default, enforced and
recorded in each row's note), as in the issue's baseline of 52 TFLOP/s at 4096³.
"""

import math

import torch

import pytorch_custom_ops as pco

from ..harness import Case


def _inputs(shape, dtype, device):
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 baseline must not use tensor cores
    *batch, m, n, k = shape
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(*batch, m, k, generator=g, device=device).to(dtype)
    b = torch.randn(*batch, k, n, generator=g, device=device).to(dtype)
    return a, b


def _reference(a, b):
    return torch.matmul(a.double(), b.double())


def _note() -> str:
    return f"torch.backends.cuda.matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}"


def _flops(shape) -> int:
    return 2 * math.prod(shape)


CASES = [
    Case(
        day="day014",
        op="gemm",
        impls={"torch": torch.matmul, "mojo_gemm": pco.gemm},
        make_inputs=_inputs,
        reference=_reference,
        flops=_flops,
        shapes={
            "quick": [(128, 128, 128), (256, 256, 256), (17, 1000, 33)],
            "full": [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192)],
        },
        dtypes={"cpu": [torch.float32], "cuda": [torch.float32, torch.bfloat16]},
        note=_note,
    ),
    Case(
        day="day014",
        op="gemm_batched",
        impls={"torch": torch.matmul, "mojo_gemm_batched": pco.gemm_batched},
        make_inputs=_inputs,
        reference=_reference,
        flops=_flops,
        shapes={"quick": [(4, 64, 64, 64)], "full": [(8, 1024, 1024, 1024)]},
        dtypes={"cpu": [torch.float32], "cuda": [torch.float32, torch.bfloat16]},
        note=_note,
    ),
]


# -- a linear layer's three GEMMs at GPT-2's shapes (the baseline issue 19's ladder must beat) --
# tokens x in x out; y = x Wᵀ forward, dX = dY W and dW = dYᵀ X backward (the transposes day
# 014 reads in place). The last shape is the tied output head over the padded vocabulary.
LINEAR_SHAPES = {
    "quick": [(64, 48, 80), (33, 17, 40)],
    "full": [(8192, 768, 2304), (8192, 768, 768), (8192, 768, 3072), (8192, 3072, 768), (8192, 768, 50304)],
}
LINEAR_PASSES = {
    # pass: (what it computes, torch (cuBLAS), gpu-days)
    "linear_forward": ("x Wᵀ", lambda x, w: torch.mm(x, w.t()), lambda x, w: pco.gemm(x, w, transpose_b=True)),
    "linear_dx": ("dY W", lambda dy, w: torch.mm(dy, w), lambda dy, w: pco.gemm(dy, w)),
    "linear_dw": ("dYᵀ X", lambda dy, x: torch.mm(dy.t(), x), lambda dy, x: pco.gemm(dy, x, transpose_a=True)),
}


def _linear_inputs(op: str):
    def make(shape, dtype, device):
        tokens, d_in, d_out = shape
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tokens, d_in, generator=g, device=device).to(dtype)
        w = torch.randn(d_out, d_in, generator=g, device=device).to(dtype)
        dy = torch.randn(tokens, d_out, generator=g, device=device).to(dtype)
        return {"linear_forward": (x, w), "linear_dx": (dy, w), "linear_dw": (dy, x)}[op]

    return make


def linear_pass_case(op: str, day: str = "day014", name: str | None = None, impls=None, shapes=None) -> Case:
    """One pass of a linear layer as a Case: torch (cuBLAS) against `impls` (default: the
    op, `mojo_gemm`). Day 019's ladder reuses it with every kernel version as an impl."""
    what, torch_fn, ours = LINEAR_PASSES[op]
    return Case(
        day=day,
        op=name or op,
        impls={"torch": torch_fn, **(impls or {"mojo_gemm": ours})},
        make_inputs=_linear_inputs(op),
        reference=lambda *ts, fn=torch_fn: fn(*(t.double() for t in ts)),
        flops=lambda shape: 2 * math.prod(shape),
        shapes=shapes or LINEAR_SHAPES,
        dtypes={"cpu": [torch.float32], "cuda": [torch.bfloat16, torch.float16]},
        note=lambda what=what: f"{what} for tokens x in x out; " + _note(),
    )


CASES += [linear_pass_case(op) for op in LINEAR_PASSES]
