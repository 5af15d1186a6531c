"""Day 020, part 6: float32 master weights under autocast get float32 gradients from the
kernels (`master_weights.py`): no cast kernel after the backward's GEMMs.

CPU: which parameters are kept as masters, and the plan of the float32 weight gradient
(its kernels: version 4's F32_OUT variants, or split-K with a float32 sum).
CUDA: weight_grad and bias_grad against float64 for every tile kind; linear, mlp and the
GPT under autocast hand float32 gradients to their float32 parameters, with no cast node
between them, and match float64.
"""

import math
import re

import pytest
import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco
from pytorch_custom_ops import master_weights as MW
from pytorch_custom_ops.gemm_gpu import SMALL_GRID, gemm_version
from pytorch_custom_ops.master_weights import (
    bias_grad,
    split_masters,
    wants_masters,
    weight_grad,
    weight_grad_gpu,
    weight_grad_tile,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16 = torch.bfloat16


# -- CPU ----------------------------------------------------------------------------------
def test_split_masters_keeps_float32_leaves_that_need_a_gradient():
    w = torch.randn(8, 4, requires_grad=True)
    frozen = torch.randn(8)
    low = torch.randn(8, dtype=BF16, requires_grad=True)
    (cw, cf, cl, none), masters = split_masters(BF16, w, frozen, low, None)
    assert masters == [w, None, None, None]
    assert cw.dtype == BF16 and cw.grad_fn is None and not cw.requires_grad  # made outside autograd
    assert torch.equal(cw, w.detach().to(BF16))
    assert cf.dtype == BF16 and cl is low and none is None
    x = torch.randn(2, 4, dtype=BF16)
    assert not wants_masters(x)  # the CPU composes the layers: casts stay inside autograd


def _plan(out_f: int, in_f: int, rows: int):
    grad = torch.empty(rows, out_f, dtype=BF16)
    x = torch.empty(rows, in_f, dtype=BF16)
    out = torch.empty(out_f, in_f, dtype=torch.float32)
    return weight_grad_gpu([out], [grad, x, torch.empty(2)], {})


@pytest.mark.parametrize(
    "out_f, in_f, kind",
    [
        (2304, 768, "split"),
        (768, 768, "split"),
        (3072, 768, "tma"),  # one round of 96 tiles of 192 x 128 (day 019, part 12)
        (768, 3072, "tma"),
        (50304, 768, "256.128"),
    ],
)
def test_gpt2_weight_gradients_plan_float32_kernels(out_f, in_f, kind):
    """GPT-2 124M's dW at 16384 rows: the tile AUTO picks, with a float32 store."""
    launches = _plan(out_f, in_f, 16384)
    keys = [launch.kernel.key for launch in launches]
    if kind == "tma":  # version 3: ...BM.BN.F32_OUT.STAGES.SMEM; TA = 1, TB = 0
        assert len(keys) == 1 and keys[0].startswith("day014.gemm_tma_kernel.bfloat16.1.0.192.128.1."), keys
        return
    # ping-pong keys end in ...CLUSTER.COOP.SPLIT.F32_OUT.TMA_STORE.C_BLOCKS.EPI_WARPS; TA = 1, TB = 0 (dH^T X
    # as stored)
    assert keys[0].startswith("day019.gemm_pingpong_kernel.bfloat16.1.0."), keys
    if kind == "split":
        assert keys[0].endswith(".1.1.2.0.0.0.0") and len(keys) == 2, keys
        assert keys[1] == "day019.split_k_sum_kernel.bfloat16.float32", keys
    else:
        assert f".{kind}." in keys[0] and keys[0].endswith(".1.1.0.1.0.0.0") and len(keys) == 1, keys


def test_weight_grad_never_picks_a_tile_without_a_float32_form():
    # a small problem, where AUTO would pick version 3's 128 x 128 for a bf16 output
    kind, bm, bn = weight_grad_tile(256, 256, 64, None)
    assert kind == "coop" and (bm, bn) in {(256, 128), (256, 192), (128, 192)}
    with gemm_version("PINGPONG_128x128"):  # no float32 form: AUTO's choice instead
        assert weight_grad_tile(256, 256, 64, None) == (kind, bm, bn)
    with gemm_version("COOP_128x192"):  # one with a float32 form: kept
        assert weight_grad_tile(256, 256, 64, None) == ("coop", 128, 192)
    with gemm_version("TMA_192x128"):  # version 3's three consumers have one too
        assert weight_grad_tile(256, 256, 64, None) == ("tma", 192, 128)
    with gemm_version("TMA_128x128"):  # ... its other tiles do not
        assert weight_grad_tile(256, 256, 64, None) == (kind, bm, bn)
    assert SMALL_GRID == 132  # (the plan's SM count on a machine without a GPU)


# -- CUDA ---------------------------------------------------------------------------------
def _rand(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to("cuda", BF16)


@needs_cuda
@pytest.mark.parametrize(
    "version",
    ["AUTO", "COOP_256x128", "COOP_256x192", "COOP_128x192", "SPLITK_256x128", "TMA_192x128", "CLUSTER_SPLITK_128x128"],
)
@pytest.mark.parametrize(
    "rows, out_f, in_f",
    [(1000, 72, 200), (3001, 392, 136), (16384, 768, 768), (4100, 3000, 776)],  # the last: AUTO's 192 x 128
)
def test_cuda_weight_grad_matches_float64(version, rows, out_f, in_f, launched):
    g, x = _rand(rows, out_f, seed=1), _rand(rows, in_f, seed=2)
    with gemm_version(version):
        dw = weight_grad(g, x)
    assert dw.dtype == torch.float32 and dw.shape == (out_f, in_f)
    want = g.double().t() @ x.double()
    # bf16 inputs are exact in float64: what is left is float32 accumulation (~2e-5 of the
    # largest value at 16384 rows), far below a bf16 output's rounding (4e-3)
    assert ((dw.double() - want).abs().max() / want.abs().max()).item() < 1e-4
    float32_v3 = launched[-1].startswith("day014.gemm_tma_kernel.bfloat16.1.0.192.128.1.")
    # ping-pong keys end in ...CLUSTER.COOP.SPLIT.F32_OUT...: cooperative, split-K's sum, or split-K in a cluster
    cluster_split = re.search(r"\.[234]\.0\.3\.1\.0\.0\.0$", launched[-1]) is not None
    ends = (".1.1.0.1.0.0.0", "split_k_sum_kernel.bfloat16.float32")
    assert float32_v3 or cluster_split or launched[-1].endswith(ends), launched
    if version == "CLUSTER_SPLITK_128x128":  # every problem here but the 168-tile one makes one round of clusters
        assert cluster_split == (out_f != 3000), launched
    if (version, out_f) in (("AUTO", 3000), ("TMA_192x128", out_f)):
        assert float32_v3, launched


@needs_cuda
@pytest.mark.parametrize("rows, width", [(1, 8), (1000, 72), (16384, 3072)])
def test_cuda_bias_grad_matches_float64(rows, width):
    g = _rand(rows, width, seed=3)
    db = bias_grad(g)
    assert db.dtype == torch.float32 and db.shape == (width,)
    want = g.double().sum(0)
    assert ((db.double() - want).abs().max() / (want.abs().max() + 1)).item() < 1e-5


def _no_cast_between(y: torch.Tensor, params) -> bool:
    """No ToCopyBackward node in y's graph leads to one of `params` (they get their
    gradients straight from the layer's backward)."""
    ids = {id(p) for p in params}
    seen, stack = set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if "ToCopy" in type(node).__name__ and type(nxt).__name__ == "AccumulateGrad":
                if id(nxt.variable) in ids:
                    return False
            stack.append(nxt)
    return True


def _check_grads(params, ref_params, scale_tol=3e-2):
    for p, r in zip(params, ref_params, strict=True):
        assert p.grad is not None and p.grad.dtype == torch.float32, p.shape
        scale = r.grad.abs().max().item() + 1
        assert (p.grad.double() - r.grad).abs().max().item() < scale_tol * scale, p.shape


@needs_cuda
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_cuda_linear_under_autocast_gives_float32_gradients_without_casts(activation, launched):
    x = _rand(3, 67, 200, seed=4).float().requires_grad_()
    w = (torch.randn(136, 200, generator=torch.Generator().manual_seed(5)) / math.sqrt(200)).cuda().requires_grad_()
    b = torch.randn(136, generator=torch.Generator().manual_seed(6)).cuda().requires_grad_()
    with torch.autocast("cuda", dtype=BF16):
        y = pco.linear(x, w, b, activation)
    assert y.dtype == BF16 and _no_cast_between(y, [w, b])
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).cuda()
    y.backward(gy.to(BF16))
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    want = F.linear(ref[0], ref[1], ref[2])
    want = want if activation is None else F.gelu(want, approximate="tanh")
    assert ((y.double() - want).abs() / (want.abs() + 1)).max().item() < 3e-2
    want.backward(gy.double())
    _check_grads([x, w, b], ref)
    assert any(k.endswith(".1.0.1.0.0.0") or k.endswith("bfloat16.float32") for k in launched), launched


@needs_cuda
def test_cuda_mlp_under_autocast_gives_float32_gradients_without_casts():
    m = pco.MojoMLP(96, 256, device="cuda")  # float32 parameters
    x = _rand(2, 75, 96, seed=8).float().requires_grad_()
    with torch.autocast("cuda", dtype=BF16):
        y = m(x)
    params = [m.fc.weight, m.fc.bias, m.proj.weight, m.proj.bias]
    assert _no_cast_between(y, params)
    y.float().pow(2).sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (x, *params)]
    want = F.linear(F.gelu(F.linear(ref[0], ref[1], ref[2]), approximate="tanh"), ref[3], ref[4])
    want.pow(2).sum().backward()
    _check_grads([x, *params], ref)


