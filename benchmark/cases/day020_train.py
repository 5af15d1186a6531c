"""Day 020: training throughput of the GPT (days/day020/model.py), one optimizer step at a
time, gpu-days against torch in the same run. Issue 20's `train` case.

One op, `train_step`: forward, mean cross-entropy, backward and a fused AdamW step on a
fixed batch of random tokens (throughput does not depend on the text). Implementations:
- `torch`: the torch build, eager (the baseline of `speedup_vs_torch`);
- `torch_compile`: torch.compile(torch build), default mode, the optimizer step eager;
- `gpu_days`: the gpu-days build, eager;
- `torch_graph`, `gpu_days_graph`: the whole step (optimizer included, `capturable=True`)
  captured once by torch.cuda.graph and replayed.
bfloat16 means mixed precision, as `python -m days.day020.train --dtype bfloat16` trains:
float32 parameters and optimizer, the forward under torch.autocast.

Before timing, each impl's first loss is compared with the torch build's loss in float32
(no autocast) from the same parameters and batch; a mismatch is a `wrong` row. Impls run
one after another (each owns a model and optimizer; two 124M models with AdamW state do
not both need to live at once). Columns: ms per step (median over the timed steps),
tokens_per_s, tflops and `mfu` from the model FLOPs per token, 6 N + 12 L d T (N: the
parameters without the position table; the attention term counts the whole score matrix,
as nanoGPT and llm.c do), peak_extra_mib (eager impls: the peak while stepping above the
memory held after the first step, i.e. activations and temporaries on top of parameters,
gradients and optimizer state; a graph's memory is taken at capture and is not counted).
"""

from __future__ import annotations

import math
import time

import torch

from days.day020.model import CONFIGS, GPT, GPTConfig
from days.day020.step import training_snapshot

from ..harness import failure_reason
from .day016 import _free, cuda_graph, strict_ops

DAY, OP = "day020", "train_step"
IMPLS = ("torch", "torch_compile", "gpu_days", "torch_graph", "gpu_days_graph")
CUDA_ONLY = ("torch_compile", "torch_graph", "gpu_days_graph")
# (config, batch, seq, dtype)
PROBLEMS = {
    "quick": [("tiny", 2, 32, torch.float32)],
    "full": [("gpt2", 16, 1024, torch.bfloat16), ("small", 64, 256, torch.bfloat16)],
}
STEPS = {"cuda": (3, 20), "cpu": (1, 3)}  # (warm-up, timed) steps per impl
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# dense bf16 tensor-core peak (no sparsity) by device name: MFU's denominator
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("A100", 312.0))


def flops_per_token(config: GPTConfig, seq: int) -> float:
    model_params = (
        config.n_layer * (12 * config.n_embd**2 + 13 * config.n_embd) + config.vocab_size * config.n_embd
    ) + 2 * config.n_embd  # blocks (4 linears with biases, 2 norms), tied head, final norm
    return 6 * model_params + 12 * config.n_layer * config.n_embd * seq


def peak_tflops(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


class Trainer:
    """One impl's model, optimizer and a step function on a fixed batch."""

    def __init__(self, impl: str, config: GPTConfig, batch: int, seq: int, dtype, device, seed: int = 0):
        base = impl.removesuffix("_graph")
        build = "torch" if base == "torch_compile" else base
        self.model = GPT(config, build).init_weights(seed).to(device)
        self.forward = torch.compile(self.model, dynamic=False) if base == "torch_compile" else self.model
        graph = impl.endswith("_graph")
        fused = device == "cuda"
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused, capturable=graph
        )
        g = torch.Generator(device="cpu").manual_seed(seed + 1)
        self.x = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)
        self.y = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)
        # autocast's weight cache cannot outlive a graph capture; off everywhere, for one setting
        self.amp = torch.autocast(
            torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32, cache_enabled=False
        )
        self.step = self._step
        if graph:
            restore = training_snapshot(list(self.model.parameters()), self.opt)
            self.step = cuda_graph(self._step)  # its warm-up steps train the model: undo them
            restore()

    def loss(self) -> torch.Tensor:
        with self.amp:
            return self.forward(self.x, self.y)[1]

    def _step(self) -> list[torch.Tensor]:
        # gradients as None: backward's results become the .grad (no add into zeroed buffers);
        # under capture they come from the graph's pool, at the addresses every replay rewrites
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss()
        loss.backward()
        self.opt.step()
        return [loss]


