"""Day 019: the fused linear layer (`pco.linear`, `MojoLinear`) against float64 torch.

CPU: the composed path (gemm + torch's GELU + add), grads, bad inputs, nn.Linear
compatibility. CUDA: the one-launch path of version 4 (bias, GELU, residual in the
epilogue), its saved pre-activation and backward, CUDA-graph capture, and that the launch
really is the fused kernel.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco
from pytorch_custom_ops.gemm_gpu import PP_C_BLOCKS, PP_EPI_WARPS, PP_TMA_STORE
from pytorch_custom_ops.linear import _fusable

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16, FP16 = torch.bfloat16, torch.float16


def reference(x, w, b, activation, r):
    y = x.double() @ w.double().T
    if b is not None:
        y = y + b.double()
    if activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    return y if r is None else y + r.double()


def inputs(lead, d_in, d_out, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(*lead, d_in, generator=g)
    w = torch.randn(d_out, d_in, generator=g) / math.sqrt(d_in)
    b = torch.randn(d_out, generator=g)
    r = torch.randn(*lead, d_out, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (x, w, b, r)]


def tolerance(dtype):
    return {torch.float32: 1e-4, torch.float64: 1e-9, BF16: 3e-2, FP16: 4e-3}[dtype]


def close(y, ref, dtype):
    err = ((y.double() - ref).abs() / (ref.abs() + 1)).max().item()
    assert err < tolerance(dtype), err


CONFIGS = [  # (bias, activation, residual)
    (True, None, False),
    (True, "gelu_tanh", False),
    (False, "gelu_tanh", False),
    (True, None, True),
    (False, None, True),
    (False, None, False),
]


@pytest.mark.parametrize("bias,activation,residual", CONFIGS)
def test_cpu_matches_float64_with_grads(bias, activation, residual):
    x, w, b, r = inputs((3, 7), 24, 40, torch.float64, "cpu")
    b = b if bias else None
    r = r if residual else None
    for t in (x, w, b, r):
        if t is not None:
            t.requires_grad_()
    y = pco.linear(x, w, b, activation, r)
    close(y, reference(x, w, b, activation, r), torch.float64)
    assert y.shape == (3, 7, 40)
    leaves = [t for t in (x, w, b, r) if t is not None]
    assert torch.autograd.gradcheck(lambda *ts: _call(_rebuild(ts, bias, residual), activation), leaves)


def check_grads(y, leaves, bias, activation, residual, dtype):
    """Backpropagate random grads through y and through the float64 reference built from
    the same leaves (x, w, then b and r where present): every leaf's grad must agree."""
    g = torch.randn_like(y)
    y.backward(g)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    rx, rw, rb, rr = _rebuild(ref_leaves, bias, residual)
    reference(rx, rw, rb, activation, rr).backward(g.double())
    for ours, ref in zip(leaves, ref_leaves, strict=True):
        scale = ref.grad.abs().max().item() + 1
        assert (ours.grad.double() - ref.grad).abs().max().item() < 4 * tolerance(dtype) * scale


def _call(xwbr, activation):
    x, w, b, r = xwbr
    return pco.linear(x, w, b, activation, r)


