"""Mojo kernels from the days of gpu-days, as torch ops and modules.

    import pytorch_custom_ops as pco
    y = pco.softmax(x, dim=-1)             # torch.ops.gpu_days.softmax (day012)
    y = pco.online_softmax(x, dim=-1)      # day009's one-pass kernel
    pco.use_mojo("softmax")                # True when the Mojo path is live

The kernels come from `days/` (built on first use, cached in `build/`), or from a
precompiled library named by GPU_DAYS_KERNEL_LIBRARY. If the Mojo path cannot run, ops
warn once and fall back to torch; GPU_DAYS_STRICT=1 turns that into an error.
"""

from . import softmax_family
from .contract import ContractError, OpSpec, TensorArg
from .fallback import MojoFallbackWarning, MojoUnavailableError, strict
from .gemm import MojoGEMM, gemm, gemm_batched, gemm_batched_kernel, gemm_kernel
from .library import KernelBuildError, build_library
from .softmax import online_softmax, online_softmax_kernel
from .softmax_family import (
    MojoLogSoftmax,
    MojoSoftmax,
    log_softmax,
    log_softmax_backward,
    softmax,
    softmax_backward,
)

KERNELS = {k.spec.name: k for k in (online_softmax_kernel, *softmax_family.KERNELS)}
KERNELS = {k.spec.name: k for k in (online_softmax_kernel, gemm_kernel, gemm_batched_kernel)}


def use_mojo(op: str) -> bool:
    """Whether `op` runs its Mojo kernel (True) or the torch fallback (False)."""
    try:
        return KERNELS[op].ready()
    except KeyError:
        raise KeyError(f"unknown op {op!r}; known: {sorted(KERNELS)}") from None


__all__ = [
    "KERNELS",
    "ContractError",
    "KernelBuildError",
    "MojoFallbackWarning",
    "MojoLogSoftmax",
    "MojoGEMM",
    "MojoSoftmax",
    "MojoUnavailableError",
    "OpSpec",
    "TensorArg",
    "build_library",
    "log_softmax",
    "log_softmax_backward",
    "gemm",
    "gemm_batched",
    "gemm_batched_kernel",
    "gemm_kernel",
    "online_softmax",
    "online_softmax_kernel",
    "softmax",
    "softmax_backward",
    "strict",
    "use_mojo",
]
