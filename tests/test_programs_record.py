"""What a recording may turn into a program (`pytorch_custom_ops/programs.py`), without a GPU.

A program replays a function's op calls from C++ and nothing else. So a function that
edits an op's output in place (day 014's float64 GEMM once scaled its product with
`mul_`) must not become one: its replay would return the unedited output.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import pytorch_custom_ops as pco
from pytorch_custom_ops import programs


def _recorded(edit):
    x = torch.randn(4)
    out = torch.empty(4)
    rec = programs.Recorder()
    rec.steps.append(("book", None, [x], [out], [out._version]))
    edit(out)
    return rec, x, out


def test_an_op_output_left_as_it_was_makes_a_program():
    rec, x, out = _recorded(lambda t: None)
    constants, steps, outputs = programs._build(rec, [x], [out])[:3]
    assert len(steps) == 1 and outputs


def test_an_op_output_edited_in_place_does_not_replay():
    rec, x, out = _recorded(lambda t: t.mul_(0.1))
    with pytest.raises(programs._Unresolved, match="modified in place after the call"):
        programs._build(rec, [x], [out])


LAYERS = {  # each layer whose backward goes through `replayed_backward`
    "MojoGEMM": lambda: pco.MojoGEMM(12, 8),
    "MojoLinear": lambda: pco.MojoLinear(12, 8, activation="gelu_tanh"),
    "MojoMLP": lambda: pco.MojoMLP(12, 16),
    "MojoLayerNorm": lambda: pco.MojoLayerNorm(12),
    "MojoSoftmax": lambda: pco.MojoSoftmax(dim=0),
    "MojoLogSoftmax": lambda: pco.MojoLogSoftmax(dim=-1),
    "MojoLongSoftmax": lambda: pco.MojoLongSoftmax(dim=-1),
}


@pytest.mark.parametrize("layer", LAYERS)
def test_a_backward_reads_its_saved_tensors_once(layer, device):
    """checkpoint(use_reentrant=False) unpacks each saved tensor once and raises on a second
    read; `replayed_backward` read ctx.saved_tensors for its key, then the backward read
    them again: every such layer failed under activation checkpointing."""
    torch.manual_seed(0)
    module = LAYERS[layer]().to(device)
    x = torch.randn(5, 12, device=device, requires_grad=True)
    inputs = [x, *module.parameters()]
    got = torch.autograd.grad(checkpoint(module, x, use_reentrant=False).square().sum(), inputs)
    want = torch.autograd.grad(module(x).square().sum(), inputs)
    for ours, ref in zip(got, want, strict=True):
        torch.testing.assert_close(ours, ref)
