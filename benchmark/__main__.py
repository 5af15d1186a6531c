"""`python -m benchmark [--day dayNNN] [--op NAME] [--quick | --full] [--list] [--no-store] [--results-dir DIR]`

Runs the registered cases on CUDA when present (full shapes), else on the CPU (quick
shapes), prints a table, and appends the rows to results/<device>/<day>.csv.
"""

from __future__ import annotations

import argparse
import sys
from fnmatch import fnmatchcase
from functools import partial
from pathlib import Path

import torch

from . import timing
from .cases import CASES, RUNNERS
from .environment import stamp
from .store import RESULTS_DIR, append_rows, new_run_id


def day_name(day: str) -> str:
    """`--day 9`, `--day 009` or `--day day009`: the day's folder name."""
    return f"day{int(day):03d}" if day.isdigit() else day


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmark", description=__doc__.splitlines()[0])
    parser.add_argument("--day", action="append", help="only these days (repeatable), e.g. day009")
    parser.add_argument("--op", action="append", help="only these ops (repeatable; patterns like 'attention_*')")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small shapes (default on CPU)")
    size.add_argument("--full", action="store_true", help="all shapes (default on CUDA)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--no-store", action="store_true", help="print only; do not append to results/")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="the results store (default: results/)")
    args = parser.parse_args(argv)
    args.day = [day_name(d) for d in args.day] if args.day else args.day

    def wanted(x) -> bool:
        return (not args.day or x.day in args.day) and (not args.op or any(fnmatchcase(x.op, o) for o in args.op))

    cases = [c for c in CASES if wanted(c)]
    runners = [r for r in RUNNERS if wanted(r)]
    if args.list:  # what the filters select
        for c in cases:
            print(f"{c.day}  {c.op:24s} impls: {', '.join(c.impls)}")
        for r in runners:
            print(f"{r.day}  {r.op:24s} (the day's own sweep)")
        return 0
    if not (cases or runners):
        asked = " ".join([*(f"--day {d}" for d in args.day or ()), *(f"--op {o}" for o in args.op or ())])
        print(f"python -m benchmark: no case matches {asked}; `--list` shows them", file=sys.stderr)
        return 2

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    device = "cuda" if torch.cuda.is_available() else "cpu"
    quick = args.quick or (device == "cpu" and not args.full)
    env = stamp()
    console = Console(width=None if sys.stdout.isatty() else 150)
    console.print(
        f"[bold]{env['device']}[/]  torch {env['torch']}  max {env['max']}  mojo {env['mojo']}  "
        f"commit {env['git_commit']}  ({'quick' if quick else 'full'} shapes)"
    )
    copy_gbps = timing.copy_bandwidth_gbps(device)
    console.print(f"device copy bandwidth: {copy_gbps:.1f} GB/s (read + write)")
    run_id = new_run_id()
    by_day: dict[str, list[dict]] = {}
    for day in sorted({x.day for x in cases + runners}):
        by_day.setdefault(day, []).append(
            {"op": "copy_bandwidth", "impl": "torch_copy", "status": "ok", "gbps": copy_gbps, "pct_copy_bw": 100.0}
        )

    total = sum(len(c.shapes["quick" if quick else "full"]) * len(c.dtypes.get(device, [1])) for c in cases)
    from .harness import run_case

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=total)
        for c in cases:
            rows = run_case(c, device, quick, copy_gbps, progress=lambda: progress.advance(task))
            by_day[c.day].extend(rows)
        for r in runners:
            progress.update(task, description=f"{r.day} {r.op}")
            by_day.setdefault(r.day, []).extend(r.rows(quick, device))

    table = Table(title=f"run {run_id}")
    cols = ("day", "op", "shape", "dtype", "impl", "median ms", "p20-p80", "GB/s", "% copy", "kernel ms")
    cols += ("TFLOP/s", "tokens/s", "vs torch")
    for col in (*cols, "status"):
        table.add_column(col, justify="right" if col not in ("day", "op", "impl", "status") else "left")
    for day, rows in by_day.items():
        for r in rows:
            if r["op"] == "copy_bandwidth":
                continue
            ok = r.get("status") == "ok"
            cell = partial(_cell, r)

            table.add_row(
                day,
                r["op"],
                r["shape"],
                r["dtype"],
                r["impl"],
                cell("ms_median", ".4f"),
                f"{cell('ms_p20', '.4f')}-{cell('ms_p80', '.4f')}",
                cell("gbps", ".1f"),
                cell("pct_copy_bw", ".0f", "%"),
                cell("kernel_ms", ".4f"),
                cell("tflops", ".1f"),
                cell("tokens_per_s", ".3g"),
                cell("speedup_vs_torch", ".2f", "x"),
                "ok" if ok else f"{r.get('status')}: {r.get('reason', '')}"[:60],
            )
    console.print(table)
    if not args.no_store:
        for day, rows in by_day.items():
            path = append_rows(rows, day=day, run_id=run_id, results_dir=args.results_dir)
            console.print(f"appended {len(rows)} rows to {path}")
    bad = [r for rows in by_day.values() for r in rows if r.get("status") == "wrong"]
    return 1 if bad else 0


def _cell(row: dict, key: str, spec: str, suffix: str = "") -> str:
    v = row.get(key)
    return f"{v:{spec}}{suffix}" if row.get("status") == "ok" and v is not None and v != "" else "-"


if __name__ == "__main__":
    sys.exit(main())
