"""Day 016's model benchmark: the GPT block's two builds agree, the `day016` runners run
and store their rows, the plot and the per-op profile are made. CPU tests use one tiny
shape (2 x 13 x 128: two heads, an odd sequence); the CUDA test runs every mode once."""

import csv

import pytest
import torch

from benchmark import gpt_block as G
from benchmark.cases import day016

SHAPE = (2, 13, 128)


def _train(build: str, x: torch.Tensor):
    block = G.make_block(x.shape[-1], build, x.dtype, x.device)
    return G.train_step(
        block, x.clone().requires_grad_(), G.causal_mask(x.shape[1], x.dtype, x.device), [*block.parameters()]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_builds_agree_with_float64_and_each_other(dtype, device):
    x = G.make_input(SHAPE, dtype, device)
    want, names = G.reference(x)
    assert len(want) == len(names) == 14  # output, grad x, 12 parameters
    got = {build: _train(build, x) for build in ("gpu_days", "gpu_days_fused", "torch")}
    errs = {build: G.check(g, want, names, dtype, build) for build, g in got.items()}
    if dtype == torch.float32:
        assert max(errs.values()) < 2e-5, errs
    # the builds against each other, tensor by tensor (all are near float64, so near each other)
    for build in ("gpu_days", "gpu_days_fused"):
        for name, a, b in zip(names, got[build], got["torch"], strict=True):
            assert G.relative_error(a, b.double()) <= 2 * G.TOLERANCE[dtype], (build, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_check_catches_a_block_without_its_causal_mask(dtype):
    # the tolerance must be tight enough to see a real bug: attention that looks ahead
    x = G.make_input(SHAPE, dtype, "cpu")
    want, names = G.reference(x)
    block = G.make_block(SHAPE[-1], "torch", dtype, "cpu")
    no_mask = torch.zeros(1, SHAPE[1], SHAPE[1], dtype=dtype)
    got = G.train_step(block, x.clone().requires_grad_(), no_mask, list(block.parameters()))
    with pytest.raises(G.BlockMismatch, match="differs from the float64 block"):
        G.check(got, want, names, dtype, "unmasked")


def test_block_rejects_bad_widths_and_builds():
    with pytest.raises(ValueError, match="GPTBlock: d=100 must be a positive multiple of the head size 64"):
        G.GPTBlock(100)
    with pytest.raises(ValueError, match="GPTBlock: unknown build 'jax'"):
        G.GPTBlock(128, "jax")
    with pytest.raises(ValueError, match=r"GPTBlock: expected \(batch, seq, 128\), got \(2, 13, 64\)"):
        G.GPTBlock(128)(torch.randn(2, 13, 64))


def test_runner_registered_and_quick_run_stores_rows_and_plots(tmp_path):
    from benchmark.__main__ import main
    from benchmark.cases import RUNNERS
    from benchmark.plots import plot_day, plot_name
    from benchmark.store import load

    assert {(r.day, r.op) for r in RUNNERS} >= {("day016", "gpt_block"), ("day016", "gpt_block_train")}
    ops = ["--op", "gpt_block", "--op", "gpt_block_train"]  # day 016 also has a permute_copy case
    assert main(["--day", "day016", *ops, "--quick", "--results-dir", str(tmp_path)]) == 0
    df = load(day="day016", results_dir=tmp_path)
    rows = df[df["op"] != "copy_bandwidth"]
    assert set(rows["op"]) == {"gpt_block", "gpt_block_train"}
    assert set(rows["status"]) == {"ok"}, rows[["op", "impl", "reason"]]
    assert set(rows["impl"]) == (
        {"torch", "gpu_days", "gpu_days_fused"} if not torch.cuda.is_available() else set(day016.IMPLS)
    )
    assert set(rows["shape"]) == {"2x13x128"} and (rows["run_id"] == rows["run_id"].iloc[0]).all()
    tokens = 2 * 13 / (rows["ms_median"] * 1e-3)
    assert ((rows["tokens_per_s"] - tokens).abs() <= 1e-4 * tokens).all()
    assert (rows.loc[rows["impl"] == "torch", "speedup_vs_torch"] == 1).all()
    assert rows["note"].str.contains("max relative error vs float64").all()
    paths = plot_day(df, "day016", tmp_path / "plots")
    device_dir = df["device_dir"].iloc[0]
    assert sorted(p.name for p in paths) == sorted(plot_name("day016", device_dir, op) for op in set(rows["op"]))


def test_a_wrong_build_is_reported_and_not_timed(monkeypatch):
    # a "gpu-days" build whose attention ignores the mask: its rows say so, torch's are timed
    import dataclasses

    lookahead = dataclasses.replace(G.TORCH, name="gpu_days", scores=lambda q, k, mask, scale: q @ k.mT * scale)
    monkeypatch.setattr(G, "GPU_DAYS", lookahead)
    rows = {r["impl"]: r for r in day016.problem_rows(day016.TRAIN, SHAPE, torch.float32, "cpu")}
    assert rows["gpu_days"]["status"] == "wrong" and "ms_median" not in rows["gpu_days"]
    assert "differs from the float64 block" in rows["gpu_days"]["reason"]
    assert rows["torch"]["status"] == "ok" and rows["torch"]["ms_median"] > 0


def test_profile_table_names_the_ops_and_stages(tmp_path):
    from benchmark import model_profile

    args = ["--shape", "2x13x128", "--dtype", "float32", "--steps", "2", "--results-dir", str(tmp_path)]
    assert model_profile.main(args) == 0
    (path,) = tmp_path.glob("*/profile/day016.csv")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == model_profile.COLUMNS and all(r["run_id"] == rows[0]["run_id"] for r in rows)
    mine = [r for r in rows if r["build"] == "gpu_days"]
    names = {r["kind"]: set() for r in mine}
    for r in mine:
        names[r["kind"]].add(r["name"])
    assert {"gpu_days::gemm", "gpu_days::gemm_batched", "gpu_days::layer_norm", "gpu_days::softmax"} <= names[
        "gpu_days_op"
    ]
    assert {"block.qkv", "block.scores", "block.softmax", "block.fc2_residual"} <= names["stage"]
    (step,) = [r for r in mine if r["kind"] == "step"]
    assert float(step["host_total_us"]) > 0
    gemm = next(r for r in mine if r["name"] == "gpu_days::gemm")
    assert float(gemm["calls_per_step"]) == 4 + 8  # 4 linears forward; 2 GEMMs each backward


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: compile and CUDA-graph modes")
@pytest.mark.parametrize("op", [day016.FORWARD, day016.TRAIN])
def test_every_mode_validates_on_cuda(op):
    rows = day016.problem_rows(op, (2, 64, 128), torch.bfloat16, "cuda")
    assert {r["impl"]: r.get("status") for r in rows} == dict.fromkeys(day016.IMPLS, "ok"), rows
