"""Benchmark: torch's softmax(X) @ V against the fused Triton kernel (fixed blocks, autotuned).

    python -m days.day011.bench_softmax_matmul                    # CUDA: the full sweep, float32
    python -m days.day011.bench_softmax_matmul --dtype bfloat16
    python -m days.day011.bench_softmax_matmul --quick            # small smoke sweep (CPU: interpreter)

Writes outputs/softmax_matmul_benchmark.csv (columns CSV_COLUMNS) and appends the same
measurements to the results store (results/<device>/day011.csv) unless --no-store.
Every configuration gets a row: one that cannot run (OOM, out of shared memory, compile
error) or gives a wrong result has NA timings and its reason printed.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from benchmark.harness import failure_reason
from benchmark.timing import copy_bandwidth_gbps
from days.day011.fused_softmax import autotuned_config, fused_softmax, fused_softmax_autotuned, softmax_mult

OP = "softmax_matmul"
DAY = "day011"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT_DIR = REPO_ROOT / "outputs"
CSV_NAME = "softmax_matmul_benchmark.csv"
CSV_COLUMNS = [
    "batch_size", "d1", "d2", "d3", "triton", "BLOCK", "forward_ms_mean", "forward_ms_std", "forward_peak_MiB",
]  # fmt: skip
CSV_DTYPES = {
    "batch_size": "int64", "d1": "int64", "d2": "int64", "d3": "int64", "triton": "bool", "BLOCK": "Int64",
    "forward_ms_mean": "Float64", "forward_ms_std": "Float64", "forward_peak_MiB": "Float64",
}  # fmt: skip
BLOCKS = (16, 32, 64)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Max |out - ref| / max |ref| against a float32 torch reference computed from the same
# inputs. float32 allows for TF32 (tl.dot's default for fp32: ~5e-4 measured on emulated
# TF32 at these shapes); the 16-bit ones for P and O rounded to 16 bits (bf16: ~8e-3).
TOLERANCE = {torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@dataclass
class Sweep:
    batch: int
    d1: int
    d2s: list[int]
    d3: int
    warmup: int
    passes: int


FULL = Sweep(batch=16, d1=2048, d2s=[64, 128, 256, 512, 1024, 2048, 4096, 8192], d3=512, warmup=10, passes=100)
QUICK_CUDA = Sweep(batch=16, d1=2048, d2s=[256, 2048], d3=512, warmup=3, passes=20)
# On the CPU the kernels run in Triton's interpreter: tiny shapes, still not multiples of
# every block, so masking is part of the smoke test.
QUICK_CPU = Sweep(batch=2, d1=40, d2s=[48, 100], d3=24, warmup=1, passes=2)


@dataclass
class Impl:
    name: str  # the results store's impl
    triton: bool
    block: int | None
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    note: str = ""


@dataclass
class Measurement:
    impl: Impl
    batch: int
    d1: int
    d2: int
    d3: int
    dtype: torch.dtype
    status: str = "ok"  # ok | NA | wrong
    reason: str = ""
    times_ms: list[float] = field(default_factory=list)
    peak_mib: float | None = None
    note: str = ""

    @property
    def shape(self) -> str:
        return f"{self.batch}x{self.d1}x{self.d2}x{self.d3}"

    def stat(self, which: str) -> float | None:
        t = self.times_ms
        if self.status != "ok" or not t:
            return None
        if which == "mean":
            return statistics.fmean(t)
        if which == "std":
            return statistics.stdev(t) if len(t) > 1 else 0.0
        if which == "median":
            return statistics.median(t)
        q = statistics.quantiles(t, n=10, method="inclusive") if len(t) > 1 else [t[0]] * 9
        return {"p20": q[1], "p80": q[7]}[which]

    @property
    def bytes_moved(self) -> int:
        # The floor: read X and V once, write O once.
        elems = self.batch * (self.d1 * self.d2 + self.d2 * self.d3 + self.d1 * self.d3)
        return elems * torch.empty((), dtype=self.dtype).element_size()


def implementations(input_precision: str = "tf32") -> list[Impl]:
    impls = [Impl("torch", False, None, softmax_mult)]
    for b in BLOCKS:
        fn = partial(fused_softmax, BLOCK_1=b, BLOCK_2=b, input_precision=input_precision)
        impls.append(Impl(f"triton_B{b}", True, b, fn))
    impls.append(Impl("triton_autotune", True, None, partial(fused_softmax_autotuned, input_precision=input_precision)))
    return impls


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, x, V, device: str, warmup: int, passes: int) -> tuple[list[float], float | None]:
    """Per-pass times in ms, and the peak memory above what was allocated before (MiB)."""
    for _ in range(warmup):
        fn(x, V)  # the result is dropped at once: at most one output is alive at a time
    _sync(device)
    if device != "cuda":
        times = []
        for _ in range(passes):
            t0 = time.perf_counter()
            fn(x, V)
            times.append((time.perf_counter() - t0) * 1e3)
        return times, None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(passes)]
    for start, end in events:
        start.record()
        fn(x, V)
        end.record()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return [s.elapsed_time(e) for s, e in events], peak


def _copy_bandwidth_gbps(device: str) -> float | None:
    """The device's copy bandwidth (GB/s, read + write), the practical memory roofline."""
    if device != "cuda":
        return None
    try:
        return copy_bandwidth_gbps(device)
    except Exception as exc:  # a roofline is a nice-to-have; the benchmark goes on without
        print(f"copy bandwidth not measured: {failure_reason(exc)}")
        return None


