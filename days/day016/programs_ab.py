"""The GPT block's training step with and without backward programs (day 016, part five).

    python -m days.day016.programs_ab          (CUDA only; one line per dtype and shape)

Times day 016's block, forward + backward, eager, in four ways in one process: torch's
build; gpu-days' build with programs and C++ nodes (programs.py, part five); with
programs but the autograd.Function's Python node (GPU_DAYS_NODES=0); and with programs
off (each op's Python runs). Each step is timed by
wall clock from an idle GPU (synchronised before and after), interleaved, median of `n`
rounds. Also the backward alone (the forward run before the clock starts).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from benchmark import gpt_block as G
from benchmark.cases.day016 import strict_ops
from pytorch_custom_ops import programs

SHAPES = ((1, 64, 768), (8, 128, 768), (8, 1024, 768), (32, 128, 1024), (4, 2048, 1024))


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def _backward_only(block, x, mask, params):
    y = block(x, mask)
    loss = G.loss_of(y)
    return lambda: torch.autograd.grad(loss, [x, *params])


def measure(shape, dtype, n: int = 40) -> dict[str, tuple[float, float]]:
    """{impl: (step ms, backward ms)} for torch, gpu_days, gpu_days_python_nodes, gpu_days_python."""
    b, s, d = shape
    x = G.make_input(shape, dtype, "cuda").requires_grad_()
    mask = G.causal_mask(s, dtype, "cuda")
    blocks = {"torch": G.make_block(d, G.TORCH, dtype, "cuda"), "gpu_days": G.make_block(d, G.GPU_DAYS, dtype, "cuda")}
    impls = {  # build, programs, C++ nodes
        "torch": ("torch", True, True),
        "gpu_days": ("gpu_days", True, True),
        "gpu_days_python_nodes": ("gpu_days", True, False),
        "gpu_days_python": ("gpu_days", False, False),
    }
    steps, backs = {k: [] for k in impls}, {k: [] for k in impls}
    for i in range(n + 5):  # 5 warm-up rounds (they record the programs)
        for impl, (build, on, nodes) in impls.items():
            programs.ENABLED, programs.NODES = on, nodes
            block = blocks[build]
            params = list(block.parameters())
            step = _timed(lambda block=block, params=params: G.train_step(block, x, mask, params))
            back = _timed(_backward_only(block, x, mask, params))
            if i >= 5:
                steps[impl].append(step)
                backs[impl].append(back)
    programs.ENABLED = programs.NODES = True
    return {k: (statistics.median(steps[k]), statistics.median(backs[k])) for k in impls}


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("days.day016.programs_ab: needs CUDA")
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per step from an idle GPU "
        "(train = forward + backward; bwd = the backward alone)"
    )
    print("columns: torch | gpu-days, programs + C++ nodes | programs, Python nodes | programs off; ratio to torch")
    with strict_ops():
        for dtype in (torch.bfloat16, torch.float32):
            for shape in SHAPES:
                r = measure(shape, dtype)
                (ts, tb), (cs, cb) = r["torch"], r["gpu_days"]
                (ps, pb), (ys, yb) = r["gpu_days_python_nodes"], r["gpu_days_python"]
                label = f"{str(dtype)[6:]} {'x'.join(map(str, shape))}"
                print(
                    f"{label:22} train {ts:5.2f} bwd {tb:5.2f} | train {cs:5.2f} bwd {cb:5.2f} | "
                    f"train {ps:5.2f} bwd {pb:5.2f} | train {ys:5.2f} bwd {yb:5.2f}   "
                    f"{ts / cs:.2f}x, {ts / ps:.2f}x, {ts / ys:.2f}x",
                    flush=True,
                )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
