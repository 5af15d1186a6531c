"""Day 017 runs its Triton kernels in the interpreter when there is no CUDA device.

TRITON_INTERPRET must be set before any @triton.jit decorates its function (Triton reads it
then). This conftest is imported before the test modules here; the kernel module also sets it
itself, for use outside pytest (pytorch_custom_ops.flash_attention, the --quick benchmark).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
