"""Day 013's column sums (`pytorch_custom_ops/column_sums.py`, days/day013/column_sums.mojo):
g.sum(0) of a bf16/fp16 CUDA matrix in two stages, a linear layer's bias gradient.

CPU: the partition of rows and columns among blocks, the plan's launches and workspace,
and a numpy emulation of the two stages on that partition. CUDA: against float64 (16-byte
and element loads, misaligned storage, odd sizes, float32 output), the same
bits on every call, the bias gradients of `gemm`, `linear` and `mlp` through it, CUDA
graphs, and clear errors.
"""

import importlib

import numpy as np
import pytest
import torch

import pytorch_custom_ops as pco

CS = importlib.import_module("pytorch_custom_ops.column_sums")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16, FP16 = torch.bfloat16, torch.float16


def rand(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) + 0.25).to(dtype).to(device)


# -- CPU: the partition and the plan ---------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 7, 8, 100, 4096, 4097, 16384, 100003])
@pytest.mark.parametrize("cols", [1, 8, 255, 256, 257, 768, 3072, 50304])
@pytest.mark.parametrize("vec", [1, 8])
def test_the_partition_covers_every_row_and_column_once(rows, cols, vec):
    col_blocks, parts, per_part = CS.partition(rows, cols, vec, 132)
    assert (col_blocks - 1) * 32 * vec < cols <= col_blocks * 32 * vec
    assert (parts - 1) * per_part < rows <= parts * per_part  # no empty part: each writes its row
    assert parts <= 65535 and col_blocks <= 2**31 - 1
    if rows >= 8 * CS.BLOCKS_PER_SM * 132:  # enough rows: about BLOCKS_PER_SM blocks per SM
        assert CS.BLOCKS_PER_SM * 132 // 2 < col_blocks * parts < CS.BLOCKS_PER_SM * 132 + 2 * col_blocks


def emulate(g: np.ndarray, vec: int) -> np.ndarray:
    """The two stages in float32, in the kernels' order: per part, each warp's two sums
    over steps of 8 rows (r, r + 8, ..., r + 56; rows 0-3 into one, 4-7 into the other),
    the leftover rows into the first, the warps in order; then the parts (compared with a
    tolerance: the second stage's order matters less)."""
    rows, cols = g.shape
    _col_blocks, parts, per_part = CS.partition(rows, cols, vec, 132)
    partials = np.zeros((parts, cols), np.float32)
    for p in range(parts):
        r0, r1 = p * per_part, min(rows, (p + 1) * per_part)
        total = np.zeros(cols, np.float32)
        for w in range(8):
            s0, s1 = np.zeros(cols, np.float32), np.zeros(cols, np.float32)
            r = r0 + w
            while r + 56 < r1:
                a = [g[r + 8 * u] for u in range(8)]
                s0 = s0 + ((a[0] + a[1]) + (a[2] + a[3]))
                s1 = s1 + ((a[4] + a[5]) + (a[6] + a[7]))
                r += 64
            while r < r1:
                s0 = s0 + g[r]
                r += 8
            total = total + (s0 + s1)
        partials[p] = total
    return partials.sum(0)


@pytest.mark.parametrize("rows,cols", [(4100, 40), (300, 264), (9, 3)])
def test_the_emulated_stages_sum_the_columns(rows, cols):
    g = rand((rows, cols), torch.float32).numpy()
    want = g.astype(np.float64).sum(0)
    got = emulate(g, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(rows))


def test_the_plan_launches_both_stages():
    from pytorch_custom_ops import direct
    from pytorch_custom_ops.layer_norm import LN_SUM_PARTIALS

    g = rand((4096, 1024), BF16)
    sums = torch.empty(1024, dtype=torch.float32)
    with direct.planning() as scratch:
        first, second = CS.column_sums_gpu([sums], [g], {})
    (ws,) = scratch
    col_blocks, parts, per_part = CS.partition(4096, 1024, 8, 132)
    assert (col_blocks, parts, per_part) == (4, 128, 32)
    assert ws.shape == (parts, 1024) and ws.dtype == torch.float32
    assert first.kernel.family is CS.COLUMN_PARTIALS_KERNEL and first.kernel.params == (BF16, 8)
    assert direct.dim3(first.grid) == (4, 128, 1) and direct.dim3(first.block) == (256, 1, 1)
    assert first.args == (ws.data_ptr(), g.data_ptr(), 4096, 1024, 1024, 32)
    assert second.kernel.family is LN_SUM_PARTIALS and second.kernel.params[:2] == (torch.float32, torch.float32)
    assert second.args[:6] == (sums.data_ptr(), 0, ws.data_ptr(), parts, 1024, 1024)


@pytest.mark.parametrize(
    "make,vec",
    [
        (lambda: rand((64, 1024), FP16), 8),
        (lambda: rand((64, 1030), BF16), 1),  # cols not a multiple of 8
        (lambda: rand((64 * 1024 + 1,), BF16)[1:].view(64, 1024), 1),  # 2 bytes into its storage
        (lambda: rand((64, 2048), BF16)[:, :768], 8),  # a wider row stride (the kernel's ld), 16-byte aligned
    ],
)
def test_the_plan_takes_element_loads_where_vectors_do_not_fit(make, vec):
    from pytorch_custom_ops import direct

    g = make()
    with direct.planning():
        first, _ = CS.column_sums_gpu([torch.empty(g.shape[1], dtype=g.dtype)], [g], {})
    assert first.kernel.params == (g.dtype, vec) and first.args[4] == g.stride(0)


