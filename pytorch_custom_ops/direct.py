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

import json
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from . import cuda_driver as cu
from .gpu_kernels import Kernel, abi_mismatch, entry_params
from .launcher import dim3, kind_letters, launcher
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


def resolve_tensormaps(letters: bytes, args: tuple) -> tuple:
    """`args` with each tensor-map argument as its 128 bytes: a plan may give an object
    whose `.encode() -> bytes` calls the driver's cuTensorMapEncodeTiled at launch time,
    so that plans make no driver call and stay testable on a CPU."""
    if b"t" not in letters:
        return args
    return tuple(a.encode() if k == 116 and not isinstance(a, bytes) else a for k, a in zip(letters, args, strict=True))


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
        self.letters = kind_letters(kernel.family.args)
        self.max_smem = 48 * 1024  # without opting in, a launch may ask for up to 48 KiB
        self._lock = threading.Lock()

    # --8<-- [start:launch]
    def launch(self, launch: Launch, stream: int) -> None:
        self.ensure_smem(launch.smem)
        self.enqueue(launch.grid, launch.block, launch.smem, stream, launch.cluster, launch.args)

    def ensure_smem(self, smem: int) -> None:
        """Opt in to `smem` bytes of dynamic shared memory (once per size increase)."""
        if smem > self.max_smem:
            with self._lock:
                if smem > self.max_smem:
                    cu.set_max_dynamic_shared_memory(self.function, smem, self.name)
                    self.max_smem = smem

    def max_active_clusters(self, cluster: int, block: int, smem: int) -> int:
        """cuOccupancyMaxActiveClusters for launches of this kernel in clusters of `cluster`."""
        self.ensure_smem(smem)
        try:
            return cu.max_active_clusters(self.function, cluster, block, smem, self.name)
        except cu.CudaDriverError as exc:
            if exc.code not in (cu.CUDA_ERROR_INVALID_CONTEXT, cu.CUDA_ERROR_INVALID_HANDLE):
                raise
            cu.make_current(self.device_index)
            return cu.max_active_clusters(self.function, cluster, block, smem, self.name)

    def enqueue(self, grid, block, smem: int, stream: int, cluster: int | None, args: tuple) -> None:
        args = resolve_tensormaps(self.letters, args)
        launch = launcher()
        code = launch(self.function, grid, block, smem, stream, cluster or 0, self.letters, args)
        if code in (cu.CUDA_ERROR_INVALID_CONTEXT, cu.CUDA_ERROR_INVALID_HANDLE):
            # this thread has no (or another) current context: use the device's primary one
            cu.make_current(self.device_index)
            code = launch(self.function, grid, block, smem, stream, cluster or 0, self.letters, args)
        if code != 0:
            what = f"launching {self.name} (grid {dim3(grid)}, block {dim3(block)}, {smem} B shared"
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


# -- recipes: a call seen before skips its checks and its plan ---------------------------------
# Plans choose from shapes, dtypes, the device, the op's parameters, whether addresses are
# 16-byte aligned, and module state that changes only through `plans_changed()` (e.g.
# `gemm_version`). So two calls that agree on those get the same launches but for the
# tensors' addresses: a `Recipe` is the first call's launches with the addresses taken
# out, and the next call only allocates its outputs, fills in its addresses and launches.
_epoch = 0


_on_change: list = []  # what else keeps launches: programs.py's books (on_plans_changed)


def plans_changed() -> None:
    """Forget every op's recipes: call after changing state a launch plan reads."""
    global _epoch
    _epoch += 1
    for forget in _on_change:
        forget()


def on_plans_changed(forget) -> None:
    """Call `forget()` on each plans_changed: for stores that C++ replays without asking
    Python first (a C++ autograd node's programs), which the lazy epoch test cannot reach."""
    _on_change.append(forget)


def plan_epoch() -> int:
    return _epoch


