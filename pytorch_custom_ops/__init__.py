"""Mojo kernels from the days of gpu-days, as torch ops and modules.

    import pytorch_custom_ops as pco
    y = pco.softmax(x, dim=-1)             # torch.ops.gpu_days.softmax (day012)
    y = pco.online_softmax(x, dim=-1)      # day009's one-pass kernel
    y = pco.layer_norm(x, (d,), w, b)      # day013, differentiable through its Mojo backward
    s, y = pco.add_layer_norm(x, delta, (d,), w, b)  # x + delta, then its LayerNorm: one pass
    c = pco.gemm(a, b, alpha=2.0)          # day014
    y = pco.linear(x, w, b, "gelu_tanh")   # day019: x Wᵀ + b, GELU, + residual in one launch
    y = pco.mlp(x, w1, b1, w2, b2)         # day020: GPT-2's MLP, no GELU kernel either way
    with pco.gemm_version("TMA_128x256"):   # force one of day014's GEMM versions
    y = pco.long_softmax(v)                # day015: a few very long rows (e.g. 2^28)
    o = pco.permute_copy(o.view(b, h, s, hd), (0, 2, 1, 3))  # day016: heads merged
    q, k, v = pco.permute_unbind(qkv.view(b, s, 3, h, hd), (2, 0, 3, 1, 4))  # ... and split
    o = pco.flash_attention(q, k, v, causal=True)  # day017: Triton FlashAttention, fwd + bwd
    o = pco.flash_attention_qkvpacked(qkv, causal=True)  # the same from (B, L, 3, H, D), no copies
    o = pco.attention(q, k, v, causal=True)        # day018: Mojo FlashAttention for Hopper
    pco.use_mojo("softmax")                # True when the Mojo path is live

The kernels come from `days/` (built on first use, cached in `build/`), or from a
precompiled library named by GPU_DAYS_KERNEL_LIBRARY. If the Mojo path cannot run, ops
warn once and fall back to torch; GPU_DAYS_STRICT=1 turns that into an error.
"""

from . import softmax_family
from .add_layer_norm import MojoAddLayerNorm, add_layer_norm
from .attention import MojoAttention, attention
from .contract import ContractError, OpSpec, TensorArg
from .cross_entropy import (
    cross_entropy,
    cross_entropy_backward_kernel,
    cross_entropy_kernel,
    cross_entropy_with_grad_kernel,
)
from .fallback import MojoFallbackWarning, MojoUnavailableError, strict
from .flash_attention import flash_attention, flash_attention_qkvpacked
from .gemm import MojoGEMM, gemm, gemm_batched, gemm_batched_kernel, gemm_kernel, gemm_version
from .layer_norm import MojoLayerNorm, layer_norm, layer_norm_backward, layer_norm_backward_kernel, layer_norm_kernel
from .library import KernelBuildError, build_library
from .linear import MojoLinear, linear
from .long_softmax import MojoLongSoftmax, long_softmax, long_softmax_kernel
from .mlp import MojoMLP, mlp
from .permute_copy import permute_copy, permute_copy_kernel
from .permute_unbind import permute_unbind
from .softmax import online_softmax, online_softmax_kernel
from .softmax_family import (
    MojoLogSoftmax,
    MojoSoftmax,
    log_softmax,
    log_softmax_backward,
    softmax,
    softmax_backward,
)

KERNELS = {
    k.spec.name: k
    for k in (
        online_softmax_kernel,  # day009
        *softmax_family.KERNELS,  # day012
        layer_norm_kernel,  # day013
        layer_norm_backward_kernel,
        gemm_kernel,  # day014
        gemm_batched_kernel,
        long_softmax_kernel,  # day015
        permute_copy_kernel((0, 1, 2, 3)),  # day016 (one op per permutation; this one stands for all)
        cross_entropy_kernel,  # day020
        cross_entropy_backward_kernel,
        cross_entropy_with_grad_kernel,
    )
}


def use_mojo(op: str) -> bool:
    """Whether `op` runs its Mojo kernel (True) or the torch fallback (False)."""
    try:
        return KERNELS[op].ready()
    except KeyError:
        raise KeyError(f"unknown op {op!r}; known: {sorted(KERNELS)}") from None


__all__ = [
    "KERNELS",
    "MojoAddLayerNorm",
    "add_layer_norm",
    "MojoAttention",
    "attention",
    "ContractError",
    "KernelBuildError",
    "MojoFallbackWarning",
    "MojoGEMM",
    "MojoLayerNorm",
    "MojoLinear",
    "MojoLogSoftmax",
    "MojoLongSoftmax",
    "MojoMLP",
    "MojoSoftmax",
    "MojoUnavailableError",
    "OpSpec",
    "TensorArg",
    "build_library",
    "cross_entropy",
    "cross_entropy_kernel",
    "cross_entropy_backward_kernel",
    "cross_entropy_with_grad_kernel",
    "flash_attention",
    "flash_attention_qkvpacked",
    "gemm",
    "gemm_batched",
    "gemm_batched_kernel",
    "gemm_kernel",
    "gemm_version",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_backward_kernel",
    "layer_norm_kernel",
    "linear",
    "log_softmax",
    "log_softmax_backward",
    "long_softmax",
    "long_softmax_kernel",
    "mlp",
    "online_softmax",
    "online_softmax_kernel",
    "permute_copy",
    "permute_copy_kernel",
    "permute_unbind",
    "softmax",
    "softmax_backward",
    "strict",
    "use_mojo",
]
