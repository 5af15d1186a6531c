"""Day 020, part 5: GPT-2's MLP as one function (`pco.mlp`, `MojoMLP`) against float64 torch.

CPU: the composed path (two linear layers and torch's GELU), every gradient, bad inputs.
CUDA: the fused path's four launches (bias + GELU with the pre-activation saved, bias; the
backward's GELU_GRAD product), every gradient, autocast, CUDA-graph replay, and the
shapes it hands back to the composition.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16, FP16 = torch.bfloat16, torch.float16


def reference(x, w1, b1, w2, b2):
    d = [None if t is None else t.double() for t in (x, w1, b1, w2, b2)]
    return F.linear(F.gelu(F.linear(d[0], d[1], d[2]), approximate="tanh"), d[3], d[4])


def make(lead, d_in, hidden, d_out, dtype, device, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d_in, generator=g)
    w1 = torch.randn(hidden, d_in, generator=g) / math.sqrt(d_in)
    b1 = torch.randn(hidden, generator=g) if bias else None
    w2 = torch.randn(d_out, hidden, generator=g) / math.sqrt(hidden)
    b2 = torch.randn(d_out, generator=g) if bias else None
    return [None if t is None else t.to(device=device, dtype=dtype) for t in (x, w1, b1, w2, b2)]


def tolerance(dtype):
    return {torch.float64: 1e-10, torch.float32: 1e-4, BF16: 3e-2, FP16: 4e-3}[dtype]


def check(leaves, dtype, launch=pco.mlp):
    """Forward and every gradient of `launch` against the float64 composition."""
    ours = [None if t is None else t.detach().requires_grad_() for t in leaves]
    ref = [None if t is None else t.detach().double().requires_grad_() for t in leaves]
    y = launch(*ours)
    want = reference(*ref)
    assert y.shape == want.shape and y.dtype == dtype
    err = ((y.double() - want).abs() / (want.abs() + 1)).max().item()
    assert err < tolerance(dtype), err
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(y.device)
    y.backward(g.to(dtype))
    want.backward(g)
    for name, a, b in zip(("x", "fc_weight", "fc_bias", "proj_weight", "proj_bias"), ours, ref, strict=True):
        if a is None:
            continue
        scale = b.grad.abs().max().item() + 1
        gap = (a.grad.double() - b.grad).abs().max().item()
        assert gap < 4 * tolerance(dtype) * scale, (name, gap, scale)


# -- CPU --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_cpu_matches_float64_with_every_gradient(dtype, bias):
    check(make((3, 7), 24, 52, 20, dtype, "cpu", bias=bias), dtype)


def test_cpu_gradcheck():
    leaves = [t.requires_grad_() for t in make((5,), 6, 10, 4, torch.float64, "cpu")]
    assert torch.autograd.gradcheck(pco.mlp, leaves)


def test_module_holds_two_linear_layers_and_matches_the_function():
    torch.manual_seed(0)
    m = pco.MojoMLP(16, 40, 12).double()
    assert [n for n, _ in m.named_parameters()] == ["fc.weight", "fc.bias", "proj.weight", "proj.bias"]
    assert m.fc.weight.shape == (40, 16) and m.proj.weight.shape == (12, 40)
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    torch.testing.assert_close(m(x), reference(x, m.fc.weight, m.fc.bias, m.proj.weight, m.proj.bias))
    assert pco.MojoMLP(8, 32).proj.weight.shape == (8, 32)  # out_features defaults to in_features


def test_bad_inputs_raise_clear_errors():
    x, w1, b1, w2, b2 = make((4,), 8, 16, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="proj_weight must be"):
        pco.mlp(x, w1, b1, w2[:, :8], b2)
    with pytest.raises(ValueError, match="does not end in in_features"):
        pco.mlp(x[:, :4], w1, b1, w2, b2)
    with pytest.raises(ValueError, match=r"second layer \(proj_weight, proj_bias\): linear: bias must have shape"):
        pco.mlp(x, w1, b1, w2, b2[:3])
    with pytest.raises(ValueError, match=r"first layer \(fc_weight, fc_bias\): linear: bias must have shape"):
        pco.mlp(x, w1, b1[:3], w2, b2)
    with pytest.raises(TypeError, match=r"first layer .*'weight' must be a torch.Tensor"):
        pco.mlp(x, None, b1, w2, b2)
    with pytest.raises(TypeError, match="'weight' is torch.float64"):
        pco.mlp(x, w1, b1, w2.double(), b2)
    with pytest.raises(TypeError, match="'proj_weight' must be a torch.Tensor"):
        pco.mlp(x, w1, b1, "w2", b2)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        pco.mlp(x.tolist(), w1, b1, w2, b2)


# -- CUDA: the fused path -----------------------------------------------------------------
def _epilogue(key: str) -> tuple[str, ...]:
    """(BIAS, GELU, GELU_GRAD) of a ping-pong kernel key: day019.gemm_pingpong_kernel., then
    dtype, TA, TB, BM, BN, STAGES, SMEM, then these."""
    return tuple(key.split(".")[9:12])


def _tma_store(key: str) -> bool:
    """Whether a ping-pong kernel key has TMA_STORE compiled in (its flag PP_TMA_STORE)."""
    from pytorch_custom_ops.gemm_gpu import PP_TMA_STORE

    return key.split(".")[2 + PP_TMA_STORE] == "1"


@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("bias", [True, False])
def test_cuda_fused_mlp_with_every_gradient(dtype, bias, launched):
    # 2 x 67 rows (tile tails in m), 72 -> 200 -> 40: tails in n and k as well
    check(make((2, 67), 72, 200, 40, dtype, "cuda", seed=1, bias=bias), dtype)
    gemms = [k for k in launched if "gemm_pingpong_kernel" in k]
    b = str(int(bias))
    # forward: bias + GELU saving pre (the projection, b2 as c, may take another version at
    # this size); backward: one GELU_GRAD product, no other fused epilogue
    epilogues = [_epilogue(k) for k in gemms]
    assert epilogues[0] == (b, "1", "0"), gemms
    assert epilogues.count(("0", "0", "1")) == 1 and epilogues.count(("0", "0", "0")) == len(gemms) - 2, gemms
    assert not any("gelu" in k.lower() and "pingpong" not in k for k in launched), launched


@needs_cuda
@pytest.mark.parametrize("version", ["COOP_TMA_256x128", "COOP_TMA_128x256", "PINGPONG_TMA_128x128"])
def test_cuda_fused_mlp_through_tma_stores(version, launched):
    """Day 019's epilogue through shared memory and TMA stores under the MLP: GELU's output
    and derivative (two boxes per piece) forward, GELU_GRAD's product backward."""
    with pco.gemm_version(version):
        check(make((3, 97), 136, 392, 72, BF16, "cuda", seed=4, bias=True), BF16)
    gemms = [k for k in launched if "gemm_pingpong_kernel" in k]
    assert gemms and all(_tma_store(k) for k in gemms), gemms
    assert ("1", "1", "0") in [_epilogue(k) for k in gemms] and ("0", "0", "1") in [_epilogue(k) for k in gemms]
    # fc's bias gradient came from the product's epilogue: its partial sums, then their sum
    after = launched[next(i for i, k in enumerate(launched) if _epilogue(k) == ("0", "0", "1")) + 1]
    assert "sum_partials_kernel" in after, launched


