"""Day 012: the softmax family (Mojo) vs torch eager and torch.compile.

Bytes models (the least each op can move): a forward reads x and writes y (2 tensors),
a backward reads grad_output and output and writes grad_input (3 tensors).
"""

import torch

import pytorch_custom_ops as pco

from ..harness import Case, compiled

SHAPES = {
    "quick": [(64, 1000), (256, 4096)],
    "full": [(32768, 256), (32768, 1024), (32768, 4096), (16384, 16384), (4096, 32000), (4096, 128256)],
}
DTYPES = {"cpu": [torch.float32], "cuda": [torch.float32, torch.bfloat16]}


def _x(shape, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(3).to(dtype),)


def _grad_and_output(log: bool):
    def make(shape, dtype, device):
        (x,) = _x(shape, dtype, device)
        g = torch.Generator(device=device).manual_seed(1)
        grad = torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)
        y = (torch.log_softmax if log else torch.softmax)(x.float(), -1).to(dtype)
        return grad, y

    return make


def _softmax_bwd_math(g, y):
    return y * (g - (g * y).sum(-1, keepdim=True))


def _log_softmax_bwd_math(g, y):
    return g - torch.exp(y) * g.sum(-1, keepdim=True)


def _bytes(tensors: int):
    return lambda shape, dtype: tensors * shape[0] * shape[1] * dtype.itemsize


def _forward_case(op, ours, theirs):
    return Case(
        day="day012",
        op=op,
        impls={
            "torch": lambda x: theirs(x, dim=-1),
            "torch_compile": compiled(lambda x: theirs(x, dim=-1)),
            "mojo": lambda x: ours(x, -1),
        },
        make_inputs=_x,
        reference=lambda x: theirs(x.double(), dim=-1),
        bytes_moved=_bytes(2),
        shapes=SHAPES,
        dtypes=DTYPES,
        cuda_only=("torch_compile",),
    )


def _backward_case(op, ours, math, log):
    return Case(
        day="day012",
        op=op,
        impls={
            # the aten kernels autograd runs for torch.softmax / torch.log_softmax
            "torch": (
                (lambda g, y: torch._log_softmax_backward_data(g, y, -1, y.dtype))
                if log
                else (lambda g, y: torch._softmax_backward_data(g, y, -1, y.dtype))
            ),
            "torch_compile": compiled(math),
            "mojo": lambda g, y: ours(g, y, -1),
        },
        make_inputs=_grad_and_output(log),
        reference=lambda g, y: math(g.double(), y.double()),
        bytes_moved=_bytes(3),
        shapes=SHAPES,
        dtypes=DTYPES,
        cuda_only=("torch_compile",),
    )


CASES = [
    _forward_case("softmax", pco.softmax, torch.softmax),
    _forward_case("log_softmax", pco.log_softmax, torch.log_softmax),
    _backward_case("softmax_backward", pco.softmax_backward, _softmax_bwd_math, log=False),
    _backward_case("log_softmax_backward", pco.log_softmax_backward, _log_softmax_bwd_math, log=True),
]
