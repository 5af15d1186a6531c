"""Split-K by the number of pieces, on the GPU: the kernel time (CUPTI) of every kernel a
weight-gradient GEMM launches, for the version 3/4 tiles, stream-K, and split-K forced to
S = 1 ... 132 / tiles pieces (the table in days/day019/README.md, part 3):

    python -m days.day019.split_k_by_pieces

Prints one line per variant: {kernel: microseconds per call}.
"""

import torch

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda
from benchmark.timing import kernel_times_us
from pytorch_custom_ops import gemm_gpu

SHAPES = [(768, 768, 8192), (768, 768, 16384), (768, 2304, 8192), (768, 3072, 8192)]  # dW: out x in, K


def kernel_us(fn) -> dict[str, float]:
    return {name[:60]: round(us, 2) for name, us in kernel_times_us(fn, reps=30).items()}


def forced_split(pieces: int):
    """gemm_gpu.split_k answering `pieces` (restored on exit)."""
    real = gemm_gpu.split_k

    class Forced:
        def __enter__(self):
            gemm_gpu.split_k = lambda *args: (pieces, 0.0)

        def __exit__(self, *exc):
            gemm_gpu.split_k = real

    return Forced()


def one_shape(m: int, n: int, k: int) -> None:
    x = torch.randn(k, m, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)

    def ours():
        return pco.gemm(x, dy, transpose_a=True)

    cublas = sum(kernel_us(lambda: torch.mm(x.t(), dy)).values())
    print(f"== dW {m}x{n} K={k}: cuBLAS {cublas:.1f} us")
    for version in ("TMA_128x128", "COOP_256x128", "STREAMK_256x128"):
        with pco.gemm_version(version):
            print(f"  {version:18s} {kernel_us(ours)}")
    tiles = -(-m // 256) * -(-n // 128)
    for pieces in range(1, gemm_gpu.sm_count(0) // tiles + 1):
        with forced_split(pieces), pco.gemm_version("SPLITK_256x128"):
            print(f"  split S={pieces:2d} grid {tiles * pieces:3d}: {kernel_us(ours)}")


def main() -> None:
    print(torch.cuda.get_device_name())
    for m, n, k in SHAPES:
        one_shape(m, n, k)


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
