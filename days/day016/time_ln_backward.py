"""The layer norm's backward, one launch (day 016, part eighteen) against day 013's two
kernels and torch's, per shape: host µs per call, kernel µs (CUPTI, summed over the
call's kernels) and the GPU's time per call from events with L2 flushed (what a cold
model step sees, gaps between the two kernels included).

    PYTHONPATH=$PWD python days/day016/time_ln_backward.py [--dtype bfloat16 float32]

It picks ONE_LAUNCH_ROWS (pytorch_custom_ops/layer_norm.py): the one launch should not
lose on the GPU where the plan takes it.
"""

from __future__ import annotations

import argparse
import importlib
from contextlib import nullcontext

import torch

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda
from benchmark.timing import host_overhead_us, kernel_time_ms, time_cuda

LN = importlib.import_module("pytorch_custom_ops.layer_norm")  # pco.layer_norm is the function
ROWS = (8, 64, 256, 1024, 2048, 4096, 8192)  # 8 x 128: benchmark.overhead's shape
COLS = (128, 768, 1024, 3072)
ALWAYS, NEVER = 1 << 40, 0  # ONE_LAUNCH_ROWS values: the one launch for every row count, or none


def calls(rows: int, cols: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(rows + cols)
    x = torch.randn(rows, cols, device="cuda", generator=gen).to(dtype)
    w = torch.rand(cols, device="cuda", generator=gen).to(dtype) + 0.5
    dy = torch.randn(rows, cols, device="cuda", generator=gen).to(dtype)
    _, mean, rstd = torch.ops.gpu_days.layer_norm(x, (cols,), w, torch.zeros_like(w), 1e-5)
    ours = lambda: pco.layer_norm_backward(dy, x, (cols,), w, mean, rstd)  # noqa: E731
    mask, bias = [True, True, True], torch.zeros_like(w)
    torch_stats = (mean.view(rows, 1), rstd.view(rows, 1))
    theirs = lambda: torch.ops.aten.native_layer_norm_backward(dy, x, (cols,), *torch_stats, w, bias, mask)  # noqa: E731
    return {"one": ours, "two": ours, "torch": theirs}


def measure(name: str, fn) -> tuple[float, float, float]:
    setting = {"one": ALWAYS, "two": NEVER}.get(name)
    with LN.ONE_LAUNCH_ROWS.set_to(setting) if setting is not None else nullcontext():
        host = host_overhead_us(fn)
        kernel = (kernel_time_ms(fn) or 0.0) * 1e3
        gpu = time_cuda({name: fn}, min_reps=50, budget_s=0.5)[name].median_ms * 1e3
    return host, kernel, gpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ONE_LAUNCH_ROWS = {LN.ONE_LAUNCH_ROWS.value}")
    print("us per call: host one / two / torch | kernel one / two / torch | gpu (events, L2 flushed) one / two / torch")
    for dtype in (getattr(torch, d) for d in args.dtype):
        for cols in COLS:
            for rows in ROWS:
                fns = calls(rows, cols, dtype)
                got = {name: measure(name, fn) for name, fn in fns.items()}
                cells = [" / ".join(f"{got[n][i]:6.1f}" for n in fns) for i in range(3)]
                shape = f"{str(dtype)[6:]:>8} {rows:5d} x {cols:5d}"
                print(f"{shape}: host {cells[0]} | kernel {cells[1]} | gpu {cells[2]}")


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
