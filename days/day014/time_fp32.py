"""Day 014's float32 GEMM against torch.matmul (cuBLAS, TF32 off), by kernel time, on a GPU:
the SIMT kernel (and its split-K for weight gradients), and 3xTF32 on tensor cores (day
019, part 9; AUTO's float32 choice since).

    PYTHONPATH=$PWD python days/day014/time_fp32.py [label]
    PYTHONPATH=$PWD python days/day014/time_fp32.py --pieces [label]

The shapes are day 014's squares and GPT-2 small's linear layers at 8192 tokens: forward
y = x W^T, dX = dY W and dW = dY^T X (the transposed-A rows, where split-K applies). Each
result is checked on sampled entries against float64 (day 014's `sampled_error`), then
timed by CUPTI (benchmark.timing.kernel_time_ms). 3xTF32's time includes its two split
kernels.

--pieces: the same layers' forward and dX at a few dozen tokens (few output tiles, a long
K), the SIMT kernel forced to each split S of K (`gemm_gpu.split_pieces`), next to AUTO
and torch: the sweep behind `simt_small_split`. Times include the sum kernel.
"""

from __future__ import annotations

import sys

import torch

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda
from benchmark.timing import kernel_time_ms
from days.day014.time_versions import SQUARES, sampled_error
from pytorch_custom_ops import gemm_gpu

SHAPES = SQUARES + [
    shape
    for d_in, d_out in ((768, 2304), (768, 768), (768, 3072), (3072, 768))
    for shape in ((8192, d_out, d_in, False, True), (8192, d_in, d_out, False, False), (d_out, d_in, 8192, True, False))
]


FEW_TOKENS = (64, 128, 256, 512, 1024)
PIECES = (1, 2, 3, 4, 6, 8, 12, 16, 24)


def sweep_pieces(label: str, dtype=torch.float32, version: str = "SIMT", auto_pieces=None, tolerance=1e-5) -> None:
    """Kernel time of GPT-2's linear layers (forward, dX) at a few tokens with K forced into
    each S of PIECES (`split_pieces`, under `version`), next to torch and AUTO, whose S
    `auto_pieces(m, n, k, tb, sms)` names (default: float32's `float_kernel`)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    print(f"{label}: {dtype}, kernel us per call; S = pieces of K (- where K does not split so)")
    sms = gemm_gpu.sm_count(0)
    fits = gemm_gpu.split_fits if dtype == torch.float32 else gemm_gpu.tma_split_fits
    print("shape                     torch   AUTO (its S) " + "".join(f"{'S=' + str(s):>7}" for s in PIECES))
    for tokens in FEW_TOKENS:
        for d_in, d_out in ((768, 2304), (768, 768), (768, 3072), (3072, 768)):
            for m, n, k, tb in ((tokens, d_out, d_in, True), (tokens, d_in, d_out, False)):
                a = torch.randn(m, k, device="cuda", dtype=dtype)
                b = torch.randn(*((n, k) if tb else (k, n)), device="cuda", dtype=dtype)
                pb = b.mT if tb else b
                row = [1e3 * kernel_time_ms(lambda: torch.matmul(a, pb), 5)]  # noqa: B023
                call = lambda: pco.gemm(a, b, transpose_b=tb)  # noqa: B023, E731
                row.append(1e3 * kernel_time_ms(call, 5))
                if auto_pieces is None:
                    kind, auto_s = gemm_gpu.float_kernel(m, n, k, 1, False, tb, True, dtype, sms, n % 2 == 0)
                    picked = "3xTF32" if kind == "tf32x3" else f"S={auto_s}"
                else:
                    picked = f"S={auto_pieces(m, n, k, tb, sms)}"
                for pieces in PIECES:
                    if not fits(k, pieces):
                        row.append(None)
                        continue
                    with pco.gemm_version(version), gemm_gpu.split_pieces(pieces):
                        error = sampled_error(call(), a, b, False, tb)
                        assert error < tolerance, (m, n, k, tb, pieces, error)
                        row.append(1e3 * kernel_time_ms(call, 5))
                cells = "".join(f"{t:7.1f}" if t is not None else f"{'-':>7}" for t in row)
                print(f"{f'{m}x{n}x{k} tb={int(tb)}':24}{cells[:14]} {picked:>7}{cells[14:]}")


def main() -> None:
    if "--pieces" in sys.argv:
        sys.argv.remove("--pieces")
        sweep_pieces(sys.argv[1] if len(sys.argv) > 1 else "fp32")
        return
    label = sys.argv[1] if len(sys.argv) > 1 else "fp32"
    torch.backends.cuda.matmul.allow_tf32 = False  # torch's float32 is IEEE float32
    torch.manual_seed(0)
    totals = {"torch": 0.0, "SIMT": 0.0, "AUTO": 0.0}
    for m, n, k, ta, tb in SHAPES:
        a = torch.randn(*((k, m) if ta else (m, k)), device="cuda")
        b = torch.randn(*((n, k) if tb else (k, n)), device="cuda")
        pa, pb = (a.mT if ta else a), (b.mT if tb else b)
        times = {"torch": kernel_time_ms(lambda: torch.matmul(pa, pb), 5)}  # noqa: B023 (called before the next shape)
        errors = []
        for version in ("SIMT", "AUTO"):
            with pco.gemm_version(version):
                errors.append(sampled_error(pco.gemm(a, b, transpose_a=ta, transpose_b=tb), a, b, ta, tb))
                times[version] = kernel_time_ms(lambda: pco.gemm(a, b, transpose_a=ta, transpose_b=tb), 5)  # noqa: B023
        if (m, n) != (8192, 8192):
            totals = {key: totals[key] + times[key] for key in totals}
        t, o, x = times["torch"], times["SIMT"], times["AUTO"]
        shape = f"{m}x{n}x{k} ta={int(ta)} tb={int(tb)}"
        print(
            f"{label} {shape}: torch {t:.3f} ms, SIMT {o:.3f} ({100 * t / o:.0f}%) err {errors[0]:.1e}, "
            f"3xTF32 {x:.3f} ({100 * t / x:.0f}%) err {errors[1]:.1e}"
        )
    t, o, x = totals["torch"], totals["SIMT"], totals["AUTO"]
    share = f"SIMT {o:.2f} ({100 * t / o:.0f}%) 3xTF32 {x:.2f} ({100 * t / x:.0f}%)"
    print(f"{label} total (no 8192^3): torch {t:.2f} {share}")


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
