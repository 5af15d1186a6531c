"""A linear layer's bias gradient, g.sum(0) of a (rows, cols) bf16 gradient, three ways, by
kernel time on a GPU: cuBLAS's matrix-vector product gᵀ 1 (what `column_sum` runs), the
same as a 1-row GEMM, and torch's column reduction.

    PYTHONPATH=$PWD python days/day016/time_column_sums.py

Each is timed over repeated calls on one tensor, so a gradient that fits in L2 (50 MB on
the H100) is read from L2: a bound for what a model's step, reading it cold, can see.
"""

from __future__ import annotations

import torch

from benchmark.gpu_script import need_cuda
from benchmark.timing import kernel_time_ms


def main() -> None:
    torch.manual_seed(0)
    for rows in (4096, 8192, 16384):
        for cols in (768, 1024, 2304, 3072, 4096):
            g = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
            ones = torch.ones(rows, device="cuda", dtype=torch.bfloat16)
            t_mv = kernel_time_ms(lambda: torch.mv(g.t(), ones), 20) * 1e3  # noqa: B023
            t_mm = kernel_time_ms(lambda: torch.mm(ones.view(1, -1), g), 20) * 1e3  # noqa: B023
            t_sum = kernel_time_ms(lambda: g.sum(0), 20) * 1e3  # noqa: B023
            mb = rows * cols * 2 / 1e3  # so MB / us = GB/s
            print(
                f"{rows}x{cols}: mv {t_mv:.1f} us ({mb / t_mv:.0f} GB/s) | mm {t_mm:.1f} ({mb / t_mm:.0f}) "
                f"| sum {t_sum:.1f} ({mb / t_sum:.0f})"
            )


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
