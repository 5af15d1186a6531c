"""The site's kernel-family plots stay readable when a family has many ops."""

import warnings
from pathlib import Path

import pytest

from benchmark import plots, store

RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_a_crowded_family_plot_gets_a_panel_per_op(tmp_path):
    """Attention's family (days 017 and 018: 8 ops x 12 impls) drew ~100 lines in one
    panel per dtype; the legend squeezed the axes to nothing (matplotlib warned)."""
    df = store.latest_run(plots.prepare(store.load(results_dir=RESULTS)))
    sub = df[df["op"].astype(str).str.contains("attention") & (df["device_type"] == "cuda")]
    if sub.empty:
        pytest.skip("no stored CUDA attention rows")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = plots.plot_family(df, "attention", ["attention"], tmp_path)
    assert paths and all(p.stat().st_size > 0 for p in paths)
    assert not [w for w in caught if "constrained_layout" in str(w.message)]
