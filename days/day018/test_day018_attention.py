"""Day 018: `pco.attention` (Mojo FlashAttention forward for Hopper) against float64.

CPU (CI): the float32 reference path, its gradients, the lse2 convention the GPU
backward relies on, bad inputs, torch.compile through the registered op. CUDA (strict
mode on the GPU machine): the Mojo kernel at ragged lengths, causal and not, GQA, head
dims 64 and 128, bf16 and fp16, strided layouts, large logits, CUDA-graph capture, side
streams, and grads through day 017's Triton backward.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco
from pytorch_custom_ops.attention import check_attention_args
from pytorch_custom_ops.attention_gpu import FWD_TILES, attention_bwd_version, attention_fwd_tile, attention_version

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16, FP16 = torch.bfloat16, torch.float16
TOL = {BF16: 2e-2, FP16: 4e-3}  # max |err| / (|ref| + 1): one 16-bit rounding of O and of P


def make(b, hq, hkv, lq, lk, d, dtype, device, seed=0, spread=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g) * spread
    k = torch.randn(b, hkv, lk, d, generator=g)
    v = torch.randn(b, hkv, lk, d, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def reference(q, k, v, causal, scale=None):
    return F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=causal, scale=scale, enable_gqa=True
    )


def close(y, ref, dtype, factor=1.0):
    err = ((y.double() - ref).abs() / (ref.abs() + 1)).max().item()
    assert err < TOL[dtype] * factor, err


def lse2_reference(q, k, causal, scale):
    group = q.shape[1] // k.shape[1]
    s = (q.double() @ k.double().repeat_interleave(group, 1).transpose(-2, -1)) * scale
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return torch.logsumexp(s, -1) / math.log(2)


SHAPES = [  # (b, hq, hkv, lq, lk, d)
    (1, 2, 2, 128, 128, 64),
    (2, 3, 1, 77, 77, 64),  # GQA, ragged
    (1, 2, 2, 300, 131, 128),  # Lq > Lk
    (2, 2, 1, 45, 260, 128),  # Lq < Lk
    (1, 1, 1, 1, 1, 64),
]


# -- CPU: the reference path ----------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES[:4])
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_forward_backward_match_float64(shape, causal):
    b, hq, hkv, lq, lk, d = shape
    q, k, v = (t.requires_grad_() for t in make(b, hq, hkv, lq, lk, d, BF16, "cpu"))
    out = pco.attention(q, k, v, causal=causal)
    ref = reference(q, k, v, causal)
    close(out, ref, BF16)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g.double())
    for a, r in zip(got, want, strict=True):
        close(a, r, BF16, factor=2)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_double_backward_is_refused_clearly(device):
    """The backward's kernels have no derivative, and the CPU math rebuilds P from the
    saved lse: a gradient penalty (create_graph=True) would be silently wrong, so it
    raises; a plain backward after it still works."""
    q, k, v = (t.requires_grad_() for t in make(1, 2, 2, 40, 40, 64, BF16, device))
    out = pco.attention(q, k, v, causal=True)
    with pytest.raises(NotImplementedError, match="attention: double backward"):
        torch.autograd.grad(out.float().square().sum(), q, create_graph=True)
    (dq,) = torch.autograd.grad(pco.attention(q, k, v, causal=True).float().square().sum(), q)
    assert dq.shape == q.shape and torch.isfinite(dq).all()


@pytest.mark.parametrize("dims", [(65536, 1), (1, 65536)])
def test_cpu_takes_more_than_65535_batches_or_heads(dims):
    """CUDA's grid limits the GPU kernels' batch and heads; the CPU path is torch math."""
    b, h = dims
    q, k, v = make(b, h, h, 1, 2, 64, BF16, "cpu")
    close(pco.attention(q, k, v), reference(q, k, v, False), BF16)


def test_cpu_lse_is_the_log2_logsumexp():
    q, k, v = make(1, 2, 1, 33, 70, 64, BF16, "cpu")
    out, lse = torch.ops.gpu_days.attention(q, k, v, True, 0.2)
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 33)
    torch.testing.assert_close(lse.double(), lse2_reference(q, k, True, 0.2), atol=1e-4, rtol=1e-5)


def test_module_and_compile():
    q, k, v = make(1, 2, 2, 40, 40, 64, BF16, "cpu")
    m = pco.MojoAttention(causal=True)
    close(m(q, k, v), reference(q, k, v, True), BF16)
    fn = torch.compile(lambda a, b, c: pco.attention(a, b, c, causal=True), fullgraph=True, backend="eager")
    close(fn(q, k, v), reference(q, k, v, True), BF16)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda q, k, v: (q.float(), k, v), TypeError, "float32"),
        (lambda q, k, v: (q[..., :32], k[..., :32], v[..., :32]), ValueError, "head_dim 32"),
        (lambda q, k, v: (q[0], k, v), ValueError, "4-D"),
        (lambda q, k, v: (q, k[:, :, :5], v), ValueError, "one shape"),
        (lambda q, k, v: (q, k[:, :1].expand(1, 3, 16, 64), v[:, :1].expand(1, 3, 16, 64)), ValueError, "multiple"),
        (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), ValueError, "length 0"),
        (lambda q, k, v: (q, k.half(), v), TypeError, "one dtype"),
        (lambda q, k, v: ("q", k, v), TypeError, "torch.Tensor"),
    ],
)
def test_bad_inputs_are_named(change, error, match):
    q, k, v = make(1, 2, 2, 16, 16, 64, BF16, "cpu")
    with pytest.raises(error, match=match):
        pco.attention(*change(q, k, v))


@pytest.mark.parametrize("scale", [0, -1.0, float("nan"), True])
def test_bad_scale(scale):
    q, k, v = make(1, 1, 1, 8, 8, 64, BF16, "cpu")
    with pytest.raises(ValueError, match="scale"):
        pco.attention(q, k, v, scale=scale)


def test_numpy_scale_is_taken_as_sdpa_takes_it():
    """np.float32(0.2) was refused as not "a positive finite number"."""
    q, k, v = make(1, 2, 2, 5, 7, 64, BF16, "cpu")
    want = pco.attention(q, k, v, scale=0.25)
    torch.testing.assert_close(pco.attention(q, k, v, scale=np.float32(0.25)), want, rtol=0, atol=0)
    torch.testing.assert_close(pco.attention(q, k, v, scale=np.float64(0.25)), want, rtol=0, atol=0)


def test_unknown_version():
    with pytest.raises(ValueError, match="version"), attention_version(5):
        pass


def test_causal_must_be_bool():
    q, k, v = make(1, 1, 1, 8, 8, 64, BF16, "cpu")
    with pytest.raises(TypeError, match="causal"):
        check_attention_args(q, k, v, 1, None)


def test_launch_plan_on_cpu():
    """The plan's grid, shared memory and tensor maps, without a GPU."""
    from pytorch_custom_ops.attention_gpu import FWD_KERNEL, attention_gpu, smem_bytes

    q, k, v = make(2, 4, 2, 300, 260, 128, BF16, "cpu")
    out, lse = torch.empty_like(q), torch.empty(2, 4, 300)
    (launch,) = attention_gpu([out, lse], [q, k, v], {"CAUSAL": True, "SCALE_LOG2": 0.1})
    assert launch.grid == (3, 4, 2) and launch.block == 384
    assert launch.kernel.family is FWD_KERNEL
    assert launch.kernel.params[:7] == (BF16, 128, 128, 3, True, 3, 2)  # "auto" at head_dim 128: version 3
    assert launch.smem == smem_bytes(128, 128, 3) <= 227 * 1024
    q_map, k_map = launch.args[0], launch.args[1]
    assert q_map.dims == (128, 300, 4, 2) and q_map.box == (64, 64, 1, 1)
    assert k_map.dims == (128, 260, 2, 2) and k_map.box == (64, 128, 1, 1)
    assert q_map.byte_strides == (256, 300 * 256, 4 * 300 * 256)
    assert launch.args[5:13] == (300, 260, 4, 2, 2, 4 * 300 * 128, 300 * 128, 128)
    with attention_version(4):  # persistent: at most a block per SM, one per work tile at most
        (launch,) = attention_gpu([out, lse], [q, k, v], {"CAUSAL": True, "SCALE_LOG2": 0.1})
        assert launch.grid == (3 * 4 * 2, 1, 1) and launch.kernel.params[5] == 4
        big = torch.empty(4, 16, 4096, 128, dtype=BF16)
        (launch,) = attention_gpu(
            [big, torch.empty(4, 16, 4096)], [big, big, big], {"CAUSAL": False, "SCALE_LOG2": 0.1}
        )
        assert launch.grid == (132, 1, 1)
    q64 = q[..., :64].contiguous()  # head_dim 64: three consumers, 192 query rows per block
    (launch,) = attention_gpu(
        [q64.clone(), lse],
        [q64, k[..., :64].contiguous(), v[..., :64].contiguous()],
        {"CAUSAL": False, "SCALE_LOG2": 0.1},
    )
    assert launch.grid == (2, 4, 2) and launch.block == 512 and launch.kernel.params[6] == 3
    assert launch.smem == smem_bytes(64, 128, 4, nc=3)
    # "auto" with the causal mask at head_dim 64: version 4, persistent, with two Qs
    (launch,) = attention_gpu(
        [q64.clone(), lse],
        [q64, k[..., :64].contiguous(), v[..., :64].contiguous()],
        {"CAUSAL": True, "SCALE_LOG2": 0.1},
    )
    assert launch.kernel.params[5] == 4 and launch.grid == (2 * 4 * 2, 1, 1)
    assert launch.smem == smem_bytes(64, 128, 4, nc=3, qbuf=2) == smem_bytes(64, 128, 4, nc=3) + 3 * 64 * 64 * 2 + 16
    with attention_version(3):
        (launch,) = attention_gpu(
            [q64.clone(), lse],
            [q64, k[..., :64].contiguous(), v[..., :64].contiguous()],
            {"CAUSAL": True, "SCALE_LOG2": 0.1},
        )
        assert launch.kernel.params[5] == 3 and launch.grid == (2, 4, 2)


