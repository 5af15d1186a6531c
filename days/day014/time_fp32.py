"""Day 014's float32 GEMM (the SIMT kernel, and its split-K for weight gradients) against
torch.matmul (cuBLAS, TF32 off), by kernel time, on a GPU.

    PYTHONPATH=$PWD python days/day014/time_fp32.py [label]

The shapes are day 014's squares and GPT-2 small's linear layers at 8192 tokens: forward
y = x W^T, dX = dY W and dW = dY^T X (the transposed-A rows, where split-K applies). Each
result is checked on sampled entries against float64 (day 014's `sampled_error`), then
timed by CUPTI (benchmark.timing.kernel_time_ms).
"""

from __future__ import annotations

import sys

import torch

import pytorch_custom_ops as pco
from benchmark.timing import kernel_time_ms
from days.day014.time_versions import SQUARES, sampled_error

SHAPES = SQUARES + [
    shape
    for d_in, d_out in ((768, 2304), (768, 768), (768, 3072), (3072, 768))
    for shape in ((8192, d_out, d_in, False, True), (8192, d_in, d_out, False, False), (d_out, d_in, 8192, True, False))
]


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "fp32"
    torch.manual_seed(0)
    total_torch = total_ours = 0.0
    for m, n, k, ta, tb in SHAPES:
        a = torch.randn(*((k, m) if ta else (m, k)), device="cuda")
        b = torch.randn(*((n, k) if tb else (k, n)), device="cuda")
        pa, pb = (a.mT if ta else a), (b.mT if tb else b)
        err = sampled_error(pco.gemm(a, b, transpose_a=ta, transpose_b=tb), a, b, ta, tb)
        t = kernel_time_ms(lambda: torch.matmul(pa, pb), 5)  # noqa: B023 (called before the next shape)
        o = kernel_time_ms(lambda: pco.gemm(a, b, transpose_a=ta, transpose_b=tb), 5)  # noqa: B023
        if (m, n) != (8192, 8192):
            total_torch, total_ours = total_torch + t, total_ours + o
        shape = f"{m}x{n}x{k} ta={int(ta)} tb={int(tb)}"
        print(f"{label} {shape}: torch {t:.3f} ms, ours {o:.3f} ({100 * t / o:.0f}%) err {err:.1e}")
    share = 100 * total_torch / total_ours
    print(f"{label} total (no 8192^3): torch {total_torch:.2f} ours {total_ours:.2f} ({share:.0f}%)")


if __name__ == "__main__":
    main()
