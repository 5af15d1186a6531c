"""The days' GPU-only scripts (time_*, ncu_*, trace_*, ...) on a machine without a GPU:
`--help` shows what they do, and a run stops with one line instead of a CUDA traceback."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from benchmark.gpu_script import need_cuda
from pytorch_custom_ops.library import REPO_ROOT


def test_help_prints_the_docstring(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["time_x.py", "--help"])
    with pytest.raises(SystemExit) as done:
        need_cuda("Times x.\n\n    python -m days.dayNNN.time_x\n", "days/dayNNN/time_x.py")
    assert done.value.code == 0 and capsys.readouterr().out.startswith("Times x.")


def test_without_cuda_one_line_names_the_script(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["time_x.py"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="time_x.py times or profiles GPU kernels and needs a CUDA GPU"):
        need_cuda("Times x.", "days/dayNNN/time_x.py")


CPU_TOO = {
    "day011/bench_softmax_matmul.py",  # runs its sweep under Triton's interpreter on the CPU
    "day020/host_census.py",  # --device cpu: host times are host times anywhere (its CPU test)
}


def _gpu_scripts():
    """Scripts that launch on CUDA: every time_*/ncu_*/trace_* file, and the others that
    call torch.cuda or the CUPTI timers at the top level of their work."""
    for path in sorted(REPO_ROOT.glob("days/day0*/*.py")):
        text = path.read_text()
        if path.name.startswith("test_") or '__name__ == "__main__"' not in text:
            continue
        if f"{path.parent.name}/{path.name}" in CPU_TOO:
            continue
        if re.match(r"(time|ncu|trace)_", path.name) or "kernel_time" in text or "torch.cuda.synchronize" in text:
            yield path


@pytest.mark.parametrize("path", list(_gpu_scripts()), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_gpu_script_says_it_needs_one(path):
    text = path.read_text()
    # shape_args (day 016's kernels_by_build) calls need_cuda for the scripts that share it
    assert "need_cuda(" in text or "shape_args(" in text or re.search(r"needs? (a )?CUDA|on CUDA GPUs", text), (
        f"{path.name}: call benchmark.gpu_script.need_cuda before its work"
    )
