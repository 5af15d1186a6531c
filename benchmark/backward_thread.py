"""Does a single-threaded backward change the host-bound GPT block's step?

    python -m benchmark.backward_thread      (CUDA only; prints one line per dtype and shape)

On CUDA, autograd runs a backward on its own device thread; with
`torch.autograd.set_multithreading_enabled(False)` it runs on the thread that called
backward(). Day 016 suspected that gpu-days' Python backward nodes run slowly on that
device thread. This times day 016's GPT block, forward + backward, eager, in both builds
and both settings (wall time per step, synchronised, median of 60). The H100's output is
results/nvidia-h100-80gb-hbm3/day016_backward_thread.txt.
"""

import statistics
import time
from functools import partial

import torch

from benchmark import gpt_block as G
from benchmark.cases.day016 import strict_ops


def time_step(step, n=60, warm=10):
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmark.backward_thread: needs CUDA (the CPU backward already runs on the caller's thread)")
    with strict_ops():
        _sweep()


def _sweep() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        for b, s, d in ((1, 64, 768), (8, 128, 768), (32, 128, 1024), (8, 1024, 768)):
            res = {}
            for impl in ("torch", "gpu_days"):
                block = G.make_block(d, impl, dtype, "cuda")
                x = torch.randn(
                    b, s, d, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(0)
                ).requires_grad_()
                mask = G.causal_mask(s, dtype, "cuda")
                params = list(block.parameters())
                for mt in (True, False):
                    with torch.autograd.set_multithreading_enabled(mt):
                        res[(impl, mt)] = time_step(partial(G.train_step, block, x, mask, params))
            t_mt, t_st = res["torch", True], res["torch", False]
            g_mt, g_st = res["gpu_days", True], res["gpu_days", False]
            print(
                f"{str(dtype)[6:]:8} {b}x{s}x{d:5}  torch mt {t_mt:6.2f} st {t_st:6.2f} | "
                f"gpu_days mt {g_mt:6.2f} st {g_st:6.2f} ms | ratio mt {t_mt / g_mt:.2f}x st {t_st / g_st:.2f}x "
                f"(st gpu_days vs mt torch {t_mt / g_st:.2f}x)",
                flush=True,
            )


if __name__ == "__main__":
    main()
