"""Calling one Mojo op from torch with as little work per call as possible.

On CUDA a call never reaches MAX: the op's launch plan (`gpu=`, a function next to its
spec) picks the compiled kernels, grid and block, and `direct.run` launches them on
torch's current stream (day 016). MAX runs the op's `execute` on the CPU.

MAX's own `CustomOpLibrary` compiles a graph for every new tensor shape (12-26 s on a
GPU) and wraps each call in a generic torch custom op. Here each op is compiled once per
(dtype, device) with *symbolic* dimensions, so a new shape costs nothing; the compiled
`Model` is kept, and a call is: check the contract, wrap the tensors (DLPack, no copy),
execute. MAX also caches the compiled graph on disk, so a new process skips the compile.

Outputs come back from the graph and are wrapped for torch, again without a copy. The
first version passed torch-allocated outputs into the graph, as MAX's `CustomOpLibrary`
does; the graph then copied each result into them, one more read and write of every
output, which halved a memory-bound kernel's speed (found on day 012, see day 010).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence

import torch

from . import cuda_driver, direct, fallback, programs, replay
from .contract import PLAIN_TENSORS, OpSpec, _overlaps, declared_parameters
from .library import load_kernel_library

# A launch plan: (outputs, inputs, compile-time params) -> the launches that compute the
# outputs. Outputs are allocated (or given) before the plan runs; it only chooses kernels.
LaunchPlan = Callable[[list[torch.Tensor], Sequence[torch.Tensor], dict], list[direct.Launch]]


class MojoOp:
    def __init__(self, spec: OpSpec, gpu: LaunchPlan | None = None):
        self.spec = spec
        self.gpu = gpu
        self._models: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self._verified = False
        self._broken: BaseException | None = None
        self._gpu_broken: BaseException | None = None
        self._gpu_loaded = False  # the days' GPU builds were found once: no need to look again
        self._recipes: dict[tuple, direct.Recipe] = {}  # see direct.Recipe
        self._book = None  # the same recipes for the C++ replay (replay.py), made with the first
        self._book_call = None  # replay.cpp's call(book, inputs, params, out)
        self._recipe_epoch = direct.plan_epoch()

    # -- readiness ------------------------------------------------------------------------
    def ready(self, device: str | torch.device | None = None) -> bool:
        """True when the Mojo path is live on `device` (default: CUDA when torch sees a
        GPU, else the CPU): on the CPU, MAX's library loaded and the contract verified; on
        CUDA, a launch plan and a GPU build of its kernels.

        On failure the reason is kept, and `fallback.fall_back` warns (or raises, strict).
        """
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if torch.device(device).type == "cuda":
            return self._gpu_ready()
        if self._broken is not None:
            return False
        if self._verified:
            return True
        try:
            self.verify()
        except Exception as exc:
            self._broken = exc
            return False
        return True

    def verify(self) -> None:
        """Check this op's spec against the compiled library (raises ContractError)."""
        kernels, _session, _path = load_kernel_library()
        analysis = kernels._analysis
        info = analysis.kernel_torch_info(self.spec.name)
        params = declared_parameters(str(analysis.kernel(self.spec.name)))
        self.spec.verify_against_library(params, info.tensor_arg_names, info.num_dps_outputs)
        self._verified = True

    def _gpu_ready(self) -> bool:
        if self._gpu_loaded:  # some callers ask on every call: skip the walk over the variants
            return True
        if self._gpu_broken is None and self.gpu is None:
            self._gpu_broken = direct.KernelLoadError(f"{self.spec.name}: no GPU launch plan")
        if self._gpu_broken is None:
            try:
                for day in {k.family.module.split(".")[1] for k in self.gpu_kernels()}:
                    direct._day_build(day)
            except Exception as exc:
                self._gpu_broken = exc
        self._gpu_loaded = self._gpu_broken is None
        return self._gpu_loaded

    def gpu_kernels(self) -> list:
        """The compiled kernels this op's launch plan may pick (its families' variants)."""
        return [k for family in getattr(self.gpu, "families", ()) for k in family.kernels()]

    @property
    def failure(self) -> BaseException | None:
        return self._broken if self._gpu_broken is None else self._gpu_broken

    # -- compile ------------------------------------------------------------------------
    def model(self, dtype: torch.dtype, device: torch.device, params: dict | None = None):
        params = self.spec.params if params is None else params
        key = (dtype, device.type, device.index or 0, tuple(sorted(params.items())))
        model = self._models.get(key)
        if model is None:
            with self._lock:
                model = self._models.get(key)
                if model is None:
                    try:
                        model = self._compile(dtype, device, params)
                    except Exception as exc:
                        model = exc
                    self._models[key] = model
        if isinstance(model, Exception):
            raise model
        return model

    def _compile(self, dtype: torch.dtype, device: torch.device, params):
        from max.experimental.torch.torch import torch_dtype_to_max
        from max.graph import DeviceRef, Graph, TensorType, ops

        kernels, session, _ = load_kernel_library()
        ref = DeviceRef.GPU(device.index or 0) if device.type == "cuda" else DeviceRef.CPU()

        def tensor_type(arg):
            return TensorType(torch_dtype_to_max(arg.dtype or dtype), list(arg.dims), device=ref)

        out_types = [tensor_type(a) for a in self.spec.outputs]
        in_types = [tensor_type(a) for a in self.spec.inputs]
        dest_types = [t for t, r in zip(out_types, self.spec.returned, strict=True) if not r]
        n_dest = len(dest_types)
        variant = "".join(f"_{k}{int(v) if isinstance(v, bool) else v}" for k, v in sorted(params.items()))
        graph_name = f"gpu_days_{self.spec.name}_{str(dtype).removeprefix('torch.')}_{device.type}{variant}"
        with Graph(
            graph_name,
            input_types=[t.as_buffer() for t in dest_types] + in_types,
            kernel_library=kernels,
        ) as graph:
            results = ops.custom(
                self.spec.name,
                ref,
                [v.tensor for v in graph.inputs[n_dest:]],
                out_types=out_types,
                parameters=dict(params),
            )
            dests = iter(graph.inputs[:n_dest])
            returned = []
            for result, is_returned in zip(results, self.spec.returned, strict=True):
                if is_returned:
                    returned.append(result.tensor)
                else:  # a size no input names: the caller's tensor, filled by a copy
                    next(dests).buffer[...] = result.tensor
            graph.output(*returned)
        return session.load(graph)

    # -- call ---------------------------------------------------------------------------
    def __call__(
        self,
        inputs: Sequence[torch.Tensor],
        *,
        out: Sequence[torch.Tensor] = (),
        torch_impl=None,
        params: dict | None = None,
    ) -> list[torch.Tensor]:
        """Run the op and return its outputs, in the spec's order.

        Outputs whose sizes follow from the inputs are allocated by MAX and handed to
        torch without a copy; the others (`spec.destinations`) are passed in as `out` and
        written in place. `params` overrides some of the spec's compile-time parameters
        for this call (one graph per distinct set, compiled once). Bad arguments always
        raise. If the Mojo path cannot run, `torch_impl()` computes the outputs instead,
        after one warning per op (an error in strict mode, or when no `torch_impl` is
        given).
        """
        if torch.autograd.profiler._is_profiler_enabled:  # name the call in profiles (free otherwise)
            with torch.profiler.record_function(f"gpu_days::{self.spec.name}"):
                outputs = self._call(inputs, out, torch_impl, params)
        elif not programs.recording:
            return self._call(inputs, out, torch_impl, params)
        else:
            outputs = self._call(inputs, out, torch_impl, params)
        if programs.recording:  # a program is being recorded (programs.py): it may hold this call
            programs.note_call(self, inputs, out, params, outputs)
        return outputs

    def _call(self, inputs, out, torch_impl, params) -> list[torch.Tensor]:
        # --8<-- [start:replay]
        key = None
        if RECIPES and inputs and inputs[0].__class__ in PLAIN_TENSORS and inputs[0].is_cuda:
            if self._recipe_epoch != direct._epoch:
                self._forget_recipes()
            clash = bool(out) and _any_overlap(out, inputs)  # a replay never checks anything else
            if self._book is not None and not clash:
                # key, outputs, addresses and launches in C++ (replay.cpp); None: not seen there
                found = self._book_call(self._book, inputs, None if params is None else tuple(params.items()), out)
                if found is not None:
                    if found.__class__ is list:
                        return found
                    return self._resume(found, inputs, torch_impl, out)
            key = _call_key(inputs, out, params)
            if key is not None:
                found = self._recipes.get(key)
                if found is not None and not clash:
                    # seen before: checked then, planned then
                    outputs = found.allocate(out)
                    try:
                        found.run(outputs, inputs)
                        return outputs
                    except cuda_driver.CudaDriverError as exc:
                        return self._cannot_launch(exc, torch_impl, out)
        # --8<-- [end:replay]
        sizes = self.spec.check_call(inputs, out)
        call_params = self.spec.call_params(params) if params else self.spec.params
        if inputs[0].is_cuda:
            return self._launch(inputs, out, sizes, call_params, torch_impl, key)
        try:
            dtype = self._op_dtype(inputs, out)
            device = inputs[0].device
            model = self.model(dtype, device, call_params) if self.ready() else None
            reason = self._broken
        except Exception as exc:  # the graph for this dtype/device failed to compile
            model, reason = None, exc
        if model is None:
            if torch_impl is None:
                raise fallback.MojoUnavailableError(f"{self.spec.name}: the Mojo kernel cannot run: {reason}")
            fallback.fall_back(self.spec.name, reason)
            return self._fill_destinations(list(torch_impl()), out)
        shapes = self.spec.output_shapes(sizes, out)
        returned_shapes = [s for s, r in zip(shapes, self.spec.returned, strict=True) if r]
        if any(math.prod(shape) == 0 for shape in returned_shapes):  # nothing to compute
            returned = [
                torch.empty(shape, dtype=arg.dtype or dtype, device=device)
                for arg, shape, r in zip(self.spec.outputs, shapes, self.spec.returned, strict=True)
                if r
            ]
        else:
            buffers = model.execute(*[_to_max(t) for t in (*out, *inputs)])
            returned = [torch.from_dlpack(b) for b in buffers]
        return self._in_spec_order(returned, out)

    def _launch(self, inputs, out, sizes, params, torch_impl, key=None) -> list[torch.Tensor]:
        """The CUDA path: allocate the outputs, let the plan pick the launches, enqueue
        them on torch's current stream. No MAX, no synchronisation. With a `key`, the
        launches are remembered as a recipe for the next call with the same key."""
        index = inputs[0].get_device()  # an int: cheaper than a torch.device on this hot path
        dtype = inputs[0].dtype if not out and self.spec.inputs[0].dtype is None else self._op_dtype(inputs, out)
        given = iter(out)
        outputs = []
        empty = False
        for arg, r in zip(self.spec.outputs, self.spec.returned, strict=True):
            if r:
                shape = [d if d.__class__ is int else sizes[d] for d in arg.dims]
                outputs.append(torch.empty(shape, dtype=arg.dtype or dtype, device=index))
                empty = empty or outputs[-1].numel() == 0
            else:
                outputs.append(next(given))
        if empty:  # nothing to compute (an empty destination, e.g. a workspace, is the plan's to reject)
            return outputs
        reason = self._gpu_broken
        if reason is None and self.gpu is None:
            reason = self._gpu_broken = direct.KernelLoadError(f"{self.spec.name}: no GPU launch plan")
        if reason is None:
            try:
                with direct.planning() as scratch:
                    launches = self.gpu(outputs, inputs, params)
                direct.run(launches, index)
                if key is not None and len(self._recipes) < MAX_RECIPES:
                    found = direct.recipe(outputs, inputs, scratch, launches, index, self.spec.returned)
                    if found is not None:
                        self._recipes[key] = found
                        self._add_to_book(inputs, key[1], out, found)
                return outputs
            except cuda_driver.CudaDriverError as exc:
                return self._cannot_launch(exc, torch_impl, out)
            except direct.KernelLoadError as exc:
                reason = self._gpu_broken = exc
        return self._torch_instead(reason, torch_impl, out)

    def _forget_recipes(self) -> None:
        self._recipes.clear()
        if self._book is not None:
            replay.module().clear(self._book)
        self._recipe_epoch = direct._epoch

    def _add_to_book(self, inputs, params: tuple | None, out, recipe: direct.Recipe) -> None:
        if self._book is None:
            module = replay.module()  # None: the C++ replay is off here (replay_kind says why)
            if module is None:
                return
            self._book, self._book_call = module.new_book(), module.call
        replay.module().add(self._book, inputs, params, out, recipe)

    def _resume(self, failed, inputs, torch_impl, out) -> list[torch.Tensor]:
        """A C++ replay's launch returned an error: its recipe goes on from that step in
        Python, which retries with the primary context or raises naming the kernel."""
        recipe, outputs, scratch, step, _code = failed
        try:
            recipe.resume(outputs, inputs, scratch, step)
            return outputs
        except cuda_driver.CudaDriverError as exc:
            return self._cannot_launch(exc, torch_impl, out)

    def _cannot_launch(self, exc, torch_impl, out) -> list[torch.Tensor]:
        if exc.sticky:  # the context is gone: torch's fallback would fail too
            raise fallback.MojoUnavailableError(f"{self.spec.name}: {exc}") from exc
        return self._torch_instead(exc, torch_impl, out)

    def _torch_instead(self, reason, torch_impl, out) -> list[torch.Tensor]:
        if torch_impl is None:
            raise fallback.MojoUnavailableError(f"{self.spec.name}: the Mojo kernel cannot run: {reason}")
        fallback.fall_back(self.spec.name, reason)
        return self._fill_destinations(list(torch_impl()), out)

    def _in_spec_order(self, returned, out) -> list[torch.Tensor]:
        """The graph's results and the caller's destinations, in the spec's output order."""
        returned, given = iter(returned), iter(out)
        return [next(returned) if r else next(given) for r in self.spec.returned]

    def _fill_destinations(self, results: list[torch.Tensor], out) -> list[torch.Tensor]:
        """The torch fallback's results, with the caller's destinations filled in place."""
        if len(results) != len(self.spec.outputs):
            want = len(self.spec.outputs)
            raise TypeError(f"{self.spec.name}: torch_impl returned {len(results)} tensors, not {want}")
        returned = [t for t, r in zip(results, self.spec.returned, strict=True) if r]
        for_destinations = [t for t, r in zip(results, self.spec.returned, strict=True) if not r]
        for result, dest in zip(for_destinations, out, strict=True):
            if result is not dest:
                dest.copy_(result)
        return self._in_spec_order(returned, out)

    def _op_dtype(self, inputs, out) -> torch.dtype:
        """The call's dtype: that of the first tensor whose spec has no fixed dtype."""
        for arg, t in zip(self.spec.inputs + self.spec.destinations, (*inputs, *out), strict=True):
            if arg.dtype is None:
                return t.dtype
        return inputs[0].dtype


