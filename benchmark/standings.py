"""Where each kernel stands: one line per op and dtype, from the results store.

For every (device, day, op, dtype) of the latest runs: the headline shape (the largest
one the log's own implementations ran), the fastest of them there, and how it compares
with the baselines timed in the same run (torch eager, torch.compile), with the copy
bandwidth, and with torch's library kernel where torch's op is one (cuBLAS for GEMM,
SDPA for attention). The host cost per call comes from day 016's overhead rows. The site's
"Where each kernel stands" page renders this table.
"""

from __future__ import annotations

import math
from pathlib import Path

# impls that are not the log's own: torch and its variants, SDPA's backends, naive references
BASELINE_PREFIXES = ("torch", "sdpa", "naive", "cublas")
LIBRARY = {"gemm": "cuBLAS", "attention": "SDPA"}  # op-name fragment -> what torch calls
NOT_KERNEL_OPS = ("copy_bandwidth",)
STUDY_DAYS = ("day010",)  # its rows are parts of one call's time, not kernels
HOST_PREFIX = "host_call:"  # day016 overhead rows: host_call:<public function>
HOST_OP_NAMES = {("day009", "softmax"): "online_softmax"}  # a day's op row -> its public function


def _ours(impl: str) -> bool:
    """One of the log's implementations, run eagerly (a CUDA-graph replay is a way of
    running one, compared separately on its day's page)."""
    return not impl.startswith(BASELINE_PREFIXES) and not impl.endswith("_graph")


def _finite(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _library(op: str) -> str | None:
    return next((name for frag, name in LIBRARY.items() if frag in op), None)


def standings(results) -> list[dict]:
    """The table's rows (dicts), GPUs first, then by day and op."""
    if results is None or results.empty:
        return []
    ok = results[results["status"] == "ok"]
    host = ok[ok["op"].astype(str).str.startswith(HOST_PREFIX)]
    kernels = ok[~ok["op"].astype(str).str.contains(":") & ~ok["op"].isin(NOT_KERNEL_OPS) & ~ok["day"].isin(STUDY_DAYS)]
    rows = []
    for (device_dir, day, op, dtype), g in kernels.groupby(["device_dir", "day", "op", "dtype"], sort=True):
        mine = g[g["impl"].astype(str).map(_ours).astype(bool) & g["ms_median"].notna()]
        if mine.empty:
            continue
        # the headline shape: the largest; among equal sizes (attention keeps batch x seq
        # fixed) the one that takes longest, i.e. the most work
        size = mine["size"].fillna(-1).max() if "size" in mine else -1
        biggest = mine[mine["size"].fillna(-1) == size] if "size" in mine else mine
        shape = biggest.sort_values("ms_median").iloc[-1]["shape"]
        at = g[g["shape"] == shape]
        best = at[at["impl"].astype(str).map(_ours).astype(bool)].sort_values("ms_median").iloc[0]
        ms = float(best["ms_median"])

        def baseline(impl, at=at):
            hit = at[(at["impl"] == impl) & at["ms_median"].notna()]
            return float(hit["ms_median"].iloc[0]) if len(hit) else None

        eager, compiled = baseline("torch"), baseline("torch_compile")
        lib = _library(str(op))
        host_op = HOST_OP_NAMES.get((day, op), op)
        host_rows = host[(host["device_dir"] == device_dir) & (host["op"] == f"{HOST_PREFIX}{host_op}")]
        host_mine = host_rows.loc[host_rows["impl"].astype(str).map(_ours).astype(bool), "host_us"].dropna()
        host_torch = host_rows[host_rows["impl"] == "torch"]["host_us"].dropna()
        rows.append(
            {
                "device_dir": device_dir,
                "device": str(best.get("device") or device_dir),
                "device_type": str(best.get("device_type") or ""),
                "day": day,
                "op": op,
                "dtype": dtype,
                "shape": best.get("shape"),
                "best": best["impl"],
                "ms": ms,
                "kernel_ms": _finite(best.get("kernel_ms")),
                "pct_copy_bw": _finite(best.get("pct_copy_bw")),
                "tflops": _finite(best.get("tflops")),
                "library": lib,
                "pct_of_library": 100 * eager / ms if lib and eager else None,
                "vs_eager": eager / ms if eager else None,
                "vs_compile": compiled / ms if compiled else None,
                "host_us": float(host_mine.iloc[-1]) if len(host_mine) else None,
                "torch_host_us": float(host_torch.iloc[-1]) if len(host_torch) else None,
                "commit": best.get("git_commit"),
            }
        )
    rows.sort(key=lambda r: (r["device_type"] != "cuda", r["device_dir"], r["day"], r["op"], r["dtype"]))
    return rows


def plot_standings(rows: list[dict], device_dir: str, path: Path) -> Path | None:
    """Horizontal bars: the best implementation's speedup over torch eager and torch.compile,
    one pair per (op, dtype) of one device, with the 1x line. None when nothing compares."""
    from matplotlib.figure import Figure

    mine = [r for r in rows if r["device_dir"] == device_dir and (r["vs_eager"] or r["vs_compile"])]
    if not mine:
        return None
    labels = [f"{r['day']} {r['op']} {r['dtype']}" for r in mine]
    fig = Figure(figsize=(8, 0.35 * len(mine) + 1.4), layout="constrained")
    ax = fig.add_subplot()
    ys = range(len(mine))
    eager = [r["vs_eager"] or 0 for r in mine]
    compiled = [r["vs_compile"] or 0 for r in mine]
    ax.barh([y + 0.2 for y in ys], eager, height=0.4, label="vs torch eager")
    ax.barh([y - 0.2 for y in ys], compiled, height=0.4, label="vs torch.compile")
    ax.axvline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup of the best gpu-days implementation (x, higher is better)")
    ax.set_title(f"Where each kernel stands — {mine[0]['device']}", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