@needs_cuda
@pytest.mark.parametrize("version", ["COOP_TMA_256x128", "COOP_TMA_128x256", "PINGPONG_TMA_128x128"])
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("float32_sums", [False, True])
def test_cuda_gelu_grad_product_also_sums_its_columns(version, dtype, float32_sums, launched):
    """The backward's product dpre = (g W2) * d also returns dpre's column sums (fc's bias
    gradient) from its epilogue, in the op's dtype or float32 (a master bias). Rows past
    the last tile (1100 = 4 x 256 + 76; 128-row halves of which one is empty), a last box
    partly past N (392 = 6 x 64 + 8), K with a tail."""
    from pytorch_custom_ops.gemm import _alpha_beta
    from pytorch_custom_ops.mlp import _gelu_grad_product_sums, sums_fuse

    gen = torch.Generator().manual_seed(11)
    m, k, n = 1100, 72, 392
    g = torch.randn(m, k, generator=gen).to("cuda", dtype)
    w = (torch.randn(k, n, generator=gen) / math.sqrt(k)).to("cuda", dtype)
    d = (1.3 * torch.rand(m, n, generator=gen) - 0.15).to("cuda", dtype)  # a GELU slope's range
    with pco.gemm_version(version):
        assert sums_fuse(g, w)
        op = _gelu_grad_product_sums[torch.float32 if float32_sums else None]
        dpre, sums = op([g, w, d, _alpha_beta(1.0, 0.0, g.device)])
    want = (g.double() @ w.double()) * d.double()
    assert dpre.dtype == dtype and ((dpre.double() - want).abs() / (want.abs() + 1)).max() < tolerance(dtype)
    assert sums.shape == (n,) and sums.dtype == (torch.float32 if float32_sums else dtype)
    want_sums = want.sum(0)
    gap = (sums.double() - want_sums).abs().max().item()
    assert gap < tolerance(dtype) * (want_sums.abs().max().item() + 1), gap
    assert [k.split(".")[1] for k in launched] == ["gemm_pingpong_kernel", "sum_partials_kernel"], launched
    assert _epilogue(launched[0]) == ("0", "0", "1") and _tma_store(launched[0])


