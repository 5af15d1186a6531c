"""Day 019's version ladder as a picture, from the committed benchmark rows:

    python -m days.day019.plot_ladder results/nvidia-h100-80gb-hbm3/day019.csv

writes days/day019/ladder.png: for each pass of a linear layer (forward, dX, dW) and each
shape, every kernel version's share of cuBLAS by kernel time (100 = cuBLAS), bf16, from
the newest run of each pass that the site shows (superseded runs skipped)."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmark.store import latest_run, load

PASSES = ("ladder_forward", "ladder_dx", "ladder_dw")
RUNG_ORDER = (
    "v3_tma_128x128",
    "v3_tma_128x256",
    "v4_pingpong_64x256",
    "v4_pingpong_128x128",
    "v4_multicast_128x128",
    "v4_coop_128x256",
    "v4_coop_256x128",
    "v4_coop_tma_128x256",
    "v4_coop_tma_256x128",
    "v4_coop_multicast_256x128",
    "v4_coop_256x192",
    "v4_streamk_256x128",
    "v4_splitk_256x128",
    "v4_cluster_splitk_128x128",
    "mojo_gemm",
)


def read_ladder(path: Path, dtype: str = "bfloat16") -> dict[str, dict[str, dict[str, float]]]:
    """{pass: {shape: {impl: % of cuBLAS by kernel time}}} of each pass's newest run, as
    the site picks it (benchmark.store.latest_run: runs listed as superseded skipped)."""
    df = latest_run(load(day=path.stem, device=path.parent.name, results_dir=path.parent.parent))
    rows = df[df["op"].isin(PASSES) & (df["dtype"] == dtype) & (df["status"] == "ok") & df["kernel_ms"].notna()]
    kernel: dict[tuple[str, str], dict[str, float]] = {}
    for op, shape, impl, ms in rows[["op", "shape", "impl", "kernel_ms"]].itertuples(index=False):
        kernel.setdefault((op, shape), {})[impl] = float(ms)
    ladder: dict[str, dict[str, dict[str, float]]] = {}
    for (op, shape), times in kernel.items():
        base = times.pop("torch")
        ladder.setdefault(op, {})[shape] = {impl: 100 * base / ms for impl, ms in times.items()}
    return ladder


def plot(ladder: dict, out: Path, title: str) -> None:
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    fig = Figure(figsize=(18, 5.5), layout="constrained")
    axes = fig.subplots(1, len(PASSES), sharey=True)
    for ax, op in zip(axes, PASSES, strict=True):
        shapes = list(ladder.get(op, {}))
        rungs = [r for r in RUNG_ORDER if any(r in ladder[op][s] for s in shapes)]
        width = 0.8 / max(len(rungs), 1)
        for i, rung in enumerate(rungs):
            xs = [j + (i - (len(rungs) - 1) / 2) * width for j in range(len(shapes))]
            # the op's own choice in black; 12 rungs outrun matplotlib's 10 default colours
            colour = "black" if rung == "mojo_gemm" else colormaps["tab20"](RUNG_ORDER.index(rung))
            ax.bar(xs, [ladder[op][s].get(rung, 0) for s in shapes], width, label=rung, color=colour)
        ax.axhline(100, color="k", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(shapes)), shapes, rotation=35, ha="right", fontsize=8)
        ax.set_title(op.removeprefix("ladder_") + " (tokens x in x out)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("% of cuBLAS (kernel time)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=(len(labels) + 1) // 2, fontsize=9)
    fig.suptitle(title)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("ladder.png"))
    args = parser.parse_args()
    plot(read_ladder(args.csv), args.out, f"Day 019's GEMM ladder, bf16 ({args.csv.parent.name})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
