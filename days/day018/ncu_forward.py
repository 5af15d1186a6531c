"""One forward of day 018's kernel, day 017's Triton kernel, and SDPA's cuDNN and flash
kernels, for Nsight Compute: bf16, (2, 16, 8192, 128) not causal unless told. Each runs
twice (Triton's autotuning launches its kernel many times in the first round); the
second round runs between cudaProfilerStart and Stop.

    M=gpu__time_duration.sum,smsp__inst_executed.sum,sm__inst_executed_pipe_tensor_op_gmma.sum,...
    ncu --clock-control none --profile-from-start off --metrics $M --section WarpStateStats \\
        python days/day018/ncu_forward.py [--shape 16 32 1024 64] [--causal]

(the metric list of the stored runs is in results/nvidia-h100-80gb-hbm3/day018_ncu.txt
and results/nvidia-h200/day018_short_rows.txt, section 3).
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=4, default=[2, 16, 8192, 128], help="batch heads seq head_dim")
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    q, k, v = (torch.randn(args.shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for round in range(2):
        if round == 1:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        pco.attention(q, k, v, causal=args.causal)
        pco.flash_attention(q, k, v, causal=args.causal)
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
