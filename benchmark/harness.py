"""One harness for every day's benchmarks.

A `Case` is one op: its implementations, shapes, dtypes, how to make inputs, a float64
reference, and a bytes (or FLOPs) model. `run_case` validates every implementation
against the reference first (a wrong result is reported, never timed), then times them
interleaved, and returns rows for the results store. Anything that fails — OOM, Triton
OutOfResources, a Mojo build error — becomes an NA row with the reason; the run goes on.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from . import timing

Impl = Callable[..., torch.Tensor]  # or a tuple of tensors (e.g. out and grads), compared pairwise


class SkipShape(Exception):  # noqa: N818 - raised by an impl: an NA row with this reason, no traceback
    """An implementation does not run at this shape on purpose (e.g. O(N^2) memory)."""


@dataclass
class Case:
    day: str
    op: str
    impls: dict[str, Impl]  # name -> fn(*inputs); "torch" is the baseline for speedups
    make_inputs: Callable[[tuple[int, ...], torch.dtype, str], tuple]
    reference: Callable[..., torch.Tensor]  # fn(*inputs) in float64 (a tuple where impls return tuples)
    bytes_moved: Callable[[tuple[int, ...], torch.dtype], int] | None = None
    flops: Callable[[tuple[int, ...]], int] | None = None
    shapes: dict[str, Sequence[tuple[int, ...]]] = field(default_factory=dict)  # "quick"/"full"
    dtypes: dict[str, Sequence[torch.dtype]] = field(default_factory=dict)  # "cpu"/"cuda"
    tolerance: dict[torch.dtype, float] = field(
        default_factory=lambda: {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float64: 1e-9}
    )
    cuda_only: tuple[str, ...] = ()  # impls that only make sense on a GPU (e.g. torch.compile)
    note: Callable[[], str] | None = None  # recorded on every row, e.g. a backend setting of the run


def compiled(fn: Impl) -> Impl:
    """`torch.compile(fn)`, built on first call (importing a case must not compile).

    One specialisation per (shape, dtype): a sweep needs more than dynamo's default
    recompile limit of 8, past which it silently runs eager (seen on the H100).
    """
    cache: list[Impl] = []

    def run(*args):
        if not cache:
            torch._dynamo.config.recompile_limit = 64
            cache.append(torch.compile(fn, dynamic=False))
        return cache[0](*args)

    return run


def shape_str(shape: tuple[int, ...]) -> str:
    return "x".join(str(s) for s in shape)


def dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def failure_reason(exc: BaseException) -> str:
    """'ExceptionType: first line of the message', short enough for a results row."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:300]


def _free_after_failure(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _peak_extra_mib(fn: Callable[[], object]) -> float | None:
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def _worst_error(got, want) -> tuple[float, float]:
    """(max |got - want|, max |want|) of the output, or of the worst output (relative to its
    own scale) when an impl returns several (e.g. out, dq, dk, dv)."""
    pairs = list(zip(got, want, strict=True)) if isinstance(got, (tuple, list)) else [(got, want)]
    worst = (0.0, 1.0)
    for g, w in pairs:
        err = (g.double() - w).abs().max().item() if g.numel() else 0.0
        scale = w.abs().max().item() if w.numel() else 1.0
        if not math.isfinite(err) or err / max(scale, 1e-30) > worst[0] / max(worst[1], 1e-30):
            worst = (err, scale)
            if not math.isfinite(err):
                break
    return worst


def run_case(case: Case, device: str, quick: bool, copy_gbps: float | None, progress=None) -> list[dict]:
    rows: list[dict] = []
    shapes = case.shapes["quick" if quick else "full"]
    dtypes = case.dtypes.get(device, [torch.float32])
    impls = {k: v for k, v in case.impls.items() if device == "cuda" or k not in case.cuda_only}
    for dtype in dtypes:
        for shape in shapes:
            base = {"op": case.op, "shape": shape_str(shape), "dtype": dtype_str(dtype)}
            try:
                inputs = case.make_inputs(shape, dtype, device)
                want = case.reference(*inputs)
            except Exception as exc:  # e.g. OOM making the inputs
                _free_after_failure(device)
                rows += [{**base, "impl": n, "status": "NA", "reason": failure_reason(exc)} for n in impls]
                continue
            if case.note is not None:  # after make_inputs, which may set the backend up
                base["note"] = case.note()
            runnable: dict[str, Callable[[], object]] = {}
            results: dict[str, dict] = {}
            for name, impl in impls.items():
                row = {**base, "impl": name}
                results[name] = row
                try:
                    got = impl(*inputs)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    tol = case.tolerance[dtype]
                    err, scale = _worst_error(got, want)
                    if not math.isfinite(err) or err > tol * max(scale, 1e-30):
                        row.update(status="wrong", reason=f"max abs error {err:.3g} > {tol:g} x max|ref| {scale:.3g}")
                        continue
                    del got
                    runnable[name] = lambda impl=impl, inputs=inputs: impl(*inputs)
                except SkipShape as exc:
                    row.update(status="NA", reason=str(exc))
                except Exception as exc:
                    _free_after_failure(device)
                    row.update(status="NA", reason=failure_reason(exc))
                    if device == "cuda" and not isinstance(exc, torch.cuda.OutOfMemoryError):
                        traceback.print_exc(limit=2)
            try:
                timed = (timing.time_cuda if device == "cuda" else timing.time_cpu)(runnable) if runnable else {}
            except Exception as exc:
                _free_after_failure(device)
                timed = {}
                for name in runnable:
                    results[name].update(status="NA", reason=failure_reason(exc))
            for name, t in timed.items():
                row = results[name]
                row.update(status="ok", ms_median=t.median_ms, ms_p20=t.p20_ms, ms_p80=t.p80_ms, ms_std=t.std_ms)
                if case.bytes_moved:
                    row["gbps"] = case.bytes_moved(shape, dtype) / (t.median_ms * 1e-3) / 1e9
                    if copy_gbps:
                        row["pct_copy_bw"] = 100 * row["gbps"] / copy_gbps
                if case.flops:
                    row["tflops"] = case.flops(shape) / (t.median_ms * 1e-3) / 1e12
                if device == "cuda":
                    try:
                        row["peak_extra_mib"] = _peak_extra_mib(runnable[name])
                        # device time alone: what the GPU spends when the host keeps up
                        row["kernel_ms"] = timing.kernel_time_ms(runnable[name])
                    except Exception:
                        _free_after_failure(device)
            if "torch" in timed:
                for name, t in timed.items():
                    results[name]["speedup_vs_torch"] = timed["torch"].median_ms / t.median_ms
            rows += list(results.values())
            if progress is not None:
                progress()
            del inputs, want
    return rows
