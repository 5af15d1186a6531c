"""The launch call: C when this machine can compile `launcher.c`, ctypes otherwise.

    launch(function, grid, block, smem, stream, cluster, kinds, args) -> CUresult

`kinds` is one letter per kernel argument (`KIND_LETTERS`), `args` a tuple of ints,
floats and 128-byte tensor maps. Both launchers pack the arguments the same way (the
tests compare them byte for byte on a CPU, with a stand-in for cuLaunchKernel).

The C launcher is compiled on first use with the machine's C compiler (`$CC`, else `cc`)
against Python's stable ABI and cached in `build/launcher/`, keyed by a hash of the
source: as Triton builds its own launcher. Day 016 measured what it saves on the H100's
host (see the day's journal). Without a compiler or Python's headers, `launcher_kind()`
says why and the ctypes launcher runs: slower on the host, identical on the GPU.
`GPU_DAYS_LAUNCHER=ctypes` forces it.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from functools import cache
from pathlib import Path

from .library import BUILD_DIR as _BUILD_ROOT

ENV_LAUNCHER = "GPU_DAYS_LAUNCHER"
SOURCE = Path(__file__).with_name("launcher.c")
BUILD_DIR = _BUILD_ROOT / "launcher"
KIND_LETTERS = {"ptr": "p", "i64": "q", "i32": "i", "f32": "f", "tensormap": "t"}

_CTYPES = {"p": ctypes.c_uint64, "q": ctypes.c_int64, "i": ctypes.c_int32, "f": ctypes.c_float}
# unsigned bytes, not c_char: a c_char array takes bytes as a C string and stops copying
# at the first NUL (a descriptor holding an address with a zero byte would be cut short)
_TENSORMAP = ctypes.c_ubyte * 128


def kind_letters(kinds: tuple[str, ...]) -> bytes:
    """The `kinds` argument of `launch` for a kernel family's argument kinds."""
    return "".join(KIND_LETTERS[k] for k in kinds).encode()


# -- the ctypes launcher ------------------------------------------------------------------
@cache
def arg_struct(letters: bytes):
    """A ctypes struct holding one launch's arguments and each field's offset (the
    driver reads each argument through a pointer: cuLaunchKernel's kernelParams)."""
    fields = [(f"a{i}", _TENSORMAP if k == "t" else _CTYPES[k]) for i, k in enumerate(letters.decode())]
    struct = type("KernelArgs", (ctypes.Structure,), {"_fields_": fields})
    offsets = tuple(getattr(struct, name).offset for name, _ in fields)
    return struct, offsets, ctypes.c_void_p * len(fields)


def pack_args(letters: bytes, args: tuple):
    """The ctypes struct of one launch's arguments."""
    struct, _, _ = arg_struct(letters)
    if len(args) != len(letters):
        raise ValueError(f"launch: {len(args)} arguments for {len(letters)} declared kinds")
    if b"t" in letters:
        args = list(args)
        for i, k in enumerate(letters.decode()):
            if k == "t":
                if not isinstance(args[i], bytes):
                    raise TypeError(f"kernel argument {i}: a tensor map must be bytes")
                if len(args[i]) != 128:
                    raise ValueError(f"kernel argument {i}: a tensor map is 128 bytes, got {len(args[i])}")
                args[i] = _TENSORMAP.from_buffer_copy(args[i])
    return struct(*args)


def _ctypes_launch(launch_kernel, launch_kernel_ex):
    from . import cuda_driver as cu

    def launch(function, grid, block, smem, stream, cluster, letters, args) -> int:
        packed = pack_args(letters, args)
        _, offsets, pointers = arg_struct(letters)
        base = ctypes.addressof(packed)
        params = pointers(*[base + o for o in offsets])
        grid, block = dim3(grid), dim3(block)
        if not cluster:
            return launch_kernel(function, *grid, *block, smem, stream, params, None)
        attr = cu._LaunchAttr()
        attr.id = cu.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim[:] = (cluster, 1, 1)
        config = cu._LaunchConfig(*grid, *block, smem, stream, ctypes.pointer(attr), 1)
        return launch_kernel_ex(ctypes.byref(config), function, params, None)

    return launch


