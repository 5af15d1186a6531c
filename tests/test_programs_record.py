"""What a recording may turn into a program (`pytorch_custom_ops/programs.py`), without a GPU.

A program replays a function's op calls from C++ and nothing else. So a function that
edits an op's output in place (day 014's float64 GEMM once scaled its product with
`mul_`) must not become one: its replay would return the unedited output.
"""

from __future__ import annotations

import pytest
import torch

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
