"""Day 018's forward on a GPU: the Mojo kernel against day 017's Triton kernel and SDPA's
flash and cuDNN backends, bf16, TFLOP/s by kernel time (CUPTI, benchmark.timing).

    PYTHONPATH=$PWD python days/day018/time_versions.py [--quick]

Shapes as in the benchmark (batch x seq = 16384, heads x head_dim = 2048). Each impl is
first checked against SDPA's math in float32 on one (batch, head) slice. `mojo_v1`,
`mojo_v2`, ... are the ladder's rungs (pytorch_custom_ops.attention_gpu.attention_version). The
stored rows come from `python -m benchmark --day day018`; this is the quick look while a
kernel changes.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco
from benchmark.cases.day017 import IMPLS_FOR_TIMING, flops, shapes_for
from benchmark.timing import kernel_time_ms
from pytorch_custom_ops.attention_gpu import DEFAULT_VERSION, VERSIONS, attention_version


def _mojo(version):
    def run(q, k, v, causal):
        with attention_version(version):
            return pco.attention(q, k, v, causal=causal)

    return run


IMPLS = {f"mojo_v{v}": _mojo(v) for v in VERSIONS} | IMPLS_FOR_TIMING


def check(fn, q, k, v, causal) -> float:
    out = fn(q, k, v, causal)[:1, :1].float()
    ref = F.scaled_dot_product_attention(q[:1, :1].float(), k[:1, :1].float(), v[:1, :1].float(), is_causal=causal)
    return (out - ref).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="seq 1024 and 8192 only")
    parser.add_argument("--backward", action="store_true", help="forward + backward (3.5x the forward's FLOPs)")
    args = parser.parse_args()
    if args.backward:
        return time_backward(args.quick)
    print(f"{torch.cuda.get_device_name()}; bf16 forward; TFLOP/s by kernel time (max |err| vs fp32)")
    print(f"{'d':>4} {'causal':>6} {'seq':>6} " + " ".join(f"{n:>18}" for n in IMPLS))
    for d in (128, 64):
        for causal in (False, True):
            for shape in shapes_for(d):
                if args.quick and shape[2] not in (1024, 8192):
                    continue
                q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                cells = []
                for fn in IMPLS.values():
                    err = check(fn, q, k, v, causal)
                    ms = kernel_time_ms(lambda fn=fn, q=q, k=k, v=v, c=causal: fn(q, k, v, c))
                    cells.append(f"{flops(shape, causal, False) / ms / 1e9:8.1f} ({err:.0e})")
                print(f"{d:>4} {causal!s:>6} {shape[2]:>6} " + " ".join(f"{c:>18}" for c in cells))


def time_backward(quick: bool) -> None:
    impls = {"mojo": IMPLS[f"mojo_v{DEFAULT_VERSION}"], **IMPLS_FOR_TIMING}
    print(f"{torch.cuda.get_device_name()}; bf16 forward + backward; TFLOP/s by kernel time (max |dq err| vs fp32)")
    print(f"{'d':>4} {'causal':>6} {'seq':>6} " + " ".join(f"{n:>18}" for n in impls))
    for d in (128, 64):
        for causal in (False, True):
            for shape in shapes_for(d):
                if quick and shape[2] not in (1024, 8192):
                    continue
                q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                ref = F.scaled_dot_product_attention(
                    q[:1, :1].float(), k[:1, :1].float(), v[:1, :1].float(), is_causal=causal
                )
                (want,) = torch.autograd.grad(ref, q, do[:1, :1].float())
                cells = []
                for fn in impls.values():

                    def step(fn=fn, q=q, k=k, v=v, do=do, c=causal):
                        return torch.autograd.grad(fn(q, k, v, c), (q, k, v), do)

                    err = (step()[0][:1, :1].float() - want[0, 0]).abs().max().item()
                    ms = kernel_time_ms(step)
                    cells.append(f"{flops(shape, causal, True) / ms / 1e9:8.1f} ({err:.0e})")
                print(f"{d:>4} {causal!s:>6} {shape[2]:>6} " + " ".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
