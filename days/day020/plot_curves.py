"""Day 020's loss curves, torch and gpu-days overlaid, from the committed CSV:

    python -m days.day020.plot_curves results/nvidia-h100-80gb-hbm3/curves/day020_loss_small.csv

writes days/day020/loss_small.png (a panel per dtype: train loss by step, validation
losses as markers, and the relative difference of the two builds underneath)."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def read_curves(path: Path) -> dict[tuple[str, str], list[dict]]:
    curves: dict[tuple[str, str], list[dict]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            curves.setdefault((row["dtype"], row["impl"]), []).append(row)
    return curves


def plot(curves: dict, out: Path, title: str) -> None:
    from matplotlib.figure import Figure

    dtypes = sorted({dtype for dtype, _ in curves}, reverse=True)  # float32 first
    fig = Figure(figsize=(6.0 * len(dtypes), 5.0), layout="constrained")
    grid = fig.subplots(2, len(dtypes), squeeze=False, height_ratios=(3, 1), sharex="col")
    for col, dtype in enumerate(dtypes):
        top, bottom = grid[0][col], grid[1][col]
        runs = {impl: rows for (d, impl), rows in curves.items() if d == dtype}
        for i, (impl, rows) in enumerate(sorted(runs.items(), reverse=True)):  # torch first
            steps = [int(r["step"]) for r in rows]
            top.plot(steps, [float(r["train_loss"]) for r in rows], f"C{i}-", label=f"{impl} train")
            val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
            top.plot(*zip(*val, strict=True), f"C{i}o", label=f"{impl} validation")
        if {"torch", "gpu_days"} <= set(runs):
            pairs = zip(runs["gpu_days"], runs["torch"], strict=True)
            diff = [(int(a["step"]), 100 * (float(a["train_loss"]) / float(b["train_loss"]) - 1)) for a, b in pairs]
            bottom.plot(*zip(*diff, strict=True), "k.-")
            bottom.axhspan(-1, 1, color="0.9")  # the tolerance: 1%
        top.set_title(dtype, fontsize=10)
        top.set_ylabel("loss (nats per byte)")
        top.legend(fontsize=8)
        top.grid(alpha=0.3)
        bottom.set_ylabel("gpu_days / torch − 1 (%)")
        bottom.set_xlabel("step")
        bottom.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.savefig(out, format="png", dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", type=Path)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("loss_small.png"))
    args = p.parse_args(argv)
    device = args.csv.parent.parent.name
    plot(read_curves(args.csv), args.out, f"day 020 · small config, 200 steps, same seed and data — {device}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