def _rebuild(ts, bias, residual):
    ts = list(ts)
    x, w = ts[0], ts[1]
    b = ts[2] if bias else None
    r = ts[-1] if residual else None
    return x, w, b, r


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1037, 4099])  # below and above GEMV_MIN_ROWS: sum, then gemv
def test_bias_gradient_column_sum(device, dtype, rows):
    """column_sum (cuBLAS's gemv on CUDA in 16-bit floats with many rows) is sum(0) to
    float rounding."""
    from pytorch_custom_ops.gemm import GEMV_MIN_ROWS, column_sum

    assert 1037 < GEMV_MIN_ROWS <= 4099
    g = torch.randn(rows, 77, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = column_sum(g.to(device=device, dtype=dtype))
    assert got.shape == (77,) and got.dtype == dtype and got.device.type == device
    want = g.to(dtype).double().sum(0)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert (got.double().cpu() - want).abs().max() <= tol * want.abs().max()
    assert column_sum(g[:0].to(device=device, dtype=dtype)).abs().sum() == 0


def test_mojo_linear_loads_an_nn_linear_state_dict():
    torch.manual_seed(0)
    ref = torch.nn.Linear(24, 40)
    ours = pco.MojoLinear(24, 40, activation="gelu_tanh")
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(5, 24)
    torch.testing.assert_close(ours(x), F.gelu(ref(x), approximate="tanh"), atol=1e-5, rtol=1e-5)
    r = torch.randn(5, 40)
    torch.testing.assert_close(pco.MojoLinear(24, 40).to(torch.float32)(x, r).shape, (5, 40))
    assert "activation=gelu_tanh" in repr(ours)


def test_zero_in_features_give_the_bias_like_torch():
    """K = 0: the product is empty, so the layer is its bias (a reshape with -1 cannot
    infer the rows of a 0-wide input; the rows are given explicitly)."""
    x, w, b = torch.randn(2, 3, 0), torch.randn(4, 0), torch.randn(4)
    torch.testing.assert_close(pco.linear(x, w, b), F.linear(x, w, b))
    torch.testing.assert_close(pco.linear(x, w, b, "gelu_tanh"), F.gelu(F.linear(x, w, b), approximate="tanh"))
    layer = pco.MojoGEMM(0, 4)
    with torch.no_grad():
        layer.bias.copy_(b)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, b))
    w2, b2 = torch.randn(5, 4), torch.randn(5)
    want = F.linear(F.gelu(F.linear(x, w, b), approximate="tanh"), w2, b2)
    torch.testing.assert_close(pco.mlp(x, w, b, w2, b2), want)


