"""One train step of day 016's GPT block, every kernel in launch order, for two builds side
by side (default: gpu-days with the fused modules, and torch.compile), then the same time
summed by kind.

    PYTHONPATH=$PWD python days/day016/kernels_in_order.py 32x128x1024 bfloat16

Same steps as kernels_by_build.py (3 warm-up steps, then torch.profiler over one); under a
CUDA graph a step runs these kernels in this order, so the table says which kernel of the
graphed step costs what against torch.compile's.
"""

from __future__ import annotations

import argparse
import collections

import torch

from benchmark.gpu_script import need_cuda
from days.day016.kernels_by_build import train_steps

# (kind, words in the kernel's name), first match wins; "bias" catches our column sums
# (day 013's column_partials, and the sum_partials launch right after one: kind_of's
# `after`), cuBLAS g^T 1 launches (nvjet / splitKreduce inside gpu-days' builds) and the
# Triton sums
KINDS = (
    ("bias gradients", ("column_partials",)),
    ("GEMMs", ("_gemm_",)),  # days_day014_gemm_..., days_day019_gemm_v4_pingpong...
    ("layer norms", ("ln_", "layer_norm")),
    ("softmax", ("softmax",)),
    ("head split / merge copies", ("permute", "clone", "CatArray")),
    ("GELU", ("gelu",)),
    ("bias gradients", ("sum",)),
)


def kind_of(name: str, ours: bool, after: str = "") -> str:
    """The kind of kernel `name`; `after`: the name of the kernel launched before it."""
    if "nvjet" in name or "splitKreduce" in name:
        return "bias gradients" if ours else "GEMMs"
    if "sum_partials" in name and "column_partials" in after:  # the column sums' second stage
        return "bias gradients"
    for kind, words in KINDS:
        if any(w in name for w in words):
            return kind
    return "elementwise, copies, the loss"


def launches_in_order(step) -> list[tuple[float, str]]:
    """(device us, name) of every kernel (and memset / memcpy) of one step, in launch order."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    return [(e.device_time, e.name) for e in kernels]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", help="batch x seq x d, e.g. 32x128x1024")
    parser.add_argument("dtype", choices=["bfloat16", "float32"])
    parser.add_argument("--builds", nargs=2, default=["gpu_days_fused", "torch_compile"])
    args = parser.parse_args()
    need_cuda(None, __file__)
    kinds = {}
    for name, step in train_steps(args.shape, args.dtype):
        if name not in args.builds:
            continue
        rows = launches_in_order(step)
        total = sum(us for us, _ in rows)
        print(f"== {name} {args.shape} {args.dtype}: {len(rows)} kernels, {total:.0f} us")
        by_kind = collections.defaultdict(lambda: [0.0, 0])
        for i, (us, kernel) in enumerate(rows):
            print(f"  {us:7.1f}  {kernel[:110]}")
            kind = kind_of(kernel, name.startswith("gpu_days"), rows[i - 1][1] if i else "")
            by_kind[kind][0] += us
            by_kind[kind][1] += 1
        kinds[name] = by_kind
    print("\n# by kind (the same steps, summed; classification by kernel name)")
    for name, by_kind in kinds.items():
        print(f"# {name}:")
        for kind, (us, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
            print(f"#   {us:8.1f} us  {n:3d}  {kind}")


if __name__ == "__main__":
    main()
