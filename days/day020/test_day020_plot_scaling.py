"""plot_scaling: the rates it draws are scaling.py's, from the newest commit of each build
and mode, and a mode without its own one-GPU run borrows its base mode's."""

from __future__ import annotations

import csv

import pytest

from days.day020 import plot_scaling as P
from days.day020.scaling import FIELDS


def _rows(commit: str, impl: str, mode: str, gpus: int, rates: list[float]) -> list[dict]:
    base = {k: "" for k in FIELDS} | {"git_commit": commit, "device": "GPU X", "global_batch": "32x1024"}
    return [
        base | {"impl": impl, "mode": mode, "gpus": gpus, "step": 10 * (i + 1), "tokens_per_s": r}
        for i, r in enumerate(rates)
    ]


@pytest.fixture
def scaling_csv(tmp_path):
    rows = _rows("old", "gpu_days", "graph", 1, [1, 100, 100]) + _rows("old", "gpu_days", "graph", 2, [1, 150, 150])
    rows += _rows("new", "gpu_days", "graph", 1, [5, 100, 110]) + _rows("new", "gpu_days", "graph", 2, [5, 190, 200])
    rows += _rows("new", "gpu_days", "graph+flat", 2, [5, 170, 190])
    rows += _rows("new", "torch", "eager", 1, [9, 80, 80])  # no two-GPU run: not drawn
    path = tmp_path / "ddp.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_the_newest_commit_and_the_base_modes_one_gpu_run(scaling_csv):
    pairs = P.newest_pairs(P.read_rates(scaling_csv))
    assert pairs == [("gpu_days", "graph+flat", "new", 105.0, 180.0), ("gpu_days", "graph", "new", 105.0, 195.0)]


def test_it_draws_a_png_and_refuses_a_file_without_pairs(scaling_csv, tmp_path, capsys):
    out = tmp_path / "scaling.png"
    assert P.main([str(scaling_csv), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "1.86x" in capsys.readouterr().out  # 195 / 105
    lonely = tmp_path / "lonely.csv"
    lonely.write_text("".join(scaling_csv.read_text().splitlines(keepends=True)[:4]))  # one-GPU rows only
    with pytest.raises(SystemExit, match="no build has both"):
        P.main([str(lonely), "--out", str(tmp_path / "x.png")])