def test_usable_names_what_the_kernels_serve():
    assert not CS.usable(rand((8, 8), BF16))  # a CPU tensor
    if torch.cuda.is_available():
        g = rand((64, 64), BF16, "cuda")
        assert CS.usable(g) and not CS.usable(g[:, :32]) and not CS.usable(g.float()) and not CS.usable(g[:0])
        assert not CS.usable(g.clone().requires_grad_())  # a double backward records a graph
        with torch.no_grad():
            assert CS.usable(g.clone().requires_grad_())
    with pytest.raises(ValueError, match="column_sums: g must be a contiguous 2-D bfloat16/float16 CUDA tensor"):
        CS.column_sums(rand((8, 8), BF16))


# -- CUDA ---------------------------------------------------------------------------------
def close(got, g, dtype):
    want = g.double().sum(0)
    scale = g.double().abs().sum(0) + 1
    assert got.dtype == dtype and got.shape == want.shape
    err = ((got.double() - want).abs() / scale).max().item()
    assert err < (1e-6 if dtype == torch.float32 else 4e-3), err


@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("float32", [False, True])
@pytest.mark.parametrize(
    "shape,offset",
    [
        ((4096, 1024), None),  # day 016's projection bias
        ((16384, 2304), None),  # GPT-2's QKV bias at 16384 tokens
        ((4097, 776), None),  # odd rows, columns not a multiple of 256
        ((5000, 1030), None),  # element loads
        ((4096, 1024), 1),  # contiguous, 2 bytes into its storage: element loads
        ((4096, 8), None),  # one block of columns, mostly outside
    ],
)
def test_cuda_column_sums_against_float64(shape, offset, dtype, float32, launched):
    g = rand(shape, dtype, "cuda", seed=shape[0])
    if offset is not None:
        g = torch.empty(g.numel() + offset, dtype=dtype, device="cuda")[offset:].view(shape).copy_(g)
    got = CS.column_sums(g, float32=float32)
    close(got, g, torch.float32 if float32 else dtype)
    assert any("column_partials_kernel" in k for k in launched) and any("sum_partials" in k for k in launched)
    assert all(torch.equal(got, CS.column_sums(g, float32=float32)) for _ in range(3))  # the same bits


@needs_cuda
def test_cuda_large_values_and_cancellation():
    g = rand((8192, 512), BF16, "cuda") * 1000
    g[4096:] = -g[:4096]  # the exact sum is 0 in every column
    got = CS.column_sums(g, float32=True)
    assert got.abs().max().item() < 1e-2 * g.abs().max().item()


@needs_cuda
def test_cuda_bias_gradients_of_the_layers_use_it(launched):
    """gemm's broadcast c, linear's and mlp's biases: rows >= GEMV_MIN_ROWS take the
    kernels, and their gradients match float64."""
    rows = importlib.import_module("pytorch_custom_ops.gemm").GEMV_MIN_ROWS
    x = rand((rows + 3, 256), BF16, "cuda").requires_grad_()
    w = (rand((384, 256), BF16, "cuda", seed=1) * 0.05).requires_grad_()
    b = rand((384,), BF16, "cuda", seed=2).requires_grad_()
    g = rand((rows + 3, 384), BF16, "cuda", seed=3)
    y = pco.linear(x, w, b)
    (db,) = torch.autograd.grad(y, b, g)
    close(db, g, BF16)
    assert any("column_partials_kernel" in k for k in launched)
    c = b.detach().clone().requires_grad_()
    out = pco.gemm(x.detach(), w.detach(), c, beta=1.0, transpose_b=True)
    (dc,) = torch.autograd.grad(out, c, g)
    close(dc, g, BF16)


@needs_cuda
def test_cuda_graph_replay():
    g = rand((8192, 768), BF16, "cuda")
    CS.column_sums(g)  # warm-up: the kernels load, the recipe is made
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = CS.column_sums(g)
    torch.cuda.current_stream().wait_stream(stream)
    g.copy_(rand((8192, 768), BF16, "cuda", seed=5))
    graph.replay()
    torch.cuda.synchronize()
    close(out, g, BF16)


@needs_cuda
def test_cuda_double_backward_through_a_bias_gradient_stays_differentiable():
    """create_graph=True: the bias gradient must itself have a gradient, so the column sum
    there is torch's (differentiable), not the op's."""
    rows = importlib.import_module("pytorch_custom_ops.gemm").GEMV_MIN_ROWS
    x = rand((rows, 64), BF16, "cuda")
    w = (rand((32, 64), BF16, "cuda", seed=1) * 0.05).requires_grad_()
    b = rand((32,), BF16, "cuda", seed=2).requires_grad_()
    g = rand((rows, 32), BF16, "cuda", seed=3).requires_grad_()
    y = pco.gemm(x, w, b, beta=1.0, transpose_b=True)
    (db,) = torch.autograd.grad(y, b, g, create_graph=True)
    close(db.detach(), g.detach(), BF16)
    (dg,) = torch.autograd.grad(db.float().sum(), g)  # d(sum of the column sums)/dg = 1
    assert torch.equal(dg, torch.ones_like(dg))
