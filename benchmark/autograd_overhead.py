"""What one Python autograd node costs in backward, next to a native one (day 016).

    python -m benchmark.autograd_overhead [--nodes 1 8 32] [--reps 200]

Day 016 measured `MojoLayerNorm`'s backward at ~530 µs of host time where the op itself
costs ~90 µs and `nn.LayerNorm`'s whole backward ~140 µs: most of it is autograd's, not
ours. The hypothesis to test: on CUDA the engine runs a backward on its device thread, and
every Python node (an `autograd.Function`'s backward) makes that thread take the GIL from
the thread waiting in `backward()`; native nodes need no GIL.

Each case builds a chain of N nodes on a tiny tensor and times `backward()` (host time,
the GPU idles): N native nodes (`x * 1.0`), N Python nodes whose backward launches the
same native op, and N Python nodes whose backward does no work at all. The difference per
node between the last two and the first is the price of a Python node. On the CPU the
engine runs on the calling thread: the control.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


class _PythonNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g * 1.0


class _EmptyPythonNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


CHAINS = {
    "native": lambda x: x * 1.0,
    "python": _PythonNode.apply,
    "python_no_work": _EmptyPythonNode.apply,
}


def backward_us(step, nodes: int, device: str, reps: int) -> float:
    """Median host µs of one backward through `nodes` links made by `step`."""
    x = torch.randn(8, 128, device=device, requires_grad=True)
    times = []
    for i in range(reps + 10):
        y = x
        for _ in range(nodes):
            y = step(y)
        loss = y.sum()
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 10:
            times.append(time.perf_counter() - t)
        x.grad = None
    return 1e6 * sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args(argv)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"{'device':6s} {'nodes':>5s} " + " ".join(f"{name:>15s}" for name in CHAINS) + "   µs per backward")
    for device in devices:
        for n in args.nodes:
            row = [backward_us(step, n, device, args.reps) for step in CHAINS.values()]
            print(f"{device:6s} {n:5d} " + " ".join(f"{v:15.1f}" for v in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
