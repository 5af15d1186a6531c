"""The fused linear layer (`pco.linear`, bias, with and without GELU) under each of version
4's tiles, by kernel time on a GPU, next to torch's F.linear and F.gelu(F.linear(...)).

    PYTHONPATH=$PWD python days/day019/time_linear_tiles.py
    PYTHONPATH=$PWD python days/day019/time_linear_tiles.py --tokens 64 256 --versions AUTO PINGPONG_TMA_64x64

x requires grad, so the GELU form also stores its pre-activation (the training forward);
the third form adds a residual (`residual=r`, read by the epilogue) to the plain one.
The shapes are day 016's block at 4096 tokens (d = 1024) and GPT-2's MLP at 8192 tokens;
`--tokens` takes instead the layers of day 016's block of width 768 (768 -> 2304, 768 ->
768, 768 -> 3072, 3072 -> 768) at each of those token counts.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda
from benchmark.timing import kernel_time_ms
from pytorch_custom_ops import gemm_gpu

VERSIONS = (
    "AUTO",
    "COOP_256x128",
    "COOP_TMA_256x128",
    "COOP_TMA_128x256",
    "PINGPONG_128x128",
    "COOP_128x256",
    "PINGPONG_64x256",
    "COOP_256x192",
)
SHAPES = ((4096, 1024, 4096), (8192, 768, 3072), (4096, 1024, 3072))  # tokens, in, out
BLOCK_768 = ((768, 2304), (768, 768), (768, 3072), (3072, 768))  # in, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", help="day 016's width-768 block at these token counts")
    parser.add_argument("--versions", nargs="+", default=list(VERSIONS), choices=list(gemm_gpu.VERSIONS))
    args = parser.parse_args()
    shapes = [(t, k, n) for t in args.tokens for k, n in BLOCK_768] if args.tokens else SHAPES
    torch.manual_seed(0)
    for m, k, n in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        fused = kernel_time_ms(lambda: F.gelu(F.linear(x, w, b), approximate="tanh"), 10) * 1e3  # noqa: B023
        plain = kernel_time_ms(lambda: F.linear(x, w, b), 10) * 1e3  # noqa: B023
        r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        added = kernel_time_ms(lambda: F.linear(x, w, b) + r, 10) * 1e3  # noqa: B023
        row = f"{m}x{k}->{n}: torch linear+gelu {fused:.1f} us (linear {plain:.1f}, + residual {added:.1f})"
        for act in ("gelu_tanh", None, "residual"):
            for version in args.versions:
                if act == "residual":
                    call = lambda: pco.linear(x, w, b, residual=r)  # noqa: B023, E731
                else:
                    call = lambda: pco.linear(x, w, b, activation=act)  # noqa: B023, E731
                with pco.gemm_version(version):
                    t = kernel_time_ms(call, 10) * 1e3
                row += f" | {act or 'plain'} {version} {t:.1f}"
        print(row)


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
