"""What a gpu-days autograd node costs in a backward besides its own kernels (day 016).

An op with outputs nobody differentiates (LayerNorm's mean and rstd, attention's lse,
cross-entropy's lse and scale) must not make autograd fill zero gradients for them: each
one is an allocation and a fill kernel per backward, tens of microseconds on the H100's
host. The count of such ops in a backward is the same on the CPU, where this runs.
"""

from __future__ import annotations

import pytest
import torch

import pytorch_custom_ops as pco

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FILLS = {"aten::zeros", "aten::zero_", "aten::fill_", "aten::zeros_like"}


def _fills_in_backward(out: torch.Tensor, grad: torch.Tensor) -> list[str]:
    """The fill ops a backward from `out` runs (the gradient given: no ones_like for it)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.backward(grad)
    return [e.name for e in prof.events() if e.name in FILLS]


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_backward_fills_no_zero_gradients(device):
    torch.manual_seed(0)
    m = pco.MojoLayerNorm(33).to(device)
    x = torch.randn(5, 33, device=device, requires_grad=True)
    ref = torch.nn.LayerNorm(33).to(device)
    ref.load_state_dict(m.state_dict())
    xr = x.detach().clone().requires_grad_()
    g = torch.randn(5, 33, device=device)
    assert _fills_in_backward(m(x), g) == []
    ref(xr).backward(g)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(m.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_backward_fills_no_zero_gradients(device):
    torch.manual_seed(0)
    logits = torch.randn(6, 37, device=device, requires_grad=True)
    targets = torch.randint(0, 37, (6,), device=device)
    assert _fills_in_backward(pco.cross_entropy(logits, targets), torch.ones((), device=device)) == []
    expect = torch.func.grad(lambda z: torch.nn.functional.cross_entropy(z, targets))(logits.detach().double())
    torch.testing.assert_close(logits.grad.double(), expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_a_gemm_backward_skips_the_public_checks_and_a_double_backward_keeps_them(device, monkeypatch):
    """The products of a GEMM's backward take operands that passed the forward's checks:
    a plain backward goes straight to the kernel. A double backward (grad mode on in the
    backward) must still go through the public function and its autograd."""
    import sys

    gemm_module = sys.modules["pytorch_custom_ops.gemm"]
    checked = []
    real = gemm_module.check_gemm_args
    monkeypatch.setattr(gemm_module, "check_gemm_args", lambda *a: checked.append(a[0]) or real(*a))
    torch.manual_seed(0)
    a = torch.randn(7, 5, device=device, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 5, device=device, dtype=torch.float64, requires_grad=True)
    c = torch.randn(3, device=device, dtype=torch.float64, requires_grad=True)
    y = pco.gemm(a, b, c, 0.5, 1.0, False, True)  # y = 0.5 a b^T + c
    checked.clear()
    g = torch.randn(7, 3, device=device, dtype=torch.float64)
    y.backward(g)
    assert checked == []
    torch.testing.assert_close(a.grad, 0.5 * g @ b.detach())
    torch.testing.assert_close(b.grad, 0.5 * g.t() @ a.detach())
    torch.testing.assert_close(c.grad, g.sum(0))
    # double backward: d/da of sum(grad_b) where grad_b = 0.5 g^T a
    a.grad = b.grad = c.grad = None
    (grad_b,) = torch.autograd.grad(pco.gemm(a, b, None, 0.5, 0.0, False, True), b, g, create_graph=True)
    assert checked  # the public path ran inside the backward
    (second,) = torch.autograd.grad(grad_b.sum(), a)
    torch.testing.assert_close(second, 0.5 * g.sum(1, keepdim=True).expand(7, 5))
