"""Where one train step of day 016's GPT block spends its device time, kernel by kernel, for
each build: gpu-days, gpu-days with the fused modules, torch eager and torch.compile.

    PYTHONPATH=$PWD python days/day016/kernels_by_build.py 8x1024x768 bfloat16

Each build runs 3 warm-up steps, then torch.profiler records 3 more; the table lists the
14 kernels that take the most device time per step, with their launches per step. Under a
CUDA graph a step runs the same kernels, so this is where a graphed step's time goes
(`benchmark.model_profile` breaks the eager step down by op and by host time instead).
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

from benchmark import gpt_block as G
from benchmark.gpu_script import need_cuda

BUILDS = ("torch", "gpu_days", "gpu_days_fused", "torch_compile")
STEPS = 3
TOP = 14


def kernel_times(step) -> dict[str, tuple[float, int]]:
    """{kernel name: (device us per step, launches per step)} over STEPS profiled steps."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += e.device_time / STEPS
            per[e.name][1] += 1
    return {name: (us, n // STEPS) for name, (us, n) in per.items()}


def shape_args(doc: str, example: str) -> argparse.Namespace:
    """The command line of this script and graph_idle.py: a block shape and a dtype."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", help=f"batch x seq x d, e.g. {example}")
    parser.add_argument("dtype", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    need_cuda(None, sys.argv[0])
    return args


def train_steps(shape_text: str, dtype_name: str):
    """(build, one train step of its block) for every build in BUILDS, on one input."""
    shape = tuple(int(v) for v in shape_text.split("x"))
    dtype = getattr(torch, dtype_name)
    x = G.make_input(shape, dtype, "cuda")
    mask = G.causal_mask(shape[1], dtype, "cuda")
    blocks = {name: G.make_block(shape[-1], name, dtype, "cuda") for name in BUILDS if name != "torch_compile"}
    blocks["torch_compile"] = torch.compile(blocks["torch"], dynamic=False)
    for name in BUILDS:
        params = list(blocks["torch" if name == "torch_compile" else name].parameters())
        xg = x.detach().clone().requires_grad_()
        yield name, lambda b=blocks[name], xg=xg, p=params: G.train_step(b, xg, mask, p)


def main() -> None:
    args = shape_args(__doc__, "8x1024x768")
    for name, step in train_steps(args.shape, args.dtype):
        times = kernel_times(step)
        total = sum(us for us, _ in times.values())
        launches = sum(n for _, n in times.values())
        print(f"== {name} {args.shape} {args.dtype}: kernels {total:.0f} us/step, {launches} launches")
        for kernel, (us, n) in sorted(times.items(), key=lambda kv: -kv[1][0])[:TOP]:
            print(f"  {us:8.1f} us  x{n:3d}  {kernel[:110]}")


if __name__ == "__main__":
    main()