@needs_cuda
def test_cuda_column_sums_only_where_the_tile_stores_through_tma():
    """Other tiles keep the separate column sum: the plan refuses sums it cannot make
    rather than leaving them unwritten."""
    from pytorch_custom_ops.gemm import _alpha_beta
    from pytorch_custom_ops.mlp import _gelu_grad_product_sums, sums_fuse

    g, w, d = (torch.randn(*s, device="cuda", dtype=BF16) for s in ((300, 64), (64, 136), (300, 136)))
    with pco.gemm_version("COOP_256x128"):
        assert not sums_fuse(g, w)
        with pytest.raises(ValueError, match="column sums come with gelu_grad on TMA-store tiles"):
            _gelu_grad_product_sums[None]([g, w, d, _alpha_beta(1.0, 0.0, g.device)])


@needs_cuda
def test_cuda_forward_saves_gelus_derivative_for_the_backward():
    """The first layer's launch writes h = gelu(pre) and d = gelu'(pre), not pre: the
    backward's product multiplies by d (see mlp.py)."""
    from pytorch_custom_ops.linear import _fused_forward

    x, w1, b1, _, _ = make((136,), 64, 200, 8, BF16, "cuda", seed=7)
    h, d = _fused_forward(x, w1, b1, "gelu_tanh", None, save_pre=True, derivative=True)
    pre = F.linear(x.double(), w1.double(), b1.double()).requires_grad_()
    want_h = F.gelu(pre, approximate="tanh")
    (want_d,) = torch.autograd.grad(want_h.sum(), pre)
    assert ((h.double() - want_h).abs() / (want_h.abs() + 1)).max() < tolerance(BF16)
    assert ((d.double() - want_d).abs() / (want_d.abs() + 1)).max() < tolerance(BF16)
    assert d.min() < 0 < d.max() and d.max() > 1  # the tanh GELU's slope dips below 0 and peaks above 1


@needs_cuda
@pytest.mark.parametrize("version", ["AUTO", "COOP_TMA_256x128", "COOP_256x128"])
def test_cuda_gpt2_shapes_under_autocast(version, launched):
    """The 124M model's MLP: 768 -> 3072 -> 768, float32 parameters, bfloat16 autocast.
    Through TMA stores fc's bias gradient comes from the product's epilogue in float32,
    the master's dtype (no bfloat16 sum in between); a register epilogue leaves it to
    bias_grad. AUTO's tile at 600 tokens stores by TMA (the ping-pong 128 x 128, day 019
    part 19)."""
    from pytorch_custom_ops.mlp import sums_fuse

    x, w1, b1, w2, b2 = make((2, 300), 768, 3072, 768, torch.float32, "cuda", seed=2)
    with torch.autocast("cuda", dtype=BF16), pco.gemm_version(version):
        check([x, w1, b1, w2, b2], BF16, launch=lambda *t: pco.mlp(*t))
        fused = sums_fuse(torch.empty(600, 768, device="cuda", dtype=BF16), w2.to(BF16))
    assert fused == (version != "COOP_256x128")
    sums = [k for k in launched if "sum_partials_kernel" in k]
    assert sums == (["day013.sum_partials_kernel.float32.float32.32.16"] if fused else []), launched


