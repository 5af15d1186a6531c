"""Day 019, part 9: 3xTF32's parts, by kernel time on a GPU, next to the SIMT kernel and
torch.matmul (cuBLAS, IEEE float32): the data AUTO's float32 cost model is fitted to
(pytorch_custom_ops/gemm_gpu.py, `float_kernel` and `tf32x3_pays`).

    PYTHONPATH=$PWD python days/day019/time_tf32x3.py

For each problem (a GPT block's linear layers and attention products at the model
benchmark's shapes): the two split kernels (us, and their GB/s), the 3xTF32 GEMM (us, and
its float32 TFLOP/s), the SIMT kernel, cuBLAS, and AUTO's pick.
"""

from __future__ import annotations

import torch

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda
from benchmark.timing import kernel_time_ms
from pytorch_custom_ops import direct
from pytorch_custom_ops.gemm_gpu import float_kernel, gemm_gpu


def block_problems(tokens: int, d: int, seq: int, heads: int) -> list[tuple]:
    """(m, n, k, batch, ta, tb, what) of one block's forward and backward products."""
    batch, hd = (tokens // seq) * heads, d // heads
    out = []
    for d_in, d_out, name in ((d, 3 * d, "qkv"), (d, d, "proj"), (d, 4 * d, "fc"), (4 * d, d, "fc2")):
        out += [
            (tokens, d_out, d_in, 1, False, True, f"{name} y"),
            (tokens, d_in, d_out, 1, False, False, f"{name} dX"),
            (d_out, d_in, tokens, 1, True, False, f"{name} dW"),
        ]
    out += [
        (seq, seq, hd, batch, False, True, "Q K^T"),
        (seq, hd, seq, batch, False, False, "P V"),
        (seq, hd, seq, batch, True, False, "P^T dO"),
    ]
    return out


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for tokens, d, seq, heads in ((4096, 1024, 128, 16), (8192, 768, 1024, 12), (8192, 1024, 2048, 16)):
        print(f"-- tokens {tokens}, d {d}, seq {seq}, heads {heads}")
        for m, n, k, batch, ta, tb, what in block_problems(tokens, d, seq, heads):
            lead = (batch,) if batch > 1 else ()
            a = torch.randn(*lead, *((k, m) if ta else (m, k)), device="cuda")
            b = torch.randn(*lead, *((n, k) if tb else (k, n)), device="cuda")
            c, ab = torch.zeros((1,) * (len(lead) + 2), device="cuda"), torch.tensor([1.0, 0.0], device="cuda")
            out = torch.empty(*lead, m, n, device="cuda")
            params = {"TRANSPOSE_A": ta, "TRANSPOSE_B": tb}
            with pco.gemm_version("TF32X3_128x128"), direct.planning():
                launches = gemm_gpu([out], [a, b, c, ab], params)
                split = kernel_time_ms(lambda: direct.run(launches[:2], 0), 5) * 1e3  # noqa: B023
                gemm = kernel_time_ms(lambda: direct.run(launches[2:], 0), 5) * 1e3  # noqa: B023
            fn = pco.gemm_batched if batch > 1 else pco.gemm
            with pco.gemm_version("SIMT"):
                simt = kernel_time_ms(lambda: fn(a, b, transpose_a=ta, transpose_b=tb), 5) * 1e3  # noqa: B023
            pa, pb = (a.mT if ta else a), (b.mT if tb else b)
            cublas = kernel_time_ms(lambda: torch.matmul(pa, pb), 5) * 1e3  # noqa: B023
            gbps = 12 * (m + n) * k * batch / split / 1e3
            tflops = 2 * m * n * k * batch / gemm / 1e6
            kind, _ = float_kernel(m, n, k, batch, ta, tb, True, torch.float32, sms, n % 2 == 0)
            pick = "3xTF32" if kind == "tf32x3" else "SIMT"
            print(
                f"{what:7s} {m}x{n}x{k} b{batch} ta={int(ta)} tb={int(tb)}: split {split:7.1f} us ({gbps:5.0f} GB/s) "
                f"gemm {gemm:7.1f} us ({tflops:5.1f} TFLOP/s) = {split + gemm:7.1f} | SIMT {simt:7.1f} | "
                f"cuBLAS {cublas:7.1f} | AUTO {pick}"
            )


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
