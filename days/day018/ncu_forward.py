"""One forward of day 018's kernel, SDPA's cuDNN kernel and its flash kernel, for Nsight
Compute: bf16 (2, 16, 8192, 128), not causal. Each runs twice; profile the second.

    M=gpu__time_duration.sum,smsp__inst_executed.sum,sm__inst_executed_pipe_tensor_op_gmma.sum,...
    ncu --clock-control none -k regex:"attention_fwd|sdpa|flash" --launch-count 6 \\
        --metrics $M --section WarpStateStats python days/day018/ncu_forward.py

(the metric list of the stored run is in results/nvidia-h100-80gb-hbm3/day018_ncu.txt).
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda

SHAPE = (2, 16, 8192, 128)


def main() -> None:
    q, k, v = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(2):
        pco.attention(q, k, v)
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