def test_forward_plan_refuses_an_out_without_16_byte_rows():
    """The kernel stores O in 16-byte blocks: an out whose rows are not 16-byte aligned
    is refused by name, not written out of line (the op always allocates an aligned one)."""
    from pytorch_custom_ops.attention_gpu import attention_gpu

    q, k, v = make(1, 2, 2, 40, 40, 64, BF16, "cpu")
    lse = torch.empty(1, 2, 40)
    shifted = torch.empty(1 * 2 * 40 * 64 + 1, dtype=BF16)[1:].view(1, 2, 40, 64)  # 2 bytes off
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        attention_gpu([shifted, lse], [q, k, v], {"CAUSAL": False, "SCALE_LOG2": 0.1})
    (launch,) = attention_gpu([torch.empty_like(q), lse], [q, k, v], {"CAUSAL": False, "SCALE_LOG2": 0.1})
    assert launch.grid == (1, 2, 1)


@pytest.mark.parametrize("tile", list(FWD_TILES))
@pytest.mark.parametrize("d", [64, 128])
def test_forward_tiles_plan_on_cpu(tile, d):
    """Each K/V tile's kernel, shared memory and K box: 192 keys and two stages at
    head_dim 128 only, SPLIT's extra mbarriers counted."""
    from pytorch_custom_ops.attention_gpu import FWD_KERNEL, SMEM_LIMIT, attention_gpu, smem_bytes

    q, k, v = make(1, 2, 2, 300, 400, d, BF16, "cpu")
    with attention_fwd_tile(tile), attention_version(3):  # one Q (version 4 at 64: two)
        outs = [torch.empty_like(q), torch.empty(1, 2, 300)]
        (launch,) = attention_gpu(outs, [q, k, v], {"CAUSAL": True, "SCALE_LOG2": 0.1})
    _, dd, bn, stages, _, _, nc, split, smem = launch.kernel.params
    assert launch.kernel.family is FWD_KERNEL and dd == d
    assert split == FWD_TILES[tile][1]
    assert bn == (FWD_TILES[tile][0] if d == 128 else 128) and launch.args[1].box == (64, bn, 1, 1)
    assert smem == launch.smem == smem_bytes(d, bn, stages, nc=nc, split=split) <= SMEM_LIMIT
    barriers_v = smem_bytes(d, bn, stages, nc=nc, split=split) - smem_bytes(d, bn, stages, nc=nc)
    assert barriers_v == (8 * stages if split else 0)
    assert stages == {(128, 128): 3, (128, 192): 2, (64, 128): 4}[(d, bn)]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("lk", [1, 4095, 4096, 9000])
