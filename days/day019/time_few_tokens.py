"""Day 019's 16-bit GEMMs at a few tokens on a GPU: K in S pieces on version 3's 128 x 64
tiles (float32 pieces, then the sum kernel), for each S, next to AUTO and cuBLAS.

    PYTHONPATH=$PWD python days/day019/time_few_tokens.py [label]

The shapes and the table are day 014's float32 sweep (`time_fp32.py --pieces`): GPT-2's
linear layers, forward and dX, at 64 to 1024 tokens. S = 1 is AUTO's tile without a split;
each S is checked on sampled entries against float64 first. The sweep behind
`few_token_pieces` in pytorch_custom_ops/gemm_gpu.py.
"""

from __future__ import annotations

import sys

import torch

from benchmark.gpu_script import need_cuda
from days.day014.time_fp32 import sweep_pieces
from pytorch_custom_ops import gemm_gpu


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    sweep_pieces(
        label,
        torch.bfloat16,
        "AUTO",
        lambda m, n, k, tb, sms: gemm_gpu.few_token_pieces(m, n, k, sms),
        tolerance=1e-2,
    )


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
