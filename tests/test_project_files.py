"""The project's own files agree with each other (pins, commands the README promises)."""

import re
import tomllib

from pytorch_custom_ops.library import REPO_ROOT


def _pins(requirements):
    return dict(re.match(r"([A-Za-z0-9_.-]+)==(\S+)", r).groups() for r in requirements if "==" in r)


def test_pixi_pins_match_pyproject():
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    pixi = tomllib.loads((REPO_ROOT / "pixi.toml").read_text())
    pinned = _pins(pyproject["project"]["dependencies"])
    assert {"torch", "mojo", "max", "triton", "numpy"} <= set(pinned)
    pixi_deps = {k: v.removeprefix("==") for k, v in pixi["pypi-dependencies"].items() if isinstance(v, str)}
    assert pixi_deps == pinned
    assert set(pixi["tasks"]) >= {"test", "bench", "docs", "lint"}


def test_readme_quickstart_and_ci_agree():
    readme = (REPO_ROOT / "README.md").read_text()
    for cmd in ("pip install nox", "nox -s test", "nox -s bench", "nox -s docs"):
        assert cmd in readme
    assert "nox -s test" in (REPO_ROOT / ".ci" / "run").read_text()


def test_every_mojo_day_has_benchmark_cases():
    """A merge once dropped the CASES list silently: `python -m benchmark` then ran nothing."""
    from benchmark.cases import CASES
    from pytorch_custom_ops.library import REPO_ROOT

    mojo_days = {p.parent.name for p in (REPO_ROOT / "days").glob("day*/*.mojo") if p.name != "__init__.mojo"}
    assert mojo_days <= {c.day for c in CASES}


def test_the_site_shows_each_ops_newest_run():
    # a GPU session may time a day's ops in separate runs (--op): each op keeps its own newest
    import pandas as pd

    from benchmark.store import latest_run

    rows = [
        ("a", "day012", "softmax", "old"),
        ("b", "day012", "softmax", "new"),
        ("c", "day012", "softmax_backward", "only"),
        ("a", "day013", "layer_norm", "stale"),
        ("d", "day013", "layer_norm", "fresh"),
    ]
    df = pd.DataFrame(rows, columns=["run_id", "day", "op", "what"]).assign(device_dir="h100")
    assert sorted(latest_run(df)["what"]) == ["fresh", "new", "only"]


def test_results_written_before_a_new_column_get_it_blank(tmp_path, monkeypatch):
    # old CSVs lack columns added later (kernel_ms): appending must not shift values
    import csv

    from benchmark import store

    monkeypatch.setattr(store, "device_slug", lambda: "dev")
    old = [c for c in store.COLUMNS if c != "kernel_ms"]
    path = tmp_path / "dev" / "day999.csv"
    path.parent.mkdir()
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=old)
        w.writeheader()
        w.writerow({**{c: "" for c in old}, "run_id": "a", "op": "x", "ms_median": "1.5", "note": "old"})
    store.append_rows([{"op": "x", "ms_median": 2.5, "kernel_ms": 0.5, "note": "new"}], "day999", "b", tmp_path)
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["run_id"], r["ms_median"], r["kernel_ms"], r["note"]) for r in rows] == [
        ("a", "1.5", "", "old"),
        ("b", "2.5", "0.5", "new"),
    ]