def test_auto_forward_tile_takes_192_keys_for_long_rows_at_head_dim_128(d, lk):
    from pytorch_custom_ops.attention_gpu import LONG_KEYS, attention_gpu

    q = torch.empty(1, 2, 8, d, dtype=BF16)
    kv = torch.empty(1, 2, lk, d, dtype=BF16)
    with attention_fwd_tile("auto"):
        outs = [torch.empty_like(q), torch.empty(1, 2, 8)]
        (launch,) = attention_gpu(outs, [q, kv, kv], {"CAUSAL": False, "SCALE_LOG2": 0.1})
    long_rows = d == 128 and lk >= LONG_KEYS
    assert launch.kernel.params[2] == (192 if long_rows else 128) and launch.kernel.params[7] == long_rows


def test_unknown_forward_tile():
    with pytest.raises(ValueError, match="attention_fwd_tile"), attention_fwd_tile("256"):
        pass


def test_tma_ready_layouts():
    """Views TMA reads in place, and the ones that are copied first."""
    from pytorch_custom_ops.attention_gpu import tma_ready

    x = torch.randn(2, 50, 3 * 4, 64, dtype=BF16)
    q, k, v = x.view(2, 50, 3, 4, 64).permute(2, 0, 3, 1, 4).unbind(0)  # (B, S, H, D) as (B, H, S, D)
    assert tma_ready(q) and tma_ready(k.contiguous())
    assert not tma_ready(q.transpose(-1, -2))  # head_dim not unit-stride
    assert not tma_ready(k[:, :1].expand(2, 4, 50, 64))  # a broadcast head (stride 0)
    assert not tma_ready(torch.randn(1, 1, 9, 72, dtype=BF16)[..., 4:68])  # rows of 144 B, base off by 8 B


def test_l2_promotion_reaches_the_attention_maps():
    # gemm_gpu.l2_promotion, the A/B switch of day 019's part 26, covers attention's loads too
    from pytorch_custom_ops.attention_gpu import tma_map
    from pytorch_custom_ops.gemm_gpu import l2_promotion

    q = torch.randn(2, 4, 50, 64, dtype=BF16)
    assert tma_map(q, 128).l2_promotion == 0
    with l2_promotion(128):
        assert tma_map(q, 128).l2_promotion == 2  # CU_TENSOR_MAP_L2_PROMOTION_L2_128B


def test_backward_plan_on_cpu():
    """dQ over 128-query blocks of q heads (it writes the (lse2, delta) pairs), then dK/dV
    over 128-key blocks of kv heads (their producer copies each tile's pairs into shared
    memory: 512 bytes and a barrier a stage); O and dO by their own strides."""
    from pytorch_custom_ops.attention_gpu import BWD_KERNEL, attention_bwd_gpu, bwd_smem_bytes, pairs_rows

    q, k, v = make(2, 4, 2, 300, 260, 64, FP16, "cpu")
    assert pairs_rows(300) == 320 and pairs_rows(64) == 64
    do, lse, delta = torch.empty_like(q), torch.empty(2, 4, 300), torch.empty(2, 4, 320, 2)
    out = torch.empty(2, 300, 4, 64, dtype=FP16).transpose(1, 2)  # (B, S, H, D) stored
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dql, dkdv = attention_bwd_gpu([dq, dk, dv, delta, None], [q, k, v, do, lse, out], {"CAUSAL": False, "SCALE": 0.125})
    assert dkdv.grid == (3, 2, 2) and dql.grid == (3, 4, 2)
    assert dkdv.kernel is BWD_KERNEL[FP16, 64, 4, False, False, False, False, False, 2, bwd_smem_bytes(64)]
    assert dql.kernel.params[4] is True and dql.smem == bwd_smem_bytes(64, dq_pass=True)
    assert dkdv.smem == bwd_smem_bytes(64) == dql.smem + 4 * (512 + 8)
    assert dkdv.args[4:6] == (dk.data_ptr(), dv.data_ptr()) and dql.args[4] == dq.data_ptr()
    assert dql.args[6:11] == (lse.data_ptr(), delta.data_ptr(), out.data_ptr(), do.data_ptr(), 0)
    assert dkdv.args[11:14] == (300, 260, 2) and dkdv.args[-1] == 0.125
    assert dql.args[14:23] == (*dq.stride()[:3], 300 * 4 * 64, 64, 4 * 64, *do.stride()[:3])
    assert dkdv.args[0].dims == (64, 260, 2, 2) and dkdv.args[2].dims == (64, 300, 4, 2)


@pytest.mark.parametrize("grad", ["dq", "dk", "dv"])
def test_backward_plan_refuses_grads_without_16_byte_rows(grad):
    """Both passes store dQ, dK and dV in 16-byte blocks: a gradient whose rows are not
    16-byte aligned is refused by name (the op always allocates aligned ones), and so are
    dk and dv with different strides (the kernel takes one set)."""
    from pytorch_custom_ops.attention_gpu import attention_bwd_gpu

    q, k, v = make(1, 2, 2, 40, 40, 64, BF16, "cpu")
    do, lse, delta, out = torch.empty_like(q), torch.empty(1, 2, 40), torch.empty(1, 2, 64, 2), torch.empty_like(q)
    grads = {"dq": torch.empty_like(q), "dk": torch.empty_like(k), "dv": torch.empty_like(v)}
    inputs, params = [q, k, v, do, lse, out], {"CAUSAL": False, "SCALE": 0.125, "VERSION": 5}
    assert len(attention_bwd_gpu([*grads.values(), delta, None], inputs, params)) == 2
    shifted = torch.empty(1 * 2 * 40 * 64 + 1, dtype=BF16)[1:].view(1, 2, 40, 64)  # 2 bytes off
    with pytest.raises(ValueError, match=f"{grad} needs 16-byte aligned rows"):
        attention_bwd_gpu([*{**grads, grad: shifted}.values(), delta, None], inputs, params)
    if grad != "dq":
        other = torch.empty(1, 40, 2, 64, dtype=BF16).transpose(1, 2)  # aligned, (B, S, H, D) stored
        with pytest.raises(ValueError, match="dk and dv need the same strides"):
            attention_bwd_gpu([*{**grads, grad: other}.values(), delta, None], inputs, params)


