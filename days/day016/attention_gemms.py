"""Day 016's GPT block computes attention with four batched GEMMs. This script times each
one alone, on the GPU, for every bf16 GEMM version and for cuBLAS.

    PYTHONPATH=$PWD python days/day016/attention_gemms.py [--versions AUTO PINGPONG_128x64 ...]

The block's shapes are batch x seq x d, with d / 64 heads of 64; the products of one head
are:

- the scores, (s x 64)(64 x s), with the (1, s, s) causal mask added as `c`;
- dP, the same product without `c`;
- P V, (s x s)(s x 64), and its transposed-A form (dV).

Each version is checked against cuBLAS (the relative error is flagged when it is 2% or
more), then timed by kernel time (CUPTI, `benchmark.timing.kernel_time_ms`).
"""

from __future__ import annotations

import argparse

import torch

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda
from benchmark.timing import kernel_time_ms
from pytorch_custom_ops.gemm_gpu import VERSIONS

SHAPES = [(8, 1024, 768), (32, 128, 1024), (4, 2048, 1024), (8, 128, 768)]
DEFAULT = [
    "AUTO",
    "TMA_128x128",
    "PINGPONG_128x128",
    "COOP_256x128",
    "COOP_256x64",
    "PINGPONG_128x64",
    "PINGPONG_TMA_128x128",
    "PINGPONG_TMA_128x64",
    "PINGPONG_64x256",
    "COOP_128x192",
]


def products(batch: int, s: int):
    """(name, gpu-days call, torch call) of the four products at one shape."""

    def rand(*shape):
        return torch.randn(*shape, device="cuda").bfloat16()

    q, k, p, v = rand(batch, s, 64), rand(batch, s, 64), rand(batch, s, s), rand(batch, s, 64)
    mask = torch.triu(torch.full((s, s), float("-inf"), device="cuda"), 1).unsqueeze(0).bfloat16()
    return [
        (
            "scores s*s k64 +mask",
            lambda: pco.gemm_batched(q, k, mask, 0.125, 1.0, False, True),
            lambda: torch.baddbmm(mask, q, k.mT, alpha=0.125),
        ),
        ("dP s*s k64", lambda: pco.gemm_batched(q, k, None, 1.0, 0.0, False, True), lambda: torch.bmm(q, k.mT)),
        ("PV s*64 k=s", lambda: pco.gemm_batched(p, v), lambda: torch.bmm(p, v)),
        ("dV s*64 k=s TA", lambda: pco.gemm_batched(p, v, None, 1.0, 0.0, True, False), lambda: torch.bmm(p.mT, v)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", nargs="+", default=DEFAULT, choices=list(VERSIONS))
    args = parser.parse_args()
    need_cuda(None, __file__)
    torch.manual_seed(0)
    for b, s, d in SHAPES:
        batch = b * d // 64
        for name, ours, ref in products(batch, s):
            want = ref().float()
            finite = torch.isfinite(want)
            cells = [f"cuBLAS {1e3 * kernel_time_ms(ref, 10):6.1f}"]
            for version in args.versions:
                with pco.gemm_version(version):
                    got = ours().float()
                    err = ((got - want)[finite].abs().max() / want[finite].abs().max()).item()
                    us = 1e3 * kernel_time_ms(ours, 10)
                cells.append(f"{version} {us:6.1f}" + ("" if err < 2e-2 else f" ERR {err:.2g}"))
            print(f"{b}x{s}x{d} b={batch} {name:22s}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
