"""How long a graphed train step of day 016's block leaves the GPU idle between kernels,
per build: torch.profiler over graph replays, kernel time summed against the span from
the first kernel's start to the last one's end.

    PYTHONPATH=$PWD python days/day016/graph_idle.py 32x128x1024 bfloat16

Part seven found our graphed step ~35 us longer than its kernels, against ~5 for
torch.compile's (kernel sums from kernels_by_build.py, step times from another lease);
this measures both in one run.
"""

from __future__ import annotations

import torch

from benchmark.cases.day016 import cuda_graph
from days.day016.kernels_by_build import shape_args, train_steps

REPLAYS = 5


def idle_us(replay) -> tuple[float, float, int]:
    """(kernel us, span us, kernels) per replay, the medians over REPLAYS replays."""
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    rows = []
    for _ in range(REPLAYS):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            replay()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0]
        start = min(e.time_range.start for e in kernels)
        end = max(e.time_range.end for e in kernels)
        rows.append((sum(e.device_time for e in kernels), end - start, len(kernels)))
    rows.sort(key=lambda r: r[1])
    return rows[len(rows) // 2]


def main() -> None:
    args = shape_args(__doc__, "32x128x1024")
    device = torch.cuda.get_device_name()
    print(f"{device}; {args.shape} {args.dtype}; graphed train step, per replay (median of {REPLAYS})")
    for name, step in train_steps(args.shape, args.dtype):
        if name == "torch_compile":
            step()  # compile outside the capture
        kernel, span, count = idle_us(cuda_graph(step))
        idle = span - kernel
        line = f"{count:3d} kernels, {kernel:7.1f} us in a span of {span:7.1f} us: idle {idle:6.1f} us"
        print(f"{name:15s}: {line}", flush=True)


if __name__ == "__main__":
    main()
