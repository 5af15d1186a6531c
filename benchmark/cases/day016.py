"""Day 016: a GPT-2-style block (benchmark/gpt_block.py) built from gpu-days' ops vs the
same block in torch, in every mode a user would run it. Issue 16, deliverable 4.

Two ops, each a sweep of shapes (batch x seq x d) and dtypes:
- `gpt_block`: the forward, under torch.no_grad() (inference);
- `gpt_block_train`: forward + backward: loss = output.float().pow(2).mean(), and
  torch.autograd.grad of it for the input and all 12 parameters.
Implementations (the `impl` column):
- `torch`: the torch build, eager (the baseline of `speedup_vs_torch`);
- `gpu_days`: the gpu-days build, eager;
- `gpu_days_fused`: the gpu-days build with day 019-020's fused modules (since
  2026-11-26): the second residual add inside the LayerNorm after it (MojoAddLayerNorm),
  the MLP as one `mlp` call (GELU and its gradient in the GEMM epilogues), the biases in
  the epilogues (MojoLinear); eager;
- `torch_compile`: torch.compile(torch build), default mode, dynamic=False: one compile
  per shape, dtype and op, done before timing (its seconds are in the note);
- `torch_graph`, `gpu_days_graph`, `gpu_days_fused_graph`, `torch_compile_graph`: the eager or compiled step
  captured whole (forward, or forward + backward) by torch.cuda.graph after 3 warm-up
  steps on a side stream, then replayed. The compiled block is captured by hand rather
  than through mode="reduce-overhead": the same capture for every build, and no second
  compile per shape.
CUDA only: the compiled and graph impls. On the CPU (quick shapes) the sweep checks that
both builds run and agree.

Before timing, every impl's output (and, for the train op, every gradient) is compared
with the block computed in float64 from the same inputs and parameters (rounded to the
dtype). A mismatch is a `wrong` row and is not timed. gpu-days' ops run strict here
(GPU_DAYS_STRICT=1): a kernel that cannot run is an NA row, never torch's fallback timed
under gpu-days' name.

Columns: ms (CUDA events around each step, L2 flushed before it and, since 2026-11-26,
the GPU idle when it starts: see TIMING), tokens_per_s =
batch*seq per step, tflops from the model's FLOPs (the full score matrix counts, masked
half included: 24 b s d^2 + 4 b s^2 d forward, three times that forward + backward),
kernel_ms (eager impls only: a replay runs the same kernels) and peak_extra_mib.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from .. import gpt_block as G
from .. import timing
from ..harness import failure_reason, shape_str

DAY = "day016"
FORWARD, TRAIN = "gpt_block", "gpt_block_train"
SHAPES = {
    "quick": [(2, 13, 128)],
    "full": [(1, 64, 768), (8, 128, 768), (8, 1024, 768), (32, 128, 1024), (4, 2048, 1024)],
}
DTYPES = {"cpu": [torch.float32], "cuda": [torch.float32, torch.bfloat16]}
IMPLS = (
    "torch",
    "gpu_days",
    "gpu_days_fused",
    "torch_compile",
    "torch_graph",
    "gpu_days_graph",
    "gpu_days_fused_graph",
    "torch_compile_graph",
)
CUDA_ONLY = ("torch_compile", "torch_graph", "gpu_days_graph", "gpu_days_fused_graph", "torch_compile_graph")
EAGER = ("torch", "gpu_days", "gpu_days_fused", "torch_compile")  # kernel_ms and peak memory are measured for these
# timing budget per (op, shape, dtype), all impls interleaved: large steps get fewer reps
# idle_start: each step from an idle GPU (timing.time_cuda), so that at the host-bound shapes
# no build hides host time behind the kernels another build left queued (before 2026-11-26,
# torch eager's step followed the graph replays and gpu-days' followed torch eager's)
TIMING = {"cuda": {"min_reps": 10, "budget_s": 1.0, "idle_start": True}, "cpu": {"min_reps": 3, "budget_s": 0.3}}
KERNEL_REPS = 3
WARMUP = 3


def flops(shape: tuple[int, int, int], train: bool) -> int:
    b, s, d = shape
    forward = 24 * b * s * d * d + 4 * b * s * s * d
    return 3 * forward if train else forward


@contextmanager
def strict_ops():
    """gpu-days' ops raise instead of falling back to torch (see fallback.py)."""
    old = os.environ.get("GPU_DAYS_STRICT")
    os.environ["GPU_DAYS_STRICT"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["GPU_DAYS_STRICT"]
        else:
            os.environ["GPU_DAYS_STRICT"] = old


def cuda_graph(step: Callable[[], list], warmup: int = WARMUP) -> Callable[[], list]:
    """`step` captured by torch.cuda.graph after `warmup` calls on a side stream (which
    also load every kernel and fill the ops' caches: nothing may allocate host-side or
    synchronise during capture). The returned function replays it and returns the
    captured outputs, rewritten in place by each replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()

    def replay():
        graph.replay()
        return static

    replay.graph, replay.outputs = graph, static  # the graph lives as long as its replay function
    return replay


def _step(block, x: torch.Tensor, mask: torch.Tensor, train: bool, params: list) -> Callable[[], list]:
    if train:
        xg = x.detach().clone().requires_grad_()
        return lambda: G.train_step(block, xg, mask, params)

    def forward():
        with torch.no_grad():
            return [block(x, mask)]

    return forward


def _build(impl: str, blocks: dict, x, mask, train: bool) -> tuple[Callable[[], list], str]:
    """The step function of `impl` and a note on how it was made."""
    base = impl.removesuffix("_graph")
    block = blocks[base]
    params = list(blocks["torch" if base == "torch_compile" else base].parameters())
    step = _step(block, x, mask, train, params)
    note = ""
    if impl == "torch_compile":
        t = time.perf_counter()
        step()  # compiles (forward, and the backward graph on the train op)
        torch.cuda.synchronize()
        note = f"torch.compile default mode, dynamic=False, compiled in {time.perf_counter() - t:.1f} s"
    if impl.endswith("_graph"):
        step = cuda_graph(step)
        note = f"torch.cuda.graph replay of the {base} step (captured after {WARMUP} warm-up steps)"
        if base == "torch_compile":
            note += "; captured by hand, not mode='reduce-overhead'"
    return step, note


def _validate(step, want, names, dtype, what: str) -> float:
    if hasattr(step, "outputs"):  # a replay must write its outputs: poison them first
        for t in step.outputs:
            t.fill_(math.nan)
    got = step()
    n = len(got)  # the forward op checks the output alone
    return G.check(got, want[:n], names[:n], dtype, what)


def problem_rows(op: str, shape, dtype, device: str, impls=IMPLS) -> list[dict]:
    """Rows of every impl for one (op, shape, dtype): validated, then timed interleaved."""
    train = op == TRAIN
    b, s, d = shape
    base = {"op": op, "shape": shape_str(shape), "dtype": str(dtype).removeprefix("torch.")}
    impls = [i for i in impls if device == "cuda" or i not in CUDA_ONLY]
    rows = {i: {**base, "impl": i} for i in impls}
    try:
        x = G.make_input(shape, dtype, device)
        mask = G.causal_mask(s, dtype, device)
        want, names = G.reference(x)
        blocks = {
            "torch": G.make_block(d, G.TORCH, dtype, device),
            "gpu_days": G.make_block(d, G.GPU_DAYS, dtype, device),
            "gpu_days_fused": G.make_block(d, G.GPU_DAYS_FUSED, dtype, device),
        }
        if any(i.startswith("torch_compile") for i in impls):
            blocks["torch_compile"] = torch.compile(blocks["torch"], dynamic=False)
    except Exception as exc:  # e.g. OOM making the inputs
        _free(device)
        return [{**r, "status": "NA", "reason": failure_reason(exc)} for r in rows.values()]
    common = "forward + backward (grads of x and 12 parameters)" if train else "forward under torch.no_grad"
    if device == "cuda" and dtype == torch.float32:
        common += f"; allow_tf32={torch.backends.cuda.matmul.allow_tf32}"
    steps: dict[str, Callable[[], list]] = {}
    for impl in impls:
        row = rows[impl]
        try:
            step, note = _build(impl, blocks, x, mask, train)
            err = _validate(step, want, names, dtype, f"{op} {impl}")
            row["note"] = "; ".join(filter(None, [common, note, f"max relative error vs float64 {err:.2g}"]))
            steps[impl] = step
        except G.BlockMismatch as exc:
            row.update(status="wrong", reason=str(exc)[:300])
        except Exception as exc:
            _free(device)
            row.update(status="NA", reason=failure_reason(exc))
    try:
        timer = timing.time_cuda if device == "cuda" else timing.time_cpu
        timed = timer(steps, **TIMING[device]) if steps else {}
    except Exception as exc:
        _free(device)
        timed = {}
        for impl in steps:
            rows[impl].update(status="NA", reason=failure_reason(exc))
    for impl, t in timed.items():
        row = rows[impl]
        row.update(status="ok", ms_median=t.median_ms, ms_p20=t.p20_ms, ms_p80=t.p80_ms, ms_std=t.std_ms)
        row["tokens_per_s"] = b * s / (t.median_ms * 1e-3)
        row["tflops"] = flops(shape, train) / (t.median_ms * 1e-3) / 1e12
        if "torch" in timed:
            row["speedup_vs_torch"] = timed["torch"].median_ms / t.median_ms
        if device == "cuda" and impl in EAGER:
            try:
                row["peak_extra_mib"] = _peak_extra_mib(steps[impl])
                row["kernel_ms"] = timing.kernel_time_ms(steps[impl], reps=KERNEL_REPS)
            except Exception:
                _free(device)
    del steps, blocks
    _free(device)
    return list(rows.values())


def _peak_extra_mib(step) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _free(device: str) -> None:
    """Release a failed impl's memory. Best effort: after a failed capture the next call
    may fail too, and that call's row then says why."""
    if device == "cuda":
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except RuntimeError:
            pass


def sweep(op: str, quick: bool, device: str, shapes=None, dtypes=None, impls=IMPLS) -> list[dict]:
    """Every (shape, dtype) of `op`: the rows the harness appends to results/<device>/day016.csv."""
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in every build (as day 014)
        torch._dynamo.config.recompile_limit = 64  # one compile per shape, dtype and grad mode
    rows = []
    with strict_ops():
        for dtype in dtypes or DTYPES[device]:
            for shape in shapes or SHAPES["quick" if quick else "full"]:
                t = time.perf_counter()
                rows += problem_rows(op, shape, dtype, device, impls)
                print(f"  {DAY} {op} {shape_str(shape)} {dtype}: {time.perf_counter() - t:.1f} s", flush=True)
    return rows
