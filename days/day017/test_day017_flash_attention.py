"""Day 017: FlashAttention forward and backward (Triton) against float64 references and SDPA.

Without CUDA the kernels run in Triton's interpreter (see conftest.py): shapes stay tiny, yet
not multiples of the tiles (the interpreter uses 32x16 / 16x32 tiles), so ragged edges, several
tiles and causal diagonals inside a tile are all exercised. With CUDA, larger cases are added.
"""

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco
from days.day017 import flash_attention as fa

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = DEVICE == "cuda"
# max |err| / max |ref| against float64. P and dS are rounded to the input dtype before their
# matmuls and the outputs are rounded once: ~6e-4 measured for float16, ~1e-2 for bfloat16.
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


def randn(*shape, dtype=torch.float16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def qkvo(b, hq, hkv, lq, lk, d, dtype=torch.float16, seed=0):
    q = randn(b, hq, lq, d, dtype=dtype, seed=seed)
    k = randn(b, hkv, lk, d, dtype=dtype, seed=seed + 1)
    v = randn(b, hkv, lk, d, dtype=dtype, seed=seed + 2)
    do = randn(b, hq, lq, d, dtype=dtype, seed=seed + 3)
    return q, k, v, do


def reference(q, k, v, do, causal, scale=None):
    """float64 out, dq, dk, dv by autograd through the materialized softmax."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = fa.attention_reference(q64, k64, v64, causal, scale)
    out.backward(do.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def ours(q, k, v, do, causal, scale=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = pco.flash_attention(q, k, v, causal=causal, scale=scale)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def assert_close(got, want, tol, what="", names=("out", "dq", "dk", "dv")):
    for name, g, w in zip(names, got, want, strict=True):
        assert g.shape == w.shape, f"{what} {name}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert torch.isfinite(g).all(), f"{what} {name}: not finite"
        err = (g.double() - w.double()).abs().max().item() if w.numel() else 0.0
        scale = w.double().abs().max().item() if w.numel() else 1.0
        assert err <= tol * max(scale, 1e-3), f"{what} {name}: max |err| {err:.3g} > {tol} x {scale:.3g}"


# (batch, q heads, kv heads, Lq, Lk, head_dim): none a multiple of the interpreter's tiles but
# (1, 2, 2, 64, 64, 32); Lq > Lk, Lq < Lk, grouped-query and multi-query heads.
SHAPES = [
    (1, 2, 2, 37, 37, 32),
    (2, 2, 1, 45, 29, 64),
    (1, 3, 1, 20, 51, 32),
    (1, 2, 2, 64, 64, 32),
    (1, 1, 1, 1, 23, 128),  # one query (decoding)
]
if CUDA:
    SHAPES += [
        (2, 8, 2, 300, 300, 128),
        (1, 4, 4, 1000, 777, 64),
        (2, 4, 2, 257, 513, 256),
        (1, 16, 16, 2048, 2048, 128),
    ]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_against_float64(shape, causal):
    dtype = torch.bfloat16 if shape[-1] == 64 else torch.float16
    q, k, v, do = qkvo(*shape, dtype=dtype, seed=sum(shape))
    assert_close(ours(q, k, v, do, causal), reference(q, k, v, do, causal), TOL[dtype], f"{shape} causal={causal}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_against_sdpa(dtype, causal):
    # Same semantics as F.scaled_dot_product_attention(is_causal, scale, enable_gqa), Lq != Lk.
    q, k, v, do = qkvo(1, 4, 2, 33, 40, 32, dtype=dtype, seed=7)
    scale = 0.3
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q2, k2, v2, is_causal=causal, scale=scale, enable_gqa=True)
    want.backward(do)
    got = ours(q, k, v, do, causal, scale)
    # both sides round to `dtype`: allow twice the error each has against float64
    assert_close(got, (want.detach(), q2.grad, k2.grad, v2.grad), 2 * TOL[dtype], f"sdpa causal={causal}")


@pytest.mark.parametrize("lq, lk", [(40, 40), (50, 30), (25, 45)])
def test_causal_has_no_future_leak(lq, lk):
    # Change key/value j0: outputs and dq of queries i < j0 must not move by a single bit.
    q, k, v, do = qkvo(1, 2, 2, lq, lk, 32, seed=11)
    j0 = 21  # inside a tile and on neither tile edge
    out1, dq1, _, _ = ours(q, k, v, do, True)
    k[:, :, j0] += 3.0
    v[:, :, j0] -= 5.0
    out2, dq2, dk2, dv2 = ours(q, k, v, do, True)
    assert torch.equal(out1[:, :, :j0], out2[:, :, :j0])
    assert torch.equal(dq1[:, :, :j0], dq2[:, :, :j0])
    assert not torch.equal(out1[:, :, j0:], out2[:, :, j0:])  # the test can fail: j0 is seen from j0 on
    # keys no query sees (j >= Lq when Lq < Lk) get exactly zero gradients
    assert (dk2[:, :, lq:] == 0).all() and (dv2[:, :, lq:] == 0).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_logits_stay_finite(causal):
    # Scores of about +-1e4: exp would overflow without the running max; softmax is near one-hot.
    q, k, v, do = qkvo(1, 2, 1, 30, 41, 32, seed=5)
    scale = 1e4 / math.sqrt(32)
    got = ours(q, k, v, do, causal, scale)
    s = (q.double() @ k.double().transpose(-2, -1)).abs().max().item() * scale
    assert s > 5e3, s
    assert all(torch.isfinite(t).all() for t in got)
    # out and dv are well conditioned. dq and dk are not: near one-hot, dS = P (dP - delta) is a
    # difference of nearly equal terms, and delta comes from the output rounded to float16.
    want = reference(q, k, v, do, causal, scale)
    assert_close(got[::3], want[::3], TOL[torch.float16], "large logits", names=("out", "dv"))


def test_non_contiguous_and_expanded_inputs():
    q, k, v, do = qkvo(2, 2, 2, 37, 29, 32, seed=3)
    want = ours(q, k, v, do, True)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, L, H, D) storage, like a fused QKV projection
    k_p = torch.zeros(2, 2, 40, 32, dtype=k.dtype, device=DEVICE)
    k_p[:, :, 3:32] = k
    k_s = k_p[:, :, 3:32]  # a sliced view with a storage offset
    v_t = v.transpose(2, 3).contiguous().transpose(2, 3)  # head_dim not contiguous: copied
    assert not q_t.is_contiguous() and not k_s.is_contiguous() and v_t.stride(-1) != 1
    got = ours(q_t, k_s, v_t, do.transpose(1, 2).contiguous().transpose(1, 2), True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # a broadcast kv head (stride 0) is GQA by another name
    kx, vx = k[:, :1].expand(2, 2, 29, 32), v[:, :1].expand(2, 2, 29, 32)
    out = pco.flash_attention(q, kx, vx, causal=False)
    torch.testing.assert_close(out, pco.flash_attention(q, k[:, :1], v[:, :1]), rtol=0, atol=0)


def test_outputs_and_gradients_follow_the_input_layout():
    """As SDPA's: q of (B, L, H, D) storage gives an out of that storage, so merging the heads
    back is a view; each gradient is laid out as its input."""
    q, k, v, do = qkvo(2, 3, 3, 21, 21, 32, seed=13)
    seq_major = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    leaves = [t.detach().clone().requires_grad_() for t in seq_major]
    out = pco.flash_attention(*leaves, causal=True)
    assert out.stride() == seq_major[0].stride()
    assert out.transpose(1, 2).is_contiguous()  # reshape(B, L, H * D) is free
    out.backward(do)
    for leaf, t in zip(leaves, seq_major, strict=True):
        assert leaf.grad.stride() == t.stride()
    head_major = pco.flash_attention(q, k, v, causal=True)
    assert head_major.is_contiguous()
    torch.testing.assert_close(out, head_major, rtol=0, atol=0)


def _packed(b, length, h, d, dtype=torch.float16, seed=0):
    return randn(b, length, 3, h, d, dtype=dtype, seed=seed), randn(b, length, h, d, dtype=dtype, seed=seed + 1)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qkvpacked_matches_the_three_tensor_op_and_float64(causal, dtype):
    qkv, do = _packed(2, 37, 3, 32, dtype=dtype, seed=14)
    leaf = qkv.clone().requires_grad_()
    out = pco.flash_attention_qkvpacked(leaf, causal=causal)
    assert out.shape == (2, 37, 3, 32) and out.is_contiguous()
    out.backward(do)
    assert leaf.grad.shape == qkv.shape and leaf.grad.is_contiguous()
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    do_h = do.transpose(1, 2)
    got = (out.transpose(1, 2), *(leaf.grad[:, :, i].transpose(1, 2) for i in range(3)))
    for g, w in zip(got, ours(q, k, v, do_h, causal), strict=True):  # the same kernels: the same bits
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert_close(got, reference(q, k, v, do_h, causal), TOL[dtype], "qkvpacked")


def test_qkvpacked_bad_inputs_and_a_strided_qkv():
    qkv, do = _packed(1, 9, 2, 32, seed=15)
    for bad in (qkv[0], qkv[:, :, :2], qkv.reshape(1, 9, 6, 32)):
        with pytest.raises(ValueError, match=r"qkv must be \(batch, seq, 3, heads, head_dim\)"):
            pco.flash_attention_qkvpacked(bad)
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor"):
        pco.flash_attention_qkvpacked(qkv.tolist())
    with pytest.raises(TypeError, match="flash_attention: q has dtype torch.float32"):
        pco.flash_attention_qkvpacked(qkv.float())
    with pytest.raises(ValueError, match="head_dim 48 is not supported"):
        pco.flash_attention_qkvpacked(randn(1, 9, 3, 2, 48))
    # a qkv whose head_dim is not contiguous is copied, then computed the same
    strided = qkv.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert strided.stride(-1) != 1
    torch.testing.assert_close(
        pco.flash_attention_qkvpacked(strided, causal=True), pco.flash_attention_qkvpacked(qkv, causal=True)
    )


@pytest.mark.parametrize("configs", [((16, 16, 4, 1), (16, 16, 4, 1)), ((64, 16, 4, 1), (32, 64, 4, 1))])
def test_other_tile_sizes(configs):
    # The tiling must not change the answer: square tiles, and tiles taller than the problem.
    fwd, bwd = configs
    q, k, v, do = qkvo(1, 2, 1, 45, 29, 32, seed=9)
    want = reference(q, k, v, do, True)
    out, lse = fa.attention_forward(q, k, v, True, config=fwd)
    dq, dk, dv = fa.attention_backward(do, q, k, v, out, lse, True, configs={"dkdv": bwd, "dq": fwd})
    assert_close((out, dq, dk, dv), want, TOL[torch.float16], f"tiles {configs}")


def test_double_backward_is_refused_clearly():
    """Triton's backward has no derivative: create_graph=True raises instead of returning
    gradients that silently carry no graph (a gradient penalty would be dropped)."""
    q, k, v = (randn(1, 2, 32, 64, seed=s).requires_grad_() for s in range(3))
    with pytest.raises(NotImplementedError, match="flash_attention: double backward"):
        torch.autograd.grad(pco.flash_attention(q, k, v).float().square().sum(), q, create_graph=True)
    qkv = randn(1, 32, 3, 2, 64).requires_grad_()
    with pytest.raises(NotImplementedError, match="flash_attention_qkvpacked: double backward"):
        torch.autograd.grad(pco.flash_attention_qkvpacked(qkv).float().square().sum(), qkv, create_graph=True)


def test_lse_is_the_log2_logsumexp():
    q, k, v, _ = qkvo(1, 2, 2, 20, 33, 32, seed=2)
    _, lse = fa.attention_forward(q, k, v, True, 0.5)
    s = (q.double() @ k.double().transpose(-2, -1)) * 0.5
    s = s.masked_fill(~torch.ones(20, 33, dtype=torch.bool, device=DEVICE).tril(), -math.inf)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1) * fa.LOG2E, rtol=1e-4, atol=1e-4)


def test_empty_dims():
    q, k, v, do = qkvo(1, 2, 1, 0, 5, 32)
    out, dq, dk, dv = ours(q, k, v, do, True)
    assert out.shape == (1, 2, 0, 32) and dq.shape == q.shape
    assert (dk == 0).all() and (dv == 0).all() and dk.shape == k.shape
    assert pco.flash_attention(*qkvo(0, 2, 1, 4, 5, 32)[:3]).shape == (0, 2, 4, 32)


def _bad(match, *args, error=ValueError, **kwargs):
    with pytest.raises(error, match=f"flash_attention: {match}"):
        pco.flash_attention(*args, **kwargs)


def test_bad_inputs_raise_clear_errors():
    q, k, v, _ = qkvo(1, 4, 2, 8, 9, 32)
    _bad("q must be 4-D", q[0], k, v)
    _bad("v must be 4-D", q, k, v[..., None])
    _bad("k must be a torch.Tensor", q, k.tolist(), v, error=TypeError)
    _bad("q has dtype torch.float32; supported: float16, bfloat16 .cast", q.float(), k, v, error=TypeError)
    _bad("q, k, v must have one dtype", q, k.bfloat16(), v, error=TypeError)
    _bad("q, k, v must be on one device", q, k.to("meta"), v)
    _bad("head_dim 48 is not supported; supported: 32, 64, 128, 256", *(t[..., :48] for t in qkvo(1, 1, 1, 4, 4, 64)))
    _bad("head_dim 16 is not supported", *(t[..., :16] for t in (q, k, v)))
    _bad("head dims differ", q, k[..., :16], v[..., :16])
    _bad("k and v must have one shape", q, k, v[:, :, :5])
    _bad("batch sizes differ", q, torch.cat([k, k]), torch.cat([v, v]))
    _bad(
        "q heads .4. must be a multiple of k/v heads .3.", q, k[:, :1].expand(1, 3, 9, 32), v[:, :1].expand(1, 3, 9, 32)
    )
    _bad("k and v have sequence length 0", q, k[:, :, :0], v[:, :, :0])
    _bad("scale must be a positive finite number", q, k, v, scale=-1.0)
    _bad("scale must be a positive finite number", q, k, v, scale=math.nan)
    _bad("causal must be a bool", q, k, v, causal=1, error=TypeError)
    if not CUDA:  # the interpreter takes CPU tensors; compiled Triton needs CUDA ones
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "0")
            _bad("the Triton kernels need CUDA tensors, got cpu", q, k, v)


@pytest.mark.skipif(CUDA, reason="the interpreter runs CPU tensors only without CUDA")
def test_triton_imported_before_the_interpreter_is_named():
    """Triton decorates its own library when first imported: with TRITON_INTERPRET=1 set
    only afterwards (by day 017's module), a CPU call would fail inside Triton."""
    code = (
        "import triton, torch, pytorch_custom_ops as pco\n"
        "q = torch.randn(1, 1, 8, 32, dtype=torch.bfloat16)\n"
        "try:\n"
        "    pco.flash_attention(q, q, q)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "triton was imported before TRITON_INTERPRET=1 was set" in out.stdout, out.stdout + out.stderr


def test_config_tables():
    for kernel, per_dim in fa.CONFIGS.items():
        assert set(per_dim) == set(fa.HEAD_DIMS), kernel
        for d, specs in per_dim.items():
            assert len(set(specs)) == len(specs) >= 1, (kernel, d)
            for bm, bn, warps, stages in specs:
                assert bm >= 16 and bn >= 16 and not bm & (bm - 1) and not bn & (bn - 1), (kernel, d)
                assert warps in (4, 8) and 1 <= stages <= 5, (kernel, d)
    # the autotuner sees only the configs of the call's head dim, and none taller than the sequences
    prune = fa._prune("fwd")
    kept = prune(None, {"LQ_KEY": 4096, "LK_KEY": 4096}, HEAD_DIM=128)
    assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept] == fa.CONFIGS["fwd"][
        128
    ]
    assert all(c.kwargs["BLOCK_M"] <= 64 for c in prune(None, {"LQ_KEY": 32, "LK_KEY": 4096}, HEAD_DIM=64))


@pytest.mark.slow
def test_torch_compile_fullgraph():
    q, k, v, do = qkvo(1, 2, 1, 20, 24, 32, seed=4)

    def f(q, k, v):
        return pco.flash_attention(q, k, v, causal=True) * 2.0

    # aot_eager on the CPU: the fake impls are what fullgraph tracing needs; inductor's CPU
    # codegen would only add a C++ build.
    compiled = torch.compile(f, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
    runs = []
    for fn in (compiled, f):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(do)
        runs.append((out.detach(), *(t.grad for t in leaves)))
    for got, want in zip(*runs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.slow
def test_opcheck():
    q, k, v, _ = qkvo(1, 2, 1, 17, 19, 32, seed=6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.gpu_days.flash_attention.default, (q, k, v, True, None))
    # seq-major inputs: the fake outputs must have the real ones' strides
    q_t, k_t, v_t = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.gpu_days.flash_attention.default, (q_t, k_t, v_t, False, None))
    qkv = randn(1, 17, 3, 2, 32, seed=7).requires_grad_()
    torch.library.opcheck(torch.ops.gpu_days.flash_attention_qkvpacked.default, (qkv, True, None))


@pytest.mark.slow
def test_qkvpacked_under_torch_compile_fullgraph():
    qkv, do = _packed(1, 20, 2, 32, seed=16)

    def f(qkv):
        return pco.flash_attention_qkvpacked(qkv, causal=True).reshape(1, 20, 64) * 2.0

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
    runs = []
    for fn in (compiled, f):
        leaf = qkv.clone().requires_grad_()
        out = fn(leaf)
        out.backward(do.reshape(1, 20, 64))
        runs.append((out.detach(), leaf.grad))
    for got, want in zip(*runs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_side_stream_and_cuda_graph():
    q, k, v, _ = qkvo(2, 4, 2, 300, 300, 128, seed=8)
    want = pco.flash_attention(q, k, v, causal=True)  # also compiles (and tunes) outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = pco.flash_attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = pco.flash_attention(q, k, v, causal=True)
    q.mul_(-1.0)  # new inputs in the same buffers: the replay must see them
    graph.replay()
    torch.testing.assert_close(captured, pco.flash_attention(q, k, v, causal=True), rtol=0, atol=0)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_autotuned_long_sequence():
    # Above SMALL_WORK the autotuner picks the tiles: check its pick, causal and not.
    q, k, v, do = qkvo(1, 8, 8, 1537, 1537, 128, dtype=torch.bfloat16, seed=12)
    assert 8 * 1537 * 1537 * 128 >= fa.SMALL_WORK
    for causal in (False, True):
        assert_close(ours(q, k, v, do, causal), reference(q, k, v, do, causal), TOL[torch.bfloat16], "autotuned")
    assert all(c is not None for c in fa.last_configs().values())


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_a_repeated_autotuned_call_skips_the_autotuner(monkeypatch):
    """The second call of a key launches the autotuner's pick itself, forward and both
    backward kernels, with the same results; REUSE_PICKS off goes through the autotuner."""
    q, k, v, do = qkvo(2, 4, 4, 769, 769, 64, dtype=torch.bfloat16, seed=13)
    assert 2 * 4 * 769 * 769 * 64 >= fa.SMALL_WORK
    first = ours(q, k, v, do, True)  # tunes (or finds) each kernel's pick for this key
    autotuner = type(fa._AUTOTUNED["fwd"])
    calls = []
    real_run = autotuner.run
    monkeypatch.setattr(autotuner, "run", lambda self, *a, **kw: calls.append(self) or real_run(self, *a, **kw))
    again = ours(q, k, v, do, True)
    assert calls == []
    for a, b in zip(first, again, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    monkeypatch.setattr(fa, "REUSE_PICKS", False)
    through = ours(q, k, v, do, True)
    assert len(calls) == 3  # fwd, dkdv, dq
    for a, b in zip(first, through, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --- the benchmark case -----------------------------------------------------------------


def test_benchmark_shapes_flops_and_reference():
    from benchmark.cases import day017 as case

    for d in (64, 128):
        for b, h, s, dd in case.shapes_for(d):
            assert b * s == 16384 and h * dd == 2048 and dd == d
    assert case.flops((2, 3, 5, 8), False, False) == 4 * 2 * 3 * 25 * 8
    assert case.flops((2, 3, 5, 8), True, True) == 4 * 2 * 3 * 15 * 8 * 7 // 2
    # the chunked float64 reference (its backward written out) against autograd; chunks of 2 slices
    q, k, v, do = qkvo(2, 3, 3, 11, 11, 32, seed=13)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(case, "REFERENCE_CHUNK", 2 * 11 * 11)
        got = case.reference(q, k, v, do, causal=True)
        assert case.reference(q, k, v, causal=False).shape == q.shape
    for g, w in zip(got, reference(q, k, v, do, True), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_benchmark_case_runs_and_validates():
    # The harness checks every impl against the float64 reference before timing it.
    from benchmark.cases import day017 as case
    from benchmark.harness import run_case

    op = next(c for c in case.CASES if c.op == "attention_fwd_bwd_d64_causal")
    rows = run_case(op, DEVICE, quick=True, copy_gbps=None)
    must = {"triton", "torch", "sdpa_math", "naive"}  # cuDNN/efficient may decline a tiny shape: NA
    assert {r["impl"] for r in rows} >= must
    bad = [(r["impl"], r["status"], r.get("reason")) for r in rows if r["status"] != "ok" and r["impl"] in must]
    assert not bad and all(r["status"] in ("ok", "NA") for r in rows), rows
    assert all(r["tflops"] > 0 for r in rows if r["status"] == "ok")
