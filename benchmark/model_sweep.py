"""Part of day 016's model benchmark (benchmark/cases/day016.py), e.g. to re-run one shape.

`python -m benchmark --day day016` runs the whole sweep; this runs the ops, shapes, dtypes
and implementations named, and appends the rows to results/<device>/day016.csv the same way.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .cases.day016 import DAY, FORWARD, IMPLS, TRAIN, sweep
from .store import RESULTS_DIR, append_rows, new_run_id


def main(argv: list[str] | None = None) -> int:
    """A part of the sweep, e.g. to re-run one shape: `python -m benchmark.model_sweep
    --op gpt_block_train --shape 4x2048x1024 --dtype bfloat16` (rows appended like the
    harness's; `python -m benchmark --day day016` runs it all)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmark.model_sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--op", action="append", choices=[FORWARD, TRAIN])
    parser.add_argument("--shape", action="append", help="batch x seq x d, e.g. 8x1024x768 (repeatable)")
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16"])
    parser.add_argument("--impl", action="append", choices=IMPLS, help="default: all (torch always: the baseline)")
    parser.add_argument("--no-store", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shape] if args.shape else None
    dtypes = [getattr(torch, n) for n in args.dtype] if args.dtype else None
    impls = tuple(dict.fromkeys(["torch", *args.impl])) if args.impl else IMPLS
    rows = []
    for op in args.op or [FORWARD, TRAIN]:
        rows += sweep(op, quick=device == "cpu", device=device, shapes=shapes, dtypes=dtypes, impls=impls)
    for r in rows:
        ms, speed = r.get("ms_median"), r.get("speedup_vs_torch")
        what = f"{ms:9.4f} ms {r['tokens_per_s']:10.4g} tok/s {speed:6.2f}x" if ms else f"{r['status']}: {r['reason']}"
        print(f"{r['op']:16s} {r['shape']:12s} {r['dtype']:9s} {r['impl']:20s} {what}")
    if not args.no_store:
        print(f"appended {len(rows)} rows to {append_rows(rows, DAY, new_run_id(), args.results_dir)}")
    return 1 if any(r.get("status") == "wrong" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
