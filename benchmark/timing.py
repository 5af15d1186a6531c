"""Timers. GPU: CUDA events around each call, L2 flushed before each, median and p20/p80
over >= 100 repetitions. CPU: wall-clock median. Plus kernel-only time from the profiler
and the device's copy bandwidth, measured in the same run for reference."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

L2_FLUSH_BYTES = 256 * 2**20  # larger than any current L2 (H100 50 MB, H200 60 MB)
LEAD_US = 300  # the GPU's lead over the host at each timed call (time_cuda), above any op's host time
LEAD_CYCLES = LEAD_US * 2000  # a spin of this many cycles lasts >= LEAD_US at clocks <= 2 GHz


@dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    std_ms: float
    reps: int


def _summary(samples_ms: list[float]) -> Timing:
    q = statistics.quantiles(samples_ms, n=10, method="inclusive") if len(samples_ms) > 1 else samples_ms * 9
    return Timing(statistics.median(samples_ms), q[1], q[7], statistics.pstdev(samples_ms), len(samples_ms))


def time_cuda(
    fns: dict[str, Callable[[], object]], min_reps: int = 100, budget_s: float = 3.0, idle_start: bool = False
) -> dict[str, Timing]:
    """Time several implementations of one problem, interleaved so drift hits all alike.

    The events time the GPU from the start marker to the end marker. Kernels queue behind
    the L2 flush and a spin of LEAD_US, so a call's time excludes the host's launch (its
    host µs are measured apart, `host_overhead_us`). The flush alone (~55 µs on an H200)
    was not always enough: a host-bound neighbour (torch.compile's guards, over 100 µs a call)
    drained the queue each round, and the next impl's host time then showed in its
    events (day 019's fused linear: 38 µs over its kernel, 2026-11-28). For a whole model step
    that would be wrong where the host is the bottleneck: the flush and whatever the
    previous implementation left queued let the host run ahead, hiding part of its time
    from one implementation and not another. `idle_start` waits for the GPU before each
    step (after the flush), so every step is timed from an idle GPU: its host time and
    its kernels' time, whichever is longer, as a loop of steps would see."""
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    for fn in fns.values():  # warm-up: compile, autotune, allocator
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    per_round = max(time.perf_counter() - t0, 1e-6)
    reps = max(min_reps, min(1000, int(budget_s / per_round)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    events = {
        name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for name in fns
    }
    for i in range(reps):
        for name, fn in fns.items():
            flush.zero_()
            if idle_start:
                torch.cuda.synchronize()
            else:
                torch.cuda._sleep(LEAD_CYCLES)
            start, end = events[name][i]
            start.record()
            fn()
            end.record()
    torch.cuda.synchronize()
    for name in fns:
        samples[name] = [s.elapsed_time(e) for s, e in events[name]]
    return {name: _summary(v) for name, v in samples.items()}


def time_cpu(fns: dict[str, Callable[[], object]], min_reps: int = 5, budget_s: float = 1.0) -> dict[str, Timing]:
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    deadline = time.perf_counter() + budget_s * len(fns)
    while min(len(v) for v in samples.values()) < min_reps or (
        time.perf_counter() < deadline and min(len(v) for v in samples.values()) < 200
    ):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t) * 1e3)
    return {name: _summary(v) for name, v in samples.items()}


def kernel_times_us(fn: Callable[[], object], reps: int = 20, counts: dict[str, int] | None = None) -> dict[str, float]:
    """Device time per call of each kernel the call launched, by kernel name (CUPTI through
    torch.profiler; self time: no double count). `counts`, when given, receives how many
    times each kernel ran over the `reps` calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    if counts is not None:
        counts.update({e.key: e.count for e in events})
    return {e.key: e.self_device_time_total / reps for e in events}


def kernel_time_ms(fn: Callable[[], object], reps: int = 20) -> float | None:
    """Device time per call, summed over every kernel the call launched: what the GPU
    spends, without host overhead or idle gaps."""
    total_us = sum(kernel_times_us(fn, reps).values())
    return total_us / 1e3 if total_us > 0 else None


def host_overhead_us(fn: Callable[[], object], reps: int = 200) -> float:
    """Wall time per call of a back-to-back loop with one sync at the end. For a tiny
    input the GPU is idle most of the time, so this is the host cost of one call."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def copy_bandwidth_gbps(device: str) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    n = (1 << 30) // 4 if device == "cuda" else (64 << 20) // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    fn = lambda: dst.copy_(src)  # noqa: E731
    t = (
        time_cuda({"copy": fn}, min_reps=20, budget_s=1.0)["copy"]
        if device == "cuda"
        else time_cpu({"copy": fn})["copy"]
    )
    return 2 * n * 4 / (t.median_ms * 1e-3) / 1e9