# GPU_DAYS_RECIPES=0 plans every call (to measure what recipes save, or to rule them out)
RECIPES = os.environ.get("GPU_DAYS_RECIPES", "1") != "0"
MAX_RECIPES = 256  # per op: a model has a few dozen distinct calls; more is a shape sweep


def _call_key(inputs, out, params) -> tuple | None:
    """What a launch plan may depend on (`direct.Recipe`): per tensor its shape, dtype,
    contiguity, device and whether its address is 16-byte aligned; and the parameters.
    None for a call that must take the checked path (a tensor subclass, a non-tensor)."""
    key = [len(out), None if params is None else tuple(params.items())]
    for t in (*out, *inputs):
        if t.__class__ not in PLAIN_TENSORS:
            return None
        key += (t.shape, t.dtype, t.get_device(), t.is_contiguous(), t.data_ptr() & 15)
    return tuple(key)


def _any_overlap(out, inputs) -> bool:
    """The one check a recipe's call still makes: destinations overlap nothing."""
    tensors = (*out, *inputs)
    return any(_overlaps(o, t) for o in out for t in tensors if t is not o)


def _to_max(t: torch.Tensor):
    from max.driver import Buffer

    if t.requires_grad:  # DLPack refuses such tensors; autograd is handled above this layer
        t = t.detach()
    if t.device.type == "cuda":
        # Hand MAX torch's current stream so the kernel is ordered after the work
        # that produced the inputs (what MAX's own torch bridge does).
        from max.experimental.torch.torch import max_device

        stream = torch.cuda.current_stream(t.device).cuda_stream
        return Buffer._from_dlpack(t.__dlpack__(), max_device(t.device), stream)
    return Buffer.from_dlpack(t)


_constants: dict[tuple, torch.Tensor] = {}


def device_constant(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant tensor (an eps, GEMM's alpha and beta) on `device`, made once and
    then reused: a new one per call would cost an allocation and a fill kernel each time.

    Inside a CUDA-graph capture a missing constant is made with fill kernels (a host-to-
    device copy cannot be captured) and not kept: it lives in the graph's memory pool.
    """
    key = (values, dtype, device)
    found = _constants.get(key)
    if found is not None:
        return found
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        t = torch.empty(len(values), dtype=dtype, device=device)
        for i, v in enumerate(values):
            t[i].fill_(v)
        return t
    t = torch.tensor(values, dtype=dtype, device=device)
    if len(_constants) < 1024:
        _constants[key] = programs.keep(direct.kept_for_the_process(t))
    return t
