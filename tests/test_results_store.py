"""The results store survives crashes and concurrent writers, and readers survive bad rows."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from benchmark import store
from pytorch_custom_ops.library import REPO_ROOT


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "device_slug", lambda: "dev")
    monkeypatch.setattr(store, "stamp", lambda: {"device": "test device", "device_type": "cpu"})
    return tmp_path


def _child(code: str, results_dir) -> subprocess.Popen:
    prelude = f"""
        import sys, time
        from pathlib import Path
        from benchmark import store
        store.device_slug = lambda: "dev"
        store.stamp = lambda: {{"device": "test device", "device_type": "cpu"}}
        RESULTS = Path({str(results_dir)!r})
    """
    script = textwrap.dedent(prelude) + textwrap.dedent(code)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)


def test_a_writer_killed_between_rows_leaves_the_file_as_it_was(results):
    path = store.append_rows([{"op": "kept", "ms_median": 1.0}], "day999", "run-a", results)
    before = path.read_bytes()
    child = _child(
        """
        def rows():
            for i in range(3):
                yield {"op": f"lost{i}", "ms_median": float(i)}
            print("between rows", flush=True)
            time.sleep(60)  # killed here, mid-run
            yield {"op": "never"}
        store.append_rows(rows(), "day999", "run-b", RESULTS)
        """,
        results,
    )
    assert child.stdout.readline().strip() == "between rows"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert path.read_bytes() == before
    rows, skipped = store.read_rows(path)
    assert [r["op"] for r in rows] == ["kept"] and skipped == []


def test_concurrent_runs_never_interleave_rows(results):
    writers = [
        _child(
            f"""
            for run in range(15):
                rows = [{{"op": "w{w}", "shape": str(i), "note": "x" * 2000}} for i in range(6)]
                store.append_rows(rows, "day999", f"w{w}-{{run}}", RESULTS)
            """,
            results,
        )
        for w in range(4)
    ]
    for child in writers:
        assert child.wait(timeout=120) == 0
    rows, skipped = store.read_rows(results / "dev" / "day999.csv")
    assert skipped == [] and len(rows) == 4 * 15 * 6
    runs = [r["run_id"] for r in rows]
    for run in set(runs):  # each run's six rows are contiguous, in order
        first = runs.index(run)
        assert runs[first : first + 6] == [run] * 6
        assert [r["shape"] for r in rows[first : first + 6]] == [str(i) for i in range(6)]


def test_header_upgrade_goes_through_a_rename_and_a_failed_one_changes_nothing(results, monkeypatch):
    old = [c for c in store.COLUMNS if c != "kernel_ms"]
    path = results / "dev" / "day999.csv"
    path.parent.mkdir()
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=old)
        w.writeheader()
        w.writerow({**{c: "" for c in old}, "run_id": "a", "op": "x", "ms_median": "1.5"})
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(store.os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        store.append_rows([{"op": "y", "kernel_ms": 0.5}], "day999", "b", results)
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == ["day999.csv"]  # no temporary file left behind
    monkeypatch.undo()
    monkeypatch.setattr(store, "device_slug", lambda: "dev")
    monkeypatch.setattr(store, "stamp", lambda: {})
    inode = path.stat().st_ino
    store.append_rows([{"op": "y", "kernel_ms": 0.5}], "day999", "b", results)
    assert path.stat().st_ino != inode  # rewritten by rename, not in place
    rows, _ = store.read_rows(path)
    assert [(r["op"], r["ms_median"], r["kernel_ms"]) for r in rows] == [("x", "1.5", ""), ("y", "", "0.5")]


def test_malformed_rows_are_skipped_and_reported_and_appends_after_a_torn_line_parse(results):
    path = store.append_rows([{"op": "good", "ms_median": 2.0}], "day999", "a", results)
    with path.open("ab") as f:
        f.write(b"b,2026,torn row with too few fields")  # no newline: a write cut short
    store.append_rows([{"op": "after", "ms_median": 3.0}], "day999", "c", results)
    with path.open("a", newline="") as f:
        row = {c: "" for c in store.COLUMNS} | {"run_id": "d", "op": "nan?", "ms_median": "fast"}
        csv.DictWriter(f, fieldnames=store.COLUMNS).writerow(row)
    df = store.load(results_dir=results)
    assert sorted(df["op"]) == ["after", "good"]
    assert df["ms_median"].tolist() == [2.0, 3.0]
    skipped = df.attrs["skipped"]
    assert len(skipped) == 2
    assert "fields, the header has" in skipped[0] and "not a number in ['ms_median']" in skipped[1]


def test_superseded_runs_stay_stored_but_the_newest_other_run_is_shown(results):
    # a run whose code was reverted is listed in <device>/superseded.txt: its rows are
    # still loaded, but latest_run skips it while the op has another run
    store.append_rows([{"op": "gemm", "ms_median": 2.0}], "day999", "a", results)
    rows = [{"op": "gemm", "ms_median": 3.0}, {"op": "alone", "ms_median": 1.0}]
    path = store.append_rows(rows, "day999", "b", results)
    (path.parent / store.SUPERSEDED_FILE).write_text("# reverted\nb  a kernel that did not land # why\n")
    assert store.superseded_runs(path.parent) == {"b": "a kernel that did not land"}
    df = store.load(results_dir=results)
    assert sorted(df["run_id"]) == ["a", "b", "b"] and df["superseded"].tolist().count(True) == 2
    shown = store.latest_run(df)
    # gemm: the older run a; alone: only the superseded run exists, so it is still shown
    assert sorted(zip(shown["op"], shown["run_id"], strict=True)) == [("alone", "b"), ("gemm", "a")]


def test_the_site_reports_and_skips_a_malformed_row(results, monkeypatch, caplog):
    import importlib.util
    import logging

    spec = importlib.util.spec_from_file_location("gpu_days_site_hooks", REPO_ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, hooks)  # its dataclasses look their module up
    spec.loader.exec_module(hooks)

    path = store.append_rows([{"op": "good", "ms_median": 2.0}], "day999", "a", results)
    with path.open("a") as f:
        f.write("x,y\n")
    monkeypatch.setenv(hooks.RESULTS_ENV, str(results))
    with caplog.at_level(logging.INFO):
        df = hooks._load_results(REPO_ROOT)
    assert df["op"].tolist() == ["good"]
    assert any("skipped a malformed result row" in r.getMessage() for r in caplog.records)


def test_time_is_not_spent_holding_the_lock_while_rendering(results):
    # rows come from a slow generator (a benchmark yielding as it measures): other
    # writers must not wait for it, since the lock is taken only for the write
    slow = _child(
        """
        def rows():
            print("rendering", flush=True)
            time.sleep(5)
            yield {"op": "slow"}
        store.append_rows(rows(), "day999", "slow", RESULTS)
        """,
        results,
    )
    assert slow.stdout.readline().strip() == "rendering"
    t = time.perf_counter()
    store.append_rows([{"op": "fast"}], "day999", "fast", results)
    assert time.perf_counter() - t < 2.5
    slow.wait(timeout=60)


def test_the_harness_names_a_filter_that_matches_nothing(capsys):
    """A typo in --day or --op is an error on stderr (exit 2), not the case list; a day
    may be given by its number."""
    from benchmark.__main__ import day_name, main

    assert main(["--day", "999", "--no-store"]) == 2
    assert "no case matches --day day999" in capsys.readouterr().err
    assert main(["--day", "day009", "--op", "softmaxx", "--no-store"]) == 2
    assert "--op softmaxx" in capsys.readouterr().err
    assert [day_name(d) for d in ("9", "009", "day009")] == ["day009"] * 3
    capsys.readouterr()
    assert main(["--day", "9", "--list"]) == 0  # the list follows the filters
    assert {line.split()[0] for line in capsys.readouterr().out.splitlines()} == {"day009"}
    assert main(["--day", "day018", "--op", "attention_fwd_bwd_*", "--list"]) == 0  # patterns, as day 018 documents
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 4 and all(" attention_fwd_bwd_d" in line for line in listed)


def test_the_commit_stamp_ignores_the_harness_own_results(tmp_path, monkeypatch):
    """A stored run's rows (results/) do not make the next run's code '+dirty'."""
    from benchmark import environment

    repo = tmp_path / "repo"
    (repo / "results").mkdir(parents=True)
    (repo / "code.py").write_text("x = 1\n")
    (repo / "results" / "day.csv").write_text("a\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    monkeypatch.delenv("GPU_DAYS_GIT_COMMIT", raising=False)  # the GPU machine's stamp
    monkeypatch.setattr(environment, "REPO_ROOT", repo)
    (repo / "results" / "day.csv").write_text("a\nb\n")
    assert not environment._git_commit().endswith("+dirty")
    (repo / "code.py").write_text("x = 2\n")
    assert environment._git_commit().endswith("+dirty")
