"""Where the time of one op call goes: torch vs the Mojo op through MAX.

`python -m benchmark.max_overhead [--no-store] [--skip-max-customop]` (day 010) measures, for softmax:
  (a) first call in a fresh process (imports + library load + graph compile or cache hit),
  (b) first call for a new shape in a warm process,
  (c) steady-state host cost per call (tiny input, back-to-back calls),
  (d) kernel time (device time from the profiler on CUDA, wall time on CPU),
and splits (c) into its parts for the Mojo path. Rows go to results/<device>/day010.csv.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from functools import partial

import torch

import pytorch_custom_ops as pco
from pytorch_custom_ops import library
from pytorch_custom_ops.mojo_op import _to_max

from . import timing
from .store import append_rows, new_run_id

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = (8, 128)
BIG = (4096, 4096)

FRESH = """
import time, torch
t0 = time.perf_counter()
import pytorch_custom_ops as pco
x = torch.randn(64, 1000, device="{dev}")
y = {call}
if x.is_cuda: torch.cuda.synchronize()
print(time.perf_counter() - t0)
"""


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed_once(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def fresh_process_s(call: str, cache_dir: str | None) -> float:
    env = dict(os.environ)
    if cache_dir:
        env["MODULAR_CACHE_DIR"] = cache_dir
    out = subprocess.run(
        [sys.executable, "-c", FRESH.format(dev=DEVICE, call=call)], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def per_call_us(fn, reps=300) -> float:
    return timing.host_overhead_us(fn, reps)


def levers(xt, tiny, model, add, rows) -> None:
    """GPU only: replaying a captured graph instead of launching through MAX each time."""
    new = torch.randn_like(xt)
    # MAX's own device-graph capture of the compiled model
    try:
        bufs = [_to_max(xt)]
        (captured_out,) = model.capture(1, *bufs)  # replays write into the same buffer
        out = torch.from_dlpack(captured_out)
        xt.copy_(new)
        model.replay(1, *bufs)
        torch.cuda.synchronize()
        ok = torch.allclose(out, torch.softmax(new, -1), atol=1e-6)
        add(
            "c_lever_max_graph_replay",
            "mojo",
            us=per_call_us(lambda: model.replay(1, *bufs)),
            shape=tiny,
            note=f"Model.capture/replay; replay result {'correct' if ok else 'WRONG'}",
        )
    except Exception as exc:
        rows.append(
            {
                "op": "c_lever_max_graph_replay",
                "impl": "mojo",
                "shape": tiny,
                "dtype": "float32",
                "status": "NA",
                "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
            }
        )
        print("max graph replay failed:", exc)
    # torch's CUDA graph around the op call. In a child process: a failed capture leaves
    # the CUDA context unusable (seen on the H100: "capturing stream has unjoined work").
    proc = subprocess.run([sys.executable, "-c", TORCH_GRAPH_LEVER], capture_output=True, text=True)
    last = (proc.stdout.strip().splitlines() or ["fail no output"])[-1].split(" ", 2)
    if proc.returncode == 0 and last[0] == "ok":
        add(
            "c_lever_torch_cuda_graph",
            "mojo",
            us=float(last[1]),
            shape=tiny,
            note=f"torch.cuda.graph around the op; replay result {last[2]}",
        )
    else:
        err = proc.stderr.strip().splitlines() or ["?"]
        reason = next((line for line in err if "Error" in line), err[-1])[:200]
        rows.append(
            {
                "op": "c_lever_torch_cuda_graph",
                "impl": "mojo",
                "shape": tiny,
                "dtype": "float32",
                "status": "NA",
                "reason": reason,
            }
        )
        print("torch cuda graph lever failed:", reason)


TORCH_GRAPH_LEVER = """
import torch, pytorch_custom_ops as pco
from benchmark.timing import host_overhead_us
x = torch.randn(8, 128, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):
        pco.online_softmax(x)
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    y = pco.online_softmax(x)
new = torch.randn_like(x)
x.copy_(new)
graph.replay()
torch.cuda.synchronize()
ok = torch.allclose(y, torch.softmax(new, -1), atol=1e-6)
print("ok", host_overhead_us(graph.replay, 300), "correct" if ok else "WRONG")
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-store", action="store_true")
    p.add_argument("--skip-max-customop", action="store_true", help="skip MAX's own per-shape path (slow compiles)")
    args = p.parse_args(argv)
    rows: list[dict] = []

    def add(metric, impl, *, ms=None, us=None, shape="", note=""):
        rows.append(
            {
                "op": metric,
                "impl": impl,
                "shape": shape,
                "dtype": "float32",
                "status": "ok",
                "ms_median": ms,
                "host_us": us,
                "note": note,
            }
        )
        val = f"{ms:.3f} ms" if ms is not None else f"{us:.1f} us"
        print(f"{metric:34s} {impl:28s} {shape:10s} {val}  {note}")

    # (a) first call in a fresh process: an empty MAX cache, then the same cache again
    with tempfile.TemporaryDirectory() as cache:
        for note in ("empty MAX cache: library load + graph compile", "warm MAX disk cache (same cache dir)"):
            add(
                "a_first_call_fresh_process",
                "mojo",
                ms=1e3 * fresh_process_s("pco.online_softmax(x)", cache),
                shape="64x1000",
                note=note,
            )
    add(
        "a_first_call_fresh_process",
        "torch",
        ms=1e3 * fresh_process_s("torch.softmax(x, -1)", None),
        shape="64x1000",
        note="import + first call",
    )

    # warm up both paths
    x = torch.randn(64, 1000, device=DEVICE)
    pco.online_softmax(x)
    torch.softmax(x, -1)

    # (b) first call for a new shape in a warm process
    for shape in [(77, 3001), (1000, 129)]:
        xs = torch.randn(shape, device=DEVICE)
        s = "x".join(map(str, shape))
        add(
            "b_first_call_new_shape",
            "mojo",
            ms=1e3 * timed_once(partial(pco.online_softmax, xs)),
            shape=s,
            note="symbolic dims: no recompile",
        )
        xs2 = torch.randn(shape[0] + 1, shape[1], device=DEVICE)
        add("b_first_call_new_shape", "torch", ms=1e3 * timed_once(partial(torch.softmax, xs2, -1)), shape=s)
    if not args.skip_max_customop:
        from pathlib import Path

        from max.experimental.torch import CustomOpLibrary

        lib = CustomOpLibrary(Path(library.library_path()))
        op = lib.online_softmax[{"BLOCK": 256}]
        for shape in [(64, 1000), (65, 1000)]:
            xs = torch.randn(shape, device=DEVICE)
            out = torch.empty_like(xs)
            add(
                "b_first_call_new_shape",
                "max_customoplibrary",
                ms=1e3 * timed_once(partial(op, out, xs)),
                shape="x".join(map(str, shape)),
                note="MAX's own bridge: one graph per shape",
            )
        add("c_host_per_call", "max_customoplibrary", us=per_call_us(lambda: op(out, xs)), shape="65x1000")

    # (c) steady-state host cost per call, and its parts for the Mojo path
    xt = torch.randn(*TINY, device=DEVICE)
    tiny = "x".join(map(str, TINY))
    add("c_host_per_call", "torch", us=per_call_us(lambda: torch.softmax(xt, -1)), shape=tiny)
    add(
        "c_host_per_call",
        "mojo",
        us=per_call_us(lambda: pco.online_softmax(xt)),
        shape=tiny,
        note="public op: checks, dispatch, MAX execute",
    )
    kernel = pco.online_softmax_kernel
    add(
        "c_part_torch_dispatch_and_wrapper",
        "mojo",
        us=per_call_us(lambda: torch.ops.gpu_days.online_softmax(xt, -1)) - per_call_us(lambda: kernel([xt])),
        shape=tiny,
        note="torch.library op + movedim/reshape around the kernel call",
    )
    add("c_part_contract_check", "mojo", us=per_call_us(lambda: kernel.spec.check_call([xt])), shape=tiny)
    model = kernel.model(xt.dtype, xt.device)
    bufs = (_to_max(xt),)
    returned = model.execute(*bufs)[0]
    add(
        "c_part_dlpack_wrap",
        "mojo",
        us=per_call_us(lambda: (_to_max(xt), torch.from_dlpack(returned))),
        shape=tiny,
        note="the input -> a MAX buffer, the returned buffer -> a torch tensor",
    )
    add(
        "c_part_model_execute",
        "mojo",
        us=per_call_us(lambda: model.execute(*bufs)),
        shape=tiny,
        note="MAX Model.execute with ready buffers",
    )

    # levers for the steady-state cost (c)
    add(
        "c_lever_execute_device_tensors",
        "mojo",
        us=per_call_us(lambda: model._execute_device_tensors(list(bufs))),
        shape=tiny,
        note="skip Model.execute's Python argument loop",
    )
    if DEVICE == "cuda":
        levers(xt, tiny, model, add, rows)

    # (d) kernel time on a big input
    xb = torch.randn(*BIG, device=DEVICE)
    big = "x".join(map(str, BIG))
    for impl, fn in (("torch", lambda: torch.softmax(xb, -1)), ("mojo", lambda: pco.online_softmax(xb))):
        if DEVICE == "cuda":
            ms = timing.kernel_time_ms(fn)
            add("d_kernel_time", impl, ms=ms, shape=big, note="device time (profiler)")
            add(
                "d_end_to_end_time",
                impl,
                ms=timing.time_cuda({impl: fn})[impl].median_ms,
                shape=big,
                note="CUDA events, L2 flushed",
            )
        else:
            add("d_end_to_end_time", impl, ms=timing.time_cpu({impl: fn})[impl].median_ms, shape=big, note="wall clock")

    if not args.no_store:
        print("appended to", append_rows(rows, day="day010", run_id=new_run_id()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