def dim3(d) -> tuple[int, int, int]:
    if d.__class__ is int:
        return (d, 1, 1)
    return tuple(d) + (1,) * (3 - len(d))


# -- the C launcher -------------------------------------------------------------------------
HEADER = SOURCE.with_name("launch_args.h")  # shared with the C++ replay (replay.cpp)


def build_extension(
    name: str,
    source: Path,
    compiler: str,
    flags: list[str],
    build_dir: Path,
    libs: list[str] = (),
    salt: str = "",
    announce: str = "",
    headers: tuple[Path, ...] = (),
) -> Path:
    """Compile `source` (which may include launch_args.h and `headers`, next to it) into the
    extension module `name`, cached in `build_dir` by a hash of the source, the headers, the
    flags and `salt`; raise
    OSError saying why it cannot. `announce`, if given, is printed to stderr before a
    compile (not for a cached build). Also builds the C++ replay (`replay.py`)."""
    text = b"".join(f.read_bytes() for f in (source, HEADER, *headers))
    h = hashlib.sha256(text + repr((flags, list(libs), salt)).encode())
    abi = ".abi3.so" if source.suffix == ".c" else sysconfig.get_config_var("EXT_SUFFIX")
    target = build_dir / f"{name}-{h.hexdigest()[:16]}{abi}"
    if target.exists():
        return target
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise OSError(f"no Python.h in {include} (install Python's development headers)")
    build_dir.mkdir(parents=True, exist_ok=True)
    if announce:
        print(announce, file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=build_dir) as tmp:
        built = Path(tmp) / target.name
        cmd = [compiler, "-O2", "-shared", "-fPIC", f"-I{include}", f"-I{HEADER.parent}", *flags, str(source)]
        cmd += ["-o", str(built), *libs]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent process sees the whole file or none
    return target


def _compile(source: Path) -> Path:
    """Compile launcher.c into a cached extension module; raise OSError saying why not."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise OSError("no C compiler (cc, gcc, clang or $CC)")
    return build_extension("gpu_days_launcher", source, cc, ["-std=c11"], BUILD_DIR)


def load_extension(path: Path, name: str = "gpu_days_launcher"):
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


_kind = "not loaded yet"
_chosen = None  # the launch function, once chosen
_lock = threading.Lock()


def c_launcher(launch_kernel_address: int, launch_kernel_ex_address: int, path: Path | None = None):
    """The compiled `launch`, bound to these driver entry points (raises OSError).

    The binding is the module's: every `launch` loaded from one file shares it. A test
    that binds a stand-in driver passes `path`, a copy of the build, so that the process's
    own launcher keeps the real driver."""
    module = load_extension(path or _compile(SOURCE))
    module.set_driver(launch_kernel_address, launch_kernel_ex_address)
    return module.launch


def _choose():
    global _kind
    from . import cuda_driver as cu

    lib = cu._lib()
    plain, ex = lib.cuLaunchKernel, lib.cuLaunchKernelEx
    if os.environ.get(ENV_LAUNCHER, "c") == "ctypes":
        _kind = f"ctypes ({ENV_LAUNCHER}=ctypes)"
        return _ctypes_launch(plain, ex)
    try:
        fn = c_launcher(ctypes.cast(plain, ctypes.c_void_p).value, ctypes.cast(ex, ctypes.c_void_p).value)
    except (OSError, ImportError) as exc:
        _kind = f"ctypes (the C launcher could not be built: {exc})"
        print(f"gpu-days: {_kind}", file=sys.stderr)
        return _ctypes_launch(plain, ex)
    _kind = "c"
    return fn


def launcher():
    """The `launch` function of this process (built or picked on first call; every launch
    asks, so the usual answer takes no lock)."""
    global _chosen
    if _chosen is None:
        with _lock:
            if _chosen is None:
                _chosen = _choose()
    return _chosen


def launcher_kind() -> str:
    """'c', or 'ctypes (why)': which launcher this process uses."""
    return _kind