@needs_cuda
def test_cuda_frozen_and_low_precision_parameters_keep_the_usual_path():
    """Only float32 parameters that want a gradient become masters; the others are cast
    (or used) as before, and their gradients come back in their own dtypes."""
    x = _rand(64, 64, seed=9).float().requires_grad_()
    w16 = _rand(32, 64, seed=10).requires_grad_()
    frozen = torch.randn(32, device="cuda")
    with torch.autocast("cuda", dtype=BF16):
        pco.linear(x, w16, frozen).float().sum().backward()
    assert w16.grad.dtype == BF16 and x.grad.dtype == torch.float32 and frozen.grad is None


@needs_cuda
def test_cuda_double_backward_through_master_gradients():
    """create_graph=True: the float32 gradients are differentiable (the composition)."""
    x = _rand(16, 32, seed=11).float().requires_grad_()
    w = torch.randn(24, 32, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=BF16):
        y = pco.linear(x, w)
    (gw,) = torch.autograd.grad(y.float().pow(2).sum(), w, create_graph=True)
    assert gw.dtype == torch.float32 and gw.requires_grad
    (ggx,) = torch.autograd.grad(gw.sum(), x)
    assert ggx.shape == x.shape and torch.isfinite(ggx).all()


# -- gradients written where the caller keeps them (day 020, part 8) -------------------------------
def test_a_named_destination_is_checked_and_used_only_while_grad_is_none():
    w = torch.randn(8, 4, requires_grad=True)
    buffer = torch.zeros(64)
    with pytest.raises(ValueError, match="16-byte aligned"):
        MW.write_grads_into(w, buffer[1:33].view(8, 4))
    with pytest.raises(ValueError, match="shape"):
        MW.write_grads_into(w, buffer[:32])
    with pytest.raises(ValueError, match="float32"):
        MW.write_grads_into(w, torch.zeros(8, 4, dtype=torch.float64))
    view = buffer[32:].view(8, 4)
    MW.write_grads_into(w, view)
    into = MW.grad_destination(w)
    assert into is not view and into.data_ptr() == view.data_ptr() and into.shape == w.shape
    assert MW.grad_destination(torch.randn(8, 4, requires_grad=True)) is None  # none named
    assert MW.grad_destination(None) is None
    w.grad = view  # already there: a second backward adds into it, as usual
    assert MW.grad_destination(w) is None
    w.grad = None
    del view, into, buffer
    assert MW.grad_destination(w) is None  # the named slice is gone: nothing to write into


