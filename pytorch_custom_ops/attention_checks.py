"""The argument checks that day 017's Triton and day 018's Mojo attention share."""

from __future__ import annotations

import torch

MAX_GRID_YZ = 65535  # CUDA's limit on grid.y (heads) and grid.z (batch)


def check_qkv(op: str, q, k, v, causal, head_dims: tuple[int, ...], device_check=None) -> None:
    """Raise TypeError/ValueError naming `op` and the problem (types, shapes, dtypes,
    devices, GQA, lengths, causal). float16/bfloat16 only; `device_check(q)` may add a
    rule about where the tensors live."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in (torch.float16, torch.bfloat16):
            hint = " (cast float32 inputs with .to(torch.bfloat16))" if t.dtype == torch.float32 else ""
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: float16, bfloat16{hint}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{op}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if device_check is not None:
        device_check(q)
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    (b, hq, lq, d), (bk, hkv, lk, dk) = q.shape, k.shape
    if b != bk:
        raise ValueError(f"{op}: batch sizes differ: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if d != dk:
        raise ValueError(f"{op}: head dims differ: q has {d}, k and v have {dk}")
    if d not in head_dims:
        raise ValueError(f"{op}: head_dim {d} is not supported; supported: {', '.join(map(str, head_dims))}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{op}: q heads ({hq}) must be a multiple of k/v heads ({hkv}) (grouped-query attention)")
    if lk == 0 and b * hq * lq > 0:
        raise ValueError(f"{op}: k and v have sequence length 0: softmax over no keys is undefined")
    if q.device.type == "cuda" and (hq > MAX_GRID_YZ or b > MAX_GRID_YZ):  # the CPU paths have no grid
        raise ValueError(f"{op}: batch ({b}) and heads ({hq}) must each be <= {MAX_GRID_YZ} (CUDA grid limits)")
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal must be a bool, got {type(causal).__name__}")
