"""What Python knows about each Mojo op, and the checks made before a call reaches Mojo.

MAX checks almost nothing on its own: a compile-time parameter that Python forgets gives
"Failed to compile the model" with no reason, and a wrong output shape writes out of
bounds (garbage or a segfault). So every op declares its contract once, here, as an
`OpSpec`; each call is checked against it, and the spec itself is checked against the
compiled library (`verify_against_library`), so Python and Mojo cannot drift apart.
"""

from __future__ import annotations

import numbers
import operator
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SUPPORTED_DEVICES = ("cpu", "cuda")
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # not subclasses: fakes, functional tensors


def check_float_tensor(name: str, x) -> None:
    """The first checks of every op's public function: a float tensor on a supported device."""
    if x.__class__ in PLAIN_TENSORS and x.dtype in FLOAT_DTYPES and (x.is_cuda or x.is_cpu):
        return  # the usual case, without making a torch.device
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: dtype {x.dtype} is not supported (float32, float16, bfloat16, float64)")
    if x.device.type not in SUPPORTED_DEVICES:
        raise ValueError(f"{name}: device {x.device} is not supported (cpu, cuda)")


def as_int(v):
    """v as a Python int where it is an integer torch takes as one (numpy's, a 0-d tensor's
    __index__); an int (bool too) or anything else as it is, for the checks to name."""
    if isinstance(v, int) or not hasattr(type(v), "__index__"):
        return v
    try:
        return operator.index(v)
    except TypeError:
        return v


def as_float(v):
    """v as a Python float where it is a real number torch takes as one (numpy's floats and
    ints); a float, a bool or anything else as it is, for the checks to name."""
    if isinstance(v, (bool, float)) or not isinstance(v, numbers.Real):
        return v
    return float(v)


def as_int_list(seq):
    """A tuple, list or range of such integers as a list of Python ints (torch's permute
    takes all of them); anything else as it is."""
    return [as_int(p) for p in seq] if isinstance(seq, (tuple, list, range)) else seq


def f32_exact(v: float) -> bool:
    """v survives a round trip through float32 (what the kernels read alpha and beta as)."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0] == v
    except OverflowError:
        return False


def same_device(t: torch.Tensor, ref: torch.Tensor) -> bool:
    """t.device == ref.device for a CPU or CUDA `ref`, without making torch.device objects."""
    return t.get_device() == ref.get_device() and t.is_cuda == ref.is_cuda and t.is_cpu == ref.is_cpu


class ContractError(RuntimeError):
    """The Python spec of an op does not match the Mojo op in the compiled library."""


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument: its Mojo name and one symbolic name per dimension.

    Dimensions with the same name must have the same size in every tensor of a call
    (e.g. `("rows", "cols")` for both the output and the input of a row softmax); an int
    is a fixed size. `dtype=None` means "the op's dtype" (that of the first such tensor);
    a fixed dtype is for side tensors such as float32 statistics next to bf16 data.
    """

    name: str
    dims: tuple[str | int, ...]
    dtype: torch.dtype | None = None

    @property
    def rank(self) -> int:
        return len(self.dims)