def test_backward_version_2_plan_on_cpu():
    """Version 2: delta over 64-row blocks of q heads, then one dK/dV pass that adds dQ
    into a float32 tensor (with room for a dS box per consumer)."""
    from pytorch_custom_ops.attention_gpu import BWD_KERNEL, DELTA_KERNEL, attention_bwd_gpu, bwd_smem_bytes

    q, k, v = make(2, 4, 2, 300, 260, 128, BF16, "cpu")
    do, lse, delta, out = torch.empty_like(q), torch.empty(2, 4, 300), torch.empty(2, 4, 320, 2), torch.empty_like(q)
    dk, dv, dq32 = torch.empty_like(k), torch.empty_like(v), torch.zeros(q.shape)
    params = {"CAUSAL": True, "SCALE": 0.1, "VERSION": 2}
    dl, dkdv = attention_bwd_gpu([None, dk, dv, delta, dq32], [q, k, v, do, lse, out], params)
    assert dl.kernel is DELTA_KERNEL[BF16, 128, False] and dl.grid == (5, 4, 2) and dl.block == 128
    assert dl.args[:5] == (delta.data_ptr(), lse.data_ptr(), out.data_ptr(), do.data_ptr(), dq32.data_ptr())
    assert dl.args[5:] == (300, *out.stride()[:3], *do.stride()[:3])
    smem = bwd_smem_bytes(128, fused=1)
    assert dkdv.kernel is BWD_KERNEL[BF16, 128, 4, True, False, 1, False, False, 2, smem] and dkdv.grid == (3, 2, 2)
    assert smem == bwd_smem_bytes(128) + 2 * 64 * 64 * 2 and dkdv.smem == smem
    assert dkdv.args[10] == dq32.data_ptr()


@pytest.mark.parametrize("d", [64, 128])
def test_backward_version_6_plan_on_cpu(d):
    """Version 6: version 2's launches, its delta kernel also zeroing dq32 (ZERO), then a
    third that puts dq32's rows in order into dq; its pass (FUSED 2) has two pairs of dS
    boxes and a 16 KB float32 piece per consumer, which leaves room for 3 K/Q stages at
    head_dim 128 (4 at 64); dq32 has whole 64-row tiles per head."""
    from pytorch_custom_ops.attention_gpu import (
        BWD_KERNEL,
        DELTA_KERNEL,
        DQ_ROWS_KERNEL,
        SMEM_LIMIT,
        attention_bwd_gpu,
        bwd_smem_bytes,
        dq32_shape,
    )

    q, k, v = make(2, 4, 2, 300, 260, d, BF16, "cpu")
    assert dq32_shape(q, 6) == (2, 4, 320, d) and dq32_shape(q, 2) == q.shape and dq32_shape(q, 5) is None
    do, lse, delta, out = torch.empty_like(q), torch.empty(2, 4, 300), torch.empty(2, 4, 320, 2), torch.empty_like(q)
    dq, dk, dv, dq32 = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty(dq32_shape(q, 6))
    params = {"CAUSAL": False, "SCALE": 0.1, "VERSION": 6}
    outputs, inputs = [dq, dk, dv, delta, dq32], [q, k, v, do, lse, out]
    (dl6, dkdv6, rows), (dl2, dkdv2) = (attention_bwd_gpu(outputs, inputs, {**params, "VERSION": v}) for v in (6, 2))
    stages = 3 if d == 128 else 4
    smem = bwd_smem_bytes(d, fused=2, stages=stages)
    tiles = 2 * 2 * 64 * d + stages * 2 * 64 * d + 4 * 64 * 64 + 2 * 64 * 64 * 2  # 16-bit elements
    assert smem == tiles * 2 + stages * (512 + 8) + 8 * (1 + 3 * stages)  # pairs, barriers
    assert smem <= SMEM_LIMIT < bwd_smem_bytes(d, fused=2, stages=stages + 1) or d == 64
    assert dkdv6.kernel is BWD_KERNEL[BF16, d, stages, False, False, 2, False, False, 2, smem] and dkdv6.smem == smem
    assert (dl6.kernel, dl2.kernel) == (DELTA_KERNEL[BF16, d, True], DELTA_KERNEL[BF16, d, False])
    assert (dl6.grid, dl6.args) == (dl2.grid, dl2.args) == ((5, 4, 2), dl6.args) and dl6.args[4] == dq32.data_ptr()
    assert (dkdv6.grid, dkdv6.block, dkdv6.args) == (dkdv2.grid, dkdv2.block, dkdv2.args)
    assert rows.kernel is DQ_ROWS_KERNEL[BF16, d] and (rows.grid, rows.block, rows.smem) == ((5, 4, 2), 128, 0)
    assert rows.args == (dq.data_ptr(), dq32.data_ptr(), 300, *dq.stride()[:3])
    strided = torch.empty(2, 300, 4, d, dtype=BF16).transpose(1, 2)
    with pytest.raises(ValueError, match="dq must be contiguous"):
        attention_bwd_gpu([strided, dk, dv, delta, dq32], inputs, params)


