"""The one-pass cross-entropy's launch shape (day 020, part 11): kernel time of forward +
backward for each (threads per row, shared-memory row cache) pair, against the two-pass
kernels and a copy of the logits (read N V, write N V: what one pass must move), CUDA-graph
replays, microseconds:

    python -m days.day020.time_one_pass

The cache bounds the blocks per SM: two 100 KB caches fit an SM's shared memory, four of
56 KB, eight of 28 KB. What is not cached, the row's tail, is read again in the second
half of the pass.
"""

from __future__ import annotations

import importlib

import torch

from benchmark.gpu_script import need_cuda
from days.day020.time_master_grads import graph_us
from pytorch_custom_ops import direct

ce = importlib.import_module("pytorch_custom_ops.cross_entropy")  # the module, not the function

SHAPES = ((8192, 50304, torch.bfloat16), (4096, 128256, torch.bfloat16), (16384, 32000, torch.bfloat16))
SHAPES += ((8192, 50304, torch.float32),)
# (threads per row, cache bytes per block)
LAUNCHES = ((1024, 200 * 1024), (1024, 110 * 1024), (512, 100 * 1024), (512, 56 * 1024), (256, 28 * 1024))
LAUNCHES += ((256, 0), (512, 0), (1024, 0))


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; us per forward + backward")
    params = {"IGNORE_INDEX": -100}
    chosen = ce.one_pass_shape
    for rows, cols, dtype in SHAPES:
        logits = (torch.randn(rows, cols, device="cuda") * 2).to(dtype)
        targets = torch.randint(0, cols, (rows,), device="cuda")
        factor = torch.full((1,), 1 / rows, dtype=torch.float64, device="cuda")
        copy_us = graph_us(lambda x=logits: x.clone(), n=5)
        line = f"{rows} x {cols} {str(dtype)[6:]}: copy {copy_us:.0f}"

        def two_pass(x=logits, t=targets, f=factor):
            _, lse = ce.cross_entropy_kernel([x, t], params=params)
            return ce.cross_entropy_backward_kernel([x, t, lse, f], params=params)

        us = graph_us(two_pass, n=5)
        line += f" | two-pass {us:.0f} ({100 * copy_us / us:.0f}%)"
        (ref,) = two_pass()
        for block, cache in LAUNCHES:
            ce.one_pass_shape = lambda cols, elem, shape=(block, cache): shape
            direct.plans_changed()
            _, _, grad = ce.cross_entropy_with_grad_kernel([logits, targets, factor], params=params)
            err = ((grad.double() - ref.double()).norm() / ref.double().norm()).item()
            if not err < 1e-3:  # bf16 roundings of a differently summed lse
                raise SystemExit(f"{block} threads, {cache} B: the gradient differs from the two-pass one ({err:.1e})")
            us = graph_us(
                lambda x=logits, t=targets, f=factor: ce.cross_entropy_with_grad_kernel([x, t, f], params=params), n=5
            )
            line += f" | {block}/{cache // 1024}K {us:.0f} ({100 * copy_us / us:.0f}%)"
        ce.one_pass_shape = chosen
        direct.plans_changed()
        print(line, flush=True)


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
