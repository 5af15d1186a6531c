"""Kernel time of the weight and bias gradients of float32 master weights (day 020, part 6),
at GPT-2 124M's shapes (16384 tokens, bf16), CUDA-graph replays, microseconds:

    bf16 + cast   day 019's GEMM writes dW in bf16, then autograd's cast to float32 (before)
    float32 out   the same GEMM storing its float32 accumulator (master_weights.weight_grad)
    bf16 alone    the GEMM without the cast (what the cast adds on top)

and for the bias: cuBLAS's gemv in bf16 then a cast, torch.mm with a float32 out_dtype
(master_weights.bias_grad), and torch's sum(0, dtype=float32).

    python -m days.day020.time_master_grads
"""

from __future__ import annotations

import torch

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda
from pytorch_custom_ops.gemm import column_sum
from pytorch_custom_ops.master_weights import bias_grad, weight_grad

ROWS = 16384
# (out, in) of each weight: c_attn, c_proj, c_fc, c_mlp_proj, the output head (wte)
WEIGHTS = ((2304, 768), (768, 768), (3072, 768), (768, 3072), (50304, 768))


def graph_us(fn, n: int = 20, reps: int = 10) -> float:
    """Microseconds per call of `fn`, n calls captured in one CUDA graph, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (n * reps)


def main() -> None:
    bf16 = torch.bfloat16
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {ROWS} rows, bf16; us per call")
    print("out x in      bf16+cast  float32_out  bf16_alone")
    total = [0.0, 0.0]
    for out_f, in_f in WEIGHTS:
        g = torch.randn(ROWS, out_f, device="cuda").to(bf16)
        x = torch.randn(ROWS, in_f, device="cuda").to(bf16)
        want = g.double().t() @ x.double()
        err = ((weight_grad(g, x).double() - want).abs().max() / want.abs().max()).item()
        if err > 1e-4:
            raise SystemExit(f"weight_grad {out_f}x{in_f}: relative error {err:.2e}")
        t = [
            graph_us(lambda g=g, x=x: pco.gemm(g, x, transpose_a=True).float()),
            graph_us(lambda g=g, x=x: weight_grad(g, x)),
            graph_us(lambda g=g, x=x: pco.gemm(g, x, transpose_a=True)),
        ]
        total[0] += t[0] * (1 if out_f == 50304 else 12)
        total[1] += t[1] * (1 if out_f == 50304 else 12)
        print(f"{out_f:5d} x {in_f:4d} " + " ".join(f"{v:11.1f}" for v in t))
    print(f"a step's weights (12 layers + head): {total[0] / 1e3:.3f} ms -> {total[1] / 1e3:.3f} ms")
    print("width   gemv+cast  mm_out_f32  sum_f32")
    for width in (768, 2304, 3072):
        g = torch.randn(ROWS, width, device="cuda").to(bf16)
        want = g.double().sum(0)
        err = ((bias_grad(g).double() - want).abs().max() / want.abs().max()).item()
        if err > 1e-4:
            raise SystemExit(f"bias_grad {width}: relative error {err:.2e}")
        t = [
            graph_us(lambda g=g: column_sum(g).float()),
            graph_us(lambda g=g: bias_grad(g)),
            graph_us(lambda g=g: g.sum(0, dtype=torch.float32)),
        ]
        print(f"{width:5d} " + " ".join(f"{v:11.1f}" for v in t))


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