class PlanSetting:
    """Module state that launch plans read (a forced kernel version, an A/B switch):
    `value`, and `set_to(v)`, a context manager that holds `v` inside its block. Recipes
    made under one value must not replay under another, so it forgets them
    (plans_changed) on the way in and on the way out."""

    def __init__(self, value):
        self.value = value

    @contextmanager
    def set_to(self, value):
        previous, self.value = self.value, value
        plans_changed()
        try:
            yield
        finally:
            self.value = previous
            plans_changed()


class _Step:
    __slots__ = ("kernel", "function", "letters", "grid", "block", "smem", "cluster", "template", "pointers", "maps")

    def __init__(self, kernel: LoadedKernel, launch: Launch, template, pointers, maps):
        kernel.ensure_smem(launch.smem)  # opted in once, here: a replay launches directly
        self.kernel, self.function, self.letters = kernel, kernel.function, kernel.letters
        self.grid, self.block = launch.grid, launch.block
        self.smem, self.cluster = launch.smem, launch.cluster or 0
        self.template, self.pointers, self.maps = template, pointers, maps


class Recipe:
    """The launches of one call, with each address argument replaced by the index of the
    tensor it came from (outputs, then inputs, then the plan's scratch tensors), and the
    shapes of what the next call allocates."""

    __slots__ = ("outputs", "scratch", "steps", "device_index", "device")

    def __init__(self, outputs, scratch, steps, device_index):
        # Sizes are kept as torch.empty's positional arguments: on the H100's host,
        # torch.empty(8, 128, ...) took 2.4 us and torch.empty((8, 128), ...) 4.1 (torch's
        # argument parser is slower on a size tuple), and a torch.device is cheaper than an
        # int device. A 0-dim output is torch.empty((), ...).
        self.outputs = [(None if shape is None else (shape or ((),)), dtype) for shape, dtype in outputs]
        self.scratch = [(shape or ((),), dtype, zeroed) for shape, dtype, zeroed in scratch]
        self.steps, self.device_index = steps, device_index
        self.device = torch.device("cuda", device_index)

    def allocate(self, given=()) -> list[torch.Tensor]:
        """The outputs: new tensors, and the caller's destinations where it gives them."""
        device, given = self.device, iter(given)
        return [
            next(given) if sizes is None else torch.empty(*sizes, dtype=dtype, device=device)
            for sizes, dtype in self.outputs
        ]

    # --8<-- [start:recipe_run]
    def run(self, outputs, inputs) -> None:
        """Launch for these tensors (in the order of the call the recipe was made from)."""
        index = self.device_index
        if index != torch._C._cuda_getDevice():
            with torch.cuda.device(index):
                return self.run(outputs, inputs)
        # freed after the launches: the allocator reuses them in stream order
        scratch = self.make_scratch() if self.scratch else ()
        self.resume(outputs, inputs, scratch, 0)

    def make_scratch(self) -> tuple[torch.Tensor, ...]:
        """The plan's scratch tensors for one call; zeroed where the plan asked for zeros
        (direct.scratch(zeroed=True)), e.g. counters."""
        return tuple(
            (torch.zeros if zeroed else torch.empty)(*sizes, dtype=dtype, device=self.device)
            for sizes, dtype, zeroed in self.scratch
        )

    def resume(self, outputs, inputs, scratch, start: int) -> None:
        """Launch steps `start`, `start + 1`, ... (the C++ replay hands over here when a
        launch fails: this path retries with the primary context, or raises naming the
        kernel). The current device is the recipe's."""
        tensors = (*outputs, *inputs, *scratch)
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        launch = launcher()
        for step in self.steps[start:]:
            args = step.template
            if step.pointers or step.maps:
                args = list(args)
                for pos, i in step.pointers:
                    args[pos] = tensors[i].data_ptr()
                for pos, i, spec, encoded in step.maps:
                    address = tensors[i].data_ptr()
                    raw = encoded.get(address)
                    if raw is None:
                        if len(encoded) >= 256:
                            encoded.clear()
                        raw = encoded[address] = spec.encode_at(address)
                    args[pos] = raw
                args = tuple(args)
            # the launcher itself (tensor maps are bytes here); on an error, `enqueue` makes
            # the context current and tries again, or raises naming the kernel
            if launch(step.function, step.grid, step.block, step.smem, stream, step.cluster, step.letters, args):
                step.kernel.enqueue(step.grid, step.block, step.smem, stream, step.cluster, args)

    # --8<-- [end:recipe_run]


