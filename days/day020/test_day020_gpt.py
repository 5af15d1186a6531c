"""Day 020 on the CPU (MAX runs the Mojo ops): the data, the model in both impls, training.

The gpu-days model must compute what the torch model computes, step after step: same
logits, same gradients, same loss curve. On CUDA the same tests run on the GPU.
"""

from __future__ import annotations

import csv
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from days.day020 import data as D
from days.day020 import step as S
from days.day020 import train as T
from days.day020.model import CONFIGS, GPT, GPTConfig, twins
from days.day020.step import FlatGrads, Stepper, bucket_sizes, training_snapshot

TINY = CONFIGS["tiny"]


# -- data -------------------------------------------------------------------------------------
@pytest.fixture
def fake_stdlib(tmp_path):
    root = tmp_path / "lib"
    for i in range(40):
        sub = root / ("pkg" if i % 3 else "") / f"m{i:02d}.py"
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_text(f"def f{i}(x):\n    return x * {i}\n" * (i + 1))
    (root / "site-packages" / "x.py").parent.mkdir(parents=True)
    (root / "site-packages" / "x.py").write_text("not the standard library\n")
    return root


def test_data_is_deterministic_split_by_file_and_written_whole(fake_stdlib, tmp_path):
    a = D.build(tmp_path / "a", root=fake_stdlib, val_percent=25)
    b = D.build(tmp_path / "b", root=fake_stdlib, val_percent=25)
    assert a["train"] == b["train"] and a["val"] == b["val"]
    assert a["train"]["files"] + a["val"]["files"] == 40  # site-packages left out
    assert 0 < a["val"]["files"] < 40
    train = D.load(tmp_path / "a", "train")
    assert train.dtype == np.uint8 and len(train) == a["train"]["tokens"]
    assert hashlib.sha256(bytes(train)).hexdigest() == a["train"]["sha256"]
    assert b"not the standard library" not in bytes(train) + bytes(D.load(tmp_path / "a", "val"))
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no temporary files left


def test_data_from_this_pythons_standard_library(tmp_path):
    meta = D.build(tmp_path, max_bytes=300_000)
    assert meta["train"]["tokens"] > 100_000 and meta["val"]["tokens"] > 0
    assert b"def " in bytes(D.load(tmp_path, "train")[:50_000])


def test_bad_data_requests_are_named(fake_stdlib, tmp_path):
    with pytest.raises(ValueError, match="val_percent"):
        D.build(tmp_path, root=fake_stdlib, val_percent=0)
    with pytest.raises(FileNotFoundError, match="no .py files"):
        D.build(tmp_path, root=tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="run `python -m days.day020.data"):
        D.load(tmp_path / "nothing", "train")
    with pytest.raises(ValueError, match="cannot make windows"):
        D.Batches(np.zeros(5, dtype=np.uint8), 2, 8, 0)


def test_batches_are_a_function_of_seed_and_step():
    tokens = np.arange(1000, dtype=np.int64).astype(np.uint8)
    batches = D.Batches(tokens, batch=3, seq=16, seed=7)
    x, y = batches.get(5)
    x2, y2 = batches.get(5)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    assert not torch.equal(batches.get(6)[0], x)
    assert not torch.equal(D.Batches(tokens, 3, 16, seed=8).get(5)[0], x)


