"""GELU on the producer warpgroup's idle warps (EPI_WARPS, part 22) against GELU on the
consumers (the register epilogue, `gelu_on_consumers`), by kernel time, in one run.

    PYTHONPATH=$PWD python days/day019/time_gelu_warps.py [--rounds 3]

For each shape (tokens x in -> out, bf16) and each form of the fused GELU layer:
* inference: y = gelu(x W^T + b) alone (no grad), the benchmark's `linear_gelu` row;
* pre: the training forward, which also stores x W^T + b for the backward;
* derivative: day 020's MLP forward, which stores GELU's derivative there instead;

it prints the CUPTI kernel time (µs, median over the rounds; the impls take turns in each
round) of the fused layer both ways (`gelu_on_epilogue_warps`, `gelu_on_consumers`), of
the plain layer (x W^T + b, no GELU: the GEMM under it) and of torch's
F.gelu(F.linear(x, w, b)) eager and compiled (inference form).
Each fused output is checked against float64 first.

`--tokens 1024 2048` takes GPT-2's MLP layer at those token counts instead (fewer rounds of
tiles). `--backward` times the MLP backward's product instead (part 23): dpre = (g W2) *
gelu'(pre) with its column sums (fc's bias gradient), from the saved derivative on the
consumers (before part 23) and on the epilogue warps (AUTO since), and from the saved
pre-activation on the warps, next to the plain product g W2 and torch's mm +
gelu_backward + sum, eager and compiled. `--ncu` instead makes three calls at GPT-2's MLP
shape, for Nsight Compute: the plain layer, then the inference form with GELU on the
warps, then on the consumers (`ncu -k regex:pingpong ... python
days/day019/time_gelu_warps.py --ncu`); with `--backward`, the plain product and the
product's three forms.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from benchmark.gpu_script import need_cuda
from benchmark.harness import compiled
from benchmark.timing import kernel_time_ms
from pytorch_custom_ops.gemm_gpu import gelu_on_consumers, gelu_on_epilogue_warps
from pytorch_custom_ops.linear import _fused_forward

# GPT-2's MLP at 8192 and 16384 tokens, day 016's block (d = 1024) at 4096, and the other
# GPT-2 widths the benchmark's GELU rows take
SHAPES = ((8192, 768, 3072), (16384, 768, 3072), (4096, 1024, 4096), (8192, 768, 2304), (8192, 3072, 768))
FORMS = ("inference", "pre", "derivative")
GRAD_FORMS = ("derivative consumers", "derivative warps", "pre warps")


def torch_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def layer_inputs(m: int, k: int, n: int):
    """x (m, k), W (n, k) scaled by 1 / sqrt(k), b (n,): bf16, the same every run."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, w, b


def fused(x, w, b, form: str):
    if form == "inference":
        return _fused_forward(x, w, b, "gelu_tanh", None, save_pre=False)[0]
    return _fused_forward(x, w, b, "gelu_tanh", None, save_pre=True, derivative=form == "derivative")


def torch_gelu_grad(g, w2, pre):
    dpre = torch.ops.aten.gelu_backward(g @ w2, pre, approximate="tanh")
    return dpre, dpre.sum(0, dtype=torch.float32)


def grad_inputs(m: int, out: int, hidden: int):
    """g (m, out), W2 (out, hidden) as nn.Linear stores it, pre (m, hidden) ~ N(0, 1),
    and GELU's derivative at pre, rounded like the forward's."""
    g, w, _ = layer_inputs(m, out, hidden)
    w2 = w.t().contiguous()  # (out, hidden), scaled by 1 / sqrt(out)
    pre = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1))
    x = pre.double().requires_grad_()
    F.gelu(x, approximate="tanh").sum().backward()
    return g, w2, pre, x.grad.to(torch.bfloat16)


def on_consumers(op, args):
    with gelu_on_consumers():
        return op(args)


def on_warps(op, args):
    with gelu_on_epilogue_warps():
        return op(args)


