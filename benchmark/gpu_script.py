"""What a GPU-only script does first (the days' time_*, ncu_* and trace_* scripts).

`--help` prints the script's docstring (scripts without argparse would otherwise start
timing), and without CUDA the script stops with one line that says so, rather than a
traceback from inside torch's CUDA initialisation.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def need_cuda(doc: str | None, script: str) -> None:
    """Call before a script's work; `doc`: its docstring, printed for -h / --help (None
    where argparse already handled them); `script`: its __file__."""
    name = Path(script).name
    if doc is not None and any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(doc.strip())
        raise SystemExit(0)
    if not torch.cuda.is_available():
        raise SystemExit(f"{name} times or profiles GPU kernels and needs a CUDA GPU (torch sees none)")
