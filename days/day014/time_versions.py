"""Day 014's version ladder on a GPU: every bf16 kernel version, forced, against cuBLAS.

    PYTHONPATH=$PWD python days/day014/time_versions.py [--quick]

For each shape (the issue's squares, GPT-2 small's Linear layers forward and backward)
and each version of `pco.gemm_version` (AUTO is the op's own choice), it checks the
result on 2000 sampled entries against float64 and prints TFLOP/s and % of
torch.matmul (cuBLAS) by kernel time (benchmark.timing.kernel_time_ms, CUPTI): at GPT-2's
shapes a call is tens of microseconds, and event timing of back-to-back calls measured
the host instead (day 019 saw every version drop 20 points on a slower host).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda
from benchmark.timing import kernel_time_ms
from pytorch_custom_ops.gemm_gpu import VERSIONS

SQUARES = [(1024, 1024, 1024, False, False), (4096, 4096, 4096, False, False), (8192, 8192, 8192, False, False)]
GPT2 = [  # (m, n, k, transpose_a, transpose_b): y = x W^T, dX = dY W, dW = dY^T X
    shape
    for tokens in (64, 1024, 8192)
    for d_in, d_out in ((768, 2304), (768, 3072), (3072, 768))
    for shape in (
        (tokens, d_out, d_in, False, True),
        (tokens, d_in, d_out, False, False),
        (d_out, d_in, tokens, True, False),
    )
]


def sampled_error(y, a, b, ta, tb) -> float:
    """max |y - ref| / (|a| @ |b|) over 2000 random entries, in float64."""
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = torch.randint(0, y.shape[0], (2000,), generator=g).to(y.device)
    cols = torch.randint(0, y.shape[1], (2000,), generator=g).to(y.device)
    pa = (a.mT if ta else a).double()[rows]
    pb = (b.mT if tb else b).double()[:, cols].T
    ref = (pa * pb).sum(1)
    scale = (pa.abs() * pb.abs()).sum(1) + 1e-30
    return ((y.double()[rows, cols] - ref).abs() / scale).max().item()


def checked_calls(m, n, k, ta, tb, versions) -> dict[str, Callable[[], torch.Tensor]]:
    """One problem's calls on random bf16 operands: torch.matmul (cuBLAS) first, then
    every version, each checked against float64 on sampled entries before it is returned
    (a version's call runs under its gemm_version)."""
    a = torch.randn(*((k, m) if ta else (m, k)), device="cuda").bfloat16()
    b = torch.randn(*((n, k) if tb else (k, n)), device="cuda").bfloat16()
    pa, pb = (a.mT if ta else a), (b.mT if tb else b)
    calls = {"cuBLAS": lambda: torch.matmul(pa, pb)}
    for version in versions:
        with pco.gemm_version(version):
            err = sampled_error(pco.gemm(a, b, transpose_a=ta, transpose_b=tb), a, b, ta, tb)
            assert err < 1.6e-2, f"{version} at {m}x{n}x{k}: error {err:.3g} of the scale"

        def call(version=version):
            with pco.gemm_version(version):
                return pco.gemm(a, b, transpose_a=ta, transpose_b=tb)

        calls[version] = call
    return calls


def time_shape(m, n, k, ta, tb, versions, quick: bool = False) -> dict[str, float]:
    """Check every version on one problem against float64, then time each next to
    torch.matmul (cuBLAS): device (kernel) ms per call from CUPTI, so the host's cost per
    call (planning, the version switch) cannot hide in the number. "cuBLAS" comes first."""
    reps = 10 if quick else 30
    return {name: kernel_time_ms(call, reps) for name, call in checked_calls(m, n, k, ta, tb, versions).items()}


def print_row(m, n, k, ta, tb, times: dict[str, float]) -> None:
    flops = 2 * m * n * k
    base = times["cuBLAS"]
    cells = [f"{name} {flops / ms / 1e9:.0f} ({100 * base / ms:.0f}%)" for name, ms in times.items()]
    print(f"{m}x{n}x{k} ta={int(ta)} tb={int(tb)}: " + " | ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing")
    args = parser.parse_args()
    need_cuda(None, __file__)
    shapes = SQUARES[:2] + GPT2[:6] if args.quick else SQUARES + GPT2
    print(f"{torch.cuda.get_device_name()}; bf16; TFLOP/s (% of torch.matmul)")
    for m, n, k, ta, tb in shapes:
        print_row(m, n, k, ta, tb, time_shape(m, n, k, ta, tb, VERSIONS, args.quick))


if __name__ == "__main__":
    main()
