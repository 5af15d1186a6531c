"""Column sums (a linear layer's bias gradient) by kernel time on a GPU: day 013's two
stages against cuBLAS's gᵀ 1 (torch.mv, what `gemm.column_sum` ran before) and torch's
g.sum(0), on the bias gradients of day 016's block and day 020's GPT-2 step.

    PYTHONPATH=$PWD python days/day013/time_column_sums.py

Each is checked against float64 first; TB/s counts the matrix read once.
"""

from __future__ import annotations

import torch

from benchmark.gpu_script import need_cuda
from benchmark.timing import kernel_time_ms
from pytorch_custom_ops.column_sums import column_sums

SHAPES = ((4096, 1024), (4096, 3072), (8192, 768), (16384, 768), (16384, 2304), (16384, 3072))


def main() -> None:
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; bf16; kernel time in us (TB/s)")
    for rows, cols in SHAPES:
        g = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        ones = torch.ones(rows, device="cuda", dtype=torch.bfloat16)
        want = g.double().sum(0)
        impls = {
            "column_sums": lambda g=g: column_sums(g),
            "cuBLAS mv": lambda g=g, ones=ones: torch.mv(g.t(), ones),
            "torch sum": lambda g=g: g.sum(0),
        }
        row = f"{rows}x{cols}:"
        for name, fn in impls.items():
            err = ((fn().double() - want).abs() / (g.double().abs().sum(0) + 1)).max().item()
            assert err < 4e-3, (name, err)
            us = kernel_time_ms(fn, 50) * 1e3
            row += f" | {name} {us:.1f} ({g.numel() * 2 / us / 1e6:.2f})"
        print(row)


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
