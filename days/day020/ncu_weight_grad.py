"""The output head's weight gradient (50304 x 768 from 16384 rows, bf16) stored in bf16 and
in float32, for Nsight Compute: why the float32 store costs 9-16% there (day 020, part 6).

    ncu --clock-control none --kernel-name regex:gemm_pingpong --launch-skip 2 --launch-count 2 \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,... \\
        python -m days.day020.ncu_weight_grad

Launch order: bf16, float32, bf16, float32 (the first pair warms up; ncu takes the second).
"""

import torch

import pytorch_custom_ops as pco
from pytorch_custom_ops.master_weights import weight_grad


def main() -> None:
    g = torch.randn(16384, 50304, device="cuda").to(torch.bfloat16)
    x = torch.randn(16384, 768, device="cuda").to(torch.bfloat16)
    for _ in range(2):
        pco.gemm(g, x, transpose_a=True)
        weight_grad(g, x)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
