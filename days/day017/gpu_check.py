"""One-command GPU check of day017: correctness on CUDA, then TFLOP/s against SDPA's backends.

    python -m days.day017.gpu_check            # ~1-2 minutes on an H100 (compiles, autotunes)
    python -m days.day017.gpu_check --quick    # correctness and one timed shape

1. Forward and backward (out, dq, dk, dv) of pco.flash_attention against the float64 reference
   of the benchmark case, for ragged shapes, GQA, causal and not, both 16-bit dtypes.
2. Forward, forward + backward and backward-alone TFLOP/s (triton.testing.do_bench: median, L2
   flushed) at batch x seq = 16384 tokens, heads x head_dim = 2048, bf16, for the Triton kernels
   and each SDPA backend, and the ratio to the fastest backend (the issue's goal: forward >= 1x,
   backward >= 0.8x at head_dim 128, seq >= 2048). Exits 1 if a correctness check fails.
"""

from __future__ import annotations

import argparse
import sys

import torch

import pytorch_custom_ops as pco
from benchmark.cases.day017 import ATTENTION, flops, reference

CHECKS = [  # (batch, q heads, kv heads, Lq, Lk, head_dim, dtype)
    (2, 16, 16, 1024, 1024, 128, torch.bfloat16),
    (1, 8, 2, 777, 1500, 64, torch.float16),
    (3, 4, 4, 2049, 2049, 128, torch.bfloat16),
    (1, 4, 1, 300, 200, 256, torch.bfloat16),
    (2, 4, 4, 500, 500, 32, torch.float16),
]
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}
BACKENDS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient")


def _qkv(b, hq, hkv, lq, lk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, hkv, lk, d, generator=g, device="cuda", dtype=dtype) for _ in range(2))
    do = torch.randn(b, hq, lq, d, generator=g, device="cuda", dtype=dtype)
    return q, k, v, do


def check(quick: bool) -> bool:
    from days.day017.flash_attention import attention_reference

    ok = True
    for b, hq, hkv, lq, lk, d, dtype in CHECKS[:2] if quick else CHECKS:
        for causal in (False, True):
            q, k, v, do = _qkv(b, hq, hkv, lq, lk, d, dtype)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = pco.flash_attention(*leaves, causal=causal)
            out.backward(do)
            got = (out, *(t.grad for t in leaves))
            if hq == hkv and lq == lk:
                want = reference(q, k, v, do, causal=causal)
            else:  # GQA or Lq != Lk: autograd through the materialized float64 softmax
                q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
                o64 = attention_reference(q64, k64, v64, causal)
                o64.backward(do.double())
                want = (o64.detach(), q64.grad, k64.grad, v64.grad)
            errs = []
            for g, w in zip(got, want, strict=True):
                errs.append((g.double() - w).abs().max().item() / max(w.abs().max().item(), 1e-3))
            good = all(e <= TOL[dtype] for e in errs)  # NaN fails too
            ok &= good
            name = f"{b}x{hq}/{hkv}x{lq}/{lk}x{d} {str(dtype)[6:]} {'causal' if causal else 'full  '}"
            print(f"{'ok  ' if good else 'FAIL'} {name:38s} max|err|/max|ref| out, dq, dk, dv: "
                  + ", ".join(f"{e:.1e}" for e in errs), flush=True)  # fmt: skip
    return ok


def _ms(fn) -> float | None:
    import triton.testing

    try:
        fn()
        return triton.testing.do_bench(fn, warmup=10, rep=40)
    except Exception as exc:  # a backend that cannot run this shape
        print(f"    ({type(exc).__name__}: {str(exc).splitlines()[0][:90]})")
        return None
    finally:
        torch.cuda.empty_cache()


def _rates(attn, inputs, causal: bool, shape) -> tuple[float | None, float | None, float | None]:
    """TFLOP/s of the forward, forward + backward, and backward alone (their difference)."""
    q, k, v, do = inputs
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    t_f = _ms(lambda: attn(q, k, v, causal))
    t_fb = _ms(lambda: torch.autograd.grad(attn(qg, kg, vg, causal), (qg, kg, vg), do))
    f_fwd, f_fb = flops(shape, causal, False), flops(shape, causal, True)
    fwd = f_fwd / t_f / 1e9 if t_f else None
    fb = f_fb / t_fb / 1e9 if t_fb else None
    bwd = (f_fb - f_fwd) / (t_fb - t_f) / 1e9 if t_f and t_fb and t_fb > t_f else None
    return fwd, fb, bwd


def bench(quick: bool) -> None:
    from days.day017.flash_attention import last_configs

    seqs = (4096,) if quick else (2048, 4096, 8192)
    print("\nTFLOP/s, bf16, batch x seq = 16384, heads x head_dim = 2048 (fwd, fwd+bwd, bwd alone)")
    for d in (128,) if quick else (128, 64):
        for causal in (False, True):
            for s in seqs:
                shape = (16384 // s, 2048 // d, s, d)
                q, k, v, do = _qkv(shape[0], shape[1], shape[1], s, s, d, torch.bfloat16)
                rates = {name: _rates(ATTENTION[name], (q, k, v, do), causal, shape) for name in ("triton", *BACKENDS)}
                best = [max((r[i] for n, r in rates.items() if n != "triton" and r[i]), default=None) for i in range(3)]
                label = f"d={d} {'causal' if causal else 'full'} seq={s} ({'x'.join(map(str, shape))})"
                print(label)
                for name, r in rates.items():
                    cells = "  ".join("    NA" if x is None else f"{x:6.1f}" for x in r)
                    print(f"  {name:15s} {cells}")
                ours = rates["triton"]
                ratios = ["NA" if not (o and bst) else f"{o / bst:.2f}x" for o, bst in zip(ours, best, strict=True)]
                print(
                    f"  triton / best SDPA backend: fwd {ratios[0]}, fwd+bwd {ratios[1]}, bwd {ratios[2]}", flush=True
                )
            picks = {k: (None if c is None else str(c)) for k, c in last_configs().items()}
            print(f"  autotuned (last shape): {picks}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check needs CUDA (the CPU tests run the kernels in the interpreter: pytest days/day017)")
        return 2
    import triton

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    ok = check(args.quick)
    bench(args.quick)
    print("\ncorrectness:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
