"""benchmark.timing's promise: `time_cuda` times a call's GPU span, with the host's launch
hidden behind the flush and the lead; `idle_start` times it from an idle GPU instead."""

from __future__ import annotations

import time

import pytest
import torch

from benchmark.timing import time_cuda

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HOST_US = 150  # a host-heavy call: this long on the host before its one small kernel (< LEAD_US)


def _spin_then_add(x: torch.Tensor):
    def call():
        t = time.perf_counter()
        while (time.perf_counter() - t) * 1e6 < HOST_US:
            pass
        x.add_(1)

    return call


@needs_cuda
def test_cuda_host_time_hides_behind_the_lead_and_shows_from_idle():
    x = torch.zeros(1 << 20, device="cuda")
    steps = {"host_heavy": _spin_then_add(x), "plain": lambda: x.add_(1)}
    queued = time_cuda(steps, min_reps=30, budget_s=0.3)
    idle = time_cuda(steps, min_reps=30, budget_s=0.3, idle_start=True)
    # queued: the same kernel, the host's 150 us out of the events
    assert queued["host_heavy"].median_ms < queued["plain"].median_ms + 0.05
    # from an idle GPU the events hold the host's time
    assert idle["host_heavy"].median_ms > HOST_US / 1e3
    assert x.min().item() > 0  # the calls ran
