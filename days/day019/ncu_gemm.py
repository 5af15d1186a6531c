"""Two GEMMs of a GPT-2 124M step, day 019's AUTO kernel and cuBLAS's, for Nsight Compute:
bf16 16384 x 2304 x 768 (the QKV forward, K = 768: 82% of cuBLAS) and 16384 x 768 x 3072
(the MLP projection's forward, K = 3072: 92%). Each runs twice; profile the second.

    M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__throughput.avg.pct_of_peak_sustained_elapsed,...
    ncu --clock-control none -k regex:"pingpong|nvjet|gemm" --launch-skip 4 --launch-count 4 \\
        --metrics $M --section WarpStateStats python days/day019/ncu_gemm.py

(the stored run and its metric list: results/nvidia-h100-80gb-hbm3/day019_ncu.txt).
"""

import torch

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda

SHAPES = ((16384, 2304, 768), (16384, 768, 3072))  # (tokens, out, in): y = x W^T


def main() -> None:
    operands = []
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda").bfloat16()
        w = torch.randn(n, k, device="cuda").bfloat16()
        operands.append((x, w))
    for _ in range(2):
        for x, w in operands:
            pco.gemm(x, w, transpose_b=True)
            torch.matmul(x, w.t())
    torch.cuda.synchronize()


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
