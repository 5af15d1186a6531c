"""Version 4's epilogue reading `c` in 16-byte blocks (C_BLOCKS, part 16) against 2-byte
loads (`gemm_gpu.c_in_pairs`, the same kernels otherwise), by kernel time on a GPU.

    PYTHONPATH=$PWD python days/day019/time_c_reads.py [--rounds 3]

Two users of a full c, bf16:
- the fused linear with a residual (`pco.linear(x, w, b, residual=r)`) at GPT-2's four
  shapes at 8192 tokens, next to torch's F.linear(x, w, b) + r and our linear without r;
- day 016's attention scores with the causal mask as c (`gemm_batched(q, k, mask, ...)`)
  at the block's shapes, next to torch.baddbmm and the product without the mask.
The two forms alternate in rounds; each output is checked against float64 (the scores
against baddbmm where finite) first.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda
from benchmark.timing import kernel_time_ms
from pytorch_custom_ops.gemm_gpu import c_in_pairs

LINEARS = ((8192, 768, 768), (8192, 3072, 768), (8192, 768, 3072), (8192, 768, 2304))  # tokens, in, out
BLOCKS = ((8, 1024, 768), (32, 128, 1024), (4, 2048, 1024), (8, 128, 768))  # day 016: batch, seq, d
REPS = 20


def linear_case(m: int, k: int, n: int):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    want = x.double() @ w.double().T + b.double() + r.double()
    return (
        f"linear {m}x{k}->{n} +residual",
        lambda: pco.linear(x, w, b, residual=r),
        lambda: F.linear(x, w, b) + r,
        lambda: pco.linear(x, w, b),
        want,
    )


def scores_case(batch: int, s: int, d: int):
    heads = batch * d // 64
    q, k = (torch.randn(heads, s, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.triu(torch.full((s, s), float("-inf"), device="cuda"), 1).unsqueeze(0).bfloat16()
    return (
        f"scores {batch}x{s}x{d} (b={heads}) +mask",
        lambda: pco.gemm_batched(q, k, mask, 0.125, 1.0, False, True),
        lambda: torch.baddbmm(mask, q, k.mT, alpha=0.125),
        lambda: pco.gemm_batched(q, k, None, 0.125, 0.0, False, True),
        0.125 * q.double() @ k.double().mT + mask.double(),
    )


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite):
        raise SystemExit(f"{name}: masked entries differ")
    err = ((got.double() - want)[finite].abs() / (want[finite].abs() + 1)).max().item()
    if not err < 2e-2:
        raise SystemExit(f"{name}: relative error {err} against float64")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; kernel time (CUPTI), us, bf16")
    for case in [linear_case(*s) for s in LINEARS] + [scores_case(*s) for s in BLOCKS]:
        name, ours, torch_form, without_c, want = case
        forms = {"blocks": contextlib.nullcontext, "pairs": c_in_pairs}
        for form in forms.values():
            with form():
                check(name, ours(), want)
        times: dict[str, list[float]] = {key: [] for key in ("torch", "blocks", "pairs", "no_c")}
        for _ in range(rounds):
            times["torch"].append(kernel_time_ms(torch_form, REPS) * 1e3)
            times["no_c"].append(kernel_time_ms(without_c, REPS) * 1e3)
            for key, form in forms.items():
                with form():
                    times[key].append(kernel_time_ms(ours, REPS) * 1e3)
        best = {key: min(v) for key, v in times.items()}
        cells = " | ".join(f"{key} " + "/".join(f"{t:.1f}" for t in v) for key, v in times.items())
        print(
            f"{name}: {cells} | best: blocks {best['blocks']:.1f} ({best['torch'] / best['blocks']:.2f}x torch),"
            f" pairs {best['pairs']:.1f} ({best['torch'] / best['pairs']:.2f}x); c costs"
            f" {best['blocks'] - best['no_c']:.1f} (pairs {best['pairs'] - best['no_c']:.1f})",
            flush=True,
        )


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
