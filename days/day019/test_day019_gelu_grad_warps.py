"""Day 019, part 23: the MLP backward's product dH * GELU' on the epilogue warps
(epilogue_warps.mojo's gelu_grad_tile), from the saved derivative (AUTO's form) or from
the saved pre-activation, whose derivative the warps compute.

CPU (CI): the warps' walk over a staged tile, emulated thread by thread: every element
of the tile is read from where the consumers staged it and stored once, and the
partial column sums' rows cover every output row once; the plan (the epilogue warps'
kernel, the workspace, the sum kernel, store_aux's bits; refusals); the rules that send
the derivative's product to the warps and would make the MLP's forward save pre.
CUDA: both forms against float64 with tails in m, n and K, and the MLP's every gradient
with the forward saving pre, and under AUTO at two rounds of tiles.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16, FP16 = torch.bfloat16, torch.float16
EPI_THREADS, BOX, CHUNK = 96, 64, 8  # epilogue_warps.mojo, tma_store.mojo; 16-bit values


def staged_at(row: int, col: int, bn: int) -> int:
    """Where the consumers stage element (row, col) of a BM x BN tile (stage_row_block
    through write_box_pairs): 64 x 64 boxes, row-major over the tile, each row's 16-byte
    chunk c at position c ^ (row % 8)."""
    box = (row // BOX) * (bn // BOX) + col // BOX
    r, chunk = row % BOX, (col % BOX) // CHUNK
    return box * BOX * BOX + r * BOX + (chunk ^ (r % 8)) * CHUNK + col % CHUNK


def staged_chunk(row: int, col_chunk: int, bn: int) -> int:
    """epilogue_warps.mojo's staged_chunk, step by step."""
    r, box_row = row % BOX, BOX * BOX * (bn // BOX)
    return (row // BOX) * box_row + (col_chunk // 8) * BOX * BOX + r * BOX + ((col_chunk % 8) ^ (r % 8)) * CHUNK


def walk(bm: int, bn: int, rows: int, cols: int):
    """gelu_grad_tile's (thread, row, column chunk) visits of a tile with `rows` x `cols`
    inside the matrix, the partial row (group) of each thread that stores one (threads
    past the last column store none), and the groups a tile has."""
    col_chunks = bn // CHUNK
    groups = EPI_THREADS // col_chunks
    visits, stores = [], {}
    for etid in range(EPI_THREADS):
        cc, group = etid % col_chunks, etid // col_chunks
        if cc * CHUNK >= cols:
            continue
        visits += [(etid, r, cc) for r in range(group, rows, groups)]
        stores[etid] = group
    return visits, stores, groups


@pytest.mark.parametrize("rows,cols", [(256, 128), (76, 128), (256, 8), (1, 64), (255, 120)])
def test_the_warps_read_each_staged_value_once_and_store_it_once(rows, cols):
    bm, bn = 256, 128
    visits, stores, groups = walk(bm, bn, rows, cols)
    seen = sorted((r, cc * CHUNK + i) for _, r, cc in visits for i in range(CHUNK))
    assert seen == [(r, c) for r in range(rows) for c in range(math.ceil(cols / CHUNK) * CHUNK)]
    for _, r, cc in visits:  # the chunk's offset is where its values were staged
        assert staged_chunk(r, cc, bn) == staged_at(r, cc * CHUNK, bn)
    # one partial row per group, each column chunk of it stored by one thread
    assert groups == 6 and sorted(set(stores.values())) == list(range(min(groups, EPI_THREADS)))
    chunks = sorted((g, etid % (bn // CHUNK)) for etid, g in stores.items())
    assert chunks == [(g, c) for g in range(groups) for c in range(math.ceil(cols / CHUNK))]


def test_the_staged_offsets_are_a_permutation_of_the_tile():
    bn = 128
    offsets = {staged_chunk(r, c, bn) for r in range(256) for c in range(bn // CHUNK)}
    assert offsets == set(range(0, 256 * bn, CHUNK))


def _plan(m, k, n, sums: bool, from_pre: bool = True, saved=None):
    from pytorch_custom_ops import direct
    from pytorch_custom_ops.mlp import gelu_grad_product_gpu

    g, w = torch.empty(m, k, dtype=BF16), torch.empty(k, n, dtype=BF16)
    saved = torch.empty(m, n, dtype=BF16) if saved is None else saved
    outs = [torch.empty(m, n, dtype=BF16)] + ([torch.empty(n, dtype=torch.float32)] if sums else [])
    with direct.planning() as scratch:
        launches = gelu_grad_product_gpu(outs, [g, w, saved, torch.empty(2)], {"FROM_PRE": from_pre})
    return launches, scratch, outs


def test_the_plan_takes_the_epilogue_warps_kernel_and_its_partial_rows():
    from pytorch_custom_ops.gemm_gpu import PP_EPI_WARPS, PP_TMA_STORE
    from pytorch_custom_ops.layer_norm import LN_SUM_PARTIALS, SUM_COLS, SUM_LANES

    m, k, n = 1100, 72, 392
    (gemm, total), (ws,), (out, sums) = _plan(m, k, n, sums=True)
    params = gemm.kernel.params
    assert params[1:5] == (False, False, 256, 128)  # neither transposed, the warps' tile
    assert params[7:10] == (False, False, True) and params[PP_TMA_STORE] and params[PP_EPI_WARPS]
    parts = math.ceil(m / 256) * 6  # six groups of the warps' rows a tile
    # store_aux: bit 0 asks for the sums, bit 1 says c is the pre-activation
    assert ws.shape == (parts, n) and gemm.args[9] == ws.data_ptr() and gemm.args[-1] == 3
    assert total.kernel is LN_SUM_PARTIALS[torch.float32, torch.float32, SUM_COLS, SUM_LANES]
    assert total.args == (sums.data_ptr(), 0, ws.data_ptr(), parts, n, n)
    # whatever version is forced, and without the sums
    with pco.gemm_version("PINGPONG_128x128"):
        (plain,), _, _ = _plan(m, k, n, sums=False)
    assert plain.kernel is gemm.kernel and plain.args[-1] == 2
    # the derivative's form keeps the consumers' kernel
    (consumers,), _, _ = _plan(m, k, n, sums=False, from_pre=False)
    assert not consumers.kernel.params[PP_EPI_WARPS]


def test_the_plan_refuses_a_pre_activation_the_warps_cannot_read():
    m, k, n = 300, 64, 136
    shifted = torch.empty(m * n + 1, dtype=BF16)[1:].view(m, n)  # 2 bytes off 16-byte alignment
    with pytest.raises(ValueError, match="GELU's gradient from its input runs on the epilogue warps only"):
        _plan(m, k, n, sums=True, saved=shifted)


def test_the_forward_saves_pre_where_the_backward_takes_the_warps(monkeypatch):
    from pytorch_custom_ops import gemm_gpu
    from pytorch_custom_ops.gemm_gpu import (
        EPI_WARPS_MAX_K,
        gelu_grad_on_epilogue_warps,
        gelu_on_consumers,
        gelu_on_epilogue_warps,
    )

    sms = 132  # a CPU plan's stand-in SM count (sm_count)
    m_two_rounds = 2 * sms // (3072 // 128) * 256  # 256-row tiles x 24 columns of tiles

    def rule(m=m_two_rounds, n=3072, k=768, dtype=BF16):
        return gelu_grad_on_epilogue_warps(m, n, k, dtype, None)

    assert not rule()  # AUTO: the forward saves the derivative (EPI_WARPS_GRAD_PRE)
    with gelu_on_epilogue_warps():
        assert rule() and rule(m=64, k=4096) and not rule(n=3068) and not rule(dtype=torch.float32)
    monkeypatch.setattr(gemm_gpu, "EPI_WARPS_GRAD_PRE", True)  # the rule AUTO would follow
    assert rule()
    assert not rule(m=m_two_rounds - 256)  # under two rounds of tiles
    assert not rule(k=EPI_WARPS_MAX_K + 8)  # a long K hides the consumers' epilogue
    assert not rule(dtype=torch.float32) and not rule(n=3068)
    with pco.gemm_version("COOP_TMA_256x128"):
        assert not rule()  # a forced version keeps its own tiles
    with gelu_on_consumers():
        assert not rule()


def test_the_derivatives_product_takes_the_warps_by_the_rule(monkeypatch):
    """The saved derivative (AUTO's form) is multiplied on the warps too, under the GELU
    layer's rule and EPI_WARPS_GRAD: store_aux's bit 0 asks for the sums, bit 1 (pre)
    stays clear. Under two rounds of tiles, or with EPI_WARPS_GRAD off, the consumers."""
    from pytorch_custom_ops import gemm_gpu
    from pytorch_custom_ops.gemm_gpu import PP_EPI_WARPS, gelu_on_epilogue_warps

    m, k, n = 2816, 768, 3072  # two rounds of 256 x 128 tiles on 132 SMs

    def plan():
        launches, scratch, _ = _plan(m, k, n, sums=True, from_pre=False)
        return launches[0], scratch[0]

    for way in ("forced", "auto"):
        with gelu_on_epilogue_warps() if way == "forced" else monkeypatch.context() as ctx:
            if way == "auto":
                ctx.setattr(gemm_gpu, "EPI_WARPS_GRAD", True)
            gemm, ws = plan()
        assert gemm.kernel.params[PP_EPI_WARPS] and gemm.kernel.params[7:10] == (False, False, True)
        assert gemm.args[-1] == 1 and ws.shape == (m // 256 * 6, n)
    with monkeypatch.context() as ctx:
        ctx.setattr(gemm_gpu, "EPI_WARPS_GRAD", False)
        gemm, ws = plan()
    assert not gemm.kernel.params[PP_EPI_WARPS] and ws.shape == (m // 128 * 4, n)
    m -= 256  # under two rounds
    gemm, _ = plan()
    assert not gemm.kernel.params[PP_EPI_WARPS]
    with gelu_on_epilogue_warps():  # a derivative the warps cannot read: the consumers
        shifted = torch.empty(m * n + 1, dtype=BF16)[1:].view(m, n)
        (gemm, _), _, _ = _plan(m, k, n, sums=True, from_pre=False, saved=shifted)
    assert not gemm.kernel.params[PP_EPI_WARPS]


# -- CUDA ---------------------------------------------------------------------------------
def _close(got, want, dtype):
    err = ((got.double() - want).abs() / (want.abs() + 1)).max().item()
    assert err < {BF16: 3e-2, FP16: 4e-3}[dtype], err


@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("sums_dtype", [None, torch.float32, "none"])
@pytest.mark.parametrize("saved", ["pre", "derivative"])
def test_cuda_gelu_grad_on_the_epilogue_warps(saved, dtype, sums_dtype, launched):
    """6000 x 136 @ 136 x 2056: 408 tiles of 256 x 128 (several per block: the mbarriers'
    phases turn over), tails in m, n and K. dpre against float64's gelu_backward, and its
    column sums (fc's bias gradient) in the op's dtype or float32; from the pre-activation
    (only the warps can), or from GELU's derivative with the warps forced."""
    from pytorch_custom_ops.gemm import _alpha_beta
    from pytorch_custom_ops.gemm_gpu import gelu_on_epilogue_warps
    from pytorch_custom_ops.mlp import _gelu_grad_product, _gelu_grad_product_sums

    gen = torch.Generator().manual_seed(23)
    m, k, n = 6000, 136, 2056
    g = torch.randn(m, k, generator=gen).to("cuda", dtype)
    w = (torch.randn(k, n, generator=gen) / math.sqrt(k)).to("cuda", dtype)
    pre = (2 * torch.randn(m, n, generator=gen)).to("cuda", dtype)
    x = pre.double().requires_grad_()
    F.gelu(x, approximate="tanh").backward(g.double() @ w.double())
    if saved == "pre":
        args, params = [g, w, pre, _alpha_beta(1.0, 0.0, g.device)], {"FROM_PRE": True}
    else:
        at = pre.double().requires_grad_()
        (derivative,) = torch.autograd.grad(F.gelu(at, approximate="tanh").sum(), at)
        args, params = [g, w, derivative.to(dtype), _alpha_beta(1.0, 0.0, g.device)], {}
    with gelu_on_epilogue_warps():
        if sums_dtype == "none":
            (dpre,) = _gelu_grad_product(args, params=params)
        else:
            dpre, sums = _gelu_grad_product_sums[sums_dtype](args, params=params)
    if sums_dtype != "none":
        assert sums.dtype == (sums_dtype or dtype)
        want_sums = x.grad.sum(0)
        gap = (sums.double() - want_sums).abs().max().item()
        assert gap < 3e-2 * (want_sums.abs().max().item() + 1), gap
    _close(dpre, x.grad, dtype)
    assert launched[0].split(".")[9:12] == ["0", "0", "1"] and launched[0].endswith(".1"), launched
    assert len(launched) == (1 if sums_dtype == "none" else 2), launched


@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_cuda_mlp_saves_pre_for_the_epilogue_warps(dtype, launched):
    """The MLP with the warps forced: its forward saves the pre-activation (aux 1, not the
    derivative) and its backward's product takes the warps; every gradient against
    float64, 2 x 300 rows, 72 -> 392 -> 40 (tails everywhere)."""
    from days.day020.test_day020_mlp import check, make
    from pytorch_custom_ops.gemm_gpu import gelu_on_epilogue_warps

    with gelu_on_epilogue_warps():
        check(make((2, 300), 72, 392, 40, dtype, "cuda", seed=5, bias=True), dtype)
    gemms = [k for k in launched if "gemm_pingpong_kernel" in k]
    grads = [k for k in gemms if k.split(".")[9:12] == ["0", "0", "1"]]
    assert len(grads) == 1 and grads[0].endswith(".1"), gemms  # GELU_GRAD on the warps


@needs_cuda
def test_cuda_mlp_at_two_rounds_of_tiles_follows_the_rule(launched):
    """AUTO at GPT-2's MLP width with two rounds of 256 x 128 tiles: the backward's product
    takes the warps only where EPI_WARPS_GRAD says (it does not: the consumers won), and
    every gradient matches float64 either way."""
    from days.day020.test_day020_mlp import check, make
    from pytorch_custom_ops.gemm_gpu import EPI_WARPS_GRAD, EPI_WARPS_MIN_ROUNDS, sm_count

    sms = sm_count(torch.cuda.current_device())
    m = math.ceil(EPI_WARPS_MIN_ROUNDS * sms / 24) * 256
    check(make((m,), 768, 3072, 768, BF16, "cuda", seed=3, bias=True), BF16)
    gemms = [k for k in launched if "gemm_pingpong_kernel" in k]
    grads = [k for k in gemms if k.split(".")[9:12] == ["0", "0", "1"]]
    assert len(grads) == 1 and grads[0].endswith(".1") == EPI_WARPS_GRAD, gemms
