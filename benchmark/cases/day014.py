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
