"""GEMMs of a GPT-2 124M step, day 019's AUTO kernel(s) and cuBLAS's, for Nsight Compute.
Each runs twice; profile the second. The default pair is two forwards: bf16 16384 x 2304
x 768 (the QKV forward, K = 768: 82% of cuBLAS) and 16384 x 768 x 3072 (the MLP
projection's forward, K = 3072: 92%):

    M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__throughput.avg.pct_of_peak_sustained_elapsed,...
    ncu --clock-control none -k regex:"pingpong|nvjet|gemm" --launch-skip 4 --launch-count 4 \\
        --metrics $M --section WarpStateStats python days/day019/ncu_gemm.py

(the stored run and its metric list: results/nvidia-h100-80gb-hbm3/day019_ncu.txt).
`--weight-grads` takes the two weakest weight gradients instead, dW = X^T dY at 8192
tokens (768 x 768, split-K, 65% of cuBLAS; 2304 x 768, one round of tiles, 84%): a split call
is the split GEMM and the sum kernel (results/nvidia-h100-80gb-hbm3/day019_ncu_weight_grads.txt).
`--names` prints each call's kernels and their CUPTI times instead (no ncu needed);
`--versions` runs those forced versions of gemm_version instead of AUTO, in that order;
`--tokens T` sets the weight gradients' K (part 28's fixed cost: T = 64 is one k-step).
"""

import argparse

import torch

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda
from benchmark.timing import kernel_times_us

FORWARDS = ((16384, 2304, 768), (16384, 768, 3072))  # (tokens, out, in): y = x W^T
WEIGHT_GRADS = ((8192, 768, 768), (8192, 768, 2304))  # (tokens, in, out): dW = dY^T X, (out, in)


def forced(version: str, fn):
    def run():
        with pco.gemm_version(version):
            return fn()

    return run


def calls(weight_grads: bool, versions: list[str], tokens: int = 8192) -> list[tuple[str, object, object]]:
    """(label, ours, cuBLAS's) for each shape and version; the weight gradients at `tokens`."""
    out = []
    shapes = [(tokens, n, k) for _, n, k in WEIGHT_GRADS] if weight_grads else FORWARDS
    for m, n, k in shapes:
        if weight_grads:  # m tokens; dY (m, k) and X (m, n): dW (k, n), K = m
            dy = torch.randn(m, k, device="cuda").bfloat16()
            x = torch.randn(m, n, device="cuda").bfloat16()
            label = f"dW {k}x{n}, K={m}"
            ours, theirs = (lambda dy=dy, x=x: pco.gemm(dy, x, transpose_a=True)), (lambda dy=dy, x=x: dy.t() @ x)
        else:
            x = torch.randn(m, k, device="cuda").bfloat16()
            w = torch.randn(n, k, device="cuda").bfloat16()
            label = f"y {m}x{n}, K={k}"
            ours, theirs = (lambda x=x, w=w: pco.gemm(x, w, transpose_b=True)), (lambda x=x, w=w: x @ w.t())
        out.extend((f"{label} {v}", forced(v, ours), theirs) for v in versions)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weight-grads", action="store_true", help="the split-K weight gradients")
    parser.add_argument("--names", action="store_true", help="print each call's kernels (CUPTI), no ncu")
    parser.add_argument("--versions", nargs="+", default=["AUTO"], help="gemm_version names")
    parser.add_argument("--tokens", type=int, default=8192, help="the weight gradients' K")
    args = parser.parse_args()
    todo = calls(args.weight_grads, args.versions, args.tokens)
    if args.names:
        print(torch.cuda.get_device_name())
        for label, ours, cublas in todo:
            for who, fn in (("gpu-days", ours), ("cuBLAS", cublas)):
                times = kernel_times_us(fn, reps=30)
                print(f"{label} {who}: {sum(times.values()):.1f} us")
                for name, us in times.items():
                    print(f"    {us:7.2f}  {name[:110]}")
        return
    for _ in range(2):
        for _label, ours, cublas in todo:
            ours()
            cublas()
    torch.cuda.synchronize()


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
