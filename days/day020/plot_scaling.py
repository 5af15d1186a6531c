"""One GPU against two, as bars, from the CSV that scaling.py appends to:

    python -m days.day020.plot_scaling results/nvidia-h100-80gb-hbm3/curves/day020_ddp_gpt2.csv

writes days/day020/scaling_h100.png: per build and way of averaging gradients (its newest
commit in the file), tokens/s on one GPU and on two, and the scaling above the pair. A run on
one GPU averages nothing, so a mode such as graph+flat borrows the one-GPU run of its base
mode (graph) from the same commit.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from .scaling import rate


def read_rates(path: Path) -> dict[tuple[str, str, str, int], float]:
    """(commit, impl, mode, gpus) -> tokens/s over the timed steps, in the file's order."""
    runs: dict[tuple[str, str, str, int], list[dict]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            runs.setdefault((row["git_commit"], row["impl"], row["mode"], int(row["gpus"])), []).append(row)
    return {key: rate(rows) for key, rows in runs.items()}


def newest_pairs(rates: dict[tuple[str, str, str, int], float]) -> list[tuple[str, str, str, float, float]]:
    """(impl, mode, commit, one GPU, two GPUs) for each (impl, mode) with a two-GPU run: the
    newest commit that has one (the file appends, so the last seen)."""
    newest: dict[tuple[str, str], str] = {}
    for commit, impl, mode, gpus in rates:
        if gpus == 2:
            newest[impl, mode] = commit
    pairs = []
    for (impl, mode), commit in newest.items():
        one = rates.get((commit, impl, mode, 1), rates.get((commit, impl, mode.split("+")[0], 1)))
        if one is not None:
            pairs.append((impl, mode, commit, one, rates[commit, impl, mode, 2]))
    return sorted(pairs, key=lambda pair: (pair[0], pair[1] != "eager", pair[1] != "graph+flat", pair[1]))


def plot(pairs: list[tuple[str, str, str, float, float]], out: Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1.6 * len(pairs) + 2.5, 4.5), layout="constrained")
    ax = fig.subplots()
    width = 0.38
    for i, (*_, one, two) in enumerate(pairs):
        ax.bar(i - width / 2, one / 1e3, width, color="C0", label="1 GPU" if i == 0 else None)
        ax.bar(i + width / 2, two / 1e3, width, color="C1", label="2 GPUs" if i == 0 else None)
        ax.annotate(f"{two / one:.2f}×", (i + width / 2, two / 1e3), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(pairs)), [f"{impl}\n{mode}\n{commit[:7]}" for impl, mode, commit, _, _ in pairs])
    ax.set_ylabel("thousand tokens/s (steps 20-50)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left")
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", type=Path)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("scaling_h100.png"))
    args = p.parse_args(argv)
    with open(args.csv, newline="") as f:
        first = next(csv.DictReader(f))
    pairs = newest_pairs(read_rates(args.csv))
    if not pairs:
        raise SystemExit(f"{args.csv}: no build has both a one-GPU and a two-GPU run")
    title = f"GPT-2 124M, bf16, global batch {first['global_batch']}, on {first['device']}"
    plot(pairs, args.out, title)
    for impl, mode, commit, one, two in pairs:
        print(f"{impl:9} {mode:12} {commit[:7]}  {one:10,.0f} {two:10,.0f}  {two / one:.2f}x")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
