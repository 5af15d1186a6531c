"""Host cost of the heads' copies, and the eager GPT block with each: gpu-days' build with
`pco.permute_copy` against the same build with torch's `.permute(...).contiguous()`.

    PYTHONPATH=$PWD python days/day016/time_permute_host.py

Host us per call: a back-to-back loop on a tiny tensor (the GPU idles), without and with
a gradient. The block rows: one train step from an idle GPU (benchmark.timing's
idle_start), both builds interleaved, median ms.
"""

from __future__ import annotations

import dataclasses

import torch

import pytorch_custom_ops as pco
from benchmark import gpt_block as G
from benchmark.gpu_script import need_cuda
from benchmark.timing import host_overhead_us, time_cuda

SHAPES = ((1, 64, 768), (8, 128, 768), (32, 128, 1024), (8, 1024, 768))


def torch_permute(x, dims):
    return x.permute(dims).contiguous()


def main() -> None:
    print(torch.cuda.get_device_name())
    x = torch.randn(1, 8, 3, 2, 64, device="cuda").bfloat16()
    xg = x.clone().requires_grad_()
    dims = (2, 0, 3, 1, 4)
    for name, fn in (("torch .permute().contiguous()", torch_permute), ("pco.permute_copy", pco.permute_copy)):
        plain = host_overhead_us(lambda fn=fn: fn(x, dims), 2000)
        grad = host_overhead_us(lambda fn=fn: fn(xg, dims), 2000)
        print(f"host us per call, {name:30s}: {plain:5.1f} without grad, {grad:5.1f} with grad")
    with_torch = dataclasses.replace(G.GPU_DAYS, name="gpu_days_torch_copies", permute=torch_permute)
    for shape in SHAPES:
        dtype, d = torch.bfloat16, shape[-1]
        x = G.make_input(shape, dtype, "cuda")
        mask = G.causal_mask(shape[1], dtype, "cuda")
        steps = {}
        for label, ops in (("permute_copy", G.GPU_DAYS), ("torch copies", with_torch)):
            block = G.make_block(d, ops, dtype, "cuda")
            params = list(block.parameters())
            xs = x.detach().clone().requires_grad_()
            steps[label] = lambda b=block, xs=xs, p=params, m=mask: G.train_step(b, xs, m, p)
        times = time_cuda(steps, min_reps=20, budget_s=2.0, idle_start=True)
        cells = " | ".join(f"{label} {t.median_ms:.3f} ms" for label, t in times.items())
        print(f"{'x'.join(map(str, shape))} bf16 train step, eager: {cells}", flush=True)


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
