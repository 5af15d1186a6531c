"""Where the cross-entropy's forward + backward spends its time outside the main kernel
(day 020, part 12): the device time of every kernel one call launches, and the call's end-
to-end time (L2 flushed, as the benchmark times it), with the small work around the
kernels done by day 020's small kernels and by torch's ops, in the same run:

    python -m days.day020.trace_cross_entropy
"""

from __future__ import annotations

import importlib

import torch

from benchmark.gpu_script import need_cuda
from benchmark.timing import copy_bandwidth_gbps, kernel_times_us, time_cuda
from pytorch_custom_ops import direct

ce = importlib.import_module("pytorch_custom_ops.cross_entropy")  # the module, not the function

SHAPES = ((8192, 50304, torch.bfloat16), (8192, 50304, torch.float32))
WAYS = {"small kernels": True, "torch's small ops": False}  # label: ce.SMALL_KERNELS


def trace(rows: int, cols: int, dtype: torch.dtype, copy_gbps: float) -> None:
    logits = (torch.randn(rows, cols, device="cuda") * 2).to(dtype).requires_grad_()
    targets = torch.randint(0, cols, (rows,), device="cuda")
    targets[::97] = -100

    def step(small: bool) -> None:
        ce.SMALL_KERNELS = small
        logits.grad = None
        ce.cross_entropy(logits, targets).backward()

    for label, small in WAYS.items():
        direct.plans_changed()
        counts: dict[str, int] = {}
        kernels = kernel_times_us(lambda small=small: step(small), reps=20, counts=counts)
        print(f"{rows} x {cols} {str(dtype)[6:]}, {label}:")
        for name, us in sorted(kernels.items(), key=lambda item: -item[1]):
            print(f"  {us:8.1f} us  x{counts[name] / 20:g}  {name[:90]}")
        print(f"  {sum(kernels.values()):8.1f} us  in all, {len(kernels)} kernels")
    timed = time_cuda({label: lambda small=small: step(small) for label, small in WAYS.items()})
    ce.SMALL_KERNELS = True
    copy_us = 2 * rows * cols * logits.element_size() / copy_gbps / 1e3
    for label, t in timed.items():
        print(f"  end to end, {label}: {t.median_ms * 1e3:.1f} us ({100 * copy_us / (t.median_ms * 1e3):.1f}% of copy)")


def main() -> None:
    copy_gbps = copy_bandwidth_gbps("cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; one forward + loss.backward()")
    print(f"# copy bandwidth {copy_gbps:.0f} GB/s (read + write); targets: every 97th row ignored")
    for shape in SHAPES:
        trace(*shape, copy_gbps)


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
