"""Shared pytest setup for every test in the repo (days/ and tests/).

Tests of Mojo ops run strict: a kernel that fails to build or run raises instead of
silently using torch's result. Tests of the fallback itself switch this off locally.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ["GPU_DAYS_STRICT"] = "1"


def devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.fixture(params=devices())
def device(request) -> str:
    return request.param


@pytest.fixture
def launched(monkeypatch) -> list[str]:
    """The kernel keys of every direct launch (pytorch_custom_ops.direct.run) made inside
    the test: which compiled variant a CUDA call really ran. Recipes are switched off for
    the test, since a recipe replays its launches without direct.run."""
    from pytorch_custom_ops import direct

    seen: list[str] = []
    real = direct.run

    def spy(launches, device_index):
        seen.extend(launch.kernel.key for launch in launches)
        return real(launches, device_index)

    monkeypatch.setattr(direct, "run", spy)
    monkeypatch.setattr("pytorch_custom_ops.mojo_op.RECIPES", False)
    return seen


# Property-based tests (tests/test_properties.py): `ci` is the default, bounded and repeatable
# (a fixed seed); `pytest --hypothesis-profile=deep` explores ~15x more examples per test.
_PROFILE = {
    "deadline": None,  # the first call of an op compiles (MAX on the CPU) or loads a kernel
    "derandomize": True,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    "print_blob": True,
}
settings.register_profile("ci", max_examples=20, **_PROFILE)
settings.register_profile("deep", max_examples=300, **_PROFILE)
settings.load_profile("ci")