# -- the model ------------------------------------------------------------------------------------
def test_config_and_input_errors():
    with pytest.raises(ValueError, match="multiple of n_head"):
        GPTConfig(n_embd=65, n_head=2)
    with pytest.raises(ValueError, match="n_layer must be positive"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match="impl must be one of"):
        GPT(TINY, "cuda")
    model = GPT(TINY, "torch").init_weights(0)
    with pytest.raises(ValueError, match="longer than block_size"):
        model(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(batch, seq\)"):
        model(torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("impl", ["torch", "gpu_days"])
def test_an_empty_batch_or_sequence_gives_empty_logits(impl, device):
    """No tokens: logits of shape (b, s, vocab) with b * s = 0 and a NaN mean loss, as
    torch's F.cross_entropy gives (a reshape with -1 could not infer the width); on CUDA
    no kernel may be launched on an empty grid, and backward gives zero gradients."""
    model = GPT(TINY, impl).init_weights(0).to(device)
    for shape in ((0, 5), (2, 0)):
        idx = torch.randint(0, TINY.vocab_size, shape, device=device)
        logits, loss = model(idx, idx)
        assert logits.shape == (*shape, TINY.vocab_size) and torch.isnan(loss)
        logits.sum().backward()  # the loss is NaN; the logits' sum is an empty 0
        assert all(p.grad is None or not p.grad.any() for p in model.parameters())
        model.zero_grad(set_to_none=True)


def test_the_command_line_refuses_zero_periods_and_fits_seq_to_the_config(capsys):
    """--eval-every 0 used to divide by zero after the first 100 steps; --config tiny (a 32
    token block) failed with the default --seq 256, which now follows the config."""
    from days.day020 import train

    for flag in ("--eval-every", "--log-every", "--checkpoint-every", "--steps", "--batch", "--seq"):
        with pytest.raises(SystemExit):
            train.parse_args(["--out", "/tmp/x", flag, "0"])
        assert "must be a positive integer" in capsys.readouterr().err
    assert train.parse_args(["--config", "tiny", "--out", "/tmp/x"]).seq is None  # train(): min(256, block)


def test_the_impls_share_parameter_names_and_init():
    models = twins(TINY, seed=3)
    a, b = (m.state_dict() for m in models.values())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    again = GPT(TINY, "torch").init_weights(3).state_dict()
    assert all(torch.equal(a[k], again[k]) for k in a)
    n_params = sum(p.numel() for p in models["torch"].parameters())
    assert n_params == sum(p.numel() for p in models["gpu_days"].parameters())


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-8), (torch.float32, 2e-4)])
def test_gpu_days_model_matches_torch_logits_loss_and_grads(device, dtype, tol):
    models = twins(TINY, seed=1, device=device, dtype=dtype)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, TINY.vocab_size, (3, 21), generator=g).to(device)  # odd length, below block_size
    targets = torch.randint(0, TINY.vocab_size, (3, 21), generator=g).to(device)
    out = {}
    for name, m in models.items():
        logits, loss = m(idx, targets)
        loss.backward()
        out[name] = (logits.detach(), loss.detach(), {n: p.grad for n, p in m.named_parameters()})
    (lt, st, gt), (lg, sg, gg) = out["torch"], out["gpu_days"]

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    assert rel(lg, lt) < tol
    assert abs(sg.item() - st.item()) < tol * abs(st.item())
    for name in gt:
        assert rel(gg[name], gt[name]) < 10 * tol, name


# -- training ---------------------------------------------------------------------------------------
def _args(tmp_path, impl, steps, out="run", **extra):
    return T.parse_args(_argv(tmp_path, impl, steps, out, **extra))


def _argv(tmp_path, impl, steps, out="run", **extra) -> list[str]:
    argv = ["--config", "tiny", "--impl", impl, "--out", str(tmp_path / out), "--data", str(tmp_path / "data")]
    argv += ["--max-data-bytes", "400000", "--steps", str(steps), "--batch", "4", "--seq", "32", "--lr", "3e-3"]
    argv += ["--warmup", "2", "--log-every", "1", "--eval-every", "4", "--eval-batches", "2", "--quiet"]
    argv += ["--sample-tokens", "8", "--checkpoint-every", str(extra.pop("checkpoint_every", 4))]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return argv


