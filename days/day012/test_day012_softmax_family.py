"""Day 012 smoke tests: softmax, log_softmax and their backwards against float64 references."""

import pytest
import torch

import pytorch_custom_ops as pco

# relative tolerance per dtype; softmax outputs are also checked with an absolute floor
# that shrinks with the row length, so the small outputs of long rows still count
TOL = {torch.float32: 3e-6, torch.float64: 1e-10, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

FORWARD = {
    "softmax": (pco.softmax, torch.softmax),
    "log_softmax": (pco.log_softmax, torch.log_softmax),
}


def ref_backward(name, g, y, dim):
    """float64 backward from the float64 forward output y."""
    if name == "softmax":
        return y * (g - (g * y).sum(dim, keepdim=True))
    return g - torch.exp(y) * g.sum(dim, keepdim=True)


def check_forward(name, x, dim=-1):
    ours, theirs = FORWARD[name]
    y = ours(x, dim)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    want = theirs(x.double(), dim)
    n = max(x.shape[dim], 1) if x.dim() else 1
    tol = TOL[x.dtype]
    if name == "softmax":
        torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol / n)
    else:  # log-probabilities: relative to the row's scale
        torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * (1 + want.abs().amax()))
    return y


def check_backward(name, x, dim=-1):
    torch.manual_seed(x.numel())
    y64 = FORWARD[name][1](x.double(), dim)
    g = torch.randn_like(x)
    y = y64.to(x.dtype)  # the forward output as the forward would have stored it
    ours = pco.softmax_backward if name == "softmax" else pco.log_softmax_backward
    dx = ours(g, y, dim)
    assert dx.shape == x.shape and dx.dtype == x.dtype
    want = ref_backward(name, g.double(), y.double(), dim)
    tol = TOL[x.dtype]
    torch.testing.assert_close(dx.double(), want, rtol=tol, atol=tol * (1 + want.abs().amax()))


def test_mojo_paths_are_live():
    for op in ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward"):
        assert pco.use_mojo(op), pco.KERNELS[op].failure


# 1 and 37: scalar loads; 256, 1000: a warp per row; 4097: unaligned, a block per row
@pytest.mark.parametrize("shape", [(3, 1), (9, 37), (64, 256), (7, 1000), (3, 4097), (2, 40000)])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_forward_fp32_shapes(name, shape, device):
    torch.manual_seed(sum(shape))
    check_forward(name, torch.randn(shape, device=device) * 4)


