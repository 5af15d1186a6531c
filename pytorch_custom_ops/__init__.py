"""Mojo kernels from the days of gpu-days, as torch ops and modules.

    import pytorch_custom_ops as pco
    y = pco.online_softmax(x, dim=-1)      # torch.ops.gpu_days.online_softmax
    y = pco.layer_norm(x, (d,), w, b)      # torch.ops.gpu_days.layer_norm (+ its backward)
    pco.use_mojo("online_softmax")         # True when the Mojo path is live

The kernels come from `days/` (built on first use, cached in `build/`), or from a
precompiled library named by GPU_DAYS_KERNEL_LIBRARY. If the Mojo path cannot run, ops
warn once and fall back to torch; GPU_DAYS_STRICT=1 turns that into an error.
"""

from .contract import ContractError, OpSpec, TensorArg
from .fallback import MojoFallbackWarning, MojoUnavailableError, strict
from .layer_norm import MojoLayerNorm, layer_norm, layer_norm_backward, layer_norm_backward_kernel, layer_norm_kernel
from .library import KernelBuildError, build_library
from .softmax import MojoSoftmax, online_softmax, online_softmax_kernel

KERNELS = {k.spec.name: k for k in (online_softmax_kernel, layer_norm_kernel, layer_norm_backward_kernel)}


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
    "MojoLayerNorm",
    "MojoSoftmax",
    "MojoUnavailableError",
    "OpSpec",
    "TensorArg",
    "build_library",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_backward_kernel",
    "layer_norm_kernel",
    "online_softmax",
    "online_softmax_kernel",
    "strict",
    "use_mojo",
]
