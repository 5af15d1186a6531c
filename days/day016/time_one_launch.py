"""Day 016, parts eighteen and nineteen: each one-launch op against its launches apart and torch's, per
shape: host µs per call, kernel µs (CUPTI, summed over the call's kernels) and the GPU's
time per call from events with L2 flushed (what a cold model step sees, gaps between
the two kernels included).

    PYTHONPATH=$PWD python days/day016/time_one_launch.py [--dtype bfloat16 float32] [--op ...]

The layer norm's backward (one launch against day 013's two kernels) picks
ONE_LAUNCH_ROWS (pytorch_custom_ops/layer_norm.py): the one launch should not lose on the
GPU where the plan takes it. The long softmax (one block a row) is the same kernels'
work with one launch less. A linear layer's backward (part nineteen, float32/float64,
`--op gemm_backward`) is one launch against three calls (two products and torch's sum),
and torch's own nn.Linear backward; rows x cols there mean tokens x (in = out) features.
"""

from __future__ import annotations

import argparse
import importlib
from contextlib import nullcontext

import torch

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda
from benchmark.overhead import node_call
from benchmark.timing import host_overhead_us, kernel_time_ms, time_cuda

LN = importlib.import_module("pytorch_custom_ops.layer_norm")  # pco.layer_norm is the function
LS = importlib.import_module("pytorch_custom_ops.long_softmax")
GB = importlib.import_module("pytorch_custom_ops.gemm_backward")
ROWS = (8, 64, 256, 1024, 2048, 4096, 8192)  # 8 x 128: benchmark.overhead's shape
COLS = (128, 768, 1024, 3072)
ALWAYS, NEVER = 1 << 40, 0  # ONE_LAUNCH_ROWS values: the one launch for every row count, or none
SOFTMAX_SHAPES = ((1, 4096), (8, 4096), (64, 1000), (1, 1000), (600, 20000), (2048, 4096))
# (tokens, features, dtype): 64 x 64 is benchmark.overhead's MojoGEMM(64, 64); float32 wider
# than 64 features splits K or takes 3xTF32 (gemm_backward.sizes_serve): three calls
LINEAR_SHAPES = ((8, 32, "float32"), (64, 64, "float32"), (64, 768, "float64"), (1024, 768, "float64"))


def ln_calls(rows: int, cols: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(rows + cols)
    x = torch.randn(rows, cols, device="cuda", generator=gen).to(dtype)
    w = torch.rand(cols, device="cuda", generator=gen).to(dtype) + 0.5
    dy = torch.randn(rows, cols, device="cuda", generator=gen).to(dtype)
    _, mean, rstd = torch.ops.gpu_days.layer_norm(x, (cols,), w, torch.zeros_like(w), 1e-5)
    ours = lambda: pco.layer_norm_backward(dy, x, (cols,), w, mean, rstd)  # noqa: E731
    mask, bias = [True, True, True], torch.zeros_like(w)
    torch_stats = (mean.view(rows, 1), rstd.view(rows, 1))
    theirs = lambda: torch.ops.aten.native_layer_norm_backward(dy, x, (cols,), *torch_stats, w, bias, mask)  # noqa: E731
    return {
        "one": (LN.ONE_LAUNCH_ROWS.set_to(ALWAYS), ours),
        "two": (LN.ONE_LAUNCH_ROWS.set_to(NEVER), ours),
        "torch": (nullcontext(), theirs),
    }


def softmax_calls(rows: int, n: int, dtype: torch.dtype) -> dict:
    x = torch.randn(rows, n, device="cuda").to(dtype) * 3
    ours = lambda: pco.long_softmax(x)  # noqa: E731
    return {
        "one": (LS.ONE_BLOCK.set_to(True), ours),
        "two": (LS.ONE_BLOCK.set_to(False), ours),
        "torch": (nullcontext(), lambda: torch.softmax(x, -1)),
    }


def linear_calls(tokens: int, features: int, dtype: torch.dtype) -> dict:
    """The backward node of a MojoGEMM and of an nn.Linear (the same weights), called
    alone as benchmark.overhead's `node_call` does (no engine around it)."""
    torch.manual_seed(tokens + features)
    ours_layer = pco.MojoGEMM(features, features).to("cuda", dtype)
    theirs_layer = torch.nn.Linear(features, features).to("cuda", dtype)
    x = torch.randn(tokens, features, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(tokens, features, device="cuda", dtype=dtype)
    for _ in range(2):  # a key's first call runs the Python autograd.Function; its node is C++ from then on
        ours_layer(x).backward(g)
    ours = node_call(ours_layer(x), g)[1]
    return {
        "one": (GB.ONE_LAUNCH.set_to(True), ours),
        "three": (GB.ONE_LAUNCH.set_to(False), ours),
        "torch": (nullcontext(), node_call(theirs_layer(x), g)[1]),
    }


def measure(setting, fn) -> tuple[float, float, float]:
    with setting:
        host = host_overhead_us(fn)
        kernel = (kernel_time_ms(fn) or 0.0) * 1e3
        gpu = time_cuda({"call": fn}, min_reps=50, budget_s=0.5)["call"].median_ms * 1e3
    return host, kernel, gpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--op", nargs="+", default=["layer_norm_backward", "long_softmax"])  # or gemm_backward
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ONE_LAUNCH_ROWS = {LN.ONE_LAUNCH_ROWS.value}")
    print("us per call: host one / apart / torch | kernel one / apart / torch | gpu (events, L2 flushed) the same")
    problems = []
    for dtype in (getattr(torch, d) for d in args.dtype):
        if "layer_norm_backward" in args.op:
            problems += [("ln bwd", ln_calls, rows, cols, dtype) for cols in COLS for rows in ROWS]
        if "long_softmax" in args.op:
            problems += [("softmax", softmax_calls, rows, n, dtype) for rows, n in SOFTMAX_SHAPES]
    if "gemm_backward" in args.op:  # its own dtypes: float32 and float64
        problems += [("linear", linear_calls, t, f, getattr(torch, d)) for t, f, d in LINEAR_SHAPES]
    for op, calls, rows, cols, dtype in problems:
        fns = calls(rows, cols, dtype)
        got = {name: measure(*setting_fn) for name, setting_fn in fns.items()}
        cells = [" / ".join(f"{got[n][i]:6.1f}" for n in fns) for i in range(3)]
        shape = f"{op:>7} {str(dtype)[6:]:>8} {rows:5d} x {cols:5d}"
        print(f"{shape}: host {cells[0]} | kernel {cells[1]} | gpu {cells[2]}")


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
