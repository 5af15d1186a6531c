"""Where one replayed call's host time goes, part by part (day 016, part four).

    python -m days.day016.replay_parts                        # the C++ replay
    GPU_DAYS_REPLAY=python python -m days.day016.replay_parts # the Python replay, for comparison

For softmax, layer_norm (y alone, and with mean and rstd), gemm and layer_norm_backward
on tiny inputs (the GPU idles: this is host time), in
microseconds per call: the public function; the op's call (`MojoOp`, after the public
function's checks); and the pieces of a Python replay: the recipe key, the outputs'
allocation, the launch loop, the C launch alone. With the C++ replay on, also the C++
call alone (key, allocation and launch in one call). Then the same for a module's forward
in grad mode, layer by layer, from `MojoLayerNorm(x)` down to the C++ node call, next to
`nn.LayerNorm`. CUDA only.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import pytorch_custom_ops as pco
from pytorch_custom_ops import mojo_op, replay
from pytorch_custom_ops.launcher import launcher
from pytorch_custom_ops.layer_norm import layer_norm_backward_kernel as ln_backward
from pytorch_custom_ops.layer_norm import layer_norm_kernel, layer_norm_y_kernel
from pytorch_custom_ops.mojo_op import device_constant
from pytorch_custom_ops.softmax_family import softmax_kernel


def per_call_us(fn, n: int = 300) -> float:
    """Median over 7 loops of n back-to-back calls, each loop synchronised at its end."""
    for _ in range(30):
        fn()
    loops = []
    for _ in range(7):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        loops.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(loops)


def cases():
    """name -> (public call, the op, its inputs)."""
    gemm_module = sys.modules["pytorch_custom_ops.gemm"]  # `pco.gemm` is the function
    ln_with_stats = sys.modules["pytorch_custom_ops.layer_norm"]._layer_norm_replayed
    x = torch.randn(8, 128, device="cuda")
    w, b = torch.randn(128, device="cuda"), torch.randn(128, device="cuda")
    eps = device_constant((1e-5,), torch.float32, x.device)
    a, bm = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    gemm_op = gemm_module._KERNELS[(False, False, False)]
    gemm_inputs = [a, bm, gemm_module._no_c(a.dtype, a.device, 2), gemm_module._alpha_beta(1.0, 0.0, a.device)]
    _, mean, rstd = torch.ops.gpu_days.layer_norm(x, [128], w, b, 1e-5)
    g = torch.randn_like(x)
    ln_bwd_inputs = [g, x, w, mean, rstd]
    return {
        "softmax 8x128": (lambda: pco.softmax(x, -1), softmax_kernel, [x]),
        "layer_norm 8x128": (lambda: pco.layer_norm(x, (128,), w, b), layer_norm_y_kernel, [x, w, b, eps]),
        # the same call as before part sixteen: mean and rstd made too (what grad mode replays)
        "ln with stats": (lambda: ln_with_stats(x, (128,), w, b, 1e-5)[0], layer_norm_kernel, [x, w, b, eps]),
        "gemm 64^3": (lambda: pco.gemm(a, bm), gemm_op, gemm_inputs),
        # two kernels (the launch column times the first) and four tensors: three outputs
        # and the partial sums' workspace
        "ln backward": (lambda: pco.layer_norm_backward(g, x, (128,), w, mean, rstd), ln_backward, ln_bwd_inputs),
    }


def parts(public, op, inputs) -> dict[str, float]:
    public()  # plans once: the recipe exists from here on
    key = mojo_op._call_key(inputs, (), None)
    recipe = op._recipes[key]

    def allocate():  # the outputs, and the plan's scratch tensors (layer_norm_backward's partial sums)
        return recipe.allocate(), recipe.make_scratch()

    outputs, scratch = allocate()
    step = recipe.steps[0]
    stream = torch._C._cuda_getCurrentRawStream(0)
    args = list(step.template)
    tensors = (*outputs, *inputs, *scratch)
    for pos, i in step.pointers:
        args[pos] = tensors[i].data_ptr()
    for pos, i, _spec, encoded in step.maps:
        args[pos] = encoded[tensors[i].data_ptr()]
    args, launch = tuple(args), launcher()
    found = {
        "public": per_call_us(public),
        "op": per_call_us(lambda: op(inputs)),
        "key": per_call_us(lambda: mojo_op._call_key(inputs, (), None)),
        "allocate": per_call_us(allocate),
        "python run": per_call_us(lambda: recipe.run(outputs, inputs)),
        "launch": per_call_us(
            lambda: launch(step.function, step.grid, step.block, step.smem, stream, step.cluster, step.letters, args)
        ),
    }
    module = replay.module()
    if op._book is not None and module is not None:
        found["c++ call"] = per_call_us(lambda: module.call(op._book, inputs, None, ()))
    return found


def grad_mode_parts() -> dict[str, float]:
    """MojoLayerNorm's forward in grad mode (8 x 128), layer by layer, and torch's."""
    layer_norm_module = sys.modules["pytorch_custom_ops.layer_norm"]
    mojo = pco.MojoLayerNorm(128, device="cuda")
    ref = torch.nn.LayerNorm(128, device="cuda")
    x = torch.randn(8, 128, device="cuda", requires_grad=True)
    args = (x, mojo.normalized_shape, mojo.weight, mojo.bias, mojo.eps)
    apply = layer_norm_module._layer_norm_autograd
    nodes = apply.nodes
    found = {"module": per_call_us(lambda: mojo(x))}  # the first calls record the programs and the node
    found["public"] = per_call_us(lambda: pco.layer_norm(*args))
    found["autograd apply"] = per_call_us(lambda: apply(*args))
    found["Nodes.call"] = per_call_us(lambda: nodes.call(args))
    tensors, params = layer_norm_module._layer_norm_replayed.split(*args)
    found["c++ node_call"] = per_call_us(lambda: nodes._call(nodes._book, tensors, params))
    with torch.no_grad():
        found["forward, no grad"] = per_call_us(lambda: layer_norm_module._layer_norm_replayed(*args))
        found["y alone, no grad"] = per_call_us(lambda: layer_norm_module._layer_norm_y_replayed(*args))
    found["torch module"] = per_call_us(lambda: ref(x))
    found["torch F.layer_norm"] = per_call_us(lambda: torch.nn.functional.layer_norm(x, (128,), ref.weight, ref.bias))
    with torch.no_grad():
        found["torch, no grad"] = per_call_us(lambda: torch.nn.functional.layer_norm(x, (128,), ref.weight, ref.bias))
    return found


def main() -> int:
    if not torch.cuda.is_available():
        print("replay_parts: needs a CUDA GPU", file=sys.stderr)
        return 1
    rows = {name: parts(*case) for name, case in cases().items()}
    x = torch.randn(8, 128, device="cuda")
    reference = per_call_us(lambda: torch.softmax(x, -1))  # the host's state: torch's own cost
    print(f"replay: {replay.replay_kind()}; torch.softmax 8x128: {reference:.1f} us per call")
    columns = list(next(iter(rows.values())))
    print(f"{'us per call':18s}" + "".join(f"{c:>12s}" for c in columns))
    for name, found in rows.items():
        print(f"{name:18s}" + "".join(f"{found.get(c, float('nan')):12.1f}" for c in columns))
    print("MojoLayerNorm(128) forward in grad mode, 8x128, us per call:")
    for part, us in grad_mode_parts().items():
        print(f"  {part:22s}{us:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