# Addresses of tensors kept for the whole process (mojo_op.device_constant's): a plan may
# pass one (split-K's alpha = 1, beta = 0 for its pieces), and every call of its recipe
# then passes the same. A constant made inside a graph capture is not kept, not listed.
_kept_addresses: set[int] = set()


def kept_for_the_process(t: torch.Tensor) -> torch.Tensor:
    """List `t`'s address as a constant a recipe may keep (the caller keeps `t` alive)."""
    _kept_addresses.add(t.data_ptr())
    return t


def recipe(outputs, inputs, scratch, launches: list[Launch], device_index: int, returned) -> Recipe | None:
    """The recipe of a call that just ran `launches`, or None when an address argument
    cannot be traced to exactly one of its tensors (an offset into a tensor, two tensors
    at one address) or to a constant kept for the process: such calls keep planning every
    time. `returned[i]` is False for an output the caller gives (a destination)."""
    tensors = (*outputs, *inputs, *scratch)
    addresses = [t.data_ptr() for t in tensors]
    steps = []
    for launch in launches:
        kernel = loaded(launch.kernel, device_index)
        template, pointers, maps = list(launch.args), [], []
        for pos, (kind, value) in enumerate(zip(kernel.kernel.family.args, launch.args, strict=True)):
            if kind == "ptr" and value == 0:  # a null the kernel's flags say it never reads: a constant
                continue
            if kind == "ptr" or kind == "tensormap":
                address = value if kind == "ptr" else getattr(value, "address", None)
                found = [i for i, a in enumerate(addresses) if a == address]
                if not found and kind == "ptr" and address in _kept_addresses:  # the same for every call
                    continue
                if len(found) != 1 or (kind == "tensormap" and not hasattr(value, "encode_at")):
                    return None
                if kind == "ptr":
                    pointers.append((pos, found[0]))
                else:
                    maps.append((pos, found[0], value, {}))
                template[pos] = None
        steps.append(_Step(kernel, launch, tuple(template), tuple(pointers), tuple(maps)))
    shapes = [(tuple(t.shape), t.dtype) if r else (None, None) for t, r in zip(outputs, returned, strict=True)]
    made = [(tuple(t.shape), t.dtype, getattr(t, "gpu_days_zeroed", False)) for t in scratch]
    return Recipe(shapes, made, steps, device_index)


# -- scratch tensors of a plan ------------------------------------------------------------------
_planning = threading.local()


@contextmanager
def planning():
    """Collect the scratch tensors a plan makes (`scratch`), for its recipe."""
    made: list[torch.Tensor] = []
    previous = getattr(_planning, "scratch", None)
    _planning.scratch = made
    try:
        yield made
    finally:
        _planning.scratch = previous


def scratch(shape, dtype: torch.dtype, device, zeroed: bool = False) -> torch.Tensor:
    """A workspace for a plan's launches, made per call (`zeroed`: filled with zeros,
    on the current stream, before the launches). Keep it referenced until the launches
    are enqueued; after that, freeing it is safe: torch's caching allocator hands the
    memory out again only in stream order."""
    t = (torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=device)
    made = getattr(_planning, "scratch", None)
    if made is not None:
        made.append(t)
    if zeroed:
        t.gpu_days_zeroed = True  # the recipe makes its next ones with torch.zeros too
    return t


def plan(*families):
    """Mark a launch plan with the kernel families it picks from (so the op knows which
    builds it needs, and the ABI test which launchers to check)."""

    def mark(fn):
        fn.families = families
        return fn

    return mark
