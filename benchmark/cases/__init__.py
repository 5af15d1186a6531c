"""Every day's benchmarks. A new day adds a module here and lists it in CASES (a Case
timed by the shared harness) or RUNNERS (a day that drives its own sweep and returns
store rows, like day011's assignment benchmark)."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import (
    day009,
    day012,
    day013,
    day014,
    day015,
    day016,
    day016_permute,
    day017,
    day018,
    day019,
    day020,
    day020_train,
)


@dataclass
class Runner:
    day: str
    op: str
    rows: Callable[[bool, str], list[dict]]  # (quick, device) -> results-store rows


def _day011(quick: bool, device: str) -> list[dict]:
    from days.day011 import bench_softmax_matmul as day011  # imports triton: only when asked

    rows = day011.benchmark_rows(quick=quick, dtype=torch.float32)
    if device == "cuda":
        rows += day011.benchmark_rows(quick=quick, dtype=torch.bfloat16)
    return rows


CASES = [
    *day009.CASES,
    *day012.CASES,
    *day013.CASES,
    *day014.CASES,
    *day015.CASES,
    *day016_permute.CASES,
    *day017.CASES,
    *day018.CASES,
    *day019.CASES,
    *day020.CASES,
]
RUNNERS = [
    Runner("day011", "softmax_matmul", _day011),
    # day 016's model benchmark: one runner per op, so that `--op` picks the forward or the training step
    Runner(day016.DAY, day016.FORWARD, lambda quick, device: day016.sweep(day016.FORWARD, quick, device)),
    Runner(day016.DAY, day016.TRAIN, lambda quick, device: day016.sweep(day016.TRAIN, quick, device)),
    Runner(day020_train.DAY, day020_train.OP, day020_train.sweep),
]
