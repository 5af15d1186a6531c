"""The direct launch path: a Mojo kernel launched on torch's current CUDA stream.

An op's launch plan (a Python function next to its OpSpec) turns one call into a list of
`Launch`es: which compiled kernel, grid, block, dynamic shared memory, cluster shape and
arguments. `run` enqueues them on `torch.cuda.current_stream()` with the CUDA driver. The
host work per launch is a few microseconds of Python and one `cuLaunchKernel`; nothing
synchronises, allocates outside torch's caching allocator or touches another stream, so
the calls are ordered like torch's own ops and `torch.cuda.graph` can capture them.

Kernels come from `gpu_build`'s output (PTX, or SASS when built with --cubin): loaded on
first use per device, then cached. Anything wrong on the way (no build, a corrupt file, a
kernel the GPU cannot run, a driver error) raises `KernelLoadError` naming the kernel.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from . import cuda_driver as cu
from .gpu_kernels import Kernel, abi_mismatch, entry_params
from .library import KernelBuildError


class KernelLoadError(RuntimeError):
    """A compiled GPU kernel cannot be found, loaded or launched."""


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~1 us, and plans make one per launch
class Launch:
    kernel: Kernel
    grid: int | tuple[int, ...]
    block: int | tuple[int, ...]
    args: tuple  # a "tensormap" argument: 128 bytes, or an object whose .encode() gives them
    smem: int = 0  # dynamic shared memory, bytes
    cluster: int | None = None  # CTAs per cluster along x (thread-block clusters)


def _dim3(d) -> tuple[int, int, int]:
    if d.__class__ is int:
        return (d, 1, 1)
    return tuple(d) + (1,) * (3 - len(d))


_CTYPES = {"ptr": ctypes.c_uint64, "i64": ctypes.c_int64, "i32": ctypes.c_int32, "f32": ctypes.c_float}
# unsigned bytes, not c_char: a c_char array takes bytes as a C string and stops copying
# at the first NUL (a descriptor holding an address with a zero byte would be cut short)
_TENSORMAP = ctypes.c_ubyte * 128


@cache
def _arg_struct(args: tuple[str, ...]):
    """A ctypes struct holding one launch's arguments, each field's offset (the driver
    reads each argument through a pointer: cuLaunchKernel's kernelParams) and the
    positions of the tensor maps."""
    fields = [(f"a{i}", _TENSORMAP if kind == "tensormap" else _CTYPES[kind]) for i, kind in enumerate(args)]
    struct = type("KernelArgs", (ctypes.Structure,), {"_fields_": fields})
    offsets = tuple(getattr(struct, name).offset for name, _ in fields)
    tensormaps = tuple(i for i, kind in enumerate(args) if kind == "tensormap")
    return struct, offsets, ctypes.c_void_p * len(args), tensormaps


def pack_args(kinds: tuple[str, ...], args: tuple):
    """The ctypes struct of one launch's arguments. A "tensormap" argument is its 128
    bytes or an object with `.encode() -> bytes` (e.g. a spec that calls the driver's
    cuTensorMapEncodeTiled at launch time, so that plans stay testable on a CPU)."""
    struct, _offsets, _pointers, tensormaps = _arg_struct(kinds)
    if tensormaps:
        args = list(args)
        for i in tensormaps:
            raw = args[i] if isinstance(args[i], bytes | bytearray) else args[i].encode()
            if len(raw) != 128:
                raise ValueError(f"argument {i}: a tensor map is 128 bytes, got {len(raw)}")
            args[i] = _TENSORMAP.from_buffer_copy(raw)
    return struct(*args)


# -- finding the build -------------------------------------------------------------------
def build_root() -> Path:
    from .gpu_build import ENV_GPU_KERNELS, GPU_BUILD_DIR

    named = os.environ.get(ENV_GPU_KERNELS)
    return Path(named) if named else GPU_BUILD_DIR


@cache
def _day_build(day: str) -> tuple[Path, dict]:
    """The build directory and manifest of a day's kernels: the build whose key matches
    these sources. With the Mojo compiler here a missing one is built now; without it (the
    GPU machine) it must have been brought along."""
    from . import gpu_build
    from .gpu_kernels import all_kernels

    kernels = gpu_build.by_day(all_kernels()).get(day, [])
    key = gpu_build.day_key(day, kernels)
    root = build_root()
    path = root / key
    if not (path / "manifest.json").exists():
        try:
            gpu_build.mojo_executable()
        except KernelBuildError:
            present = sorted(p.name for p in root.glob(f"{day}-*")) if root.is_dir() else []
            raise KernelLoadError(
                f"no GPU build of {day} for these sources (expected {path}; present: {present or 'none'}); "
                "run `python -m pytorch_custom_ops.gpu_build` where Mojo is installed and bring build/gpu along"
            ) from None
        path = gpu_build.build(days=[day], root=root)[day]
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise KernelLoadError(f"the GPU build manifest {path / 'manifest.json'} is unreadable: {exc}") from exc
    return path, manifest


class LoadedKernel:
    """One kernel loaded into one device's context."""

    def __init__(self, kernel: Kernel, device_index: int):
        self.kernel = kernel
        self.name = str(kernel)
        day = kernel.family.module.split(".")[1]
        path, manifest = _day_build(day)
        info = manifest.get("kernels", {}).get(kernel.key)
        if info is None:
            raise KernelLoadError(f"{self.name}: not in the GPU build manifest {path / 'manifest.json'}")
        image_path = path / f"{kernel.key}.cubin"
        if not image_path.exists():
            image_path = path / f"{kernel.key}.ptx"
        try:
            image = image_path.read_bytes()
        except OSError as exc:
            raise KernelLoadError(f"{self.name}: cannot read {image_path}: {exc}") from exc
        if image_path.suffix == ".ptx":
            try:
                params = entry_params(image.decode(errors="replace"), info["entry"])
            except ValueError as exc:
                raise KernelLoadError(f"{self.name}: {image_path} is not the PTX the manifest names: {exc}") from exc
            mismatch = abi_mismatch(kernel, params)
            if mismatch:
                raise KernelLoadError(f"ABI mismatch: {mismatch}")
        try:
            module = cu.load_module(image, device_index, f"{self.name} from {image_path}")
            self.function = cu.get_function(module, info["entry"], self.name)
        except cu.CudaDriverError as exc:
            raise KernelLoadError(f"{self.name}: {exc}") from exc
        self.device_index = device_index
        _struct, self.offsets, self.pointer_array, _ = _arg_struct(kernel.family.args)
        self.max_smem = 48 * 1024  # without opting in, a launch may ask for up to 48 KiB
        self._lock = threading.Lock()

    # --8<-- [start:launch]
    def launch(self, launch: Launch, stream: int) -> None:
        smem = launch.smem
        if smem > self.max_smem:
            with self._lock:
                if smem > self.max_smem:
                    cu.set_max_dynamic_shared_memory(self.function, smem, self.name)
                    self.max_smem = smem
        args = pack_args(self.kernel.family.args, launch.args)
        base = ctypes.addressof(args)
        params = self.pointer_array(*[base + o for o in self.offsets])
        grid, block = _dim3(launch.grid), _dim3(launch.block)
        cluster = None if launch.cluster is None else (launch.cluster, 1, 1)
        code = cu.launch(self.function, grid, block, smem, stream, params, cluster)
        if code in (cu.CUDA_ERROR_INVALID_CONTEXT, cu.CUDA_ERROR_INVALID_HANDLE):
            # this thread has no (or another) current context: use the device's primary one
            cu.make_current(self.device_index)
            code = cu.launch(self.function, grid, block, smem, stream, params, cluster)
        if code != 0:
            what = f"launching {self.name} (grid {grid}, block {block}, {smem} B shared"
            what += f", cluster {cluster})" if cluster else ")"
            cu.check(code, what)

    # --8<-- [end:launch]


_loaded: dict[tuple[int, int], LoadedKernel | KernelLoadError] = {}
_load_lock = threading.Lock()


def loaded(kernel: Kernel, device_index: int) -> LoadedKernel:
    key = (id(kernel), device_index)  # kernels live as long as their family: id() is a stable, cheap key
    found = _loaded.get(key)
    if found is None:
        with _load_lock:
            found = _loaded.get(key)
            if found is None:
                try:
                    found = LoadedKernel(kernel, device_index)
                except (KernelLoadError, KernelBuildError, cu.CudaDriverError) as exc:
                    found = exc if isinstance(exc, KernelLoadError) else KernelLoadError(f"{kernel}: {exc}")
                _loaded[key] = found
    if isinstance(found, KernelLoadError):
        raise found
    return found


# --8<-- [start:run]
def run(launches: list[Launch], device_index: int) -> None:
    """Enqueue `launches` in order on torch's current stream of CUDA device `device_index`."""
    if device_index != torch._C._cuda_getDevice():
        with torch.cuda.device(device_index):  # that device's context and stream, as torch's own ops do
            return run(launches, device_index)
    # the raw cudaStream_t (what Triton asks for too): no Python Stream object per call
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    for launch in launches:
        loaded(launch.kernel, device_index).launch(launch, stream)


# --8<-- [end:run]


def plan(*families):
    """Mark a launch plan with the kernel families it picks from (so the op knows which
    builds it needs, and the ABI test which launchers to check)."""

    def mark(fn):
        fn.families = families
        return fn

    return mark