def test_weight_grad_into_a_destination_launches_there(monkeypatch):
    """The plan's output pointer is the destination (CPU: the launches are caught, not run);
    split-K's workspace is alive while its launches are enqueued."""
    runs = []
    monkeypatch.setattr(MW.direct, "run", lambda launches, index: runs.append(launches))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda t: 0)
    for rows, split in ((16384, True), (64, False)):
        grad, x = torch.empty(rows, 2304, dtype=BF16), torch.empty(rows, 768, dtype=BF16)
        into = torch.empty(2304, 768)
        assert MW.weight_grad(grad, x, into) is into
        launches = runs.pop()
        assert len(launches) == 1 + split
        # split-K: the kernel that sums the pieces writes the output; else the GEMM (after its four maps)
        assert (launches[1].args[0] if split else launches[0].args[4]) == into.data_ptr()
    with pytest.raises(ValueError, match="into is"):
        MW.weight_grad(grad, x, torch.empty(768, 2304))


@needs_cuda
def test_cuda_layers_write_master_gradients_into_named_slices():
    """linear and mlp under autocast write dW into the slices FlatGrads names; autograd
    adopts them as .grad (same memory, no copy), and the values are those of a run without."""
    from days.day020.model import CONFIGS, GPT
    from days.day020.step import FlatGrads

    config = CONFIGS["tiny"]
    idx = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(12)).cuda()
    plain, named = (GPT(config, "gpu_days").init_weights(0).cuda() for _ in range(2))
    flat = FlatGrads(list(named.parameters()), world=1, bucket_bytes=4096)
    flat.begin()
    for model in (plain, named):
        with torch.autocast("cuda", dtype=BF16):
            loss = model(idx, idx.roll(1, 1))[1]
        loss.backward()
    flat.finish()
    for (name, p), q in zip(named.named_parameters(), plain.parameters(), strict=True):
        assert p.grad.data_ptr() == flat.view(p).data_ptr(), name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    weights = [p for n, p in named.named_parameters() if n.endswith("weight") and p.dim() == 2 and "wpe" not in n]
    assert all(MW._destinations.get(id(p)) for p in weights)
