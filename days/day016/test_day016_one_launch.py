"""Day 016, part eighteen: two ops in one launch (`days/day016/one_launch.mojo`): the layer
norm's backward for a few rows, and the long softmax where a row gets one block.

On the CPU: the plans hand the kernels the right blocks and arguments (more in day 013's
plan tests). On the GPU: the layer norm against float64 and against day 013's two kernels,
for every tier, element loads, ragged column blocks and the fused residual form,
deterministic, one launch a call; the softmax bit for bit against day 015's two launches.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco

LN = importlib.import_module("pytorch_custom_ops.layer_norm")  # pco.layer_norm is the function
LS = importlib.import_module("pytorch_custom_ops.long_softmax")
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def test_plan_puts_the_column_blocks_first_and_sizes_their_shared_memory():
    rows, cols = 300, 1000  # 1000 bf16 = 125 vectors: 16 column blocks, the last with 5
    # grad_x, grad_weight, grad_bias, grad_out, x, weight in bf16; mean and rstd in float32
    shapes = ((rows, cols), (cols,), (cols,), (rows, cols), (rows, cols), (cols,))
    t = [torch.empty(s, dtype=torch.bfloat16) for s in shapes] + [torch.empty(rows) for _ in range(2)]
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


# -- the long softmax with one block a row -----------------------------------------------
def _softmax_plan(rows, n, dtype=torch.float32, offset=0):
    x = torch.empty(rows * n + offset, dtype=dtype)[offset:].view(rows, n)
    y = torch.empty(rows, n, dtype=dtype)
    return x, y, LS._long_softmax_rows_gpu([y], [x], {"PIPELINE": "fused", "BLOCK": LS.BLOCK})


def test_plan_one_block_a_row_is_one_launch(monkeypatch):
    monkeypatch.setitem(LS._SM_COUNT, None, 132)  # the H100's: 528 blocks a wave
    for rows, n, dtype, offset, vec in [
        (1, 4096, torch.float32, 0, 4),  # one tile
        (7, 1001, torch.bfloat16, 0, 1),  # rows not 16-byte aligned: element loads
        (3, 4096, torch.float16, 1, 1),  # an offset view
        (600, 70000, torch.float32, 0, 4),  # more rows than a wave of blocks
        (2, 1, torch.float64, 0, 1),  # rows of one element: no 16-byte rows
    ]:
        x, y, launches = _softmax_plan(rows, n, dtype, offset)
        (one,) = launches
        assert one.kernel is LS.ONE_BLOCK_SOFTMAX_KERNEL[dtype, vec, LS.BLOCK], (rows, n)
        assert one.grid == rows and one.block == LS.BLOCK and one.smem == 0
        assert one.args == (y.data_ptr(), x.data_ptr(), n)
    for rows, n in [(1, 4097), (3, 70001), (527 // 2, 9000)]:  # two blocks a row or more: day 015's
        kernels = [launch.kernel.family for launch in _softmax_plan(rows, n)[2]]
        assert kernels == [LS.ONLINE_PARTIALS_KERNEL, LS.NORMALIZE_KERNEL], (rows, n)
    with LS.ONE_BLOCK.set_to(False):
        assert len(_softmax_plan(1, 4096)[2]) == 2
    x, y, _ = _softmax_plan(1, 4096)
    four = LS._long_softmax_rows_gpu([y], [x], {"PIPELINE": "four_stage", "BLOCK": LS.BLOCK})
    assert LS.ONE_BLOCK_SOFTMAX_KERNEL not in {launch.kernel.family for launch in four}


def test_plan_reaches_every_one_block_variant(monkeypatch):
    monkeypatch.setitem(LS._SM_COUNT, None, 132)
    picked = {_softmax_plan(3, 4096, d, offset)[2][0].kernel for d in LS.FLOAT_DTYPES for offset in (0, 1)}
    assert picked == set(LS.ONE_BLOCK_SOFTMAX_KERNEL.kernels())


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rows, n", [(1, 4096), (5, 1000), (3, 1), (1, 37), (600, 20000), (2, 4095)])
def test_cuda_one_block_softmax_is_the_two_launches_bit_for_bit(rows, n, dtype, launched):
    gen = torch.Generator().manual_seed(rows + n)
    x = (torch.randn(rows, n + 1, generator=gen, dtype=torch.float64) * 4).to("cuda", dtype)
    if n > 5:
        x[0, :5] = float("-inf")  # masked entries
    for view in (x[:, :n], x[:, 1:]):  # aligned rows, then an offset view (element loads)
        launched.clear()
        one = pco.long_softmax(view)
        assert [k.split(".")[1] for k in launched] == ["one_block_softmax_kernel"], launched
        with LS.ONE_BLOCK.set_to(False):
            two = pco.long_softmax(view)
        torch.testing.assert_close(one, two, rtol=0, atol=0)  # bit for bit
        want = torch.softmax(view.double(), -1)
        torch.testing.assert_close(one.double(), want, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-2)


@needs_cuda
def test_cuda_one_block_softmax_masked_row_is_nan_like_torch():
    x = torch.full((2, 300), float("-inf"), device="cuda")
    x[1] = torch.randn(300, device="cuda")
    y = pco.long_softmax(x)
    assert torch.isnan(y[0]).all()
    torch.testing.assert_close(y[1], torch.softmax(x[1], -1))
