"""Where the fused linear's end-to-end time goes, next to torch eager and torch.compile.

    PYTHONPATH=$PWD python days/day019/time_linear_e2e.py

The benchmark's `linear_gelu` rows (H200, 2026-11-28) put the fused layer 38 µs above its
own kernel time end to end, where torch eager was 5 µs above. This times each impl five
ways, in the same run, at GPT-2's four layer shapes (bf16):

* kernel: the sum of the call's kernels (CUPTI), warm L2, as the rows' `kernel_ms`;
* kernel_cold: the same after the benchmark's 256 MB L2 flush before each call;
* e2e: the benchmark's timer (events around each call, the flush queued before it);
* e2e_idle: the same with the GPU idle when the call starts (host time included);
* loop: 50 calls back to back, no flush, one pair of events: what a model's stream sees.

and lists every CUDA activity of one fused call (a copy or fill would show there).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import pytorch_custom_ops as pco
from benchmark.cases.day019 import LAYER_SHAPES, _layer_inputs, _torch_gelu
from benchmark.gpu_script import need_cuda
from benchmark.harness import compiled
from benchmark.timing import L2_FLUSH_BYTES, kernel_time_ms, time_cuda


def cold_kernel_ms(fn, flush: torch.Tensor, reps: int = 20) -> float:
    """Kernel time of `fn` alone, each call after the flush; the flush's own kernel is
    left out by name (it is the only fill of `flush`'s size)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    flush_us = kernel_time_ms(lambda: flush.zero_(), reps) * 1e3
    total = sum(e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0)
    return (total / reps - flush_us) / 1e3


def loop_ms(fn, calls: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def activities(fn) -> list[str]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.self_device_time_total > 0 or "Memcpy" in e.key or "Memset" in e.key or "Synchronize" in e.key:
            rows.append(f"{e.key[:60]} x{e.count} gpu {e.self_device_time_total:.1f} us")
    return rows


def main() -> None:
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    impls = {
        "torch": _torch_gelu,
        "torch_compile": compiled(_torch_gelu),
        "mojo_linear": lambda x, w, b, r: pco.linear(x, w, b, "gelu_tanh"),
    }
    print(f"{torch.cuda.get_device_name()}; bf16 linear + bias + GELU (tanh); ms")
    cols = ("kernel", "kernel_cold", "e2e", "e2e_idle", "loop")
    print(f"{'shape':>16} {'impl':>14} " + " ".join(f"{c:>11}" for c in cols))
    for shape in LAYER_SHAPES["full"]:
        x, w, b, r = _layer_inputs(shape, torch.bfloat16, "cuda")
        ref = _torch_gelu(x.double(), w.double(), b.double(), r.double())
        steps = {name: (lambda fn=fn, x=x, w=w, b=b, r=r: fn(x, w, b, r)) for name, fn in impls.items()}
        for name, step in steps.items():
            err = (step().double() - ref).abs().max().item()
            assert err < 0.1, f"{name} {shape}: max |err| {err}"
        e2e = time_cuda(steps, min_reps=100, budget_s=1.0)
        idle = time_cuda(steps, min_reps=50, budget_s=0.5, idle_start=True)
        for name, step in steps.items():
            cells = (
                kernel_time_ms(step),
                cold_kernel_ms(step, flush),
                e2e[name].median_ms,
                idle[name].median_ms,
                loop_ms(step),
            )
            label = "x".join(map(str, shape))
            print(f"{label:>16} {name:>14} " + " ".join(f"{c:11.4f}" for c in cells))
    x, w, b, r = _layer_inputs(LAYER_SHAPES["full"][0], torch.bfloat16, "cuda")
    for name in ("torch", "mojo_linear"):
        print(f"one {name} call's activities:")
        for row in activities(lambda fn=impls[name]: fn(x, w, b, r)):
            print("   ", row)


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