def test_dq_from_pieces_puts_rows_back():
    """Version 6's pieces: float4 jj of warpgroup thread 32 w + 4 g + t holds rows
    16 w + g (+ 8), columns 8 jj + 2 t (+ 1) of its 64 x 64 piece (the wgmma accumulator's
    layout); stored at 16 (128 jj + 32 w + 4 g + t) bytes. Scatter a tensor by that rule,
    element by element, and the view must give it back."""
    from pytorch_custom_ops.attention_gpu import dq_from_pieces

    rows, d, lq = 128, 128, 100
    want = torch.randn(1, 2, rows, d)
    pieces = torch.full((1, 2, rows * d), float("nan"))
    for r in range(rows):
        tile, rr = divmod(r, 64)
        w, half, g = rr // 16, (rr % 16) // 8, rr % 8
        for c in range(d):
            piece, cc = divmod(c, 64)
            jj, t, e = cc // 8, (cc % 8) // 2, cc % 2
            at = (tile * (d // 64) + piece) * 4096 + 4 * (128 * jj + 32 * w + 4 * g + t) + 2 * half + e
            pieces[:, :, at] = want[:, :, r, c]
    got = dq_from_pieces(pieces.view(1, 2, rows, d), lq)
    assert got.shape == (1, 2, lq, d)
    torch.testing.assert_close(got, want[:, :, :lq], rtol=0, atol=0)


@pytest.mark.parametrize("version", [3, 4, 5, 7])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_versions_with_turns_plan_on_cpu(version, d, causal):
    """Versions 3 to 5 and 7: version 1's two launches and arguments, with kernels whose
    consumers take turns (TURNS): both passes in version 3; in versions 4, 5 and 7 all
    but the dK/dV pass at head_dim 128 without the mask (measured slower with turns).
    Versions 5 and 7 also overlap (OVERLAP) in the dQ pass. Version 7's passes at
    head_dim 64 have three consumers: 192 fixed rows and 512 threads a block, room for a
    third consumer's fixed Q and dO (K and V); elsewhere it is version 5."""
    from pytorch_custom_ops.attention_gpu import BWD_KERNEL, attention_bwd_gpu, bwd_smem_bytes

    q, k, v = make(1, 2, 1, 200, 130, d, BF16, "cpu")
    do, lse, delta, out = torch.empty_like(q), torch.empty(1, 2, 200), torch.empty(1, 2, 256, 2), torch.empty_like(q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    inputs, outputs = [q, k, v, do, lse, out], [dq, dk, dv, delta, None]
    plans = {
        ver: attention_bwd_gpu(outputs, inputs, {"CAUSAL": causal, "SCALE": 0.1, "VERSION": ver})
        for ver in (1, version)
    }
    dkdv_turns = version == 3 or causal or d == 64
    for (one, new), dq_pass in zip(zip(plans[1], plans[version], strict=True), (True, False), strict=True):
        smem = bwd_smem_bytes(d, dq_pass=dq_pass)
        turns = True if dq_pass else dkdv_turns
        overlap = version in (5, 7) and dq_pass
        nc = 3 if version == 7 and d == 64 else 2
        smem_nc = bwd_smem_bytes(d, dq_pass=dq_pass, nc=nc)
        assert new.kernel is BWD_KERNEL[BF16, d, 4, causal, dq_pass, False, turns, overlap, nc, smem_nc]
        assert one.kernel is BWD_KERNEL[BF16, d, 4, causal, dq_pass, False, False, False, 2, smem]
        assert smem_nc == smem + (nc - 2) * 2 * 64 * d * 2  # two fixed tiles a consumer
        # 200 queries over 2 q heads, 130 keys over 1 kv head: 2 blocks of 128 or of 192;
        # 130 keys are one block of 192
        assert one.grid == ((2, 2, 1) if dq_pass else (2, 1, 1)) and one.block == 384
        grid = one.grid if nc == 2 or dq_pass else (1, 1, 1)
        assert (new.grid, new.block) == (grid, 512 if nc == 3 else 384)
        assert new.args == one.args


def test_backward_version_7_blocks_of_192_rows():
    """Version 7's passes at head_dim 64 cover 192 fixed rows a block: 3 blocks for 400
    queries and 2 for 300 keys, against version 5's 4 and 3 of 128."""
    from pytorch_custom_ops.attention_gpu import attention_bwd_gpu

    q, k, v = make(1, 2, 1, 400, 300, 64, BF16, "cpu")
    do, lse, delta, out = torch.empty_like(q), torch.empty(1, 2, 400), torch.empty(1, 2, 448, 2), torch.empty_like(q)
    inputs = [q, k, v, do, lse, out]
    outputs = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), delta, None]
    (dq7, dkdv7), (dq5, dkdv5) = (
        attention_bwd_gpu(outputs, inputs, {"CAUSAL": True, "SCALE": 0.1, "VERSION": ver}) for ver in (7, 5)
    )
    assert (dq7.grid, dq7.block, dq5.grid, dq5.block) == ((3, 2, 1), 512, (4, 2, 1), 384)
    assert (dkdv7.grid, dkdv7.block, dkdv5.grid, dkdv5.block) == ((2, 1, 1), 512, (3, 1, 1), 384)
    for seven, five in ((dq7, dq5), (dkdv7, dkdv5)):
        assert seven.kernel.params[-2] == 3 and five.kernel.params[-2] == 2 and seven.args == five.args


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_version_8_persistent_dq_plan_on_cpu(d, causal):
    """Version 8: version 7's dK/dV launch, and its dQ pass in a persistent grid: one
    block per SM at most (132 stand in on a CPU), which take the work tiles of 64 NC
    query rows from a counter (a 6th output, int32, zeroed), with two buffers of the
    fixed Q and dO beside the K/V stages."""
    from pytorch_custom_ops.attention_gpu import (
        DQ_PERSISTENT_KERNEL,
        SMEM_LIMIT,
        attention_bwd_gpu,
        dq_persistent_smem_bytes,
        dq_work_counter,
        tma_map,
    )

    q, k, v = make(2, 6, 3, 1000, 900, d, BF16, "cpu")
    do, lse, out = torch.empty_like(q), torch.empty(2, 6, 1000), torch.empty_like(q)
    pairs = torch.empty(2, 6, 1024, 2)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    work = dq_work_counter(8, "cpu")
    assert (work.dtype, work.tolist(), dq_work_counter(7, "cpu")) == (torch.int32, [0], None)
    inputs, outputs = [q, k, v, do, lse, out], [dq, dk, dv, pairs, None, work]
    params = {"CAUSAL": causal, "SCALE": 0.1, "VERSION": 8}
    dq8, dkdv8 = attention_bwd_gpu(outputs, inputs, params)
    dq7, dkdv7 = attention_bwd_gpu(outputs[:5], inputs, {**params, "VERSION": 7})
    for bad in ([], [None], [torch.zeros(1)], [torch.zeros(2, dtype=torch.int32)]):
        with pytest.raises(ValueError, match="work counter"):
            attention_bwd_gpu(outputs[:5] + bad, inputs, params)
    assert (dkdv8.kernel, dkdv8.grid, dkdv8.args) == (dkdv7.kernel, dkdv7.grid, dkdv7.args)
    nc, stages = (3, 4) if d == 64 else (2, 3)  # two fixed buffers leave head_dim 128 three stages
    smem = dq_persistent_smem_bytes(d, stages, nc)
    assert smem <= SMEM_LIMIT < dq_persistent_smem_bytes(d, stages + 1, nc) or stages == 4
    assert dq8.kernel is DQ_PERSISTENT_KERNEL[BF16, d, stages, causal, nc, smem]
    assert dq8.kernel.entry_directives == (".minnctapersm 1",)
    tiles = -(-1000 // (64 * nc)) * 6 * 2  # 6 or 8 query blocks x 12 (batch, head) pairs
    assert (dq8.grid, dq8.block, dq8.smem) == ((min(tiles, 132), 1, 1), 128 * (1 + nc), smem)
    # the dQ pass's arguments, reordered: maps (q, do, k, v, then out's, for L2 prefetches),
    # dq, lse, pairs, out, do, the counter, then Lq, Lk, heads, batch, group, the strides
    # of dq, out and do, the scales
    maps, (dst, _, lse_p, pairs_p, out_p, do_p) = dq7.args[:4], dq7.args[4:10]
    assert dq8.args[:5] == (*maps, tma_map(out, 64))
    assert dq8.args[5:11] == (dst, lse_p, pairs_p, out_p, do_p, work.data_ptr())
    assert dq8.args[11:16] == (1000, 900, 6, 2, 2)
    assert dq8.args[16:] == (*dq.stride()[:3], *out.stride()[:3], *do.stride()[:3], 0.1 * 1.4426950408889634, 0.1)


@pytest.mark.parametrize(
    ("d", "causal", "lk", "want"),
    [(64, c, lk, 8 if lk <= (1536 if c else 1024) else 7) for c in (False, True) for lk in (1, 1024, 1025, 1536, 1537)]
    + [(64, c, lk, 7) for c in (False, True) for lk in (2048, 4096, 16384)]
    + [(128, c, lk, 6 if lk >= 4096 else 5) for c in (False, True) for lk in (1, 2048, 4095, 4096, 16384)],
)
def test_auto_backward_version(d, causal, lk, want):
    """The default ("auto"): at head_dim 128 version 6 from 4096 keys and version 5 below,
    at head_dim 64 version 8 up to 1024 keys (1536 with the mask) and version 7 above;
    a version chosen by name is taken as it is."""
    from pytorch_custom_ops.attention_gpu import DEFAULT_BWD_VERSION, bwd_version

    assert DEFAULT_BWD_VERSION == "auto"
    assert bwd_version(d, causal, lk) == want
    with attention_bwd_version(3):
        assert bwd_version(d, causal, lk) == 3
    with attention_bwd_version("auto"):
        assert bwd_version(d, causal, lk) == want


def test_unknown_backward_version():
    from pytorch_custom_ops.attention_gpu import attention_bwd_version

    with pytest.raises(ValueError, match="unknown version 9"):
        with attention_bwd_version(9):
            pass


# -- CUDA: the Mojo kernel ---------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("version", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_forward_matches_float64(version, dtype, shape, causal):
    b, hq, hkv, lq, lk, d = shape
    q, k, v = make(b, hq, hkv, lq, lk, d, dtype, "cuda")
    with attention_version(version):
        out, lse = torch.ops.gpu_days.attention(q, k, v, causal, None)
    close(out, reference(q, k, v, causal), dtype)
    torch.testing.assert_close(lse.double(), lse2_reference(q, k, causal, 1 / math.sqrt(d)), atol=2e-3, rtol=1e-4)


@needs_cuda
@pytest.mark.parametrize("tile", [t for t in FWD_TILES if t != "128"])
@pytest.mark.parametrize("version", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", SHAPES[1:4] + [(2, 9, 3, 1999, 1531, 128), (1, 2, 1, 700, 1000, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_forward_tiles_match_float64(tile, version, shape, causal):
    """The other K/V tiles (SPLIT's separate K and V releases, 192 keys at head_dim 128)
    on ragged, GQA and causal problems, long enough that the two-stage ring wraps many
    times (and version 4 walks several work tiles a block); fp16 where the scores grow."""
    b, hq, hkv, lq, lk, d = shape
    q, k, v = make(b, hq, hkv, lq, lk, d, FP16, "cuda", seed=3, spread=3.0)
    with attention_version(version), attention_fwd_tile(tile):
        out, lse = torch.ops.gpu_days.attention(q, k, v, causal, None)
    close(out, reference(q, k, v, causal), FP16)
    torch.testing.assert_close(lse.double(), lse2_reference(q, k, causal, 1 / math.sqrt(d)), atol=2e-3, rtol=1e-4)


@needs_cuda
@pytest.mark.parametrize("tile", ["128", "128_split"])
@pytest.mark.parametrize("version", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "shape",
    [
        (1, 3, 1, 1000, 1000, 64),  # two consumers with no rows: past Lq, or causal before row 0
        (1, 2, 2, 1000, 333, 64),  # causal, Lq > Lk: every consumer past row 333 reads all keys
        (2, 2, 1, 200, 1000, 64),  # Lq < Lk; causal: the first block's consumers end at 1, 1 and 2 tiles
        (1, 2, 1, 1000, 1000, 128),
        (2, 2, 2, 333, 1000, 128),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_consumers_pass_the_tiles_their_rows_do_not_need(tile, version, shape, causal):
    """A block streams the K/V tiles its last rows need; a consumer whose rows end
    earlier (causal) or lie past Lq only takes its turns and frees those tiles
    (`pass_tiles`). Wrong counts would hang the block or let a stage be overwritten
    while another consumer reads it; wrong tiles would show in the output."""
    b, hq, hkv, lq, lk, d = shape
    q, k, v = make(b, hq, hkv, lq, lk, d, BF16, "cuda", seed=5)
    with attention_version(version), attention_fwd_tile(tile):
        out, lse = torch.ops.gpu_days.attention(q, k, v, causal, None)
    close(out, reference(q, k, v, causal), BF16)
    torch.testing.assert_close(lse.double(), lse2_reference(q, k, causal, 1 / math.sqrt(d)), atol=2e-3, rtol=1e-4)


@needs_cuda
@pytest.mark.parametrize("version", [1, 2, 3, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_long_sequences_and_large_logits(version, d):
    q, k, v = make(1, 2, 2, 1000, 2100, d, BF16, "cuda", spread=8.0)  # scores in the hundreds
    for causal in (False, True):
        with attention_version(version):
            out = pco.attention(q, k, v, causal=causal)
        close(out, reference(q, k, v, causal), BF16)


@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_persistent_blocks_walk_several_tiles(d, causal):
    """Version 4 with more work tiles than SMs: each block runs two or three tiles in a
    row (ragged, GQA, causal rows of different lengths), its stages and mbarrier phases
    going on from one tile to the next."""
    q, k, v = make(2, 9, 3, 1999, 1531, d, BF16, "cuda")
    with attention_version(4):
        out, lse = torch.ops.gpu_days.attention(q, k, v, causal, None)
    close(out, reference(q, k, v, causal), BF16)
    torch.testing.assert_close(lse.double(), lse2_reference(q, k, causal, 1 / math.sqrt(d)), atol=2e-3, rtol=1e-4)


@needs_cuda
def test_cuda_broadcast_kv_heads():
    """k and v expanded over heads (stride 0) are copied before TMA reads them."""
    q, k, v = make(1, 4, 1, 130, 130, 64, BF16, "cuda")
    ke, ve = k.expand(1, 4, 130, 64), v.expand(1, 4, 130, 64)
    close(pco.attention(q, ke, ve, causal=True), reference(q, k, v, True), BF16)


@needs_cuda
def test_cuda_causal_does_not_leak_future_keys():
    q, k, v = make(1, 2, 2, 200, 200, 64, BF16, "cuda")
    base = pco.attention(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 150:] = 100.0
    v2[:, :, 150:] = -100.0
    changed = pco.attention(q, k2, v2, causal=True)
    assert torch.equal(base[:, :, :150], changed[:, :, :150])


@needs_cuda
def test_cuda_strided_layouts():
    """(batch, seq, heads, head_dim) tensors viewed as (batch, heads, seq, head_dim): TMA
    reads them in place; a transposed head_dim is copied."""
    x = torch.randn(2, 97, 3 * 4, 64, device="cuda", dtype=BF16)
    q, k, v = x.view(2, 97, 3, 4, 64).permute(2, 0, 3, 1, 4).unbind(0)
    close(pco.attention(q, k, v), reference(q, k, v, False), BF16)
    qt = q.contiguous().transpose(-1, -2).contiguous().transpose(-1, -2)  # head_dim not unit-stride
    close(pco.attention(qt, k, v, causal=True), reference(q, k, v, True), BF16)


@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_contiguous_but_misaligned_inputs_are_copied(d):
    """x[1:] of a flat buffer is contiguous, 2 bytes past a 16-byte boundary: its own
    .contiguous(), which TMA refused (cuTensorMapEncodeTiled: invalid argument)."""
    shape = (3, 5, 129, d)

    def misaligned():
        t = torch.randn(math.prod(shape) + 1, device="cuda", dtype=BF16)[1:].view(shape)
        assert t.is_contiguous() and t.data_ptr() % 16 != 0
        return t.requires_grad_()

    q, k, v = misaligned(), misaligned(), misaligned()
    out = pco.attention(q, k, v, causal=True)
    ref = reference(q, k, v, True)
    close(out, ref, BF16)
    g = misaligned().detach()
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g.double())
    for a, r in zip(got, want, strict=True):
        close(a, r, BF16, factor=2)


# many key blocks: versions 2 and 6 add into the same dQ rows (atomics)
LONG_GRAD_SHAPES = [(1, 4, 2, 1100, 1300, 128), (2, 2, 1, 900, 700, 64)]


@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("lq, d", [(300, 64), (64, 128), (1, 128), (1000, 128)])
def test_cuda_version_6_zero_and_rows_launches(dtype, lq, d):
    """Version 6's first and last launches alone: the delta kernel zeroes every 64-row
    tile of dq32 (NaN before it), and the rows kernel writes dq32's rows in order, cast
    bit for bit as torch casts them (dq_from_pieces, checked on the CPU, is the order)."""
    from pytorch_custom_ops import direct
    from pytorch_custom_ops.attention_gpu import attention_bwd_gpu, dq32_shape, dq_from_pieces, pairs_rows

    q, k, v = make(2, 3, 1, lq, 70, d, dtype, "cuda", seed=5)
    do, out = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(2, 3, lq, device="cuda")
    pairs = torch.empty(2, 3, pairs_rows(lq), 2, device="cuda")
    dq32 = torch.full(dq32_shape(q, 6), float("nan"), device="cuda")
    dq = torch.full_like(q, float("nan"))
    delta, _, rows = attention_bwd_gpu(
        [dq, torch.empty_like(k), torch.empty_like(v), pairs, dq32],
        [q, k, v, do, lse, out],
        {"CAUSAL": False, "SCALE": 0.1, "VERSION": 6},
    )
    direct.run([delta], q.get_device())
    assert torch.equal(dq32, torch.zeros_like(dq32))
    dq32.normal_()
    direct.run([rows], q.get_device())
    assert torch.equal(dq, dq_from_pieces(dq32, lq).to(dtype))
    want = (do.float() * out.float()).sum(-1)
    torch.testing.assert_close(pairs[..., :lq, 1], want, rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("bwd", [1, 2, 3, 4, 5, 6, 7, 8, "auto"])
@pytest.mark.parametrize("dtype", [BF16, FP16])
# (1, 2, 1, 200, 450, 64): Lq < Lk at head_dim 64, where the dQ passes' consumers (three in
# version 7) stop at their own diagonal and pass the block's later key tiles. Version 7's
# dK/dV consumers pass the query tiles before their keys (with the mask; GQA in (2, 3, 1,
# 77, 77, 64) and (2, 2, 1, 900, 700, 64)) and, past Lk, every tile (128, 77, 450 and 700 keys)
@pytest.mark.parametrize(
    "shape", SHAPES + [(1, 4, 1, 700, 333, 64), (1, 2, 1, 200, 450, 64), (2, 2, 2, 64, 64, 128)] + LONG_GRAD_SHAPES
)
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_grads(bwd, dtype, shape, causal):
    b, hq, hkv, lq, lk, d = shape
    q, k, v = (t.requires_grad_() for t in make(b, hq, hkv, lq, lk, d, dtype, "cuda"))
    out = pco.attention(q, k, v, causal=causal)
    ref = reference(q, k, v, causal)
    g = torch.randn_like(out)
    with attention_bwd_version(bwd):
        got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g.double())
    for a, r in zip(got, want, strict=True):
        close(a, r, dtype, factor=2)


@needs_cuda
@pytest.mark.parametrize("bwd", ["auto", 8])
@pytest.mark.parametrize("lq, d", [(1000, 64), (700, 128)])
def test_cuda_causal_first_block_idle_consumers_store_nothing(lq, d, bwd):
    """With the mask, the forward's and the dQ pass's query blocks end at the last row
    (block_first_row): at these lengths the first block's first consumers (two at
    head_dim 64, one at 128) hold rows before row 0, and must store nothing there. Such
    rows are the previous head's last ones. With 96 heads, the forward's walk and the dQ
    pass run those blocks after the rows they could overwrite; a store would show there
    (in out and lse, or through the (lse2, delta) pairs in dk and dv). Version 8's
    persistent dQ pass walks 576 (head_dim 64) or 384 work tiles on at most 132 blocks."""
    q, k, v = (t.requires_grad_() for t in make(2, 48, 48, lq, lq, d, BF16, "cuda", seed=7))
    out, lse = torch.ops.gpu_days.attention(q, k, v, True, None)
    ref = reference(q, k, v, True)
    close(out, ref, BF16)
    torch.testing.assert_close(lse.double(), lse2_reference(q, k, True, 1 / math.sqrt(d)), atol=2e-3, rtol=1e-4)
    g = torch.randn_like(out)
    with attention_bwd_version(bwd):
        got = torch.autograd.grad(pco.attention(q, k, v, causal=True), (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g.double())
    for a, r in zip(got, want, strict=True):
        close(a, r, BF16, factor=2)


@needs_cuda
@pytest.mark.parametrize("bwd", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_grads_of_a_strided_incoming_gradient(bwd, d):
    """The dQ pass reads dO and O by their strides for delta = rowsum(dO * O): a
    (batch, seq, heads, head_dim) view, and one TMA cannot read (copied first)."""
    q, k, v = (t.requires_grad_() for t in make(2, 3, 3, 200, 170, d, BF16, "cuda"))
    want_out = reference(q, k, v, False)
    for g in (
        torch.randn(2, 200, 3, d, device="cuda", dtype=BF16).transpose(1, 2),
        torch.randn(2, 3, 200, d + 8, device="cuda", dtype=BF16)[..., 4 : d + 4],  # rows off by 8 B
    ):
        with attention_bwd_version(bwd):
            got = torch.autograd.grad(pco.attention(q, k, v), (q, k, v), g)
        want = torch.autograd.grad(want_out, (q, k, v), g.double(), retain_graph=True)
        for a, r in zip(got, want, strict=True):
            close(a, r, BF16, factor=2)


@needs_cuda
@pytest.mark.parametrize("bwd", [1, 2, 3, 4, 5, 6, 7, 8])
def test_cuda_grads_strided_and_graph(bwd):
    """Grads of (batch, seq, heads, head_dim) views, and a captured forward + backward."""
    with attention_bwd_version(bwd):
        grads_strided_and_graph()


def grads_strided_and_graph():
    x = torch.randn(2, 150, 3, 2, 64, device="cuda", dtype=BF16, requires_grad=True)
    q, k, v = x.permute(2, 0, 3, 1, 4).unbind(0)
    g = torch.randn(2, 2, 150, 64, device="cuda", dtype=BF16)
    (got,) = torch.autograd.grad(pco.attention(q, k, v, causal=True), x, g)
    (want,) = torch.autograd.grad(reference(q, k, v, True), x, g.double())
    close(got, want, BF16, factor=2)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the capture
        torch.autograd.grad(pco.attention(qs, ks, vs), (qs, ks, vs), g)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        grads = torch.autograd.grad(pco.attention(qs, ks, vs), (qs, ks, vs), g)
    graph.replay()
    torch.cuda.synchronize()
    want = torch.autograd.grad(reference(qs, ks, vs, False), (qs, ks, vs), g.double())
    for a, r in zip(grads, want, strict=True):
        close(a, r, BF16, factor=2)


@needs_cuda
def test_cuda_graph_and_side_stream():
    q, k, v = make(2, 2, 2, 256, 256, 64, FP16, "cuda")
    want = pco.attention(q, k, v, causal=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        on_side = pco.attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(on_side, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = pco.attention(q, k, v, causal=True)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    close(captured, reference(q, k, v, True), FP16)


@needs_cuda
def test_cuda_compile_fullgraph():
    q, k, v = make(1, 2, 2, 129, 129, 128, BF16, "cuda")
    fn = torch.compile(lambda a, b, c: pco.attention(a, b, c, causal=True), fullgraph=True)
    close(fn(q, k, v), reference(q, k, v, True), BF16)
