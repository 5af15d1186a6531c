"""Plots from the results store, for the site (docs/hooks.py calls these at build time).

    plot_day(df, "day009", out_dir)       # one PNG per (device, op) of the day's latest runs
    plot_family(df, "softmax", ["softmax"], out_dir)   # every day's softmax ops, one PNG per device

x is the problem size (elements: the product of the `shape` string "AxBxC", log scale),
y is GB/s (ms where a figure has no GB/s), one panel per dtype, one line per implementation,
or, for compute-bound ops whose rows have TFLOP/s and no GB/s, y is TFLOP/s and x the FLOPs
of one call (for attention at a fixed number of tokens, proportional to the sequence length),
the shaded band is the p20-p80 spread, and the dashed line is the device's copy bandwidth
when the run measured it (a row with op == "copy_bandwidth"). A model benchmark's op (rows
with tokens/s, day 016) is drawn as bars instead: speedup over torch eager per shape.

Matplotlib is driven through `Figure` objects (Agg canvas), never pyplot: no global
backend or state is touched, so this is safe to call from any process.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from .store import NUMERIC_COLUMNS

COPY_OP = "copy_bandwidth"
NUMERIC = NUMERIC_COLUMNS
MAX_PANELS_PER_ROW = 3
MAX_LINES_PER_PANEL = 16  # more and the legend crowds the axes out


def shape_elements(shape) -> int | None:
    """'4096x32768' -> 134217728; None when the string holds no dimension."""
    dims = [int(d) for d in re.findall(r"\d+", str(shape))]
    return math.prod(dims) if dims else None


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-") or "x"


def plot_name(*parts: str) -> str:
    """File name of a plot: plot_day writes plot_name(day, device_dir, op), plot_family
    plot_name("family", family, device_dir)."""
    return "-".join(slug(p) for p in parts) + ".png"


def prepare(df):
    """Numeric columns as floats, a `size` column (elements); a copy of `df`."""
    import pandas as pd

    df = df.copy()
    for col in NUMERIC:
        if col in df.columns:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    df["size"] = df["shape"].map(shape_elements) if "shape" in df.columns else None
    return df


def _latest(df):
    from .store import latest_run

    return latest_run(df)


def copy_bandwidth(rows) -> float | None:
    """The best copy bandwidth (GB/s) among `rows` (one device's run), or None."""
    copy = rows[(rows["op"] == COPY_OP) & (rows["status"] == "ok")]["gbps"].dropna()
    return float(copy.max()) if len(copy) else None


def plot_day(df, day: str, out_dir: Path) -> list[Path]:
    """PNGs of `day`'s latest run on each device: one per (device, op), a panel per dtype."""
    df = prepare(df)
    if df.empty:
        return []
    rows = _latest(df[df["day"] == day])
    out_dir = Path(out_dir)
    paths = []
    for device_dir, dev in sorted(rows.groupby("device_dir"), key=lambda kv: kv[0]):
        copy_gbps = copy_bandwidth(dev)
        device = _first(dev, "device") or device_dir
        for op, sub in sorted(dev[dev["op"] != COPY_OP].groupby("op"), key=lambda kv: kv[0]):
            path = out_dir / plot_name(day, device_dir, op)
            title = f"{day} · {op} — {device}"
            if "tokens_per_s" in sub.columns and sub["tokens_per_s"].notna().any():  # a model benchmark
                drawn = _plot_speedups(sub, title, path)
            else:
                drawn = _plot(sub, lambda r: str(r["impl"]), title, copy_gbps, path)
            if drawn:
                paths.append(path)
    return paths


def plot_family(df, family: str, ops: list[str] | tuple[str, ...], out_dir: Path) -> list[Path]:
    """PNGs comparing every implementation of ops whose name contains one of `ops`, across days:
    one per device (latest run of each day), a panel per dtype, a line per (day, op, impl)."""
    df = prepare(df)
    if df.empty:
        return []
    latest = _latest(df)
    out_dir = Path(out_dir)
    paths = []
    for device_dir, dev in sorted(latest.groupby("device_dir"), key=lambda kv: kv[0]):
        copy_gbps = copy_bandwidth(dev)
        match = dev["op"].astype(str).map(lambda op: op != COPY_OP and any(s in op for s in ops))
        sub = dev[match]
        if sub.empty:
            continue
        several_ops = sub["op"].nunique() > 1
        # one line per (day, op, impl) in a panel per dtype, unless that makes more lines than
        # a legend can name (attention: 8 ops x 12 impls): then a panel per (op, dtype)
        by_op = several_ops and len(sub.groupby(["day", "op", "impl"])) > MAX_LINES_PER_PANEL

        def label(r, several_ops=several_ops, by_op=by_op):
            return f"{r['day']} {r['op']}/{r['impl']}" if several_ops and not by_op else f"{r['day']} {r['impl']}"

        def panel(r, by_op=by_op):
            return f"{r['op']} · {r['dtype']}" if by_op else str(r["dtype"])

        device = _first(dev, "device") or device_dir
        path = out_dir / plot_name("family", family, device_dir)
        if _plot(sub, label, f"{family} — {device}", copy_gbps, path, panel):
            paths.append(path)
    return paths


def _first(rows, col: str) -> str | None:
    vals = [v for v in rows[col].tolist() if isinstance(v, str) and v] if col in rows.columns else []
    return vals[0] if vals else None


def _plot(rows, label, title: str, copy_gbps: float | None, path: Path, panel_of=None) -> bool:
    """One figure, a panel per dtype (or per `panel_of(row)`); False (and no file) when no
    row has a value to draw."""
    from matplotlib.figure import Figure

    ok = rows[(rows["status"] == "ok") & rows["size"].notna()]
    has = {c: c in ok.columns and ok[c].notna().any() for c in ("gbps", "tflops")}
    metric = "gbps" if has["gbps"] else "tflops" if has["tflops"] else "ms_median"
    ok = ok[ok[metric].notna() & (ok[metric] > 0)]
    if ok.empty:
        return False
    if metric == "tflops":  # x: the work of one call, which the shape's element count may not track
        ok = ok.assign(size=ok["tflops"] * ok["ms_median"] * 1e9)
    panel_of = panel_of or (lambda r: str(r["dtype"]))
    ok = ok.assign(panel=[panel_of(r) for _, r in ok.iterrows()])
    keys = sorted(ok["panel"].unique())
    ncols = min(len(keys), MAX_PANELS_PER_ROW)
    nrows = math.ceil(len(keys) / ncols)
    fig = Figure(figsize=(5.4 * ncols, 3.9 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    labels = sorted({label(r) for _, r in ok.iterrows()})
    colors = {name: f"C{i % 10}" for i, name in enumerate(labels)}
    markers = "osD^vP*Xh<>"
    for ax in axes.flat[len(keys) :]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys, strict=False):
        panel = ok[ok["panel"] == key]
        series: dict[str, list] = {}
        for _, r in panel.iterrows():
            series.setdefault(label(r), []).append(r)
        for name in sorted(series):
            pts = sorted(series[name], key=lambda r: r["size"])
            xs = [r["size"] for r in pts]
            ys = [r[metric] for r in pts]
            i = labels.index(name)
            ax.plot(
                xs, ys, marker=markers[i % len(markers)], color=colors[name], label=name, linewidth=1.6, markersize=5
            )
            band = _band(pts, metric)
            if band:
                ax.fill_between(xs, band[0], band[1], color=colors[name], alpha=0.12, linewidth=0)
        if metric == "gbps" and copy_gbps:
            ax.axhline(
                copy_gbps, color="0.35", linestyle="--", linewidth=1.2, label=f"copy bandwidth ({copy_gbps:,.0f} GB/s)"
            )
        ax.set_xscale("log")
        if metric in ("gbps", "tflops"):
            ax.set_ylim(bottom=0)
            ax.set_ylabel("GB/s (higher is better)" if metric == "gbps" else "TFLOP/s (higher is better)")
        else:
            ax.set_yscale("log")
            ax.set_ylabel("median ms (lower is better)")
        ax.set_xlabel(f"problem size ({'FLOPs' if metric == 'tflops' else 'elements'}, log scale)")
        _shape_ticks(ax, panel)
        ax.set_title(key, fontsize=10)
        ax.grid(True, which="major", alpha=0.35)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    return path.exists() and path.stat().st_size > 0


def _plot_speedups(rows, title: str, path: Path) -> bool:
    """A model benchmark (rows with tokens/s): per shape, a bar per implementation of its
    speedup over torch eager (the dashed line at 1), tokens/s of the torch baseline under
    each shape; a panel per dtype. False (and no file) when nothing has a speedup."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ok = rows[(rows["status"] == "ok") & rows["speedup_vs_torch"].notna()]
    if ok.empty:
        return False
    dtypes = sorted(ok["dtype"].astype(str).unique())
    impls = list(dict.fromkeys(ok["impl"].astype(str)))  # the order the benchmark wrote them
    colors = {name: f"C{i % 10}" for i, name in enumerate(impls)}
    fig = Figure(figsize=(max(6.0, 1.6 * ok["shape"].nunique() + 2), 3.6 * len(dtypes)), layout="constrained")
    axes = fig.subplots(len(dtypes), 1, squeeze=False)[:, 0]
    width = 0.8 / len(impls)
    for ax, dtype in zip(axes, dtypes, strict=True):
        panel = ok[ok["dtype"].astype(str) == dtype]
        shapes = sorted(panel["shape"].astype(str).unique(), key=lambda sh: shape_elements(sh) or 0)
        for i, impl in enumerate(impls):
            got = _by_shape(panel[panel["impl"].astype(str) == impl], "speedup_vs_torch")
            xs = [j + (i - (len(impls) - 1) / 2) * width for j, sh in enumerate(shapes) if sh in got]
            ys = [got[sh] for sh in shapes if sh in got]
            ax.bar(xs, ys, width, color=colors[impl], label=impl)
        ax.axhline(1.0, color="0.35", linestyle="--", linewidth=1.0)
        base = _by_shape(panel[panel["impl"] == "torch"], "tokens_per_s")
        labels = [f"{sh}\n({_human(base[sh])} tok/s)" if sh in base else sh for sh in shapes]
        ax.set_xticks(range(len(shapes)), labels, fontsize=7)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.set_ylabel("speedup vs torch eager\n(log, higher is better)")
        ax.set_title(dtype, fontsize=10)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7, ncols=min(len(impls), 3), loc="best")
    fig.suptitle(title + " (batch x seq x d; torch eager's tokens/s under each)", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    return path.exists() and path.stat().st_size > 0


def _by_shape(rows, col: str) -> dict[str, float]:
    return {str(sh): float(v) for sh, v in zip(rows["shape"], rows[col], strict=True) if v == v}


def _shape_ticks(ax, rows) -> None:
    """Label the x axis with the measured shapes at their sizes; shapes of nearly the same size
    (within 8%) share one tick. Each label is the shape and its size, e.g. "4096x4096 (16.8M)"."""
    from matplotlib.ticker import NullLocator

    sizes = sorted({(r["size"], str(r["shape"])) for _, r in rows.iterrows()})
    groups: list[list] = []
    for size, shape in sizes:
        if groups and size / groups[-1][0][0] < 1.08:
            if shape not in [s for _, s in groups[-1]]:
                groups[-1].append((size, shape))
        else:
            groups.append([(size, shape)])
    ticks = [math.exp(sum(math.log(z) for z, _ in g) / len(g)) for g in groups]
    labels = ["\n".join(f"{s} ({_human(z)})" for z, s in g) for g in groups]
    ax.set_xticks(ticks, labels, fontsize=7, rotation=30, ha="right", rotation_mode="anchor")
    ax.xaxis.set_minor_locator(NullLocator())
    if len(ticks) == 1:
        ax.set_xlim(ticks[0] / 2, ticks[0] * 2)


def _human(n: float) -> str:
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def _band(pts, metric: str):
    """(low, high) of the p20-p80 spread in `metric` units, or None when not measured."""
    lo, hi = [], []
    for r in pts:
        p20, p80, med = r.get("ms_p20"), r.get("ms_p80"), r.get("ms_median")
        if any(v is None or not math.isfinite(v) or v <= 0 for v in (p20, p80, med)):
            return None
        if metric in ("gbps", "tflops"):  # bytes and FLOPs are fixed: the rate scales with 1/ms
            lo.append(r[metric] * med / p80)
            hi.append(r[metric] * med / p20)
        else:
            lo.append(p20)
            hi.append(p80)
    return lo, hi