def measure(
    quick: bool = False, dtype: torch.dtype = torch.float32, input_precision: str = "tf32", verbose: bool = True
) -> tuple[list[Measurement], float | None]:
    """Run the sweep; returns the measurements and the copy bandwidth (GB/s, None on CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not quick:
        print("no CUDA device: running the --quick smoke sweep through the Triton interpreter")
        quick = True
    sweep = FULL if not quick else QUICK_CUDA if device == "cuda" else QUICK_CPU
    log = print if verbose else (lambda *a, **k: None)
    copy_gbps = _copy_bandwidth_gbps(device)
    tf32_note = f"torch fp32 matmul allow_tf32={torch.backends.cuda.matmul.allow_tf32}"
    results: list[Measurement] = []
    for d2 in sweep.d2s:
        shape = (sweep.batch, sweep.d1, d2, sweep.d3)
        log(f"[{DAY}] {'x'.join(map(str, shape))} {str(dtype).removeprefix('torch.')}")
        x = V = ref = None
        try:
            gen = torch.Generator(device=device).manual_seed(d2)
            x = torch.randn(sweep.batch, sweep.d1, d2, generator=gen, device=device).to(dtype)
            V = torch.randn(sweep.batch, d2, sweep.d3, generator=gen, device=device).to(dtype)
            ref = softmax_mult(x.float(), V.float())  # the yardstick for every implementation
        except Exception as exc:
            reason = f"inputs: {failure_reason(exc)}"
            log(f"  all implementations NA: {reason}")
            results += [Measurement(i, *shape, dtype, "NA", reason) for i in implementations(input_precision)]
            x = V = ref = None
            if device == "cuda":
                torch.cuda.empty_cache()
            continue
        for impl in implementations(input_precision):
            m = Measurement(impl, *shape, dtype)
            if impl.name == "torch" and dtype == torch.float32:
                m.note = tf32_note
            elif impl.triton and dtype == torch.float32:
                m.note = f"tl.dot input_precision={input_precision}"
            try:
                # Correctness first: a wrong kernel is reported, not timed.
                out = impl.fn(x, V)
                _sync(device)
                err = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                del out
                if not math.isfinite(err) or err > TOLERANCE[dtype]:
                    m.status, m.reason = "wrong", f"max |err| / max |ref| = {err:.3g} > {TOLERANCE[dtype]:g}"
                else:
                    m.times_ms, m.peak_mib = _time(impl.fn, x, V, device, sweep.warmup, sweep.passes)
                    if impl.name == "triton_autotune" and (cfg := autotuned_config()) is not None:
                        picked = " ".join(f"{k}={v}" for k, v in cfg.kwargs.items())
                        picked += f" num_warps={cfg.num_warps} num_stages={cfg.num_stages}"
                        m.note = "; ".join(filter(None, [m.note, f"autotune picked {picked}"]))
            except torch.cuda.OutOfMemoryError as exc:
                m.status, m.reason = "NA", f"OOM: {failure_reason(exc)}"
                torch.cuda.empty_cache()
            except Exception as exc:  # triton OutOfResources, CompileTimeAssertionFailure, ...
                m.status, m.reason = "NA", failure_reason(exc)
                if device == "cuda":
                    torch.cuda.empty_cache()
            if m.status == "ok":
                peak = "" if m.peak_mib is None else f", peak +{m.peak_mib:.0f} MiB"
                log(f"  {impl.name:16s} {m.stat('mean'):9.3f} ms ± {m.stat('std'):.3f}{peak}")
            else:
                log(f"  {impl.name:16s} {m.status}: {m.reason}")
            results.append(m)
        del x, V, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    return results, copy_gbps


def to_frame(results: list[Measurement]):
    """The CSV table: exactly CSV_COLUMNS, with nullable dtypes (CSV_DTYPES)."""
    import pandas as pd

    rows = [
        {
            "batch_size": m.batch,
            "d1": m.d1,
            "d2": m.d2,
            "d3": m.d3,
            "triton": m.impl.triton,
            "BLOCK": m.impl.block,  # <NA> for torch, and for the autotuned kernel (triton=True)
            "forward_ms_mean": m.stat("mean"),
            "forward_ms_std": m.stat("std"),
            "forward_peak_MiB": m.peak_mib if m.status == "ok" else None,
        }
        for m in results
    ]
    df = pd.DataFrame(rows, columns=CSV_COLUMNS)
    return df.astype(CSV_DTYPES)


def read_csv(path: Path):
    """Read the CSV back with the dtypes it was written with."""
    import pandas as pd

    return pd.read_csv(path, dtype=CSV_DTYPES)


def to_store_rows(results: list[Measurement], copy_gbps: float | None = None) -> list[dict]:
    """Rows for benchmark.store.append_rows (keys from benchmark.store.ROW_COLUMNS)."""
    torch_ms = {m.shape: m.stat("median") for m in results if m.impl.name == "torch"}
    rows = []
    for m in results:
        median = m.stat("median")
        gbps = m.bytes_moved / (median * 1e-3) / 1e9 if median else None
        base = torch_ms.get(m.shape)
        rows.append(
            {
                "op": OP,
                "impl": m.impl.name,
                "shape": m.shape,
                "dtype": str(m.dtype).removeprefix("torch."),
                "status": m.status,
                "reason": m.reason,
                "ms_median": median,
                "ms_p20": m.stat("p20"),
                "ms_p80": m.stat("p80"),
                "ms_std": m.stat("std"),
                "gbps": gbps,
                "pct_copy_bw": 100 * gbps / copy_gbps if gbps and copy_gbps else None,
                "speedup_vs_torch": base / median if base and median else None,
                "peak_extra_mib": m.peak_mib if m.status == "ok" else None,
                "note": m.note,
            }
        )
    return rows


def benchmark_rows(quick: bool = False, dtype=torch.float32) -> list[dict]:
    """The sweep as results-store rows, for the project-wide harness (it appends them)."""
    results, copy_gbps = measure(quick=quick, dtype=dtype)
    return to_store_rows(results, copy_gbps)


def print_summary(results: list[Measurement], copy_gbps: float | None = None) -> None:
    rows = to_store_rows(results, copy_gbps)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is optional: plain text
        for r in rows:
            print(r["shape"], r["impl"], r["status"], r["ms_median"], r["peak_extra_mib"], r["reason"])
        return

    def num(v, fmt):
        return "NA" if v is None else format(v, fmt)

    title = f"softmax(X) @ V, {rows[0]['dtype'] if rows else ''}"
    if copy_gbps:
        title += f" (copy bandwidth {copy_gbps:.0f} GB/s)"
    table = Table(title=title)
    for col in ["shape (BxD1xD2xD3)", "impl", "BLOCK", "mean ms", "std ms", "GB/s", "% copy bw", "vs torch",
                "peak +MiB", "status"]:  # fmt: skip
        table.add_column(col, justify="left" if col in ("shape (BxD1xD2xD3)", "impl", "status") else "right")
    for m, r in zip(results, rows, strict=True):
        table.add_row(
            r["shape"], r["impl"], num(m.impl.block, "d") if m.impl.triton else "NA",
            num(m.stat("mean"), ".3f"), num(m.stat("std"), ".3f"), num(r["gbps"], ".0f"),
            num(r["pct_copy_bw"], ".0f"), num(r["speedup_vs_torch"], ".2f") + ("x" if r["speedup_vs_torch"] else ""),
            num(r["peak_extra_mib"], ".0f"), r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason']}",
        )  # fmt: skip
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        console = Console(width=180)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke sweep (forced on CPU)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--input-precision", choices=["tf32", "tf32x3", "ieee"], default="tf32",
                        help="tl.dot's precision for float32 inputs (default tf32, Triton's default)")  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help=f"where {CSV_NAME} goes")
    parser.add_argument("--results-dir", type=Path, default=None, help="results store root (default: results/)")
    parser.add_argument("--no-store", action="store_true", help="do not append to the results store")
    args = parser.parse_args(argv)

    results, copy_gbps = measure(quick=args.quick, dtype=DTYPES[args.dtype], input_precision=args.input_precision)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = args.out_dir / CSV_NAME
    to_frame(results).to_csv(csv_path, index=False)
    print(f"wrote {csv_path}")
    if not args.no_store:
        from benchmark.store import append_rows, new_run_id

        extra = {} if args.results_dir is None else {"results_dir": args.results_dir}
        path = append_rows(to_store_rows(results, copy_gbps), day=DAY, run_id=new_run_id(), **extra)
        print(f"appended {len(results)} rows to {path}")
    print_summary(results, copy_gbps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
