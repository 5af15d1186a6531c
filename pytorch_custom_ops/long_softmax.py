"""`long_softmax(x, dim=-1)`: day015's multi-block softmax for very long rows, as a torch op.

Registered as `gpu_days::long_softmax(x, dim, pipeline)`. Day 009's op gives a row one
block, which is right for many short rows; here each row is spread over many blocks, for
a few rows of millions of elements (a 2^28 vector, or 8 x 2^22). `pipeline` picks the
Mojo pipeline at compile time (one graph each): "fused" (2 launches, 2 reads + 1 write)
or "four_stage" (max, exp + partial sums, sum, normalize: 3 reads + 2 writes).

The Mojo op also takes a float64 workspace for the per-block partials, allocated here
(torch's caching allocator, on the stream the kernels run on) and checked by the bridge
like any other tensor. It is scratch: the torch op returns only the softmax.
"""

from __future__ import annotations

import torch

from . import softmax
from .contract import OpSpec, TensorArg
from .mojo_op import MojoOp
from .softmax import _as_rows, _from_rows, _needs_dispatcher, check_softmax_args

PIPELINES = ("fused", "four_stage")
# Layout of a workspace row (days/day015/long_softmax.mojo): 4 slots (row max, row sum),
# then two regions of `cap` partials. Mojo uses at most `cap` blocks a row, so `cap`
# bounds the parallelism: 1024 is more than an H100 uses for one row (132 SMs x 4),
# and a block never gets less than MIN_BLOCK_ELEMS elements, so short rows get a small
# workspace (6 slots, one block: day009's regime).
PARTIALS = 4
MAX_BLOCKS_PER_ROW = 1024
MIN_BLOCK_ELEMS = 4096

LONG_SOFTMAX = OpSpec(
    name="long_softmax",
    outputs=(
        TensorArg("output", ("rows", "cols")),
        TensorArg("workspace", ("rows", "slots"), dtype=torch.float64),
    ),
    inputs=(TensorArg("x", ("rows", "cols")),),
    params={"PIPELINE": "fused"},
)
long_softmax_kernel = MojoOp(LONG_SOFTMAX)


def workspace_slots(n: int) -> int:
    """Slots a workspace row needs for a row of n elements (an even count, so that each
    region of float64 partials starts on a 16-byte boundary)."""
    cap = min(MAX_BLOCKS_PER_ROW, max(1, -(-n // MIN_BLOCK_ELEMS)))
    return PARTIALS + 2 * (cap + cap % 2)


def _check_pipeline(pipeline) -> None:
    if not isinstance(pipeline, str):
        raise TypeError(f"long_softmax: pipeline must be a str, got {type(pipeline).__name__}")
    if pipeline not in PIPELINES:
        raise ValueError(f"long_softmax: pipeline must be one of {PIPELINES}, got {pipeline!r}")


def _long_softmax_eager(x: torch.Tensor, dim: int, pipeline: str = "fused") -> torch.Tensor:
    dim = check_softmax_args("long_softmax", x, dim)
    _check_pipeline(pipeline)
    rows = _as_rows(x, dim)
    workspace = torch.empty(rows.shape[0], workspace_slots(rows.shape[1]), dtype=torch.float64, device=rows.device)
    out, _ = long_softmax_kernel(
        [rows],
        out=[workspace],
        torch_impl=lambda: [torch.softmax(rows, dim=-1), workspace],
        params={"PIPELINE": pipeline},
    )
    return _from_rows(out, x, dim)


_long_softmax = torch.library.custom_op("gpu_days::long_softmax", _long_softmax_eager, mutates_args=())


@_long_softmax.register_fake
def _(x: torch.Tensor, dim: int, pipeline: str = "fused") -> torch.Tensor:
    check_softmax_args("long_softmax", x, dim)
    _check_pipeline(pipeline)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _backward(ctx, grad):
    # softmax's backward in plain torch (y * (g - sum(g * y))): a reduction and an
    # elementwise pass that torch already runs near bandwidth; the day is about the forward.
    return (*softmax._backward(ctx, grad), None)


_long_softmax.register_autograd(_backward, setup_context=softmax._setup_context)


def long_softmax(x: torch.Tensor, dim: int = -1, pipeline: str = "fused") -> torch.Tensor:
    """Softmax of `x` along `dim`, each row spread over many blocks (day015's Mojo kernels)."""
    if _needs_dispatcher(x):
        check_softmax_args("long_softmax", x, dim)  # our message before torch's schema check
        _check_pipeline(pipeline)
        return torch.ops.gpu_days.long_softmax(x, dim, pipeline)
    return _long_softmax_eager(x, dim, pipeline)


class MojoLongSoftmax(torch.nn.Module):
    """`torch.nn.Softmax(dim)` for very long rows, backed by the multi-block Mojo kernels."""

    def __init__(self, dim: int = -1, pipeline: str = "fused"):
        super().__init__()
        _check_pipeline(pipeline)
        self.dim = dim
        self.pipeline = pipeline

    @property
    def use_mojo(self) -> bool:
        return long_softmax_kernel.ready()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return long_softmax(x, self.dim, self.pipeline)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, pipeline={self.pipeline!r}"