@pytest.mark.parametrize("shape", [(3, 1), (9, 37), (7, 1000), (3, 4097)])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_backward_fp32_shapes(name, shape, device):
    torch.manual_seed(sum(shape))
    check_backward(name, torch.randn(shape, device=device) * 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_forward_other_dtypes(name, dtype, device):
    torch.manual_seed(5)
    check_forward(name, (torch.randn(33, 1024, device=device) * 4).to(dtype))
    check_forward(name, (torch.randn(5, 999, device=device) * 4).to(dtype))  # unaligned rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_backward_other_dtypes(name, dtype, device):
    torch.manual_seed(6)
    check_backward(name, (torch.randn(33, 1024, device=device) * 4).to(dtype))


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_every_dim_and_layout(name, dim, device):
    torch.manual_seed(7)
    x = torch.randn(5, 6, 7, device=device) * 3
    check_forward(name, x, dim)
    check_forward(name, x.transpose(0, 2), dim)  # non-contiguous
    check_backward(name, x, dim)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_large_magnitudes(name, device):
    torch.manual_seed(8)
    x = (torch.rand(16, 513, device=device) * 2 - 1) * 1e4
    x[:, 100] = 1e4  # exp without the max shift would overflow
    check_forward(name, x)
    check_forward(name, x + 1e4)  # a large common offset cancels


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_masked_rows_and_nan_match_torch(name, device):
    ours, theirs = FORWARD[name]
    x = torch.randn(5, 300, device=device)
    x[0, :100] = float("-inf")  # partly masked: softmax 0 / log_softmax -inf there
    x[2] = float("-inf")  # fully masked: NaN, like torch
    x[3, 7] = float("nan")  # a NaN poisons its row
    x[4, 9] = float("inf")  # so does +inf (inf - inf)
    y, want = ours(x, -1), theirs(x, -1)
    assert torch.equal(torch.isnan(y), torch.isnan(want))
    assert torch.equal(torch.isneginf(y), torch.isneginf(want))
    ok = ~torch.isnan(want) & torch.isfinite(want)
    torch.testing.assert_close(y[ok], want[ok], rtol=3e-6, atol=3e-6)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_gradcheck_and_gradgradcheck(name, device):
    x = torch.randn(3, 11, dtype=torch.float64, device=device, requires_grad=True)
    fn = FORWARD[name][0]
    assert torch.autograd.gradcheck(lambda t: fn(t, 1), (x,))
    assert torch.autograd.gradgradcheck(lambda t: fn(t, 0), (x,))


def test_autograd_runs_the_mojo_backward(monkeypatch, device):
    calls = []
    kernel = pco.KERNELS["softmax_backward"]
    original = type(kernel).__call__

    def spy(self, inputs, *args, **kwargs):
        calls.append(self.spec.name)
        return original(self, inputs, *args, **kwargs)

    monkeypatch.setattr(type(kernel), "__call__", spy)
    x = torch.randn(4, 50, device=device, requires_grad=True)
    pco.softmax(x, -1).sum().backward()
    pco.online_softmax(x, -1).pow(2).sum().backward()  # day009's op uses the same backward
    assert calls.count("softmax_backward") == 2


@pytest.mark.parametrize(
    "op, args",
    [
        ("softmax", lambda d: (torch.randn(4, 9, device=d), 1)),
        ("log_softmax", lambda d: (torch.randn(4, 9, device=d), 0)),
        ("softmax_backward", lambda d: (torch.randn(4, 9, device=d), torch.rand(4, 9, device=d), 1)),
        ("log_softmax_backward", lambda d: (torch.randn(4, 9, device=d), torch.randn(4, 9, device=d), 1)),
    ],
)
def test_opcheck(op, args, device):
    torch.library.opcheck(getattr(torch.ops.gpu_days, op).default, args(device))


def test_torch_compile_fullgraph_forward_and_backward(device):
    torch._dynamo.reset()

    def f(t):
        return pco.log_softmax(pco.softmax(t, 0) * 3, -1)

    x = torch.randn(6, 10, device=device, requires_grad=True)
    y = torch.compile(f, fullgraph=True)(x)
    y.sum().backward()
    x_ref = x.detach().double().requires_grad_(True)
    y_ref = torch.log_softmax(torch.softmax(x_ref, 0) * 3, -1)
    y_ref.sum().backward()
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), x_ref.grad, atol=1e-5, rtol=1e-5)


def test_modules_train_like_torch_modules(device):
    torch.manual_seed(9)
    ours = torch.nn.Sequential(torch.nn.Linear(8, 5), pco.MojoLogSoftmax(-1)).to(device)
    theirs = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.LogSoftmax(-1)).to(device)
    theirs.load_state_dict(ours.state_dict())
    x, target = torch.randn(16, 8, device=device), torch.randint(0, 5, (16,), device=device)
    for model in (ours, theirs):
        torch.nn.functional.nll_loss(model(x), target).backward()
    assert ours[1].use_mojo and pco.MojoSoftmax().use_mojo
    torch.testing.assert_close(ours[0].weight.grad, theirs[0].weight.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(pco.MojoSoftmax(0)(x), torch.softmax(x, 0), atol=1e-6, rtol=1e-5)


def test_scalar_and_empty(device):
    assert pco.softmax(torch.tensor(3.0, device=device)).item() == 1.0
    assert pco.log_softmax(torch.tensor(3.0, device=device)).item() == 0.0
    assert pco.softmax(torch.empty(0, 5, device=device)).shape == (0, 5)
    assert pco.log_softmax(torch.empty(2, 0, 3, device=device), dim=1).shape == (2, 0, 3)
    e = torch.empty(4, 0, device=device)
    assert pco.softmax_backward(e, e, -1).shape == (4, 0)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(TypeError, match="log_softmax: dtype torch.int64"):
        pco.log_softmax(torch.arange(6).reshape(2, 3))
    with pytest.raises(IndexError, match="softmax: dim 2 is out of range"):
        pco.softmax(torch.randn(2, 3), dim=2)
    with pytest.raises(ValueError, match=r"softmax_backward: grad_output has shape \(2, 3\) but output has \(3, 2\)"):
        pco.softmax_backward(torch.randn(2, 3), torch.randn(3, 2))
    mixed = "log_softmax_backward: grad_output is torch.float32 but output is torch.float64"
    with pytest.raises(TypeError, match=mixed):
        pco.log_softmax_backward(torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="softmax: expected a torch.Tensor"):
        pco.softmax([1.0, 2.0])
