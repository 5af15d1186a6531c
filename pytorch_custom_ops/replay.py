"""The C++ replay of recipes (`replay.cpp`): a call seen before, from key to launch in C++.

    m = replay.module()                        # the compiled module, or None (replay_kind() says why)
    book = m.new_book()                        # one per op (MojoOp keeps it)
    m.add(book, inputs, params, out, recipe)   # after the Python path made `recipe` for this call
    m.call(book, inputs, params, out)          # outputs | None (no recipe) | a failed launch to resume

`params` is None or the call's parameters as a tuple of items, `out` the destinations
(usually empty): both are part of the key, as in `mojo_op._call_key`.

`replay.cpp` is compiled on first use with the machine's C++ compiler against the torch
it runs with (its headers and libraries: a torch extension without pybind11's bindings),
cached in `build/replay/` by a hash of the source, the torch version and the flags. It
takes ~15 s once per machine and torch version: `python -m pytorch_custom_ops.replay`
builds it ahead. Where it cannot be built the recipes replay in Python, as before,
and `replay_kind()` says why (also printed once). `GPU_DAYS_REPLAY=python` forces that.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
import sysconfig
import threading
from pathlib import Path

import torch

from .launcher import BUILD_DIR as _LAUNCHER_DIR
from .launcher import build_extension, load_extension

ENV_REPLAY = "GPU_DAYS_REPLAY"
SOURCE = Path(__file__).with_name("replay.cpp")
HEADERS = tuple(SOURCE.with_name(name) for name in ("replay_book.h", "replay_programs.h", "replay_nodes.h"))
BUILD_DIR = _LAUNCHER_DIR.with_name("replay")
MODULE = "gpu_days_replay"

_kind = "not loaded yet"
_module = None
_tried = False
_lock = threading.Lock()


def compile_flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags) for an extension against this process's torch. The
    paths are torch's own layout (what torch.utils.cpp_extension reports, without
    importing it: that import takes ~0.2 s, and every process asks once)."""
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w"]  # -w: torch's headers warn a lot
    flags += [f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
    lib = root / "lib"
    libs = [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    return flags, libs


def build(build_dir: Path | None = None) -> Path:
    """The compiled module's path (compiled now if this source, torch and flags have none
    yet); OSError saying why it cannot be built."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise OSError("no C++ compiler (c++, g++, clang++ or $CXX)")
    flags, libs = compile_flags()
    salt = f"torch {torch.__version__} python {sysconfig.get_config_var('EXT_SUFFIX')}"
    note = f"gpu-days: compiling the C++ replay for torch {torch.__version__} (once per machine, ~15 s)"
    return build_extension(
        MODULE, SOURCE, cxx, flags, build_dir or BUILD_DIR, libs=libs, salt=salt, announce=note, headers=HEADERS
    )


def load(path: Path, driver: tuple[int, int] | None = None, device=None, stream=None):
    """Load a built module and bind it to the driver's launch entry points (addresses of
    cuLaunchKernel and cuLaunchKernelEx; default: libcuda's) and to torch's current device
    and raw stream (`device()`, `stream(index)`; tests pass stand-ins for all three).
    The binding is the file's: tests that bind stand-ins load a copy of the build."""
    from .contract import PLAIN_TENSORS

    if driver is None:
        from . import cuda_driver as cu

        lib = cu._lib()
        driver = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in (lib.cuLaunchKernel, lib.cuLaunchKernelEx))
    module = load_extension(path, MODULE)
    module.configure(
        *driver,
        tuple(PLAIN_TENSORS),
        device or torch._C._cuda_getDevice,
        stream or torch._C._cuda_getCurrentRawStream,
    )
    return module


def module():
    """The C++ replay of this process, or None (then `replay_kind()` says why)."""
    global _module, _kind, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        if os.environ.get(ENV_REPLAY, "c++") == "python":
            _kind = f"python ({ENV_REPLAY}=python)"
        else:
            try:
                _module = load(build())
                _kind = "c++"
            except (OSError, ImportError, AttributeError) as exc:
                _kind = f"python (the C++ replay could not be built or loaded: {exc})"
                print(f"gpu-days: {_kind}", file=sys.stderr)
        _tried = True
    return _module


def replay_kind() -> str:
    """'c++', or 'python (why)': where this process replays recipes."""
    return _kind


if __name__ == "__main__":  # build ahead: python -m pytorch_custom_ops.replay
    print(build())
