"""The results store: append-only CSV files, `results/<device>/<day>.csv`.

One row per measurement (implementation x shape x dtype), stamped with the run id and
the environment. Earlier runs are never rewritten; readers pick the run they want
(`latest_run`). The site and the plots read only from here.
"""

from __future__ import annotations

import csv
import uuid
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path

from .environment import REPO_ROOT, device_slug, stamp

RESULTS_DIR = REPO_ROOT / "results"

STAMP_COLUMNS = [
    "run_id",
    "timestamp",
    "git_commit",
    "device",
    "device_type",
    "driver",
    "cuda",
    "python",
    "torch",
    "triton",
    "max",
    "mojo",
]
NUMERIC_COLUMNS = [
    "ms_median",
    "ms_p20",
    "ms_p80",
    "ms_std",
    "gbps",
    "tflops",
    "pct_copy_bw",
    "speedup_vs_torch",
    "peak_extra_mib",
    "host_us",  # host-side cost of one call (steady state), where measured
    "kernel_ms",  # GPU: device time of the kernels one call launches (profiler), no host cost
    "tokens_per_s",  # model benchmarks (day 016): batch * seq tokens per second of one step
]
ROW_COLUMNS = [
    "day",
    "op",
    "impl",
    "shape",
    "dtype",
    "status",  # ok | NA (could not run: OOM, build error...) | wrong (failed validation)
    "reason",
    *NUMERIC_COLUMNS,
    "note",
]
COLUMNS = STAMP_COLUMNS + ROW_COLUMNS


def new_run_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


def append_rows(rows: Iterable[Mapping], day: str, run_id: str, results_dir: Path = RESULTS_DIR) -> Path:
    """Append `rows` (dicts with ROW_COLUMNS keys; missing ones are blank) for `day`."""
    path = results_dir / device_slug() / f"{day}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    if not new:
        _upgrade_header(path)
    env = stamp()
    now = datetime.now(UTC).isoformat(timespec="seconds")
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="raise")
        if new:
            writer.writeheader()
        for row in rows:
            unknown = set(row) - set(ROW_COLUMNS)
            if unknown:
                raise KeyError(f"unknown result columns: {sorted(unknown)}")
            full = {**{k: "" for k in COLUMNS}, **env, "run_id": run_id, "timestamp": now, "day": day}
            full.update({k: _fmt(v) for k, v in row.items()})
            writer.writerow(full)
    return path


def _upgrade_header(path: Path) -> None:
    """Rewrite a file written before a column was added, with that column blank, so
    that appended rows line up with its header."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames == COLUMNS:
            return
        unknown = set(reader.fieldnames or ()) - set(COLUMNS)
        if unknown:
            raise KeyError(f"{path}: unknown result columns {sorted(unknown)}")
        rows = list(reader)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(rows)


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def load(day: str | None = None, device: str | None = None, results_dir: Path = RESULTS_DIR):
    """All stored rows (optionally of one day / device folder) as a pandas DataFrame."""
    import pandas as pd

    files = sorted(results_dir.glob(f"{device or '*'}/{day or '*'}.csv"))
    if not files:
        return pd.DataFrame(columns=COLUMNS + ["device_dir"])
    text = {c: str for c in STAMP_COLUMNS + ["day", "op", "impl", "shape", "dtype", "status", "reason", "note"]}
    frames = [
        pd.read_csv(f, keep_default_na=False, na_values=[""], dtype=text).assign(device_dir=f.parent.name)
        for f in files
    ]
    return pd.concat(frames, ignore_index=True)


def latest_run(df):
    """Rows of the newest run in `df`, per device folder, day and op.

    Per op, not per day: a GPU session may time a day's ops in separate runs
    (`--op`), and each op's newest run is the one to show.
    """
    if df.empty:
        return df
    newest = df.groupby(["device_dir", "day", "op"])["run_id"].transform("max")
    return df[df["run_id"] == newest]
