"""Day 016, part eighteen: the layer norm's backward in one launch for a few rows
(`days/day016/layer_norm_bwd_one.mojo`).

On the CPU: the plan hands the kernel the right blocks and arguments (more in day 013's
plan tests). On the GPU: against float64 and against day 013's two kernels, for every
tier, element loads, ragged column blocks and the fused residual form; deterministic; one
launch per call.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco

LN = importlib.import_module("pytorch_custom_ops.layer_norm")  # pco.layer_norm is the function
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def test_plan_puts_the_column_blocks_first_and_sizes_their_shared_memory():
    rows, cols = 300, 1000  # 1000 bf16 = 125 vectors: 16 column blocks, the last with 5
    t = [torch.empty(s, dtype=torch.bfloat16) for s in ((rows, cols), (cols,), (cols,), (rows, cols), (rows, cols))]
    t += [torch.empty(s, dtype=torch.bfloat16) for s in [(cols,)]]
    t += [torch.empty(rows, dtype=torch.float32) for _ in range(2)]
    (one,) = LN._layer_norm_backward_gpu(t[:3], t[3:], {})
    # (bf16, bf16, f32, VEC 8, a warp a row, 6 vectors a lane, 12 rows a block)
    assert one.kernel is LN.LN_BWD_ONE[torch.bfloat16, torch.bfloat16, torch.float32, 8, 32, 6, 12]
    assert one.args[-1] == 16 and one.grid == 16 + 25 and one.block == 384
    assert one.smem == 384 * 8 * 2 * 4  # each thread's two 8-wide sums


def _backward(x, w, b, dy, layer_norm=pco.layer_norm):
    x, w, b = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    layer_norm(x, (x.shape[-1],), w, b).backward(dy)
    return x.grad, w.grad, b.grad


def _close(got, want, tol, what):
    scale = want.abs().max().item() + 1e-30
    gap = (got.double() - want).abs().max().item()
    assert gap <= tol * scale, f"{what}: {gap:.3g} > {tol:.1g} x {scale:.3g}"


# (rows, cols): every backward tier of day 013 (warp 6 and 8 vectors, 256 x 4, 512 x 4,
# 512 x 8), element loads (odd cols), ragged last column block, rows < workers, one row
SHAPES = [(1, 768), (64, 768), (333, 1001), (2048, 1024), (100, 4096), (7, 8200), (19, 16384), (5, 24)]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_cuda_one_launch_matches_float64_and_the_two_kernels(rows, cols, dtype, launched):
    if dtype != torch.float32 and cols == 16384:
        pytest.skip("16-bit rows of 16384 take the 512 x 8 tier like 8200")
    gen = torch.Generator().manual_seed(rows * 7 + cols)
    x = (torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 2 + 0.5).to("cuda", dtype)
    w = (torch.rand(cols, generator=gen, dtype=torch.float64) + 0.5).to("cuda", dtype)
    b = torch.randn(cols, generator=gen, dtype=torch.float64).to("cuda", dtype)
    dy = torch.randn(rows, cols, generator=gen, dtype=torch.float64).to("cuda", dtype)
    launched.clear()
    one = _backward(x, w, b, dy)
    assert any(".layer_norm_bwd_one_kernel." in k for k in launched), launched
    assert not any("sum_partials" in k for k in launched), launched
    assert all(torch.equal(a, c) for a, c in zip(one, _backward(x, w, b, dy), strict=True))  # deterministic
    with LN.ONE_LAUNCH_ROWS.set_to(0):  # day 013's two kernels
        two = _backward(x, w, b, dy)
    want = _backward(x.double(), w.double(), b.double(), dy.double(), F.layer_norm)
    for got, other, ref, name in zip(one, two, want, ("grad_x", "grad_weight", "grad_bias"), strict=True):
        assert got.dtype == dtype and got.shape == ref.shape
        _close(got, ref, TOL[dtype], f"{name} {rows}x{cols} {dtype}")
        _close(got, other.double(), TOL[dtype], f"{name} against the two kernels")
    assert torch.equal(one[0], two[0])  # grad_x: the same per-row code in both


@needs_cuda
def test_cuda_one_launch_fused_residual_form():
    """Day 020's add_layer_norm backward (grad_resid added, grad_x written again in bf16)
    through the one launch, against the two kernels and float64."""
    gen = torch.Generator().manual_seed(3)
    rows, cols = 96, 768
    x = torch.randn(rows, cols, generator=gen).cuda().requires_grad_(True)
    d = torch.randn(rows, cols, generator=gen).cuda().to(torch.bfloat16).requires_grad_(True)
    w = (torch.rand(cols, generator=gen) + 0.5).cuda().requires_grad_(True)
    b = torch.randn(cols, generator=gen).cuda().requires_grad_(True)
    gs, gy = torch.randn(rows, cols, generator=gen).cuda(), torch.randn(rows, cols, generator=gen).cuda()

    def grads():
        for t in (x, d, w, b):
            t.grad = None
        s, y = pco.add_layer_norm(x, d, (cols,), w, b)
        torch.autograd.backward([s, y], [gs, gy.to(y.dtype)])
        return [t.grad.clone() for t in (x, d, w, b)]

    one = grads()
    with LN.ONE_LAUNCH_ROWS.set_to(0):
        two = grads()
    for got, other in zip(one, two, strict=True):
        _close(got, other.double(), 1e-5 if got.dtype == torch.float32 else 1e-2, "fused form")
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@needs_cuda
def test_cuda_one_launch_under_graph_capture():
    """Nothing of the one launch lives between calls: a captured backward replays right."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 768, generator=gen).cuda().to(torch.bfloat16).requires_grad_(True)
    ln = pco.MojoLayerNorm(768).cuda().to(torch.bfloat16)
    dy = torch.randn(64, 768, generator=gen).cuda().to(torch.bfloat16)
    ln(x).backward(dy)
    want = [t.grad.clone() for t in (x, ln.weight, ln.bias)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for t in (x, ln.weight, ln.bias):
            t.grad = None
        ln(x).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in (x, ln.weight, ln.bias):
        t.grad = None
    with torch.cuda.graph(graph):
        ln(x).backward(dy)
    for _ in range(3):
        for t in (x, ln.weight, ln.bias):
            t.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(t.grad, r) for t, r in zip((x, ln.weight, ln.bias), want, strict=True))