@pytest.mark.slow
def test_gpu_days_training_follows_torch_and_learns(tmp_path):
    steps = 12
    curves = {impl: T.train(_args(tmp_path, impl, steps, out=impl)) for impl in ("torch", "gpu_days")}
    torch_losses = [r["train_loss"] for r in curves["torch"]]
    ours = [r["train_loss"] for r in curves["gpu_days"]]
    assert len(ours) == len(torch_losses) == steps
    for step, (a, b) in enumerate(zip(ours, torch_losses, strict=True), 1):
        assert abs(a - b) <= 0.01 * b, f"step {step}: gpu_days {a:.5f} vs torch {b:.5f}"
    val = [r["val_loss"] for r in curves["gpu_days"] if r["val_loss"] != ""]
    ref_val = [r["val_loss"] for r in curves["torch"] if r["val_loss"] != ""]
    assert abs(val[-1] - ref_val[-1]) <= 0.01 * ref_val[-1]
    assert ours[-1] < ours[0] - 0.5  # it learns: from ~ln(256) = 5.5 down
    with open(tmp_path / "gpu_days" / "loss.csv") as f:
        assert len(list(csv.DictReader(f))) == steps
    assert (tmp_path / "gpu_days" / "sample.txt").read_text().startswith("def ")


@pytest.mark.slow
def test_mixed_precision_training_follows_torch(tmp_path):
    """--dtype bfloat16: float32 parameters, bf16 compute under torch.autocast in both builds."""
    curves = {
        impl: T.train(_args(tmp_path, impl, 4, out=f"amp-{impl}", dtype="bfloat16")) for impl in ("torch", "gpu_days")
    }
    for a, b in zip(curves["gpu_days"], curves["torch"], strict=True):
        assert abs(a["train_loss"] - b["train_loss"]) <= 0.02 * b["train_loss"], (a, b)
    saved = torch.load(tmp_path / "amp-gpu_days" / "checkpoint.pt", weights_only=False)["model"]
    assert all(v.dtype == torch.float32 for v in saved.values())  # master weights stay float32


