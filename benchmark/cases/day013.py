"""Day 013: LayerNorm forward and backward (Mojo) vs torch eager and torch.compile.

Bytes models (s = bytes per element, N = rows * cols), what an ideal kernel must move:
- forward:  read x, write y = 2 N s, plus weight and bias (2 cols s) and the float32
  mean and rstd (8 rows);
- backward: read dy and x, write dx = 3 N s, plus weight, grad_weight and grad_bias
  (3 cols s) and the saved mean and rstd (8 rows).
Each backward impl starts from the same saved float32 mean and rstd and computes all
three gradients; only grad_x is compared with the float64 reference here (the tests
check grad_weight and grad_bias), so no concatenation is timed.
"""

import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco

from ..harness import Case, compiled

SHAPES = {
    "quick": [(64, 1000), (512, 1024), (256, 4096)],
    "full": [(4096, 1024), (4096, 4096), (4096, 16384), (32768, 4096)],
}
DTYPES = {"cpu": [torch.float32], "cuda": [torch.float32, torch.bfloat16]}


def _params(cols, dtype, device, g):
    w = (1 + 0.5 * torch.randn(cols, generator=g, device=device)).to(dtype)
    b = (0.5 * torch.randn(cols, generator=g, device=device)).to(dtype)
    return w, b


def _forward_inputs(shape, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, generator=g, device=device).mul_(2).add_(1).to(dtype)
    return (x, *_params(shape[1], dtype, device, g))


def _backward_inputs(shape, dtype, device):
    x, w, b = _forward_inputs(shape, dtype, device)
    g = torch.Generator(device=device).manual_seed(1)
    dy = torch.randn(shape, generator=g, device=device).to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    var, mean = torch.var_mean(x.to(acc), dim=1, unbiased=False)
    rstd = torch.rsqrt(var + 1e-5)
    return dy, x, w, b, mean.float(), rstd.float()


def _forward_reference(x, w, b):
    return F.layer_norm(x.double(), x.shape[-1:], w.double(), b.double(), 1e-5)


def _backward_reference(dy, x, w, b, mean, rstd):
    xd = x.double().requires_grad_()
    F.layer_norm(xd, x.shape[-1:], w.double(), b.double(), 1e-5).backward(dy.double())
    return xd.grad


def _torch_backward(dy, x, w, b, mean, rstd):
    cols = x.shape[-1]
    return torch.ops.aten.native_layer_norm_backward(
        dy, x, [cols], mean[:, None], rstd[:, None], w, b, [True, True, True]
    )[0]


def _mojo_backward(dy, x, w, b, mean, rstd):
    return pco.layer_norm_backward(dy, x, (x.shape[-1],), w, mean, rstd)[0]


def _forward_bytes(shape, dtype):
    rows, cols = shape
    return 2 * rows * cols * dtype.itemsize + 2 * cols * dtype.itemsize + 8 * rows


def _backward_bytes(shape, dtype):
    rows, cols = shape
    return 3 * rows * cols * dtype.itemsize + 3 * cols * dtype.itemsize + 8 * rows


CASES = [
    Case(
        day="day013",
        op="layer_norm",
        impls={
            "torch": lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5),
            "torch_compile": compiled(lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5)),
            "mojo": lambda x, w, b: pco.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
        },
        make_inputs=_forward_inputs,
        reference=_forward_reference,
        bytes_moved=_forward_bytes,
        shapes=SHAPES,
        dtypes=DTYPES,
        cuda_only=("torch_compile",),
    ),
    Case(
        day="day013",
        op="layer_norm_backward",
        impls={"torch": _torch_backward, "torch_compile": compiled(_torch_backward), "mojo": _mojo_backward},
        make_inputs=_backward_inputs,
        reference=_backward_reference,
        bytes_moved=_backward_bytes,
        shapes=SHAPES,
        dtypes=DTYPES,
        cuda_only=("torch_compile",),
    ),
]
