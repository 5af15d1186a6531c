"""How much of a one-round GEMM's kernel time does not grow with K (day 019, part 28).

    PYTHONPATH=$PWD python days/day019/time_fixed_cost.py [--versions AUTO PINGPONG_TMA_128x128]

For a few outputs of about one round of 128 x 128 tiles (GPT-2's 768 x 768 and
2304 x 768 weight gradients), each version and cuBLAS is timed by kernel time (CUPTI)
at K = 64 ... 16384 (checked against float64 first), and a line through the long-K
points gives the time per k-step (64 of K) and the intercept: what a call costs besides
its k-loop (launch, the pipeline's first loads, the epilogue, a split's second kernel
or exchange). A kernel that does nothing stands for the floor of any launch.
"""

from __future__ import annotations

import argparse

import torch

from benchmark.gpu_script import need_cuda
from benchmark.timing import kernel_time_ms
from days.day014.time_versions import checked_calls
from pytorch_custom_ops import gemm_gpu

OUTPUTS = ((768, 768), (2304, 768))
KS = (64, 256, 1024, 2048, 4096, 8192, 16384)
LONG_K = 2048  # the line is fitted from here up


def fit(ks: list[int], ms: list[float]) -> tuple[float, float]:
    """(us per k-step, intercept in us): least squares through (K / 64, us)."""
    xs, ys = [k / 64 for k in ks], [1e3 * t for t in ms]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--versions", nargs="+", default=["AUTO", "PINGPONG_TMA_128x128"], choices=list(gemm_gpu.VERSIONS)
    )
    args = parser.parse_args()
    need_cuda(None, __file__)
    empty = torch.empty(1, device="cuda")
    floor = kernel_time_ms(lambda: empty.zero_(), 50)
    print(f"{torch.cuda.get_device_name()}; bf16; kernel time in us; a one-element fill: {1e3 * floor:.1f} us")
    for m, n in OUTPUTS:
        times: dict[str, dict[int, float]] = {}
        for k in KS:
            for name, call in checked_calls(m, n, k, True, False, args.versions).items():
                times.setdefault(name, {})[k] = kernel_time_ms(call, 20)
        for name, by_k in times.items():
            cells = " ".join(f"K={k}: {1e3 * t:.1f}" for k, t in by_k.items())
            long_k = [k for k in by_k if k >= LONG_K]
            step, fixed = fit(long_k, [by_k[k] for k in long_k])
            print(f"{m}x{n} {name}: {cells} | {step:.3f} us a k-step, {fixed:.1f} us fixed", flush=True)


if __name__ == "__main__":
    main()
