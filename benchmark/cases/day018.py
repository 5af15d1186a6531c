"""Day 018: the Mojo FlashAttention forward for Hopper next to day 017's Triton kernel and
torch's SDPA backends, in the same run. Same ops, shapes, FLOP count and float64 reference as
day 017 (benchmark/cases/day017.py): `attention_{fwd,fwd_bwd}_d{64,128}[_causal]`, batch x seq =
16384 tokens, heads x head_dim = 2048, bfloat16.

Impls: `mojo_v1` ... `mojo_v4` (pco.attention with each forward version, and the Mojo
backward's default version; pytorch_custom_ops.attention_gpu.DEFAULT_VERSION and
DEFAULT_BWD_VERSION are the defaults; a row's commit says which those were),
`triton` (day 017), `torch` (SDPA's default dispatch, the speedup baseline), `sdpa_flash`,
`sdpa_cudnn` (SDPA's fastest on the H100 at long sequences). The O(seq^2) impls stay in day 017.
"""

from __future__ import annotations

import pytorch_custom_ops as pco
from pytorch_custom_ops.attention_gpu import attention_version

from .day017 import ATTENTION, IMPLS_FOR_TIMING, _case


def _mojo(version: int):
    def run(q, k, v, causal):
        with attention_version(version):
            return pco.attention(q, k, v, causal=causal)

    return run


IMPLS = {
    "mojo_v1": _mojo(1),
    "mojo_v2": _mojo(2),
    "mojo_v3": _mojo(3),
    "mojo_v4": _mojo(4),
    "torch": ATTENTION["torch"],
    **IMPLS_FOR_TIMING,
}

CASES = [
    _case(d, causal, bwd, day="day018", attention=IMPLS)
    for bwd in (False, True)
    for d in (64, 128)
    for causal in (False, True)
]
