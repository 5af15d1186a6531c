"""Shared pytest setup for every test in the repo (days/ and tests/).

Tests of Mojo ops run strict: a kernel that fails to build or run raises instead of
silently using torch's result. Tests of the fallback itself switch this off locally.
"""

import os

import pytest
import torch

os.environ["GPU_DAYS_STRICT"] = "1"


def devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.fixture(params=devices())
def device(request) -> str:
    return request.param
