"""One forward + backward of day 018's kernels per backward version and mask, for Nsight
Compute: bf16 (2, 16, 8192, 128) unless --shape says. Everything runs twice, the second
round between cudaProfilerStart and Stop (`ncu --profile-from-start off` sees only it).

    M=gpu__time_duration.sum,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,...
    ncu --clock-control none -k regex:"attention_bwd" --metrics $M \\
        python days/day018/ncu_backward.py --versions 5 6

(the metric lists and stored runs: section 2 of
results/nvidia-h100-80gb-hbm3/day018_backward_onepass.txt, and with --cudnn and the
stall reasons results/nvidia-h200/day018_ncu_backward.txt; with --triton at head_dim 64,
results/nvidia-h200/day018_backward_16b_stores.txt).
"""

import argparse

import torch

import pytorch_custom_ops as pco
from benchmark.cases.day017 import ATTENTION
from benchmark.gpu_script import need_cuda
from days.day018.time_versions import causal_flags
from pytorch_custom_ops.attention_gpu import BWD_VERSIONS, attention_bwd_version

SHAPE = (2, 16, 8192, 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=4, default=list(SHAPE), help="batch heads seq head_dim")
    parser.add_argument("--versions", type=int, nargs="+", default=[5, 6], choices=BWD_VERSIONS)
    parser.add_argument("--masks", nargs="+", choices=("none", "causal"), default=["none", "causal"])
    parser.add_argument("--cudnn", action="store_true", help="also SDPA's cuDNN backend per mask (last)")
    parser.add_argument("--triton", action="store_true", help="also day 017's Triton kernel per mask (last)")
    args = parser.parse_args()
    need_cuda(None, __file__)
    q, k, v = (torch.randn(args.shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(args.shape, device="cuda", dtype=torch.bfloat16)
    rivals = [name for name, wanted in (("triton", args.triton), ("sdpa_cudnn", args.cudnn)) if wanted]
    for round in range(2):  # Triton autotunes in the first round
        if round == 1:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        for causal in causal_flags(args.masks):
            for version in args.versions:
                with attention_bwd_version(version):
                    torch.autograd.grad(pco.attention(q, k, v, causal=causal), (q, k, v), g)
            for name in rivals:
                torch.autograd.grad(ATTENTION[name](q, k, v, causal), (q, k, v), g)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
