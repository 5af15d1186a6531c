"""Find, build and load the one Mojo kernel library that holds every day's ops.

`days/` is a Mojo package. It is precompiled into `build/<hash>/days.mojoc`, where the
hash covers every `.mojo` file under `days/` plus the compiler version, so editing any
kernel rebuilds it (a stale library is the classic MAX pitfall) and an unchanged tree
reuses it. `GPU_DAYS_KERNEL_LIBRARY=/path/to/x.mojoc` loads a precompiled library
instead: the GPU machine has no Mojo compiler.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
KERNEL_PACKAGE = REPO_ROOT / "days"
BUILD_DIR = REPO_ROOT / "build"
ENV_LIBRARY = "GPU_DAYS_KERNEL_LIBRARY"
OLD_LIBRARY_S = 24 * 3600  # an older library is removed once this old (build_library)


class KernelBuildError(RuntimeError):
    """The Mojo kernel library could not be built or loaded."""


def mojo_executable() -> str:
    """The `mojo` next to this Python first (a venv that is not activated), then PATH."""
    beside = Path(sys.executable).parent / "mojo"
    if beside.exists():
        return str(beside)
    found = shutil.which("mojo")
    if found is None:
        raise KernelBuildError("the `mojo` compiler is not installed (pip install mojo==1.2.0)")
    return found


def sources_hash(package: Path = KERNEL_PACKAGE) -> str:
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.mojo")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    try:
        from importlib.metadata import version

        digest.update(version("mojo").encode())
    except Exception:  # the version only sharpens the key; no package metadata is fine
        pass
    return digest.hexdigest()[:16]


def build_library(package: Path = KERNEL_PACKAGE, build_dir: Path = BUILD_DIR) -> Path:
    """Precompile `package` unless a library for the same sources already exists."""
    # MAX names the Mojo package after the file's stem, so the file keeps the package's
    # name and the hash goes into the directory.
    key = sources_hash(package)
    target = build_dir / key / f"{package.name}.mojoc"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=build_dir))
    cmd = [mojo_executable(), "precompile", str(package), "-o", str(staging / target.name)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise KernelBuildError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stderr or proc.stdout}")
    (staging / target.name).replace(target)  # atomic: parallel workers never see half a file
    shutil.rmtree(staging, ignore_errors=True)
    # older libraries (hash-named; build/gpu is gpu_build's), once a day old: a process
    # still running on one (edited sources, a new process rebuilt) compiles its next graph
    # from that file, and failed when it was gone. They are ~0.6 MB each.
    for old in build_dir.iterdir():
        if old.is_dir() and old.name != key and len(old.name) == len(key) and old.name.isalnum():
            if time.time() - old.stat().st_mtime > OLD_LIBRARY_S:
                shutil.rmtree(old, ignore_errors=True)
    return target


def library_path() -> Path:
    """The .mojoc to load: the one named by the environment, else a fresh build."""
    named = os.environ.get(ENV_LIBRARY)
    if named:
        path = Path(named)
        if not path.is_file():
            raise KernelBuildError(f"{ENV_LIBRARY}={named} does not name a file")
        return path
    return build_library()


@cache
def load_kernel_library():
    """Load the library into MAX once per process: (KernelLibrary, InferenceSession)."""
    try:
        from max.driver import CPU, Accelerator, accelerator_count
        from max.engine import InferenceSession
        from max.graph import KernelLibrary
    except ImportError as exc:
        raise KernelBuildError(f"MAX is not installed ({exc}); pip install max==26.7.0") from exc
    path = library_path()
    kernels = KernelLibrary()
    try:
        kernels.load_paths([path])
    except Exception as exc:
        raise KernelBuildError(f"MAX could not load {path}: {exc}") from exc
    devices = [CPU()] + [Accelerator(i) for i in range(accelerator_count())]
    return kernels, InferenceSession(devices=devices), path