def test_bad_inputs_raise_clear_errors():
    x, w, b, r = inputs((4,), 8, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        pco.linear(x, w, b, "relu")
    with pytest.raises(ValueError, match="does not end in in_features=8"):
        pco.linear(x[:, :6], w)
    with pytest.raises(ValueError, match=r"bias must have shape \(16,\)"):
        pco.linear(x, w, b[:5])
    with pytest.raises(TypeError, match="'weight' is torch.float64 but 'x' is torch.float32"):
        pco.linear(x, w.double())
    with pytest.raises(ValueError, match="residual of shape"):
        pco.linear(x, w, b, residual=r[:, :3])
    with pytest.raises(TypeError, match="'x' must be a torch.Tensor"):
        pco.linear([1.0], w)
    with pytest.raises(ValueError, match="weight must be"):
        pco.linear(x, w[0])
    with pytest.raises(ValueError, match="unknown activation"):
        pco.MojoLinear(8, 16, activation="gelu")
    with pytest.raises(TypeError, match="'x' has dtype torch.int64"):
        pco.linear(x.long(), w.long())
    empty = pco.linear(x[:0], w, b, "gelu_tanh")  # no rows: an empty result, as F.linear
    assert empty.shape == (0, 16)
    one = pco.linear(x[0], w, b)  # a 1-D input, as F.linear takes it
    torch.testing.assert_close(one, F.linear(x[0], w, b), atol=1e-5, rtol=1e-5)


def test_fused_tile_follows_auto_and_forced_versions():
    """The fused launch takes AUTO's wide cooperative tile where it fills the SMs, AUTO's
    few-tile ping-pong tiles (64 x 64 for a few tokens, part 19), version 4's ping-pong
    128 x 128 with TMA stores where AUTO would pick version 3's square tile (the fused
    epilogue is version 4's), and a forced version 4 kind as it is (H100: 132 SMs)."""
    from pytorch_custom_ops.linear import linear_tile

    assert linear_tile(8192, 3072, 768, None) == ("coop_tma", 256, 128)  # 768 wide tiles, TMA stores
    assert linear_tile(1024, 3072, 768, None) == ("coop", 128, 192)  # 128 of these, 96 wide: both one round
    assert linear_tile(1024, 3072, 768, None, gelu=True) == ("coop_tma", 256, 128)  # GELU keeps 128 columns
    assert linear_tile(64, 2304, 768, None) == ("pingpong_tma", 64, 64)  # 64 tokens: 36 tiles, one round
    assert linear_tile(64, 768, 3072, None, gelu=True) == ("pingpong_tma", 64, 64)
    assert linear_tile(256, 3072, 768, None) == ("pingpong_tma", 128, 64)  # 192 of 64 x 64: two rounds
    assert linear_tile(2048, 768, 768, None) == ("pingpong_tma", 128, 128)  # version 3's square tile
    assert linear_tile(8192, 768, 3072, None) == ("coop", 256, 192)  # 128 tiles: one round
    assert linear_tile(3072, 1024, 4096, None) == ("coop_tma", 256, 128)  # AUTO's 192 x 128 is version 3's
    assert linear_tile(8192, 768, 3072, None, gelu=True) == ("coop_tma", 256, 128)  # GELU spills at 192
    for version, kind in (("MULTICAST_128x128", ("multicast", 128, 128)), ("COOP_128x256", ("coop", 128, 256))):
        with pco.gemm_version(version):
            assert linear_tile(8192, 3072, 768, None) == kind
    with pco.gemm_version("TMA_128x256"):  # not a version 4 kind: AUTO's choice stands
        assert linear_tile(8192, 3072, 768, None) == ("coop_tma", 256, 128)


def test_a_block_residual_with_a_short_k_takes_the_ping_pong():
    """Day 019, part 16: a residual read in 16-byte blocks with K <= 768 goes to the
    ping-pong 128 x 128 with TMA stores (its epilogue overlaps the other consumer's
    k-loop); a longer K, GELU, a residual read in pairs or a forced version keep their
    tile. The plan decides "in blocks" from the residual itself (CPU tensors: H100's SMs)."""
    from pytorch_custom_ops.gemm_gpu import c_in_pairs
    from pytorch_custom_ops.linear import linear_gpu, linear_tile

    short = ("pingpong_tma", 128, 128)
    assert linear_tile(8192, 768, 768, None, block_residual=True) == short
    assert linear_tile(16384, 3072, 768, None, block_residual=True) == short
    assert linear_tile(8192, 768, 3072, None, block_residual=True) == ("coop", 256, 192)  # K = 3072
    assert linear_tile(8192, 1024, 1024, None, block_residual=True) != short  # K = 1024 lost
    assert linear_tile(8192, 768, 768, None, gelu=True, block_residual=True) != short
    assert linear_tile(64, 768, 768, None, block_residual=True) == ("pingpong_tma", 64, 64)  # few tiles first
    with pco.gemm_version("COOP_256x192"):
        assert linear_tile(8192, 768, 768, None, block_residual=True) == ("coop", 256, 192)

    def plan(residual):
        x, w, b = torch.empty(8192, 768, dtype=BF16), torch.empty(768, 768, dtype=BF16), torch.empty(768, dtype=BF16)
        out = torch.empty(8192, 768, dtype=BF16)
        params = {"GELU": False, "BIAS": True, "GELU_DERIVATIVE": False}
        (launch,) = linear_gpu([out], [x, w, b, residual, torch.empty(2)], params)
        p = launch.kernel.params
        return (p[3], p[4], p[PP_TMA_STORE], p[PP_C_BLOCKS])

    full = torch.empty(8192, 768, dtype=BF16)
    unaligned = torch.empty(8192 * 768 + 1, dtype=BF16)[1:].view(8192, 768)
    assert plan(full) == (128, 128, True, True)
    assert plan(unaligned) == (256, 192, False, False)  # in pairs: AUTO's tile
    assert plan(torch.empty(1, 768, dtype=BF16)) == (256, 192, False, False)  # a row
    with c_in_pairs():  # as before part 16
        assert plan(full) == (256, 192, False, False)


def test_gelu_without_a_residual_goes_to_the_epilogue_warps():
    """Day 019, part 22: the GELU layer on the cooperative 256 x 128 TMA-store tile runs
    GELU on the producer warpgroup's idle warps (EPI_WARPS) where K <= EPI_WARPS_MAX_K, the
    tiles make EPI_WARPS_MIN_ROUNDS rounds and the saved output is not the derivative; with
    a residual (beta c), without GELU, on another tile or under `gelu_on_consumers` the
    consumers keep it, and `gelu_on_epilogue_warps` forces it wherever the tile allows.
    CPU tensors: the plan only (H100's SMs)."""
    from pytorch_custom_ops.gemm_gpu import EPI_WARPS_MAX_K, gelu_on_consumers, gelu_on_epilogue_warps
    from pytorch_custom_ops.linear import linear_gpu

    def plan(gelu=True, residual=False, saving=False, derivative=False, m=8192, n=3072, k=768):
        x, w, b = torch.empty(m, k, dtype=BF16), torch.empty(n, k, dtype=BF16), torch.empty(n, dtype=BF16)
        outs = [torch.empty(m, n, dtype=BF16)] + ([torch.empty(m, n, dtype=BF16)] if saving else [])
        c = torch.empty(m, n, dtype=BF16) if residual else torch.empty(1, 1, dtype=BF16)
        params = {"GELU": gelu, "BIAS": True, "GELU_DERIVATIVE": derivative}
        (launch,) = linear_gpu(outs, [x, w, b, c, torch.empty(2)], params)
        p = launch.kernel.params
        return (p[3], p[4], p[5], p[PP_TMA_STORE], p[PP_EPI_WARPS])

    warps, consumers = (256, 128, 3, True, True), (256, 128, 4, True, False)
    assert plan() == plan(saving=True) == warps  # three stages: the tile's copy takes the fourth's room
    assert plan(k=EPI_WARPS_MAX_K) == warps and plan(k=EPI_WARPS_MAX_K + 8) == consumers  # a long K: no
    # two rounds of 256 x 128 tiles at least (132 SMs: 264): 11 x 24 tiles yes, 10 x 24 no
    assert plan(m=2816) == warps and plan(m=2560) == consumers and plan(m=1024) == consumers
    assert plan(saving=True, derivative=True) == consumers  # GELU' too: slower there
    assert plan(residual=True)[4] is False  # beta c: the consumers' epilogue reads c
    assert plan(gelu=False) == consumers
    assert plan(m=64, n=768)[:2] == (64, 64) and plan(m=64, n=768)[4] is False  # a few tokens: ping-pong
    with gelu_on_consumers():
        assert plan() == consumers
    with gelu_on_epilogue_warps():
        assert plan(saving=True, derivative=True) == plan(k=3072) == plan(m=1024) == warps
        assert plan(residual=True)[4] is False and plan(gelu=False)[4] is False
    with pco.gemm_version("COOP_256x128"):  # no TMA stores: no epilogue warps
        assert plan()[3:] == (False, False)


def test_a_few_tokens_with_a_long_k_split_the_layer_without_gelu():
    """Day 019, parts 19 and 20: at 64 tokens and K = 3072 a layer without GELU runs as
    gemm's split (version 3's float32 pieces, then the sum kernel adding the bias as a row
    and the residual as c); GELU, a forced version or a short K keep the fused launch.
    CPU tensors: the plan only (H100's SMs)."""
    from pytorch_custom_ops.gemm_gpu import PINGPONG_KERNEL, SPLIT_K_SUM_KERNEL, TMA_KERNEL
    from pytorch_custom_ops.linear import linear_gpu

    def plan(k, bias=True, residual=None, gelu=False):
        x, w, b = torch.empty(64, k, dtype=BF16), torch.empty(768, k, dtype=BF16), torch.empty(768, dtype=BF16)
        out = torch.empty(64, 768, dtype=BF16)
        c = torch.empty(1, 1, dtype=BF16) if residual is None else residual
        alpha_beta = torch.empty(2)
        params = {"GELU": gelu, "BIAS": bias, "GELU_DERIVATIVE": False}
        return linear_gpu([out], [x, w, b, c, alpha_beta], params), b, c, alpha_beta

    r = torch.empty(64, 768, dtype=BF16)
    for bias, residual in ((True, None), (False, r), (True, r), (False, None)):
        launches, b, c, alpha_beta = plan(3072, bias, residual)
        assert [launch.kernel.family for launch in launches] == [TMA_KERNEL, SPLIT_K_SUM_KERNEL]
        # dst, ws, c, alpha_beta, bias, m, n, batch, splits, c_bs, c_rs, c_cs, with_bias
        _, _, c_ptr, ab, b_ptr, m, n, batch, pieces, _, c_rs, c_cs, with_bias = launches[1].args
        assert (c_ptr, ab, m, n, batch) == (c.data_ptr(), alpha_beta.data_ptr(), 64, 768, 1) and pieces > 1
        assert (b_ptr, with_bias) == ((b.data_ptr(), 1) if bias else (0, 0))
        # the residual's row and column strides; the placeholder's (beta 0: never read)
        assert (c_rs, c_cs) == ((768, 1) if residual is not None else (0, 0))
        assert launches[0].grid[2] == pieces  # a batch entry per piece of K
    for unsplit in (plan(3072, gelu=True)[0], plan(3072, residual=r, gelu=True)[0], plan(768)[0]):
        assert [launch.kernel.family for launch in unsplit] == [PINGPONG_KERNEL]
    with pco.gemm_version("PINGPONG_TMA_64x64"):
        assert [launch.kernel.family for launch in plan(3072)[0]] == [PINGPONG_KERNEL]


# -- CUDA: the fused launch -------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("bias,activation,residual", CONFIGS)
def test_cuda_fused_forward_and_backward(bias, activation, residual, dtype, launched):
    # 2 x 65 = 130 rows, 264 outputs: tails of every tile in m and n; K = 72 is one and a bit k tiles
    x, w, b, r = inputs((2, 65), 72, 264, dtype, "cuda", seed=1)
    b = b if bias else None
    r = r if residual else None
    with torch.no_grad():
        y = pco.linear(x, w, b, activation, r)
    close(y, reference(x, w, b, activation, r), dtype)
    assert launched and all("gemm_pingpong_kernel" in key for key in launched), launched
    # (BIAS, GELU, GELU_GRAD) compiled into the kernel, after the name, dtype, TA, TB, BM,
    # BN, STAGES and SMEM
    flags = launched[-1].split(".")[9:12]
    assert flags == [str(int(bias)), str(int(activation is not None)), "0"], launched

    leaves = [t.detach().requires_grad_() for t in (x, w, b, r) if t is not None]
    xs, ws, bs, rs = _rebuild(leaves, bias, residual)
    y = pco.linear(xs, ws, bs, activation, rs)
    check_grads(y, leaves, bias, activation, residual, dtype)


@needs_cuda
@pytest.mark.parametrize("version", ["COOP_TMA_256x128", "COOP_TMA_128x256"])
@pytest.mark.parametrize("bias,activation,residual", CONFIGS)
def test_cuda_tma_store_epilogues(bias, activation, residual, version, launched):
    """Day 019, part 10: every fused epilogue stored through shared memory by TMA. 3 x 173
    rows and 392 outputs leave tails in m and n (TMA clips them); K = 200 is 3 k-steps and a
    bit; a second matrix of the batch shares nothing with the first."""
    x, w, b, r = inputs((3, 173), 200, 392, BF16, "cuda", seed=2)
    b = b if bias else None
    r = r if residual else None
    with pco.gemm_version(version):
        with torch.no_grad():
            y = pco.linear(x, w, b, activation, r)
        close(y, reference(x, w, b, activation, r), BF16)
        assert launched[-1].split(".")[2 + PP_TMA_STORE] == "1", launched  # TMA_STORE compiled in
        leaves = [t.detach().requires_grad_() for t in (x, w, b, r) if t is not None]
        xs, ws, bs, rs = _rebuild(leaves, bias, residual)
        y = pco.linear(xs, ws, bs, activation, rs)  # the training form: GELU stores its input too
        check_grads(y, leaves, bias, activation, residual, BF16)


@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("form", ["inference", "pre", "derivative"])
def test_cuda_gelu_on_the_epilogue_warps(form, dtype, launched):
    """Day 019, part 22: GELU applied by the producer warpgroup's warps 1-3 from the
    tile's shared-memory copy. 6000 x 2056 outputs are 408 tiles of 256 x 128 (three or
    four per block: the mbarriers' phases turn over), with tails in m, n and K = 136;
    each form against float64 and against the consumers' register GELU
    (`gelu_on_consumers`): the output, then the saved pre-activation with its grads, or
    GELU's derivative (day 020's MLP; forced there, `gelu_on_epilogue_warps`)."""
    from pytorch_custom_ops.gemm_gpu import gelu_on_consumers, gelu_on_epilogue_warps
    from pytorch_custom_ops.linear import _fused_forward

    x, w, b, _ = inputs((6000,), 136, 2056, dtype, "cuda", seed=6)
    pre_ref = reference(x, w, b, None, None)
    want = F.gelu(pre_ref, approximate="tanh")

    def run():
        if form == "inference":
            with torch.no_grad():
                return pco.linear(x, w, b, "gelu_tanh"), None
        return _fused_forward(x, w, b, "gelu_tanh", None, save_pre=True, derivative=form == "derivative")

    with gelu_on_epilogue_warps():  # AUTO keeps the derivative on the consumers
        y, second = run()
    assert launched[-1].split(".")[2 + PP_EPI_WARPS] == "1", launched
    close(y, want, dtype)
    with gelu_on_consumers():
        y_regs, second_regs = run()
    assert launched[-1].split(".")[2 + PP_EPI_WARPS] == "0", launched
    close(y, y_regs.double(), dtype)
    if form == "pre":
        close(second, pre_ref, dtype)
        assert torch.equal(second, second_regs)  # the same rounding of the same sums
    elif form == "derivative":
        u = 0.7978845608028654 * (pre_ref + 0.044715 * pre_ref**3)
        s = (1 + torch.tanh(u)) / 2
        close(second, s + 2 * pre_ref * s * (1 - s) * 0.7978845608028654 * (1 + 0.134145 * pre_ref**2), dtype)
    if form == "pre":  # the training form's grads, through the saved pre-activation
        leaves = [t.detach().requires_grad_() for t in (x, w, b)]
        check_grads(pco.linear(*leaves, "gelu_tanh"), leaves, True, "gelu_tanh", False, dtype)


@needs_cuda
def test_cuda_tma_store_batched_transposed_and_beta():
    """The plain product through TMA stores: batched, both operands transposed, c added."""
    g = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(3, 300, 130, device="cuda", generator=g, dtype=BF16)  # (batch, K, M): transpose_a
    b = torch.randn(3, 264, 300, device="cuda", generator=g, dtype=BF16)  # (batch, N, K): transpose_b
    c = torch.randn(3, 130, 264, device="cuda", generator=g, dtype=BF16)
    want = 0.5 * a.double().mT @ b.double().mT + 2.0 * c.double()
    for version in ("COOP_TMA_256x128", "COOP_TMA_128x256"):
        with pco.gemm_version(version):
            got = pco.gemm_batched(a, b, c, alpha=0.5, beta=2.0, transpose_a=True, transpose_b=True)
        err = ((got.double() - want).abs() / (want.abs() + 1)).max().item()
        assert err < tolerance(BF16), (version, err)


@needs_cuda
def test_cuda_a_column_residual_is_not_read_as_a_row():
    """A residual (M, 1) with M == N holds N values like a row (N,), but adds along the
    other axis: it goes the composed way (the fused epilogue takes a row or the full
    output). Its gradient is the row sums, not the column sums."""
    x, w, b, _ = inputs((136,), 64, 136, BF16, "cuda")
    r = torch.randn(136, 1, device="cuda", dtype=BF16)
    leaves = [t.detach().requires_grad_() for t in (x, w, b, r)]
    y = pco.linear(*leaves[:3], None, leaves[3])
    close(y, reference(x, w, b, None, r), BF16)
    g = torch.randn_like(y)
    (got,) = torch.autograd.grad(y, leaves[3], g)
    torch.testing.assert_close(got.float(), g.float().sum_to_size(r.shape), atol=0.5, rtol=2e-2)


@needs_cuda
def test_cuda_gpt2_mlp_shapes_and_a_broadcast_residual(launched):
    x, w, b, _ = inputs((4, 256), 768, 3072, BF16, "cuda")
    with torch.no_grad():
        close(pco.linear(x, w, b, "gelu_tanh"), reference(x, w, b, "gelu_tanh", None), BF16)
        row = torch.randn(3072, device="cuda", dtype=BF16)  # one row for every token
        close(pco.linear(x, w, None, None, row), reference(x, w, None, None, row), BF16)
    assert len(launched) == 2
    # 1024 x 3072: one round of 128 x 192 tiles (AUTO) for the residual layer, of 256 x 128 for
    # GELU (its epilogue keeps 128 columns); cooperative, no cluster, no split, a bf16 store
    # (keys end in CLUSTER, COOP, SPLIT, F32_OUT, TMA_STORE, C_BLOCKS, EPI_WARPS)
    gelu_key, residual_key = launched
    assert ".256.128." in gelu_key and ".128.192." in residual_key
    # TMA stores: 256 x 128 only, GELU on the consumers (96 tiles: under part 22's two rounds
    # for the epilogue warps); a row residual is read in pairs, not blocks
    assert gelu_key.endswith(".1.1.0.0.1.0.0") and residual_key.endswith(".1.1.0.0.0.0.0")
    strided_bias = torch.randn(2 * 3072, device="cuda", dtype=BF16)[::2]  # a view, stride 2
    unaligned_bias = torch.randn(3073, device="cuda", dtype=BF16)[1:]  # 2 bytes past 16-byte alignment
    wt = w.t().contiguous().t()  # a transposed layout: copied, not misread
    with torch.no_grad():
        got = pco.linear(x, wt, strided_bias, "gelu_tanh")
    close(got, reference(x, w, strided_bias, "gelu_tanh", None), BF16)
    with torch.no_grad():  # the epilogue reads the bias in 16-byte blocks: an unaligned one is copied
        got = pco.linear(x, w, unaligned_bias, None)
    close(got, reference(x, w, unaligned_bias, None, None), BF16)


@needs_cuda
@pytest.mark.parametrize("activation,residual", [("gelu_tanh", False), (None, True)])
def test_cuda_projection_shape_takes_the_256x192_tile(activation, residual, launched):
    """8000 x 768 outputs: 128 tiles of 256 x 192 (two column parts, 128 + 64, in one
    consumer; the last row of tiles is a tail), forward and backward against float64.
    GELU runs the 256 x 192 kernel forced (AUTO's fused layer avoids it: it spills)."""
    x, w, b, r = inputs((8000,), 320, 768, BF16, "cuda", seed=3)
    r = r if residual else None
    leaves = [t.requires_grad_() for t in (x, w, b) + ((r,) if residual else ())]
    with pco.gemm_version("COOP_256x192"):
        y = pco.linear(x, w, b, activation, r)
    assert ".256.192." in launched[0], launched
    close(y, reference(x, w, b, activation, r), BF16)
    check_grads(y, leaves, True, activation, residual, BF16)


@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("bias,residual", [(True, False), (False, True), (False, False), (True, True)])
def test_cuda_a_few_tokens_with_a_long_k(bias, residual, dtype, launched):
    """Day 019, parts 19 and 20: 2 x 29 tokens, 3072 -> 776 (a tail in n): the layer in
    pieces of K, its sum adding the bias, the residual or both; grads too."""
    x, w, b, r = inputs((2, 29), 3072, 776, dtype, "cuda", seed=5)
    b, r = (b if bias else None), (r if residual else None)
    with torch.no_grad():
        y = pco.linear(x, w, b, None, r)
    close(y, reference(x, w, b, None, r), dtype)
    assert any("split_k_sum_kernel" in key for key in launched), launched
    leaves = [t.detach().requires_grad_() for t in (x, w, b, r) if t is not None]
    xs, ws, bs, rs = _rebuild(leaves, bias, residual)
    check_grads(pco.linear(xs, ws, bs, None, rs), leaves, bias, None, residual, dtype)


@needs_cuda
def test_cuda_unfusable_calls_are_still_right():
    x, w, b, r = inputs((5,), 20, 36, BF16, "cuda")  # K = 20: rows are not 16-byte multiples
    close(pco.linear(x, w, b, "gelu_tanh", r), reference(x, w, b, "gelu_tanh", r), BF16)
    x, w, b, r = inputs((5,), 24, 40, torch.float32, "cuda")  # float32: gemm's SIMT kernel + torch GELU
    close(pco.linear(x, w, b, "gelu_tanh", r), reference(x, w, b, "gelu_tanh", r), torch.float32)


@needs_cuda
def test_cuda_graph_replays_the_fused_layer():
    layer = pco.MojoLinear(64, 128, activation="gelu_tanh", device="cuda", dtype=BF16)
    x = torch.randn(96, 64, device="cuda", dtype=BF16)
    static_y = layer(x)  # warm-up: load the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = layer(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    close(static_y, reference(x, layer.weight, layer.bias, "gelu_tanh", None), BF16)


def test_fused_path_is_chosen_only_where_it_can_run():
    x, w, b, r = inputs((4,), 16, 24, BF16, "cpu")
    assert not _fusable(x, w, b, r)  # the CPU
    if torch.cuda.is_available():
        xc, wc = x.cuda(), w.cuda()
        assert _fusable(xc, wc, None, None)
        assert not _fusable(xc.float(), wc.float(), None, None)
        assert not _fusable(xc, wc, None, torch.zeros(4, 1, device="cuda", dtype=BF16))


@needs_cuda
@pytest.mark.parametrize("version", ["COOP_256x192", "COOP_TMA_256x128", "PINGPONG_128x128", "MULTICAST_128x128"])
def test_cuda_c_in_16_byte_blocks(version, launched):
    """Day 019, part 16: a full, 16-byte aligned c is read in 16-byte blocks (C_BLOCKS) and
    asked of L2 before each tile's k-loop. 2100 x 1032 outputs are more tiles than SMs
    (blocks take several; rows and columns with tails); c aligned (blocks) and 2 bytes
    past alignment (2-byte reads), each against float64; then a batch with one c for
    every matrix (c_bs = 0) and with one c each."""
    g = torch.Generator(device="cuda").manual_seed(4)
    a = torch.randn(2100, 136, device="cuda", generator=g, dtype=BF16)
    b = torch.randn(1032, 136, device="cuda", generator=g, dtype=BF16) / 12  # (N, K): transpose_b
    c = torch.randn(2100, 1032, device="cuda", generator=g, dtype=BF16)
    unaligned = torch.empty(2100 * 1032 + 1, device="cuda", dtype=BF16)[1:].view(2100, 1032).copy_(c)
    want = 0.5 * a.double() @ b.double().T + 1.5 * c.double()
    with pco.gemm_version(version):
        for cc, blocks in ((c, "1"), (unaligned, "0")):
            close(pco.gemm(a, b, cc, alpha=0.5, beta=1.5, transpose_b=True), want, BF16)
            assert "gemm_pingpong_kernel" in launched[-1] and launched[-1].split(".")[2 + PP_C_BLOCKS] == blocks, (
                launched
            )
        ab = torch.stack([a[:1000], a[1000:2000]])
        bb = torch.stack([b, b.flip(0)])
        for cb in (c[:1000], torch.stack([c[:1000], c[1000:2000]])):  # one c for both, one each
            got = pco.gemm_batched(ab, bb, cb, beta=-1.0, transpose_b=True)
            close(got, ab.double() @ bb.double().mT - cb.double(), BF16)
            assert launched[-1].split(".")[2 + PP_C_BLOCKS] == "1", launched
