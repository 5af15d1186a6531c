"""The torch fallback: used only when the Mojo path cannot run, never silently.

If MAX is missing, or a kernel fails to build, load or compile, an op falls back to its
torch implementation and warns once per op (not per call). With GPU_DAYS_STRICT=1 the
fallback becomes an error instead: the test suite runs strict, so a broken kernel fails
its tests rather than passing on torch's results.
"""

from __future__ import annotations

import os
import warnings

STRICT_ENV = "GPU_DAYS_STRICT"


class MojoUnavailableError(RuntimeError):
    """The Mojo path of an op cannot run and strict mode forbids the torch fallback."""


class MojoFallbackWarning(RuntimeWarning):
    """An op is running its torch implementation because the Mojo path failed."""


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "0").strip().lower() not in ("", "0", "false", "no", "off")


_warned: set[str] = set()


def fall_back(op: str, reason: BaseException | str) -> None:
    """Record that `op` must use torch; raise instead when strict."""
    if strict():
        raise MojoUnavailableError(
            f"{op}: the Mojo kernel cannot run and {STRICT_ENV}=1 forbids the torch fallback: {reason}"
        ) from (reason if isinstance(reason, BaseException) else None)
    if op not in _warned:
        _warned.add(op)
        warnings.warn(
            f"{op}: using the torch fallback because the Mojo kernel cannot run: {reason}",
            MojoFallbackWarning,
            stacklevel=3,
        )