@dataclass(frozen=True)
class OpSpec:
    name: str  # the name given to @register in Mojo
    outputs: tuple[TensorArg, ...]
    inputs: tuple[TensorArg, ...]
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    params: Mapping[str, bool | int | str] = field(default_factory=dict)
    # compile-time parameters MAX infers from the tensors instead of taking from Python
    inferred: tuple[str, ...] = ("dtype",)

    # -- which outputs MAX allocates (fixed per spec; cached: every call reads them) -------
    @cached_property
    def returned(self) -> tuple[bool, ...]:
        """Per output: True when every dimension is fixed or named by an input.

        MAX can size such an output itself, so the graph returns it and torch wraps the
        buffer (DLPack, no copy). An output with a dimension no input names (GEMM's
        (m, n), a workspace's slots) is passed in by the caller instead, and the graph
        copies the op's result into it: one more read and write of that tensor.
        """
        named = {d for a in self.inputs for d in a.dims if isinstance(d, str)}
        return tuple(all(isinstance(d, int) or d in named for d in a.dims) for a in self.outputs)

    @cached_property
    def destinations(self) -> tuple[TensorArg, ...]:
        """The outputs the caller passes in (see `returned`)."""
        return tuple(a for a, r in zip(self.outputs, self.returned, strict=True) if not r)

    def output_shapes(self, sizes: Mapping[str, int], destinations: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
        """Every output's shape, from the sizes `check_call` bound."""
        given = iter(destinations)
        return [
            tuple(d if isinstance(d, int) else sizes[d] for d in a.dims) if r else tuple(next(given).shape)
            for a, r in zip(self.outputs, self.returned, strict=True)
        ]

    # -- per call ---------------------------------------------------------------------
    @cached_property
    def _fast_checks(self) -> tuple:
        """(dtype per tensor or None, dims per tensor, index of the first dtype-free
        tensor), destinations first: what `_sizes_if_valid` walks on every call."""
        args = self.destinations + self.inputs
        free = next((i for i, a in enumerate(args) if a.dtype is None), 0)
        return tuple(a.dtype for a in args), tuple(a.dims for a in args), free, frozenset(self.dtypes)

    def _sizes_if_valid(self, inputs, destinations) -> dict[str, int] | None:
        """The sizes of a valid call in as few steps as possible (every op call pays for
        this), or None when anything is off; `check_call` then finds and names it."""
        if destinations or self.destinations or len(inputs) != len(self.inputs):
            return None  # destinations also need the overlap check: the full path
        dtypes, dims_list, free, allowed = self._fast_checks
        first = inputs[free]
        if not isinstance(first, torch.Tensor):
            return None
        dtype, cuda, index = first.dtype, first.is_cuda, first.get_device()  # no torch.device objects: slow
        if dtype not in allowed or not (cuda or first.is_cpu):
            return None
        sizes: dict[str, int] = {}
        for fixed, dims, t in zip(dtypes, dims_list, inputs, strict=True):
            if not isinstance(t, torch.Tensor) or t.dtype != (fixed or dtype) or not t.is_contiguous():
                return None
            if t is not first and (t.is_cuda != cuda or t.get_device() != index or not (cuda or t.is_cpu)):
                return None
            shape = t.shape
            if len(shape) != len(dims):
                return None
            for name, size in zip(dims, shape, strict=True):
                if name.__class__ is int:
                    if size != name:
                        return None
                elif sizes.setdefault(name, size) != size:
                    return None
        return sizes

    def check_call(self, inputs: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor] = ()) -> dict[str, int]:
        """Raise TypeError/ValueError naming the op and the problem; return the dimension
        sizes the tensors bind when the call is safe. `destinations` are the outputs the
        caller passes in (`self.destinations`), in order."""
        sizes = self._sizes_if_valid(inputs, destinations)
        if sizes is not None:
            return sizes
        op = self.name
        for kind, given, declared in (("destination", destinations, self.destinations), ("input", inputs, self.inputs)):
            if len(given) != len(declared):
                names = ", ".join(a.name for a in declared) or "none"
                raise TypeError(f"{op}: expected {len(declared)} {kind} tensor(s) ({names}), got {len(given)}")
        pairs = list(zip(self.destinations + self.inputs, list(destinations) + list(inputs), strict=True))
        for arg, t in pairs:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: '{arg.name}' must be a torch.Tensor, got {type(t).__name__}")
        first_arg, first = next(((a, t) for a, t in pairs if a.dtype is None), pairs[0])
        sizes: dict[str, tuple[int, str]] = {}
        for arg, t in pairs:
            if arg.dtype is not None:
                if t.dtype != arg.dtype:
                    raise TypeError(f"{op}: '{arg.name}' must be {arg.dtype}, got {t.dtype}")
            elif t.dtype not in self.dtypes:
                allowed = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
                raise TypeError(f"{op}: '{arg.name}' has dtype {t.dtype}; supported: {allowed}")
            elif t.dtype != first.dtype:
                raise TypeError(f"{op}: '{arg.name}' is {t.dtype} but '{first_arg.name}' is {first.dtype}")
            if t.device.type not in SUPPORTED_DEVICES:
                raise ValueError(f"{op}: '{arg.name}' is on {t.device}; supported devices: cpu, cuda")
            if t.device != first.device:
                raise ValueError(f"{op}: '{arg.name}' is on {t.device} but '{first_arg.name}' is on {first.device}")
            if t.dim() != arg.rank:
                raise ValueError(f"{op}: '{arg.name}' must have rank {arg.rank} {arg.dims}, got shape {tuple(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{op}: '{arg.name}' must be contiguous (call .contiguous() first)")
            for dim_name, size in zip(arg.dims, t.shape, strict=True):
                if isinstance(dim_name, int):
                    if size != dim_name:
                        raise ValueError(f"{op}: '{arg.name}' must have shape {arg.dims}, got {tuple(t.shape)}")
                    continue
                seen = sizes.setdefault(dim_name, (size, arg.name))
                if seen[0] != size:
                    raise ValueError(
                        f"{op}: shape mismatch on '{dim_name}': '{arg.name}' has {size}, '{seen[1]}' has {seen[0]}"
                    )
        for i, (arg, out) in enumerate(zip(self.destinations, destinations, strict=True)):
            for other_arg, other in pairs[:i] + pairs[i + 1 :]:
                if _overlaps(out, other):
                    raise ValueError(f"{op}: output '{arg.name}' overlaps '{other_arg.name}' in memory")
        return {name: size for name, (size, _) in sizes.items()}

    def call_params(self, overrides: Mapping[str, bool | int | str] | None) -> dict[str, bool | int | str]:
        """The compile-time parameters of one call: the spec's defaults with `overrides`
        (e.g. a transpose flag). Each distinct set compiles its own graph, once."""
        if not overrides:
            return dict(self.params)
        unknown = sorted(set(overrides) - set(self.params))
        if unknown:
            raise TypeError(f"{self.name}: unknown compile-time parameter(s) {unknown}; known: {sorted(self.params)}")
        for key, value in overrides.items():
            if type(value) is not type(self.params[key]):
                raise TypeError(
                    f"{self.name}: parameter {key!r} must be {type(self.params[key]).__name__}, "
                    f"got {type(value).__name__}"
                )
        return {**self.params, **overrides}

    # -- once per library -------------------------------------------------------------
    def verify_against_library(
        self, declared_params: Sequence[str], tensor_args: Sequence[str], n_outputs: int
    ) -> None:
        """Compare this spec with the op's `execute` signature as the compiled library declares it."""
        op = self.name
        expected_tensors = [a.name for a in self.outputs + self.inputs]
        if list(tensor_args) != expected_tensors or n_outputs != len(self.outputs):
            raise ContractError(
                f"{op}: Mojo declares tensors {list(tensor_args)} ({n_outputs} output(s)); "
                f"Python declares {expected_tensors} ({len(self.outputs)} output(s))"
            )
        needed = set(declared_params) - {"target"} - set(self.inferred)
        missing = sorted(needed - set(self.params))
        extra = sorted(set(self.params) - needed)
        if missing:
            raise ContractError(f"{op}: Mojo declares compile-time parameter(s) {missing} that Python does not pass")
        if extra:
            raise ContractError(f"{op}: Python passes parameter(s) {extra} that the Mojo op does not declare")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b share bytes: one storage, and their extents intersect. The cheap
    tests first (a recipe's replay asks this on every call with destinations); torch.device
    and storage objects only when the extents do intersect."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    if not (a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()):
        return False
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


_PARAM_DECL = re.compile(r"param\.decl (\w+) :")


def declared_parameters(kernel_decl: str) -> list[str]:
    """Compile-time parameter names of an op's `execute`, read from its MLIR declaration.

    Names MAX makes up for the tensors' internals contain a backquote and do not match.
    """
    return _PARAM_DECL.findall(kernel_decl)


def user_ops(kernels) -> list[str]:
    """Names of the ops registered with @register in our own Mojo sources."""
    analysis = kernels._analysis
    return sorted(n for n in kernels if "is_user_defined = true" in str(analysis.kernel(n)))
