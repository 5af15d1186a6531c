"""Day 009 smoke test: the online softmax op against a float64 reference."""

import pytest
import torch

import pytorch_custom_ops as pco

# float64 1e-13: Mojo 1.2's own float64 exp was ~3e-13 off (days/day009/exp_f64.mojo)
TOL = {torch.float32: 2e-6, torch.float64: 1e-13, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def reference(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.softmax(x.double(), dim=dim)


def check(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    y = pco.online_softmax(x, dim)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert torch.isfinite(y).all()
    want = reference(x, dim)
    # relative per element; the absolute floor scales with 1/n so tiny outputs of long
    # rows are still checked (a drifting row sum shows up here)
    n = x.shape[dim] if x.dim() else 1
    torch.testing.assert_close(y.double(), want, rtol=TOL[x.dtype], atol=TOL[x.dtype] / n)
    torch.testing.assert_close(y.double().sum(dim), torch.ones_like(want.sum(dim)), atol=TOL[x.dtype] * 8, rtol=0)
    return y


def test_mojo_path_is_live():
    assert pco.use_mojo("online_softmax"), pco.online_softmax_kernel.failure


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (7, 1000), (3, 4097), (256, 33), (1, 70000)])
def test_fp32_shapes(shape, device):
    torch.manual_seed(sum(shape))
    check(torch.randn(shape, device=device) * 3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes(dtype, device):
    torch.manual_seed(1)
    check(torch.randn(37, 1000, device=device).to(dtype) * 4)


@pytest.mark.parametrize("scale", [100.0, 1e4])
def test_large_magnitudes_stay_finite(scale, device):
    torch.manual_seed(2)
    x = (torch.rand(16, 513, device=device) * 2 - 1) * scale
    x[:, 7] = scale  # a shared maximum; exp without the max shift would overflow
    check(x)


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2])
def test_any_dim_and_layout(dim, device):
    torch.manual_seed(3)
    x = torch.randn(5, 6, 7, device=device)
    check(x, dim)
    check(x.transpose(0, 2), dim)  # non-contiguous input


def test_masked_entries_and_row(device):
    x = torch.randn(4, 9, device=device)
    x[0, :4] = float("-inf")  # partly masked row: those entries get exactly 0
    y = pco.online_softmax(x)
    assert (y[0, :4] == 0).all()
    torch.testing.assert_close(y[1:].double(), reference(x[1:], -1), atol=2e-6, rtol=2e-6)
    x[2] = float("-inf")  # a fully masked row is nan, as in torch
    x[3, 5] = float("nan")  # so is a row holding a nan (Mojo's max() and exp() drop nans)
    y = pco.online_softmax(x)
    assert torch.isnan(y[2:]).all() and not torch.isnan(y[:2]).any()
    assert torch.equal(torch.isnan(y), torch.isnan(torch.softmax(x, -1)))


def test_scalar_and_empty(device):
    assert pco.online_softmax(torch.tensor(3.0, device=device)).item() == 1.0
    assert pco.online_softmax(torch.empty(0, 5, device=device)).shape == (0, 5)
    assert pco.online_softmax(torch.empty(5, 0, device=device)).shape == (5, 0)  # a zero-length softmax dim
    assert pco.online_softmax(torch.empty(2, 0, 3, device=device), dim=1).shape == (2, 0, 3)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(TypeError, match="online_softmax: dtype torch.int64"):
        pco.online_softmax(torch.arange(6).reshape(2, 3))
    with pytest.raises(IndexError, match="online_softmax: dim 2 is out of range"):
        pco.online_softmax(torch.randn(2, 3), dim=2)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        pco.online_softmax([1.0, 2.0])
    with pytest.raises(TypeError, match="dim must be an int"):
        pco.online_softmax(torch.randn(2, 3), dim=1.0)
    with pytest.raises(ValueError, match="device meta is not supported"):
        pco.online_softmax(torch.randn(2, 3, device="meta"))


def test_module_matches_functional(device):
    x = torch.randn(8, 100, device=device)
    module = pco.MojoSoftmax(dim=-1)
    assert module.use_mojo
    torch.testing.assert_close(module(x), pco.online_softmax(x))
