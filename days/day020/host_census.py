"""Where an eager training step's host time goes (day 020, the open "eager at small sizes").

    python -m days.day020.host_census [--config small] [--batch 64] [--seq 256] [--impl gpu_days --impl torch]

For each impl: the step's wall time (synchronised), and the host time of its three parts
(forward with the loss, backward, AdamW) each measured until Python returns, with the GPU
running behind; the autograd nodes of one step's graph by name (a Python node is an
`autograd.Function`'s, `CppNode<gpu_days::ReplayedBackward>` is a C++ node replaying its
backward's program); and cProfile's top functions over a few forwards (by cumulative
time) and steps (by own time). The
model is day 020's GPT under bf16 autocast with float32 master weights, as `train_step`.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import sys
import time

import torch

from benchmark.cases.day020_train import Trainer
from days.day020.model import CONFIGS


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def part_times(trainer: Trainer, device: str, steps: int) -> dict[str, float]:
    """Median ms per step: wall (synchronised) and each part's host time."""
    found = collections.defaultdict(list)
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        trainer.opt.zero_grad(set_to_none=True)
        loss = trainer.loss()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        trainer.opt.step()
        t3 = time.perf_counter()
        _sync(device)
        t4 = time.perf_counter()
        for name, ms in (("forward host", t1 - t0), ("backward host", t2 - t1), ("adamw host", t3 - t2)):
            found[name].append(ms * 1e3)
        found["step wall"].append((t4 - t0) * 1e3)
    return {name: statistics.median(v) for name, v in found.items()}


def node_census(trainer: Trainer) -> collections.Counter:
    """The names of the nodes in one step's autograd graph (each node once)."""
    loss = trainer.loss()
    seen, stack, names = set(), [loss.grad_fn], collections.Counter()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names[node.name()] += 1
        stack.extend(g for g, _ in node.next_functions)
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="small", choices=sorted(CONFIGS))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--impl", action="append", choices=["gpu_days", "torch"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    for impl in args.impl or ["gpu_days", "torch"]:
        trainer = Trainer(impl, CONFIGS[args.config], args.batch, args.seq, dtype, args.device)
        for _ in range(3):  # warm-up: the programs and nodes are recorded here
            trainer.step()
        print(f"== {impl}, {args.config} {args.batch}x{args.seq} {dtype}")
        for name, ms in part_times(trainer, args.device, args.steps).items():
            print(f"  {name:14s} {ms:8.2f} ms")
        print("  autograd nodes in one step:")
        for name, n in node_census(trainer).most_common():
            print(f"    {n:5d}  {name}")
        for part, order in (("forward", "cumulative"), ("step", "tottime")):
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(3):
                trainer.loss() if part == "forward" else trainer.step()
            _sync(args.device)
            profiler.disable()
            print(f"  cProfile, 3 {part}s, top {args.top} by {order} time:")
            pstats.Stats(profiler, stream=sys.stdout).sort_stats(order).print_stats(args.top)
        del trainer
    return 0


if __name__ == "__main__":
    sys.exit(main())