@pytest.mark.slow
def test_a_resumed_run_computes_the_same_losses(tmp_path):
    whole = T.train(_args(tmp_path, "torch", 8, out="whole"))
    first = T.train(_args(tmp_path, "torch", 8, out="parts", stop_after="5"))  # stopped, as if interrupted
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5]
    rest = T.train(_args(tmp_path, "torch", 8, out="parts", resume=True))
    assert [r["train_loss"] for r in first + rest] == [r["train_loss"] for r in whole]
    with open(tmp_path / "parts" / "loss.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, 9))


@pytest.mark.slow
@pytest.mark.parametrize(
    "impl, grad_sync", [("torch", "ddp"), ("gpu_days", "ddp"), ("gpu_days", "flat"), ("gpu_days", "buckets")]
)
def test_two_ranks_compute_the_one_process_losses(tmp_path, impl, grad_sync):
    """torchrun with 2 CPU ranks (gloo): each rank takes half of the same global batch, the
    gradients are averaged (DistributedDataParallel, or all-reduces of the flat gradient
    buffer that --graph uses: whole, or in buckets during backward), so the losses are one
    process's."""
    steps = 4
    one = T.train(_args(tmp_path, impl, steps, out="one", device="cpu"))
    argv = [str(a) for a in _argv(tmp_path, impl, steps, out="two", device="cpu", grad_sync=grad_sync)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]
    repo = Path(__file__).resolve().parents[2]  # `-m days.day020.train` from the repository root
    done = subprocess.run([*run, "-m", "days.day020.train", *argv], env=env, cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "two" / "loss.csv") as f:
        two = list(csv.DictReader(f))  # rank 0's file: one row per step, not two
    assert [int(r["step"]) for r in two] == list(range(1, steps + 1))
    for a, b in zip(two, one, strict=True):
        assert abs(float(a["train_loss"]) - b["train_loss"]) <= 1e-4 * b["train_loss"], (a, b)
    assert abs(float(two[-1]["val_loss"]) - one[-1]["val_loss"]) <= 1e-4 * one[-1]["val_loss"]


def test_flat_gradients_are_views_that_backward_fills():
    model = GPT(TINY, "torch").init_weights(0)
    flat = FlatGrads(list(model.parameters()))
    assert flat.buffer.numel() == sum(p.numel() for p in model.parameters())
    idx = torch.randint(0, TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    twin = GPT(TINY, "torch").init_weights(0)
    for m in (model, twin):
        m(idx, idx.roll(1, 1))[1].backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert p.grad.data_ptr() >= flat.buffer.data_ptr(), name  # still a view into the buffer
        assert torch.equal(p.grad, q.grad), name
    assert flat.buffer.abs().sum() > 0
    with pytest.raises(ValueError, match="one dtype and device"):
        FlatGrads([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])


def test_a_profile_has_the_wall_time_first_then_kernels_by_time(tmp_path, monkeypatch):
    """train.py --profile-steps: each rank's CSV (the kernel times are CUPTI's on CUDA; here a
    stand-in), and the line scaling.py prints from it."""
    from benchmark import timing
    from days.day020.scaling import profile_summary

    steps = []

    def fake_kernel_times(fn, reps, counts):
        for _ in range(reps):
            fn()
        counts.update({"gemm": 2 * reps, "ncclDevKernel_AllReduce": reps})
        return {"gemm": 300.0, "ncclDevKernel_AllReduce": 1500.0}

    monkeypatch.setattr(timing, "kernel_times_us", fake_kernel_times)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    path = tmp_path / "profile-rank0.csv"
    T.profile_steps(lambda: steps.append(1), 4, path)
    assert len(steps) == 1 + 4 + 4  # one warm-up, four timed, four profiled
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [r["kernel"] for r in rows] == ["(wall)", "ncclDevKernel_AllReduce", "gemm"]
    assert [float(r["calls_per_step"]) for r in rows] == [1.0, 1.0, 2.0]
    assert float(rows[0]["us_per_step"]) > 0
    assert profile_summary(path).endswith("kernels 1.80 ms (NCCL 1.50 ms)")


def test_bucket_sizes_walk_from_the_last_parameter():
    assert bucket_sizes([4, 4, 4, 4], 8) == [2, 2]
    assert bucket_sizes([1, 2, 30, 3, 3], 8) == [2, 1, 2]  # 30 bytes: a bucket of its own
    assert bucket_sizes([5, 5, 5], 4) == [1, 1, 1]
    assert bucket_sizes([3], 100) == [1]
    assert sum(bucket_sizes([7, 1, 9, 2, 2, 8], 9)) == 6
    with pytest.raises(ValueError, match="positive"):
        bucket_sizes([1], 0)


def test_the_all_reduce_timer_sends_the_steps_buckets():
    from days.day020.allreduce_time import step_buckets

    params = list(GPT(TINY, "torch").parameters())
    total = sum(p.numel() for p in params)
    assert step_buckets("tiny", None) == (total, [(0, total)])
    numel, spans = step_buckets("tiny", 4096)
    assert numel == total and spans == FlatGrads(params, world=2, bucket_bytes=4096).buckets and len(spans) > 3


def test_buckets_are_averaged_in_order_while_backward_runs(monkeypatch):
    """Every element of the buffer is all-reduced exactly once per backward, bucket by bucket
    in one fixed order, and the first buckets go out before backward has reached the first
    parameters (the overlap); a second step does the same again."""
    launches: list[tuple[int, int, int]] = []  # (first, end, gradients accumulated so far)
    accumulated = [0]
    monkeypatch.setattr(S, "_all_reduce_mean", lambda t, world: launches.append((*span(t), accumulated[0])))
    model = GPT(TINY, "torch").init_weights(0)
    params = list(model.parameters())
    flat = FlatGrads(params, world=2, bucket_bytes=4096)

    def span(t):
        first = (t.data_ptr() - flat.buffer.data_ptr()) // flat.buffer.element_size()
        return first, first + t.numel()

    for p in params:
        p.register_post_accumulate_grad_hook(lambda _p: accumulated.__setitem__(0, accumulated[0] + 1))
    assert len(flat.buckets) > 3
    idx = torch.randint(0, TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        launches.clear()
        accumulated[0] = 0
        flat.begin()
        model(idx, idx.roll(1, 1))[1].backward()
        flat.finish()
        assert [(a, b) for a, b, _ in launches] == flat.buckets
        covered = sorted((a, b) for a, b, _ in launches)
        assert covered[0][0] == 0 and covered[-1][1] == flat.buffer.numel()
        assert all(x[1] == y[0] for x, y in zip(covered, covered[1:], strict=False))  # no gap, no overlap
        assert launches[0][2] < len(params)  # went out before backward was done
        assert flat.buffer.abs().sum() > 0
        assert not flat.active


def test_buckets_take_the_gradients_backward_hands_over(monkeypatch):
    """In buckets, begin() drops the grads: backward hands each gradient over and the hooks
    move it into its view, so no buffer is zeroed and nothing is added. Over two steps the
    .grad are the views again, with autograd's values; a parameter that got no gradient in
    a step holds zeros, as the zeroed buffer did."""
    monkeypatch.setattr(S, "_all_reduce_mean", lambda t, world: None)
    idx = torch.randint(0, TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(8))
    model, twin = GPT(TINY, "torch").init_weights(0), GPT(TINY, "torch").init_weights(0)
    flat = FlatGrads(list(model.parameters()), world=2, bucket_bytes=4096)
    for step in range(2):
        twin.zero_grad(set_to_none=True)
        flat.begin()
        assert all(p.grad is None for p in model.parameters())
        unused = model.blocks[-1].c_mlp_proj.bias if step == 1 else None
        for m in (model, twin):  # step 1: the last bias is left out of the loss
            if step == 1:
                m.blocks[-1].c_mlp_proj.bias.requires_grad_(False)
            m(idx, idx.roll(1, 1))[1].backward()
            m.blocks[-1].c_mlp_proj.bias.requires_grad_(True)
        flat.finish()
        for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
            assert p.grad.data_ptr() == flat.view(p).data_ptr(), name
            if p is unused:
                assert not p.grad.any(), name
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_frozen_parameters_stay_out_of_the_flat_buffer(monkeypatch):
    """A parameter that wants no gradient gets no view (AdamW would decay it), no bucket and
    no hook (a hook on it would raise)."""
    monkeypatch.setattr(S, "_all_reduce_mean", lambda t, world: None)
    model = GPT(TINY, "torch").init_weights(0)
    frozen = model.wpe.weight.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    flat = FlatGrads(list(model.parameters()), world=2, bucket_bytes=4096)
    assert frozen.grad is None
    assert flat.buffer.numel() == sum(p.numel() for p in trained)
    assert flat.buckets[0][1] == flat.buffer.numel() and flat.buckets[-1][0] == 0
    idx = torch.randint(0, TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(7))
    flat.begin()
    model(idx, idx.roll(1, 1))[1].backward()
    flat.finish()
    assert frozen.grad is None and all(p.grad.abs().sum() > 0 for p in trained[-4:])


def test_a_training_snapshot_undoes_steps_in_place():
    """What a capture's warm-up steps change comes back: parameters, the moments AdamW had,
    and the state it created since (zeroed: a fresh AdamW), in the same tensors."""
    model = GPT(TINY, "torch").init_weights(0)
    opt = T.make_optimizer(model, 1e-2, 0.1, "cpu")
    idx = torch.randint(0, TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(6))

    def step():
        opt.zero_grad()
        model(idx, idx.roll(1, 1))[1].backward()
        opt.step()

    params = list(model.parameters())
    fresh = training_snapshot(params, opt)
    before = [p.detach().clone() for p in params]
    step()
    moments = {id(t): t.clone() for s in opt.state.values() for t in s.values()}
    tensors = [t for s in opt.state.values() for t in s.values()]
    resumed = training_snapshot(params, opt)
    after_one = [p.detach().clone() for p in params]
    step()
    step()
    resumed()  # back to after one step, moments included
    assert all(torch.equal(p, q) for p, q in zip(params, after_one, strict=True))
    assert all(torch.equal(t, moments[id(t)]) for s in opt.state.values() for t in s.values())
    fresh()  # back to the start: moments and step counts zero, in the same tensors
    assert all(torch.equal(p, q) for p, q in zip(params, before, strict=True))
    assert all(a is b for a, b in zip([t for s in opt.state.values() for t in s.values()], tensors, strict=True))
    assert all(not t.any() for t in tensors)


def test_a_captured_step_is_refused_without_cuda(tmp_path):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        T.train(_args(tmp_path, "torch", 2, device="cpu", graph=True))
    with pytest.raises(ValueError, match="--profile-steps .* needs a CUDA device"):
        T.train(_args(tmp_path, "torch", 2, device="cpu", profile_steps=3))
    with pytest.raises(ValueError, match="--profile-steps must be 0"):
        T.train(_args(tmp_path, "torch", 2, device="cpu", profile_steps=-1))
    model = GPT(TINY, "torch")
    opt = T.make_optimizer(model, 1e-3, 0.0, "cpu")
    with pytest.raises(ValueError, match="CUDA device"):
        Stepper(model, opt, torch.autocast("cpu", enabled=False), 1, "flat", graph=True, batch_shape=(2, 8))
    with pytest.raises(ValueError, match="grad_sync='buckets' or 'flat'"):
        Stepper(model, opt, torch.autocast("cpu", enabled=False), 2, "ddp", graph=True, batch_shape=(2, 8))
    with pytest.raises(ValueError, match="grad_sync must be one of"):
        Stepper(model, opt, torch.autocast("cpu", enabled=False), 1, "ring", batch_shape=(2, 8))


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("impl", ["torch", "gpu_days"])
def test_cuda_captured_step_computes_the_eager_losses(tmp_path, impl):
    """--graph replays one captured step: same losses as eager (its warm-up steps are undone),
    and a resumed captured run continues with the eager run's losses."""
    steps = 6
    eager = T.train(_args(tmp_path, impl, steps, out="eager"))
    graph = T.train(_args(tmp_path, impl, steps, out="graph", graph=True))
    for a, b in zip(graph, eager, strict=True):
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-4 * b["train_loss"], (a, b)
    T.train(_args(tmp_path, impl, steps, out="parts", graph=True, stop_after="3"))
    rest = T.train(_args(tmp_path, impl, steps, out="parts", graph=True, resume=True))
    for a, b in zip(rest, eager[3:], strict=True):
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-4 * b["train_loss"], (a, b)


@pytest.mark.slow
def test_scaling_runs_one_and_two_processes_and_stores_stamped_rows(tmp_path, capsys, monkeypatch):
    """days/day020/scaling.py on the CPU (two gloo ranks): both runs' rows land in the CSV
    with the stamp, the GPU count and the mode, and the two curves agree."""
    from days.day020 import scaling

    D.build(tmp_path / "data", max_bytes=400_000)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # `-m days.day020.train` from the repository root
    out = tmp_path / "scaling.csv"
    argv = ["--out", str(out), "--impl", "torch", "--mode", "eager", "--config", "tiny", "--batch", "4"]
    argv += ["--seq", "32", "--steps", "20", "--data", str(tmp_path / "data")]
    assert scaling.main(argv) == 0
    with open(out) as f:
        assert next(csv.reader(f)) == scaling.FIELDS
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [(r["gpus"], r["step"]) for r in rows] == [("1", "10"), ("1", "20"), ("2", "10"), ("2", "20")]
    assert all(r["mode"] == "eager" and r["impl"] == "torch" and r["git_commit"] for r in rows)
    for a, b in zip(rows[:2], rows[2:], strict=True):
        assert abs(float(a["train_loss"]) - float(b["train_loss"])) <= 1e-4 * float(a["train_loss"])
    assert "scaling" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="columns"):  # another file's columns: refused, not mixed
        bad = tmp_path / "other.csv"
        bad.write_text("a,b\n")
        scaling.main(["--out", str(bad), "--impl", "torch", "--mode", "eager"])


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        T.train(_args(tmp_path, "torch", 2, resume=True))


@pytest.mark.slow
def test_a_resume_after_a_crash_keeps_one_row_a_step_and_the_runs_settings(tmp_path, capsys):
    """A run killed between checkpoints has logged steps past its last checkpoint; the
    resumed run logs them again, so they are cut first. Settings given with --resume that
    differ from the checkpoint's are refused; the periods come from the checkpoint."""
    T.train(_args(tmp_path, "torch", 8, out="crash", stop_after="4"))  # checkpoint at step 4
    with open(tmp_path / "crash" / "loss.csv", "a", newline="") as f:  # what the dead run logged after it
        f.write("5,9.9,,1.0,torch\n6,9.9,,1.0,torch\n")
    T.train(_args(tmp_path, "torch", 8, out="crash", resume=True))
    with open(tmp_path / "crash" / "loss.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 9)) and all(r["train_loss"] != "9.9" for r in rows)
    argv = ["--out", str(tmp_path / "crash"), "--data", str(tmp_path / "data"), "--resume", "--quiet", "--steps", "12"]
    assert T.main(argv) == 2
    assert "--steps 12 differs from its 8" in capsys.readouterr().err
    state = torch.load(tmp_path / "crash" / "checkpoint.pt", weights_only=False)
    assert state["args"]["eval_every"] == 4 and state["args"]["log_every"] == 1


def test_evaluation_follows_its_own_period(tmp_path):
    """--eval-every 4 with --log-every 3: a validation loss at steps 4 and 8, not only where
    the two periods meet."""
    rows = T.train(_args(tmp_path, "torch", 9, log_every=3, eval_every=4, checkpoint_every=9))
    assert [(r["step"], r["val_loss"] != "") for r in rows] == [
        (3, False),
        (4, True),
        (6, False),
        (8, True),
        (9, True),
    ]


def test_the_command_line_reports_bad_settings_in_one_line(tmp_path, capsys):
    base = ["--config", "tiny", "--data", str(tmp_path / "data"), "--max-data-bytes", "400000", "--quiet"]
    (tmp_path / "a_file").write_text("")
    for extra, message in (
        (["--out", str(tmp_path / "a_file")], "File exists"),
        (["--out", str(tmp_path / "r"), "--seq", "64"], "longer than the config's block_size 32"),
        (["--out", str(tmp_path / "r"), "--device", "nonsense"], "--device nonsense"),
    ):
        assert T.main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("train: error:") and message in err and "Traceback" not in err, err
    for flag, value in (("--stop-after", "0"), ("--lr", "nan")):
        with pytest.raises(SystemExit):
            T.parse_args(["--out", "/tmp/x", flag, value])


def test_train_step_flops_count_the_models_parameters():
    """benchmark/cases/day020_train.py's MFU numerator: 6 N + 12 L d T per token, N the
    parameters without the position table (the tied head counted once)."""
    from benchmark.cases.day020_train import flops_per_token

    for config in CONFIGS.values():
        model = GPT(config, "torch")
        n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("wpe"))
        assert flops_per_token(config, 100) == 6 * n + 12 * config.n_layer * config.n_embd * 100


@pytest.mark.slow
def test_train_step_benchmark_validates_and_times_both_builds():
    from benchmark.cases import day020_train

    rows = day020_train.problem_rows("tiny", 2, 16, torch.float32, "cpu", impls=("torch", "gpu_days"))
    assert [r["impl"] for r in rows] == ["torch", "gpu_days"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["tokens_per_s"] > 0 and r["ms_median"] > 0 and "first loss" in r["note"]
    assert rows[0]["speedup_vs_torch"] == 1


def test_host_census_counts_the_nodes_of_a_step(capsys):
    """host_census on the tiny config (CPU here): every part timed, and the node census
    names the ops' own nodes (gpu-days) and torch's (the twin)."""
    from days.day020 import host_census

    assert host_census.main(["--config", "tiny", "--batch", "2", "--seq", "16", "--steps", "1", "--top", "3"]) == 0
    out = capsys.readouterr().out
    for part in ("forward host", "backward host", "adamw host", "step wall", "by cumulative time"):
        assert out.count(part) == 2, part
    assert "AddLayerNormBackward" in out and "NativeLayerNormBackward0" in out