@needs_cuda
def test_cuda_unaligned_and_strided_operands_are_copied_not_misread():
    x, w1, b1, w2, b2 = make((130,), 64, 136, 48, BF16, "cuda", seed=4)
    odd = torch.empty(x.numel() + 1, device="cuda", dtype=BF16)[1:].view_as(x).copy_(x)  # 2 bytes off
    bias = torch.empty(b1.numel() + 1, device="cuda", dtype=BF16)[1:].copy_(b1)
    wt = w2.t().contiguous().t()  # a transposed layout
    check([odd, w1, bias, wt, b2], BF16)


@needs_cuda
def test_cuda_unfusable_widths_take_the_composition(launched):
    # hidden 100 is not a multiple of 8: composed (day 014's GEMM and torch's GELU), still right
    check(make((33,), 64, 100, 48, BF16, "cuda", seed=5), BF16)
    assert not any(_epilogue(k)[2] == "1" for k in launched if "gemm_pingpong_kernel" in k)
    check(make((33,), 24, 40, 16, torch.float32, "cuda", seed=6), torch.float32)  # float32: SIMT


def captured_step(m, x):
    """(graph, its output): one forward + backward of `m` on `x` (gradient of ones),
    warmed up on a side stream (kernels loaded, plans made), then captured."""

    def step():
        m.zero_grad(set_to_none=False)
        x.grad = None
        y = m(x)
        y.backward(torch.ones_like(y))
        return y

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    return graph, y


@needs_cuda
def test_cuda_graph_replays_forward_and_backward():
    torch.manual_seed(3)
    m = pco.MojoMLP(64, 256, device="cuda", dtype=BF16)
    x = torch.randn(96, 64, device="cuda", dtype=BF16, requires_grad=True)
    graph, static_y = captured_step(m, x)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    want = reference(x, m.fc.weight, m.fc.bias, m.proj.weight, m.proj.bias)
    assert ((static_y.double() - want).abs() / (want.abs() + 1)).max().item() < tolerance(BF16)
    ref_w = m.proj.weight.detach().double().requires_grad_()
    reference(x.detach(), m.fc.weight, m.fc.bias, ref_w, m.proj.bias).sum().backward()
    scale = ref_w.grad.abs().max().item() + 1
    assert (m.proj.weight.grad.double() - ref_w.grad).abs().max().item() < 4 * tolerance(BF16) * scale


@needs_cuda
def test_cuda_graph_replays_the_column_sums_of_the_backward():
    """On a TMA-store tile the backward's product also writes fc's bias gradient (a second
    launch and a workspace): captured and replayed with the rest, new inputs give new sums."""
    torch.manual_seed(5)
    m = pco.MojoMLP(64, 264, device="cuda", dtype=BF16)
    x = torch.randn(300, 64, device="cuda", dtype=BF16, requires_grad=True)
    with pco.gemm_version("COOP_TMA_256x128"):
        graph, _ = captured_step(m, x)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ref = [t.detach().double().requires_grad_() for t in (m.fc.weight, m.fc.bias, m.proj.weight, m.proj.bias)]
    want = reference(x.detach(), *ref)
    want.backward(torch.ones_like(want))
    for got, r in zip((m.fc.weight.grad, m.fc.bias.grad), ref[:2], strict=True):
        scale = r.grad.abs().max().item() + 1
        assert (got.double() - r.grad).abs().max().item() < 4 * tolerance(BF16) * scale
