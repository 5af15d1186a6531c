"""The LayerNorm forward's kernel time per tier of the launch plan (FWD_TIERS), next to
torch.compile's Triton kernel, for the plain and the fused residual-add forms.

    PYTHONPATH=$PWD python days/day013/time_forward_tiers.py 4096x1024 16384x768

Each tier that can hold the row is forced in turn (the plan takes the first tier that
fits); then the first tier with its grid capped at 1-4 blocks an SM. Times are CUPTI
kernel times (benchmark.timing.kernel_times_us), µs per call, and the bytes each form
must move (read x [and delta], write y [and the sum]) per second.
"""

from __future__ import annotations

import argparse
import importlib

import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda
from benchmark.timing import kernel_times_us
from pytorch_custom_ops import direct

LN = importlib.import_module("pytorch_custom_ops.layer_norm")  # (the package's `layer_norm` is the function)


def forced(tier):
    """The plan's tiers with `tier` first."""
    return (tier, *(t for t in LN.FWD_TIERS if t != tier))


def time_us(fn) -> float:
    return sum(kernel_times_us(fn, reps=50).values())


def run_shape(rows: int, cols: int, dtype: torch.dtype) -> None:
    x, delta = (torch.randn(rows, cols, device="cuda", dtype=dtype) for _ in range(2))
    w, b = torch.randn(cols, device="cuda", dtype=dtype), torch.randn(cols, device="cuda", dtype=dtype)
    nvec = cols // (16 // x.element_size())
    moved = {"plain": 2 * x.nbytes, "add": 4 * x.nbytes}
    ours = {
        "plain": lambda: pco.layer_norm(x, (cols,), w, b),
        "add": lambda: pco.add_layer_norm(x, delta, (cols,), w, b),
    }
    compiled = {
        "plain": torch.compile(lambda: F.layer_norm(x, (cols,), w, b)),
        "add": torch.compile(lambda: (x + delta, F.layer_norm(x + delta, (cols,), w, b))),
    }
    tiers = LN.FWD_TIERS
    print(f"== {rows} x {cols} {dtype}")
    # the first tier with its grid capped at k blocks an SM: each warp loops over rows, so
    # one row's stores overlap the next one's loads (uncapped, all rows start at once)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    cap = LN.MAX_GRID
    for form in ("plain", "add"):
        for k in (1, 2, 3, 4):
            LN.MAX_GRID = k * sms
            direct.plans_changed()
            us = time_us(ours[form])
            print(f"  {form:5s} first tier, grid <= {k} x {sms}: {us:6.1f} us  {moved[form] / us / 1e3:6.0f} GB/s")
    LN.MAX_GRID = cap
    direct.plans_changed()
    for form in ("plain", "add"):
        for tier in (t for t in tiers if nvec <= t[0] * t[1]):
            LN.FWD_TIERS = forced(tier)
            direct.plans_changed()
            us = time_us(ours[form])
            print(f"  {form:5s} tier {tier}: {us:6.1f} us  {moved[form] / us / 1e3:6.0f} GB/s")
        LN.FWD_TIERS = tiers
        direct.plans_changed()
        us = time_us(compiled[form])
        print(f"  {form:5s} torch.compile:    {us:6.1f} us  {moved[form] / us / 1e3:6.0f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="*", default=["4096x1024", "16384x768"])
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    need_cuda(None, __file__)
    for shape in args.shapes:
        rows, cols = map(int, shape.split("x"))
        run_shape(rows, cols, getattr(torch, args.dtype))


if __name__ == "__main__":
    with torch.no_grad():
        main()
