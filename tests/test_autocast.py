"""gpu-days ops under torch.autocast, as mixed-precision training uses them.

An eager call skips the dispatcher, where autocast would cast a registered op's inputs, so
each public function applies torch's CUDA policy itself: GEMMs in the autocast dtype,
LayerNorm and the softmaxes in float32, cross-entropy on the logits as given with a float32
loss. Checked on the CPU (autocast to bfloat16) and on CUDA when present.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco


def _autocast(device):
    return torch.autocast(device, dtype=torch.bfloat16)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_gemm_and_mojogemm_run_in_the_autocast_dtype(device):
    torch.manual_seed(0)
    x = torch.randn(6, 33, device=device, requires_grad=True)
    linear = torch.nn.Linear(33, 17).to(device)
    ours = pco.MojoGEMM(33, 17).to(device)
    ours.load_state_dict(linear.state_dict())
    a, b = torch.randn(5, 7, device=device), torch.randn(7, 9, device=device)
    with _autocast(device):
        y = ours(x)
        ref = linear(x)
        mm = pco.gemm(a, b)
        bmm = pco.gemm_batched(a[None], b[None])
    assert y.dtype == ref.dtype == mm.dtype == bmm.dtype == torch.bfloat16
    assert rel(y, ref) < 1e-2
    assert rel(mm, a.bfloat16().double() @ b.bfloat16().double()) < 1e-2
    y.float().sum().backward()
    grad_ours = (x.grad.clone(), ours.weight.grad.clone())
    x.grad = None
    ref.float().sum().backward()
    assert x.grad.dtype == ours.weight.grad.dtype == torch.float32  # leaves keep their dtype
    assert rel(grad_ours[0], x.grad) < 2e-2 and rel(grad_ours[1], linear.weight.grad) < 2e-2


def test_linear_and_mlp_take_low_precision_activations_and_float32_parameters(device):
    """Inside a mixed-precision model the activations arrive in bfloat16 (a LayerNorm's
    output) while the parameters are float32: both are cast, as F.linear does, not refused."""
    torch.manual_seed(1)
    x = torch.randn(40, 32, device=device).bfloat16().requires_grad_()
    fc, proj = torch.nn.Linear(32, 64).to(device), torch.nn.Linear(64, 32).to(device)
    with _autocast(device):
        y = pco.mlp(x, fc.weight, fc.bias, proj.weight, proj.bias)
        z = pco.linear(x, fc.weight, fc.bias, "gelu_tanh")
        want = proj(F.gelu(fc(x), approximate="tanh"))
    assert y.dtype == z.dtype == torch.bfloat16
    z_want = F.gelu(F.linear(x.double(), fc.weight.double(), fc.bias.double()), approximate="tanh")
    assert rel(y, want) < 2e-2 and rel(z, z_want) < 2e-2
    y.float().sum().backward()
    got = (x.grad.clone(), fc.weight.grad.clone(), proj.bias.grad.clone())
    x.grad = fc.weight.grad = proj.bias.grad = None
    want.float().sum().backward()
    assert got[1].dtype == torch.float32  # the float32 leaf's gradient, through the cast
    for ours, ref in zip(got, (x.grad, fc.weight.grad, proj.bias.grad), strict=True):
        assert rel(ours, ref) < 3e-2


def test_layer_norm_and_softmax_run_in_float32(device):
    x = torch.randn(4, 64, device=device).bfloat16()
    w, b = torch.randn(64, device=device), torch.randn(64, device=device)
    with pytest.raises(TypeError, match="weight is torch.float32 but the input is torch.bfloat16"):
        pco.layer_norm(x, 64, w, b)  # mixed dtypes are an error outside autocast
    with _autocast(device):
        y = pco.layer_norm(x, 64, w, b)
        p = pco.softmax(x, -1)
        lp = pco.log_softmax(x, -1)
    assert y.dtype == p.dtype == lp.dtype == torch.float32
    torch.testing.assert_close(y, F.layer_norm(x.float(), (64,), w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p, torch.softmax(x.float(), -1))
    torch.testing.assert_close(lp, torch.log_softmax(x.float(), -1))


def test_cross_entropy_reads_low_precision_logits_and_returns_float32(device):
    logits = torch.randn(8, 300, device=device).bfloat16().requires_grad_()
    targets = torch.randint(0, 300, (8,), device=device)
    with _autocast(device):
        loss = pco.cross_entropy(logits, targets)
        ref = F.cross_entropy(logits, targets)
    assert loss.dtype == ref.dtype == torch.float32
    assert abs(loss.item() - F.cross_entropy(logits.double(), targets).item()) < 1e-4
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16


def test_float64_is_left_alone_as_torch_autocast_does(device):
    """torch.autocast casts no float64 tensor: torch.mm, F.linear, F.layer_norm, softmax and
    F.cross_entropy stay float64 inside it, and so must the ops (they ran in bf16/float32)."""
    torch.manual_seed(2)
    a, b = torch.randn(5, 7, device=device, dtype=torch.float64), torch.randn(7, 9, device=device, dtype=torch.float64)
    w, bias = b.t().contiguous(), torch.randn(9, device=device, dtype=torch.float64)
    targets = torch.randint(0, 7, (5,), device=device)
    with _autocast(device):
        got = {
            "gemm": (pco.gemm(a, b), a @ b),
            "gemm_batched": (pco.gemm_batched(a[None], b[None]), (a @ b)[None]),
            "linear": (pco.linear(a, w, bias), F.linear(a, w, bias)),
            "mlp": (pco.mlp(a, w, bias, b, None), F.linear(F.gelu(F.linear(a, w, bias), approximate="tanh"), b)),
            "layer_norm": (pco.layer_norm(a, 7), F.layer_norm(a, (7,))),
            "softmax": (pco.softmax(a, -1), torch.softmax(a, -1)),
            "cross_entropy": (pco.cross_entropy(a, targets), F.cross_entropy(a, targets)),
        }
    for name, (ours, ref) in got.items():
        assert ours.dtype == ref.dtype == torch.float64, name
        torch.testing.assert_close(ours, ref, msg=name)


def test_long_softmax_runs_in_float32(device):
    x = torch.randn(4, 300, device=device).bfloat16()
    with _autocast(device):
        p = pco.long_softmax(x, -1)
    assert p.dtype == torch.float32  # as pco.softmax, torch's CUDA policy for softmax
    torch.testing.assert_close(p, torch.softmax(x.float(), -1))


def test_attention_casts_float32_inputs_to_the_autocast_dtype(device):
    """SDPA under autocast runs float32 q, k, v (say after a float32 rotary embedding) in the
    autocast dtype; attention refused them with a TypeError."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 64, device=device, requires_grad=True) for _ in range(3))
    with _autocast(device):
        out = pco.attention(q, k, v, causal=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert rel(out, F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)) < 2e-2
    out.float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.float32  # through the casts
