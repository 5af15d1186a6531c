"""The results store: append-only CSV files, `results/<device>/<day>.csv`.

One row per measurement (implementation x shape x dtype), stamped with the run id and
the environment. Earlier runs are never rewritten; readers pick the run they want
(`latest_run`). The site and the plots read only from here.

Crash and concurrency safety: a run's rows are rendered in memory first and appended in one
write, under an exclusive lock on the device folder, so a writer killed mid-run leaves the
file as it was, and two benchmark runs on one machine never interleave rows. A header
rewrite (a column was added) goes through a temporary file and a rename. A torn last line
(power loss) is closed with a newline before the next append, and readers skip and report
any malformed row instead of failing or dropping the file.
"""

from __future__ import annotations

import csv
import fcntl
import io
import os
import tempfile
import uuid
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
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
    "mfu",  # training (day 020): model FLOPs per second over the GPU's dense bf16 peak
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
    """Append `rows` (dicts with ROW_COLUMNS keys; missing ones are blank) for `day`:
    all of them or, if anything fails before the write, none."""
    path = results_dir / device_slug() / f"{day}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    env = stamp()
    now = datetime.now(UTC).isoformat(timespec="seconds")
    body = io.StringIO()
    writer = csv.DictWriter(body, fieldnames=COLUMNS, extrasaction="raise")
    for row in rows:  # rendered before the file is touched: a crash here writes nothing
        unknown = set(row) - set(ROW_COLUMNS)
        if unknown:
            raise KeyError(f"unknown result columns: {sorted(unknown)}")
        full = {**{k: "" for k in COLUMNS}, **env, "run_id": run_id, "timestamp": now, "day": day}
        full.update({k: _fmt(v) for k, v in row.items()})
        writer.writerow(full)
    with _locked(path.parent):
        if not path.exists() or path.stat().st_size == 0:
            header = io.StringIO()
            csv.DictWriter(header, fieldnames=COLUMNS).writeheader()
            write_atomically(path, header.getvalue() + body.getvalue())
            return path
        _upgrade_header(path)
        with path.open("ab") as f:
            if _last_byte(path) not in (b"\n", b""):
                f.write(b"\r\n")  # close a torn line: it stays one malformed row that readers skip
            f.write(body.getvalue().encode())
            f.flush()
            os.fsync(f.fileno())
    return path


@contextmanager
def _locked(folder: Path):
    """One writer at a time per device folder, across processes (flock on the folder)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _last_byte(path: Path) -> bytes:
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return b""
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def write_atomically(path: Path, data: bytes | str) -> None:
    """Write `data` to a temporary file beside `path`, then rename it over `path`: a reader
    sees the old file or the whole new one, never a part (text is written as UTF-8)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _upgrade_header(path: Path) -> None:
    """Rewrite a file written before a column was added, with that column blank, so
    that appended rows line up with its header (through a temporary file and a rename)."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames == COLUMNS:
            return
        unknown = set(reader.fieldnames or ()) - set(COLUMNS)
        if unknown:
            raise KeyError(f"{path}: unknown result columns {sorted(unknown)}")
        rows = list(reader)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, restval="")
    writer.writeheader()
    writer.writerows(rows)
    write_atomically(path, out.getvalue())


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def read_rows(path: Path) -> tuple[list[dict], list[str]]:
    """The well-formed rows of one results file, and a note for each row skipped (wrong
    number of fields, a number that does not parse)."""
    rows, skipped = [], []
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return rows, skipped
        unknown = set(header) - set(COLUMNS)
        if unknown:
            return rows, [f"{path}: unknown columns {sorted(unknown)}: file skipped"]
        for fields in reader:
            line = reader.line_num
            if not fields:
                continue
            if len(fields) != len(header):
                skipped.append(f"{path}:{line}: {len(fields)} fields, the header has {len(header)}")
                continue
            row = dict(zip(header, fields, strict=True))
            bad = [c for c in NUMERIC_COLUMNS if row.get(c) and not _is_number(row[c])]
            if bad:
                skipped.append(f"{path}:{line}: not a number in {bad}")
                continue
            rows.append(row)
    return rows, skipped


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def load(day: str | None = None, device: str | None = None, results_dir: Path = RESULTS_DIR):
    """All stored rows (optionally of one day / device folder) as a pandas DataFrame.

    Malformed rows are skipped; `df.attrs["skipped"]` lists them (file:line: why)."""
    import pandas as pd

    files = sorted(results_dir.glob(f"{device or '*'}/{day or '*'}.csv"))
    records, skipped = [], []
    for f in files:
        rows, bad = read_rows(f)
        gone = superseded_runs(f.parent)
        records += [{**r, "device_dir": f.parent.name, "superseded": r.get("run_id") in gone} for r in rows]
        skipped += bad
    df = pd.DataFrame.from_records(records, columns=COLUMNS + ["device_dir", "superseded"])
    df = df.replace("", float("nan"))
    for c in NUMERIC_COLUMNS:
        df[c] = pd.to_numeric(df[c])
    df.attrs["skipped"] = skipped
    return df


SUPERSEDED_FILE = "superseded.txt"


def superseded_runs(device_dir: Path) -> dict[str, str]:
    """Run ids listed in `<device>/superseded.txt`, with the reason given for each.

    A run whose code was reverted stays in the append-only store, but it no longer
    describes what landed: listing it there (one run id a line, then the reason; `#`
    starts a comment) keeps the site and the plots on the newest run that does."""
    path = device_dir / SUPERSEDED_FILE
    if not path.exists():
        return {}
    runs = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            run_id, _, why = line.partition(" ")
            runs[run_id] = why.strip()
    return runs


def latest_run(df):
    """Rows of the newest run in `df`, per device folder, day and op, not counting
    superseded runs (see `superseded_runs`) while the op has any other.

    Per op, not per day: a GPU session may time a day's ops in separate runs
    (`--op`), and each op's newest run is the one to show.
    """
    if df.empty:
        return df
    if "superseded" in df.columns:
        keys = ["device_dir", "day", "op"]
        kept = df["superseded"] != True  # noqa: E712 (NaN: a row without the flag counts)
        has_kept = kept.groupby([df[k] for k in keys]).transform("any")
        df = df[kept | ~has_kept]
    newest = df.groupby(["device_dir", "day", "op"])["run_id"].transform("max")
    return df[df["run_id"] == newest]
