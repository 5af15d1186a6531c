"""The project's own files agree with each other (pins, commands the README promises)."""

import ast
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


def _gpu_only(decorator: str, aliases: set[str]) -> bool:
    """A skip marker that skips unless CUDA is there (`skipif(not ... cuda ...)`), or a
    module's alias for one (`needs_cuda = pytest.mark.skipif(...)`)."""
    return bool(re.search(r"skipif\(\s*not\b[^,]*cuda", decorator, re.IGNORECASE)) or decorator in aliases


def test_gpu_only_tests_carry_cuda_in_their_names():
    """The GPU machine runs the CUDA cases by name (`pytest days tests -k cuda`, README's
    "Running on a GPU"): a test that only runs on CUDA and has no `cuda` in its name or its
    module's would never run there (day 016, part fourteen, found 17 such tests)."""
    missed = []
    for path in sorted([*REPO_ROOT.glob("days/*/test_*.py"), *REPO_ROOT.glob("tests/test_*.py")]):
        tree = ast.parse(path.read_text())
        aliases, module_gpu_only = set(), False
        for node in tree.body:
            if isinstance(node, ast.Assign) and _gpu_only(ast.unparse(node.value), set()):
                names = {t.id for t in node.targets if isinstance(t, ast.Name)}
                aliases |= names - {"pytestmark"}
                module_gpu_only |= "pytestmark" in names
        for node in tree.body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            gpu_only = module_gpu_only or any(_gpu_only(ast.unparse(d), aliases) for d in node.decorator_list)
            if gpu_only and "cuda" not in node.name and "cuda" not in path.name:
                missed.append(f"{path.relative_to(REPO_ROOT)}::{node.name}")
    assert not missed, f"GPU-only tests that `-k cuda` does not select: {missed}"
