"""Where a result came from: device, driver, CUDA, library versions, git commit."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# not imported from pytorch_custom_ops: that imports torch, and the docs build reads this
REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_LIBRARY = "GPU_DAYS_KERNEL_LIBRARY"  # as in pytorch_custom_ops.library (importing it imports torch)


def _version(pkg: str) -> str:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return "-"


def _max_version() -> str:
    found = _version("max")
    if found == "-":  # the GPU machine's MAX bundle has no package metadata
        try:
            from max._core import __version__ as found
        except ImportError:
            pass
    return found


def _mojo_version() -> str:
    """The compiler that built the kernels: installed here, or recorded beside a
    precompiled library (GPU_DAYS_KERNEL_LIBRARY=x.mojoc, version in x.mojoc.version)."""
    found = _version("mojo")
    named = os.environ.get(ENV_LIBRARY)
    if found == "-" and named and os.path.exists(named + ".version"):
        found = open(named + ".version").read().strip()
    return found


def _git_commit() -> str:
    if os.environ.get("GPU_DAYS_GIT_COMMIT"):  # a copy of the tree without .git (the GPU machine)
        return os.environ["GPU_DAYS_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
        # results/ is the harness's own output: an earlier run's rows do not make the code dirty
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return (out.stdout.strip() or "unknown") + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "-"
    except (OSError, subprocess.TimeoutExpired):
        return "-"


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def stamp() -> dict[str, str]:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else f"CPU {_cpu_name()}",
        "device_type": "cuda" if cuda else "cpu",
        "driver": _driver() if cuda else "-",
        "cuda": (torch.version.cuda or "-") if cuda else "-",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "max": _max_version(),
        "mojo": _mojo_version(),
        "git_commit": _git_commit(),
    }


def device_slug(name: str | None = None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3': the results folder name."""
    name = name or stamp()["device"]
    if name.startswith("CPU"):
        return "cpu"  # CPU runs are smoke runs, not comparable across machines anyway
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
