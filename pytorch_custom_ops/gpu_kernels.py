"""The GPU kernels the direct launch path may run, declared once in Python.

A `KernelFamily` names a Mojo kernel function (`days.day009.online_softmax` /
`online_softmax_kernel`), the argument list its launcher passes (the ABI: kinds in
order) and the compile-time parameter sets ("variants") that the op's launch plan may
pick. `gpu_build` compiles every variant of every family to PTX ahead of time, on any
machine (no GPU needed); at run time `direct` loads the one a launch plan asks for.

The argument kinds and what each must be in the PTX `.entry` parameter list:

    ptr        a device pointer              .param .u64 .ptr ...
    i64        Int64                         .param .b64
    i32        Int32                         .param .b32
    f32        Float32                       .param .f32 (or .b32)
    tensormap  a TMA descriptor by value     .param .align 64 .b8 name[128]
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

ARG_KINDS = ("ptr", "i64", "i32", "f32", "tensormap")

_MOJO_DTYPES = {
    torch.float32: "DType.float32",
    torch.float16: "DType.float16",
    torch.bfloat16: "DType.bfloat16",
    torch.float64: "DType.float64",
}

_FAMILIES: dict[tuple[str, str], KernelFamily] = {}


def mojo_literal(value) -> str:
    """How a compile-time parameter is written in Mojo source."""
    if isinstance(value, torch.dtype):
        return _MOJO_DTYPES[value]
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return str(value)
    raise TypeError(f"no Mojo spelling for compile-time parameter {value!r}")


def _short(value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(int(value)) if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Kernel:
    """One compiled specialization: a family and its compile-time parameter values."""

    family: KernelFamily
    params: tuple

    @property
    def key(self) -> str:
        """A file-name-safe identity, e.g. `day009.online_softmax_kernel.float32.256`."""
        day = self.family.module.split(".")[1]
        return ".".join([day, self.family.function, *(_short(p) for p in self.params)])

    @property
    def entry_directives(self) -> tuple[str, ...]:
        """PTX lines the build adds after this kernel's `.maxntid` (the family's rule)."""
        rule = self.family.entry_directives
        return tuple(rule(self.params)) if rule else ()

    @property
    def mojo(self) -> str:
        """The specialization as a Mojo expression, e.g. `online_softmax_kernel[DType.float32, 256]`."""
        return f"{self.family.function}[{', '.join(mojo_literal(p) for p in self.params)}]"

    def __str__(self) -> str:
        return f"{self.family.module}.{self.mojo}"


@dataclass(frozen=True, eq=False)
class KernelFamily:
    module: str  # Mojo module path, e.g. "days.day009.online_softmax"
    function: str  # the kernel function in it
    args: tuple[str, ...]  # what every launch passes, in order (ARG_KINDS)
    variants: tuple[tuple, ...]  # every compile-time parameter set a launch plan may pick
    # variant params -> PTX lines for its entry, e.g. (".minnctapersm 1",): what Mojo cannot
    # declare (gpu_build.with_entry_directives says why that one matters)
    entry_directives: Callable[[tuple], tuple[str, ...]] | None = field(default=None, repr=False)
    _index: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        unknown = [a for a in self.args if a not in ARG_KINDS]
        if unknown:
            raise ValueError(f"{self.function}: unknown argument kinds {unknown}; known: {ARG_KINDS}")
        if not self.module.startswith("days.day"):
            raise ValueError(f"{self.function}: module {self.module!r} is not a day's Mojo module")
        for params in self.variants:
            self._index[tuple(params)] = Kernel(self, tuple(params))
        _FAMILIES[(self.module, self.function)] = self

    def __getitem__(self, params) -> Kernel:
        params = params if isinstance(params, tuple) else (params,)
        try:
            return self._index[params]
        except KeyError:
            raise KeyError(
                f"{self.module}.{self.function}{list(map(_short, params))} is not one of the declared variants "
                "(add it to the family's variants so that gpu_build compiles it)"
            ) from None

    def __contains__(self, params) -> bool:
        """Whether `params` is a declared variant (a plan may prefer a special one)."""
        return (params if isinstance(params, tuple) else (params,)) in self._index

    def kernels(self) -> list[Kernel]:
        return list(self._index.values())


def families() -> list[KernelFamily]:
    """Every declared family (importing pytorch_custom_ops declares them all)."""
    return list(_FAMILIES.values())


def all_kernels() -> list[Kernel]:
    return [k for f in families() for k in f.kernels()]


# -- the ABI, read back from the PTX ----------------------------------------------------------
_ENTRY = re.compile(r"\.entry\s+(\S+)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+(.*?)\s+(\S+?)(\[\d+\])?\s*$")


def entry_params(ptx: str, entry: str) -> list[str]:
    """The parameter kinds of `.entry entry(...)` in a PTX file, as ARG_KINDS."""
    for name, body in _ENTRY.findall(ptx):
        if name != entry:
            continue
        kinds = []
        for line in filter(None, (p.strip() for p in body.split(","))):
            match = _PARAM.match(line)
            if not match:
                raise ValueError(f"{entry}: unreadable parameter {line!r}")
            decl, _name, array = match.groups()
            words = decl.split()
            if array == "[128]" and "b8" in decl.replace(".", " ").split() and ".align 64" in decl:
                kinds.append("tensormap")
            elif words[0] == ".u64" and ".ptr" in words:
                kinds.append("ptr")
            elif words == [".b64"] or words == [".u64"] or words == [".s64"]:
                kinds.append("i64")
            elif words in ([".b32"], [".u32"], [".s32"]):
                kinds.append("i32")
            elif words == [".f32"]:
                kinds.append("f32")
            else:
                kinds.append(f"unknown({decl}{array or ''})")
        return kinds
    raise ValueError(f"no .entry {entry} in the PTX")


def abi_mismatch(kernel: Kernel, ptx_kinds: list[str]) -> str | None:
    """None when the launcher's argument kinds fit the kernel's `.entry` parameters.

    A Float32 and an Int32 are both 32-bit in PTX (`.f32` or `.b32`): they may stand for
    each other only as f32 <- b32, which is how some Mojo versions declare a float."""
    declared = list(kernel.family.args)
    ok = len(declared) == len(ptx_kinds) and all(
        d == p or (d == "f32" and p == "i32") for d, p in zip(declared, ptx_kinds, strict=True)
    )
    if ok:
        return None
    return f"{kernel}: the launcher passes {declared}, the kernel's .entry takes {ptx_kinds}"
