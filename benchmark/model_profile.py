"""Where one training step of the GPT block spends its time, op by op (day 016).

`python -m benchmark.model_profile [--shape 8x1024x768 ...] [--dtype bfloat16 ...]
[--build gpu_days|torch ...] [--steps 5] [--no-store] [--results-dir DIR]`

runs torch.profiler over a few forward + backward steps of benchmark/gpt_block.py (the
day016 benchmark's `gpt_block_train`, eager) and prints, per profiler event and per step:
- host time: self (the event alone, e.g. an op's Python body) and total (with the ops it
  called, e.g. the allocation of its output);
- device time: the kernels the event launched (self for a kernel itself).
Events are classified: `stage` (the block's own ranges: ln1, qkv, scores, softmax... set by
GPTBlock.label_stages), `gpu_days_op` (gpu_days::*, the label every op call gets while a
profiler runs), `backward` (autograd nodes), `aten`, `autograd_fn` (the autograd.Function
around an op's forward), `kernel`, `cuda_api`
(cuLaunchKernel, cudaLaunchKernel...), `other`; plus a `step` row: the
step's wall time without the profiler, and the sum of its kernels' time (if that is much
less than the wall time, the GPU waits on the host). A call whose host time exceeds its
kernels' time is what holds an eager block back.

The rows go to results/<device>/profile/day016.csv, stamped like the results store. The
subfolder keeps them out of the store itself (it reads <device>/*.csv): the columns differ.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from . import gpt_block as G
from .cases.day016 import strict_ops
from .environment import device_slug, stamp
from .harness import shape_str
from .store import RESULTS_DIR, STAMP_COLUMNS, new_run_id

DAY = "day016"
PROFILE_COLUMNS = [
    "build",  # gpu_days | torch: which build of the block was profiled
    "shape",
    "dtype",
    "kind",  # step | stage | gpu_days_op | backward | autograd_fn | aten | kernel | cuda_api | other
    "name",
    "calls_per_step",
    "host_self_us",  # per step
    "host_total_us",  # per step, with the events it called
    "device_us",  # per step: the kernels it launched (a kernel: its own time)
    "host_us_per_call",
    "device_us_per_call",
]
COLUMNS = STAMP_COLUMNS + PROFILE_COLUMNS
DEFAULT_SHAPES = {"cuda": ["1x64x768", "8x1024x768"], "cpu": ["2x13x128"]}


EVALUATE = "autograd::engine::evaluate_function: "  # the engine's range around one backward node


def kind_of(name: str, on_device: bool) -> str | None:
    """The row kind of a profiler event; None for one not to list (a duplicate)."""
    if on_device:
        return "kernel"
    if name.startswith("block."):
        return "stage"
    if name.startswith("gpu_days::"):
        return "gpu_days_op"
    if name.startswith(EVALUATE):
        return "backward"
    if re.search(r"Backward\d*$", name):
        return None  # a backward node's own range: inside its evaluate_function row
    if name.startswith("GeneratedBackwardFor_"):
        return "autograd_fn"  # the autograd.Function around a custom op's forward
    if name.startswith("aten::"):
        return "aten"
    if name.startswith(("cuda", "cu")):
        return "cuda_api"
    return "other"


def _device_us(evt, self_only: bool) -> float:
    """Device time of a key_averages entry (named cuda_* before torch 2.4)."""
    for attr in (
        ("self_device_time_total", "self_cuda_time_total")
        if self_only
        else (
            "device_time_total",
            "cuda_time_total",
        )
    ):
        if hasattr(evt, attr):
            return float(getattr(evt, attr))
    return 0.0


def _on_device(evt) -> bool:
    return "CUDA" in str(getattr(evt, "device_type", "")) or (
        evt.self_cpu_time_total == 0 and _device_us(evt, True) > 0
    )


def wall_ms(step, reps: int, device: str) -> float:
    """Median wall time of one step, synchronised (no profiler)."""
    samples = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def profile_step(build: str, shape: tuple[int, int, int], dtype: torch.dtype, device: str, steps: int = 5):
    """Rows (dicts with PROFILE_COLUMNS) of `steps` profiled train steps of one build."""
    from torch.profiler import ProfilerActivity, profile

    b, s, d = shape
    block = G.make_block(d, build, dtype, device)
    x = G.make_input(shape, dtype, device).requires_grad_()
    mask = G.causal_mask(s, dtype, device)
    params = list(block.parameters())

    def step():
        return G.train_step(block, x, mask, params)

    with strict_ops():  # profile gpu-days' kernels, never torch's fallback under their name
        for _ in range(3):  # load kernels, fill caches, let the allocator settle
            step()
        step_ms = wall_ms(step, max(steps, 5), device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        block.label_stages = True
        try:
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    step()
                if device == "cuda":
                    torch.cuda.synchronize()
        finally:
            block.label_stages = False
    base = {"build": build, "shape": shape_str(shape), "dtype": str(dtype).removeprefix("torch.")}
    rows, kernel_us = [], 0.0
    for evt in prof.key_averages():
        on_device = _on_device(evt)
        kind = kind_of(evt.key, on_device)
        if kind is None:
            continue
        dev_us = _device_us(evt, self_only=on_device) / steps if device == "cuda" else None
        host_self = 0.0 if on_device else evt.self_cpu_time_total / steps
        host_total = 0.0 if on_device else evt.cpu_time_total / steps
        if kind == "kernel":
            kernel_us += dev_us
        if max(host_total, dev_us or 0.0) <= 0:
            continue
        calls = evt.count / steps
        rows.append(
            {
                **base,
                "kind": kind,
                "name": evt.key.removeprefix(EVALUATE),
                "calls_per_step": calls,
                "host_self_us": host_self,
                "host_total_us": host_total,
                "device_us": dev_us,
                "host_us_per_call": host_total / calls if calls else None,
                "device_us_per_call": dev_us / calls if calls and dev_us is not None else None,
            }
        )
    order = ["step", "stage", "gpu_days_op", "backward", "autograd_fn", "aten", "kernel", "cuda_api", "other"]
    rows.sort(key=lambda r: (order.index(r["kind"]), -max(r["host_total_us"], r["device_us"] or 0.0)))
    step_row = {**base, "kind": "step", "name": "train step (wall, no profiler)", "calls_per_step": 1.0}
    step_row.update(host_total_us=step_ms * 1e3, device_us=kernel_us if device == "cuda" else None)
    return [step_row, *rows]


def append_profile(rows: list[dict], results_dir: Path = RESULTS_DIR) -> Path:
    path = results_dir / device_slug() / "profile" / f"{DAY}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    env = {**stamp(), "run_id": new_run_id(), "timestamp": datetime.now(UTC).isoformat(timespec="seconds")}
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="raise")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({**{c: "" for c in COLUMNS}, **env, **{k: _fmt(v) for k, v in row.items()}})
    return path


def _fmt(v) -> str:
    if v is None:
        return ""
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def print_table(rows: list[dict], top: int = 12) -> None:
    """The step, the stages, gpu-days' ops and the `top` largest of the other kinds."""
    shown, seen = [], {}
    for r in rows:
        seen[r["kind"]] = seen.get(r["kind"], 0) + 1
        if r["kind"] in ("step", "stage", "gpu_days_op") or seen[r["kind"]] <= top:
            shown.append(r)
    head = f"{'kind':12s} {'name':60s} {'calls':>6s} {'host self':>10s} {'host tot':>10s} {'device':>10s}"
    print(head + "   (us per step)")
    for r in shown:

        def num(key, r=r):
            v = r.get(key)
            return f"{v:10.1f}" if isinstance(v, float) else f"{'-':>10s}"

        name = r["name"] if len(r["name"]) <= 60 else r["name"][:57] + "..."
        print(f"{r['kind']:12s} {name:60s} {r['calls_per_step']:6.1f} {num('host_self_us')} "
              f"{num('host_total_us')} {num('device_us')}")  # fmt: skip


def _shape(text: str) -> tuple[int, int, int]:
    dims = tuple(int(v) for v in text.lower().split("x"))
    if len(dims) != 3:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not batch x seq x d, e.g. 8x1024x768")
    return dims


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmark.model_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", type=_shape, help="batch x seq x d (repeatable)")
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16"], help="(repeatable)")
    parser.add_argument("--build", action="append", choices=sorted(G.BUILDS), help="default: gpu_days and torch")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps (default 5)")
    parser.add_argument("--no-store", action="store_true", help="print only")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # as the benchmark
    shapes = args.shape or [_shape(s) for s in DEFAULT_SHAPES[device]]
    dtypes = [getattr(torch, n) for n in (args.dtype or ["bfloat16" if device == "cuda" else "float32"])]
    rows = []
    for dtype in dtypes:
        for shape in shapes:
            for build in args.build or ["gpu_days", "torch"]:
                got = profile_step(build, shape, dtype, device, args.steps)
                print(f"\n{build} {shape_str(shape)} {dtype}: train step, per step")
                print_table(got)
                rows += got
    if not args.no_store:
        print(f"\nappended {len(rows)} rows to {append_profile(rows, args.results_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