def time_backward(shapes, rounds: int) -> None:
    from pytorch_custom_ops.gemm import _alpha_beta, gemm
    from pytorch_custom_ops.mlp import _gelu_grad_product_sums

    compiled_grad = compiled(torch_gelu_grad)
    op = _gelu_grad_product_sums[None]
    print(f"{torch.cuda.get_device_name()}; bf16; the MLP backward's product at tokens x out -> hidden")
    print(f"CUPTI kernel time (the product and the partial sums' kernel), us, median of {rounds} rounds")
    for m, k, n in shapes:
        g, w2, pre, d = grad_inputs(m, k, n)
        ab = _alpha_beta(1.0, 0.0, g.device)
        x = pre.double().requires_grad_()
        F.gelu(x, approximate="tanh").backward(g.double() @ w2.double())
        want, want_sums = x.grad, x.grad.sum(0)
        calls = {
            "torch": lambda g=g, w2=w2, pre=pre: torch_gelu_grad(g, w2, pre),
            "torch_compile": lambda g=g, w2=w2, pre=pre: compiled_grad(g, w2, pre),
            "plain": lambda g=g, w2=w2: gemm(g, w2),
            "derivative consumers": lambda g=g, w2=w2, d=d, ab=ab: on_consumers(op, [g, w2, d, ab]),
            "derivative warps": lambda g=g, w2=w2, d=d, ab=ab: on_warps(op, [g, w2, d, ab]),
            "pre warps": lambda g=g, w2=w2, pre=pre, ab=ab: op([g, w2, pre, ab], params={"FROM_PRE": True}),
        }
        for form in GRAD_FORMS:
            dpre, sums = calls[form]()
            err = ((dpre.double() - want).abs() / (want.abs() + 1)).max().item()
            gap = (sums.double() - want_sums).abs().max().item() / (want_sums.abs().max().item() + 1)
            assert err < 3e-2 and gap < 3e-2, f"{form} {m}x{k}->{n}: error {err}, sums {gap}"
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(rounds):
            for name, fn in calls.items():
                times[name].append(kernel_time_ms(fn, 20) * 1e3)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        row = f"{m}x{k}->{n}:" + "".join(f" | {name} {t:.1f}" for name, t in med.items())
        speedup = med["derivative consumers"] / med["derivative warps"]
        print(row + f" || derivative, warps vs consumers: {speedup:.3f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ncu", action="store_true", help="three calls to profile, no timing")
    parser.add_argument("--tokens", type=int, nargs="+", help="GPT-2's MLP layer (768 -> 3072) at these token counts")
    parser.add_argument("--backward", action="store_true", help="the MLP backward's product (part 23)")
    args = parser.parse_args()
    shapes = [(t, 768, 3072) for t in args.tokens] if args.tokens else SHAPES
    if args.backward and args.ncu:  # the plain product; from pre on the warps; from d on the warps, the consumers
        from pytorch_custom_ops.gemm import _alpha_beta, gemm
        from pytorch_custom_ops.mlp import _gelu_grad_product_sums

        g, w2, pre, d = grad_inputs(*SHAPES[0])
        ab = _alpha_beta(1.0, 0.0, g.device)
        gemm(g, w2)
        _gelu_grad_product_sums[None]([g, w2, pre, ab], params={"FROM_PRE": True})
        on_warps(_gelu_grad_product_sums[None], [g, w2, d, ab])
        on_consumers(_gelu_grad_product_sums[None], [g, w2, d, ab])
        torch.cuda.synchronize()
        return
    if args.backward:
        time_backward(shapes if args.tokens else [s for s in SHAPES if s[1] <= s[2]], args.rounds)
        return
    if args.ncu:
        x, w, b = layer_inputs(*SHAPES[0])
        _fused_forward(x, w, b, None, None, save_pre=False)
        with gelu_on_epilogue_warps():
            fused(x, w, b, "inference")
        with gelu_on_consumers():
            fused(x, w, b, "inference")
        torch.cuda.synchronize()
        return
    compiled_gelu = compiled(torch_gelu)
    print(f"{torch.cuda.get_device_name()}; bf16; CUPTI kernel time, us, median of {args.rounds} rounds")
    for m, k, n in shapes:
        x, w, b = layer_inputs(m, k, n)
        want = torch_gelu(x.double(), w.double(), b.double())
        calls = {
            "torch": lambda x=x, w=w, b=b: torch_gelu(x, w, b),
            "torch_compile": lambda x=x, w=w, b=b: compiled_gelu(x, w, b),
            "plain": lambda x=x, w=w, b=b: _fused_forward(x, w, b, None, None, save_pre=False)[0],
        }
        for form in FORMS:
            for where in ("warps", "consumers"):

                def call(x=x, w=w, b=b, form=form, where=where):
                    with gelu_on_consumers() if where == "consumers" else gelu_on_epilogue_warps():
                        return fused(x, w, b, form)

                out = call()
                y = out if form == "inference" else out[0]
                err = ((y.double() - want).abs() / (want.abs() + 1)).max().item()
                assert err < 3e-2, f"{form} {where} {m}x{k}->{n}: error {err}"
                calls[f"{form} {where}"] = call
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                times[name].append(kernel_time_ms(fn, 20) * 1e3)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        row = f"{m}x{k}->{n}:"
        for name, t in med.items():
            row += f" | {name} {t:.1f}"
        row += f" || inference speedup vs torch: warps {med['torch'] / med['inference warps']:.3f}x,"
        row += f" consumers {med['torch'] / med['inference consumers']:.3f}x"
        print(row, flush=True)


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
