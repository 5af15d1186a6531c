"""Kernel time of GPT-2 124M's forward products with their bias (16384 tokens, bf16, CUDA-graph
replays, microseconds): the bias as gemm's broadcast c (MojoGEMM), the BIAS epilogue
(`linear`), no bias (what the bias costs), and cuBLAS with its bias (F.linear).

    python -m days.day020.time_bias_epilogues
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda

from .time_master_grads import ROWS, graph_us

SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))  # (in, out): c_attn, c_proj, c_fc, c_mlp_proj


def main() -> None:
    bf16 = torch.bfloat16
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {ROWS} rows, bf16; us per call")
    print("in->out   bias_as_c  bias_epilogue  no_bias  cublas_bias")
    for k_in, n_out in SHAPES:
        x = torch.randn(ROWS, k_in, device="cuda").to(bf16)
        w = (torch.randn(n_out, k_in, device="cuda") * 0.02).to(bf16)
        b = torch.randn(n_out, device="cuda").to(bf16)
        want = F.linear(x.double(), w.double(), b.double())
        for y in (pco.gemm(x, w, b, 1.0, 1.0, False, True), pco.linear(x, w, b)):
            err = ((y.double() - want).abs() / (want.abs() + 1)).max().item()
            if err > 3e-2:
                raise SystemExit(f"{k_in}->{n_out}: error {err:.2e} against float64")
        t = [
            graph_us(lambda x=x, w=w, b=b: pco.gemm(x, w, b, 1.0, 1.0, False, True)),
            graph_us(lambda x=x, w=w, b=b: pco.linear(x, w, b)),
            graph_us(lambda x=x, w=w: pco.gemm(x, w, transpose_b=True)),
            graph_us(lambda x=x, w=w, b=b: F.linear(x, w, b)),
        ]
        print(f"{k_in}->{n_out:<5d}" + " ".join(f"{v:12.1f}" for v in t))


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