def reference_loss(config: GPTConfig, batch: int, seq: int, device, seed: int = 0) -> float:
    """The torch build's first loss in float32 (TF32 off by the caller)."""
    ref = Trainer("torch", config, batch, seq, torch.float32, device, seed)
    with torch.no_grad():
        value = ref.loss().item()
    del ref
    _free(device)
    return value


def time_steps(step, device: str, warmup: int, timed: int) -> list[float]:
    """Milliseconds of each of `timed` steps after `warmup` steps."""
    for _ in range(warmup):
        step()
    if device != "cuda":
        out = []
        for _ in range(timed):
            t = time.perf_counter()
            step()
            out.append((time.perf_counter() - t) * 1e3)
        return out
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(timed + 1)]
    events[0].record()
    for i in range(timed):
        step()
        events[i + 1].record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in zip(events, events[1:], strict=False)]


def problem_rows(config_name: str, batch: int, seq: int, dtype, device: str, impls=IMPLS) -> list[dict]:
    config = CONFIGS[config_name]
    tokens = batch * seq
    base = {"day": DAY, "op": OP, "shape": f"{config_name}:{batch}x{seq}", "dtype": str(dtype).removeprefix("torch.")}
    impls = [i for i in impls if device == "cuda" or i not in CUDA_ONLY]
    peak = peak_tflops(device) if dtype == torch.bfloat16 else None
    flops_step = flops_per_token(config, seq) * tokens
    warmup, timed = STEPS[device]
    rows = []
    try:
        want = reference_loss(config, batch, seq, device)
    except Exception as exc:
        _free(device)
        return [{**base, "impl": i, "status": "NA", "reason": failure_reason(exc)} for i in impls]
    for impl in impls:
        row = {**base, "impl": impl}
        rows.append(row)
        trainer = None
        try:
            t0 = time.perf_counter()
            trainer = Trainer(impl, config, batch, seq, dtype, device)
            got = trainer.step()[0].item()  # the first step's loss (compiles, or captures and replays)
            setup_s = time.perf_counter() - t0
            err = abs(got - want) / abs(want)
            if not math.isfinite(got) or err > TOLERANCE[dtype]:
                row.update(status="wrong", reason=f"first loss {got:.6g} vs float32 torch {want:.6g} (rel {err:.2g})")
                continue
            if device == "cuda":
                torch.cuda.synchronize()
                held = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            ms = sorted(time_steps(trainer.step, device, warmup, timed))
            median = ms[len(ms) // 2]
            row.update(
                status="ok",
                ms_median=median,
                ms_p20=ms[len(ms) // 5],
                ms_p80=ms[(4 * len(ms)) // 5],
                tokens_per_s=tokens / (median * 1e-3),
                tflops=flops_step / (median * 1e-3) / 1e12,
                note=f"first loss {got:.5g} (float32 torch {want:.5g}); setup {setup_s:.1f} s; "
                f"{timed} timed steps after {warmup}",
            )
            if peak:
                row["mfu"] = row["tflops"] / peak
            if device == "cuda" and not impl.endswith("_graph"):  # a graph's memory was taken at capture
                row["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - held) / 2**20
        except Exception as exc:
            row.update(status="NA", reason=failure_reason(exc))
        finally:
            del trainer
            _free(device)
    torch_row = next((r for r in rows if r["impl"] == "torch" and r.get("status") == "ok"), None)
    for r in rows:
        if torch_row and r.get("status") == "ok":
            r["speedup_vs_torch"] = torch_row["ms_median"] / r["ms_median"]
    return rows


def sweep(quick: bool, device: str, problems=None, impls=IMPLS) -> list[dict]:
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch._dynamo.config.recompile_limit = 64
    rows = []
    with strict_ops():
        for config_name, batch, seq, dtype in problems or PROBLEMS["quick" if quick else "full"]:
            t = time.perf_counter()
            rows += problem_rows(config_name, batch, seq, dtype, device, impls)
            print(f"  {DAY} {OP} {config_name} {batch}x{seq} {dtype}: {time.perf_counter() - t:.1f} s", flush=True)
    return rows


def profile_rows(impl: str, config_name: str, batch: int, seq: int, dtype, steps: int = 3) -> list[dict]:
    """Device time per training step by kernel (torch.profiler over `steps` steps after
    warm-up): what a step of `impl` spends its GPU time on."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    prof = _profiled_steps(impl, config_name, batch, seq, dtype, steps, activities)
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or 0
        if device_us <= 0 or event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        rows.append(
            {
                "impl": impl,
                "kernel": event.key[:160],
                "calls_per_step": event.count / steps,
                "ms_per_step": device_us / steps / 1e3,
            }
        )
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def _profiled_steps(impl: str, config_name: str, batch: int, seq: int, dtype, steps: int, activities):
    """torch.profiler over `steps` training steps of `impl` after 3 warm-up steps; the
    trainer is freed before returning."""
    trainer = Trainer(impl, CONFIGS[config_name], batch, seq, dtype, "cuda")
    time_steps(trainer.step, "cuda", 3, 1)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            trainer.step()
        torch.cuda.synchronize()
    del trainer
    _free("cuda")
    return prof


def gap_rows(impl: str, config_name: str, batch: int, seq: int, dtype, steps: int = 3) -> list[dict]:
    """Where a step's GPU sits idle between kernels: the profiled kernels of `steps` steps
    in start order, each gap (a kernel's start minus the previous one's end, when positive)
    charged to the kernel that follows it. One row per following kernel, plus "(busy)" and
    "(idle)" totals."""
    prof = _profiled_steps(impl, config_name, batch, seq, dtype, steps, [torch.profiler.ProfilerActivity.CUDA])
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not _is_annotation(e.name)),
        key=lambda e: e.time_range.start,
    )
    idle: dict[str, list[float]] = {}
    busy = 0.0
    for prev, kernel in zip(kernels, kernels[1:], strict=False):
        busy += kernel.time_range.end - kernel.time_range.start
        gap = kernel.time_range.start - prev.time_range.end
        if 0 < gap < 1000:  # (a step boundary's host wait is not a gap between kernels)
            idle.setdefault(kernel.name[:120], []).append(gap)
    rows = [
        {"impl": impl, "next_kernel": name, "gaps_per_step": len(g) / steps, "idle_us_per_step": sum(g) / steps}
        for name, g in idle.items()
    ]
    total_idle = sum(r["idle_us_per_step"] for r in rows)
    rows.sort(key=lambda r: -r["idle_us_per_step"])
    summary = [
        {
            "impl": impl,
            "next_kernel": "(busy)",
            "gaps_per_step": len(kernels) / steps,
            "idle_us_per_step": busy / steps,
        },
        {"impl": impl, "next_kernel": "(idle)", "gaps_per_step": 0, "idle_us_per_step": total_idle},
    ]
    return summary + rows


def _is_annotation(name: str) -> bool:
    return name.startswith(("gpu_days::", "Optimizer."))


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmark.cases.day020_train --profile [--config gpt2] [--batch 16]
    [--seq 1024]`: the kernels of one training step, per impl (torch, gpu_days), as CSV on
    stdout; with `--gaps`, the idle time between them instead. (`python -m benchmark --day
    day020 --op train_step` runs the timed sweep.)"""
    import argparse
    import csv
    import sys

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--profile", action="store_true", required=True)
    p.add_argument("--gaps", action="store_true", help="idle time between kernels instead (gap_rows)")
    p.add_argument("--config", default="gpt2", choices=sorted(CONFIGS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument(
        "--impl", action="append", choices=["torch", "gpu_days", "torch_compile", "gpu_days_graph", "torch_graph"]
    )
    args = p.parse_args(argv)
    from benchmark.gpu_script import need_cuda

    need_cuda(None, __file__)  # the profile reads CUDA kernels: one line without a GPU, not a traceback
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.gaps:
        writer = csv.DictWriter(sys.stdout, ["impl", "next_kernel", "gaps_per_step", "idle_us_per_step"])
        writer.writeheader()
        with strict_ops():
            for impl in args.impl or ["gpu_days_graph", "torch_compile"]:
                writer.writerows(gap_rows(impl, args.config, args.batch, args.seq, getattr(torch, args.dtype)))
        return 0
    writer = csv.DictWriter(sys.stdout, ["impl", "kernel", "calls_per_step", "ms_per_step"])
    writer.writeheader()
    with strict_ops():
        for impl in args.impl or ["torch", "gpu_days"]:
            rows = profile_rows(impl, args.config, args.batch, args.seq, getattr(torch, args.dtype))
            writer.writerows(rows)
            # kernels only: an op's record_function range (gpu_days::gemm, Optimizer.step#...)
            # carries the device time of the kernels inside it, which have rows of their own
            total = sum(r["ms_per_step"] for r in rows if not _is_annotation(r["kernel"]))
            print(f"# {impl}: {total:.3f} ms of kernels per step", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
