"""One GPU against two: the same training command run as one process and under
`torchrun --nproc_per_node=2`, per build (gpu_days, torch) and mode (eager, --graph).

    python -m days.day020.scaling --out results/nvidia-h100-80gb-hbm3/curves/day020_ddp_gpt2.csv

Each run trains GPT-2 124M (bf16, global batch 32 x 1024, 50 steps) from the same seed and
data; its loss.csv rows are appended to --out with the machine's stamp, the number of GPUs
and the mode. The summary compares tokens/s over steps 20-50 (the first 10 include
loading, compiling and capture) and the largest relative train-loss gap between one and
two GPUs. NVLink SHARP (NCCL_NVLS_ENABLE) stays off, as the lending rules ask.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmark.environment import stamp

from .step import GRAD_SYNCS

FIELDS = [
    "git_commit",
    "device",
    "driver",
    "cuda",
    "torch",
    "triton",
    "gpus",
    "mode",
    "step",
    "train_loss",
    "val_loss",
    "tokens_per_s",
    "impl",
    "dtype",
    "global_batch",
    "note",
]
PROFILE_STEPS = 5  # with --profile-dir: steps timed, then as many profiled, after each run
FIRST_TIMED_STEP = 20  # rows from here on: their tokens/s covers steps 11+, after loading and capture


def train_command(impl: str, graph: bool, gpus: int, out: Path, args) -> list[str]:
    launcher = [sys.executable]
    if gpus > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={gpus}", "--standalone"]
    command = [*launcher, "-m", "days.day020.train", "--config", args.config, "--impl", impl, "--out", str(out)]
    command += ["--dtype", "bfloat16", "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
    command += ["--log-every", "10", "--eval-every", str(args.steps), "--eval-batches", "2", "--sample-tokens", "0"]
    command += ["--checkpoint-every", str(10 * args.steps), "--data", str(args.data), "--quiet"]
    if args.grad_sync and gpus > 1:
        command += ["--grad-sync", args.grad_sync]
    if args.profile_dir:
        command += ["--profile-steps", str(PROFILE_STEPS)]
    return command + (["--graph"] if graph else [])


def mode_label(mode: str, grad_sync: str | None) -> str:
    """The rows' mode: eager or graph, with the way of averaging when one was asked for."""
    return f"{mode}+{grad_sync}" if grad_sync else mode


def run_one(impl: str, mode: str, gpus: int, args, scratch: Path) -> list[dict]:
    out = scratch / f"{impl}-{mode}-{gpus}"
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    t = time.perf_counter()
    done = subprocess.run(
        train_command(impl, mode == "graph", gpus, out, args), env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{impl} {mode} on {gpus} GPU(s) failed:\n{done.stderr[-4000:]}")
    with open(out / "loss.csv") as f:
        rows = list(csv.DictReader(f))
    print(f"  {impl:8} {mode:5} {gpus} GPU(s): {time.perf_counter() - t:.0f} s", flush=True)
    if args.profile_dir:
        label = mode_label(mode, args.grad_sync)
        for rank in range(gpus):
            kept = args.profile_dir / f"{impl}-{label}-{gpus}gpu-rank{rank}.csv"
            shutil.copyfile(out / f"profile-rank{rank}.csv", kept)
            print(f"    rank {rank}: {profile_summary(kept)}", flush=True)
    return rows


def profile_summary(path: Path) -> str:
    """One line from a rank's profile (train.py --profile-steps): the step's wall time, the
    sum of its kernels' times, and NCCL's share of that sum, in ms per step."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    wall = sum(float(r["us_per_step"]) for r in rows if r["kernel"] == "(wall)")
    kernels = [r for r in rows if r["kernel"] != "(wall)"]
    total = sum(float(r["us_per_step"]) for r in kernels)
    nccl = sum(float(r["us_per_step"]) for r in kernels if "nccl" in r["kernel"].lower())
    return f"wall {wall / 1e3:.2f} ms/step, kernels {total / 1e3:.2f} ms (NCCL {nccl / 1e3:.2f} ms)"


def rate(rows: list[dict]) -> float:
    timed = [float(r["tokens_per_s"]) for r in rows if int(r["step"]) >= FIRST_TIMED_STEP]
    return sum(timed) / len(timed)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="CSV to append the rows to")
    p.add_argument("--impl", action="append", choices=["gpu_days", "torch"])
    p.add_argument("--mode", action="append", choices=["eager", "graph"])
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="process counts to run (1 and 2 to compare)")
    p.add_argument("--config", default="gpt2")
    p.add_argument("--batch", type=int, default=32, help="global batch")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--data", type=Path, default=Path("build/day020/data"))
    p.add_argument(
        "--profile-dir",
        type=Path,
        default=None,
        help=f"CUDA: after each run, {PROFILE_STEPS} more steps timed and profiled on every rank; "
        "the per-rank kernel tables are copied here (<impl>-<mode>-<gpus>gpu-rank<r>.csv)",
    )
    p.add_argument(
        "--grad-sync",
        choices=list(GRAD_SYNCS),
        default=None,
        help="how the two ranks average gradients (train.py's default per mode when not given); "
        "given, it is part of the rows' mode, e.g. graph+flat",
    )
    args = p.parse_args(argv)
    env = stamp()
    note = (
        f"torchrun --nproc_per_node=2 vs one process; --config {args.config} --dtype bfloat16 "
        f"--batch {args.batch} --seq {args.seq} --steps {args.steps}; NCCL, NVLS off"
    )
    if args.grad_sync:
        note += f"; --grad-sync {args.grad_sync}"
    new = not args.out.exists()
    if not new:
        with open(args.out) as f:
            header = next(csv.reader(f), [])
        if header != FIELDS:
            raise SystemExit(f"{args.out}: its columns are {header}, not {FIELDS}; name another --out")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    summary = []
    with tempfile.TemporaryDirectory() as scratch:
        for impl in args.impl or ["gpu_days", "torch"]:
            for mode in args.mode or ["eager", "graph"]:
                label = mode_label(mode, args.grad_sync)
                runs = {gpus: run_one(impl, mode, gpus, args, Path(scratch)) for gpus in args.gpus}
                with open(args.out, "a", newline="") as f:
                    writer = csv.DictWriter(f, FIELDS)
                    if new:
                        writer.writeheader()
                        new = False
                    for gpus, rows in runs.items():
                        for r in rows:
                            writer.writerow(
                                {
                                    **{
                                        k: env[k] for k in ("git_commit", "device", "driver", "cuda", "torch", "triton")
                                    },
                                    "gpus": gpus,
                                    "mode": label,
                                    "step": r["step"],
                                    "train_loss": r["train_loss"],
                                    "val_loss": r["val_loss"],
                                    "tokens_per_s": r["tokens_per_s"],
                                    "impl": impl,
                                    "dtype": "bfloat16",
                                    "global_batch": f"{args.batch}x{args.seq}",
                                    "note": note,
                                }
                            )
                if sorted(runs) != [1, 2]:
                    for gpus, rows in runs.items():
                        print(
                            f"{impl:9} {label:13} {gpus} GPU(s): {rate(rows):12,.0f} tokens/s, "
                            f"val {rows[-1]['val_loss']}"
                        )
                    continue
                gap = max(
                    abs(float(a["train_loss"]) - float(b["train_loss"])) / float(a["train_loss"])
                    for a, b in zip(runs[1], runs[2], strict=True)
                )
                one, two = rate(runs[1]), rate(runs[2])
                vals = runs[1][-1]["val_loss"], runs[2][-1]["val_loss"]
                summary.append((impl, label, one, two, two / one, gap, *vals))
    print(f"{'impl':9} {'mode':13} {'1 GPU tok/s':>12} {'2 GPUs tok/s':>13} {'scaling':>8} {'loss gap':>9}  val 1 / 2")
    for impl, mode, one, two, scale, gap, v1, v2 in summary:
        print(
            f"{impl:9} {mode:13} {one:12,.0f} {two:13,.0f} {scale:7.2f}x {gap:9.1e}  {float(v1):.5f} / {float(v2):.5f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
