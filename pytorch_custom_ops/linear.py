"""`linear`: day019's fused linear layer as a torch function, and `MojoLinear`, its module.

    y = act(x @ weight.T + bias) + residual        act: None or "gelu_tanh" (GPT-2's GELU)

`weight` is (out_features, in_features) as in `nn.Linear`; `bias` (out_features,) and
`residual` (broadcasting to y) are optional; x may have any leading dims.

On CUDA in bfloat16/float16 (rows 16-byte aligned) the whole layer is one launch of
day 019's persistent GEMM (days/day019/gemm_v4_pingpong.mojo): the bias, the
GELU and the residual are applied to the accumulator in registers, and the output is
written once. In grad mode with GELU, the same launch also writes the pre-activation
(x W^T + b) that GELU's backward needs. The backward is two GEMM calls through `gemm`
(dX = dH W, dW = dH^T X, read in place through transpose flags), torch's own
`gelu_backward` for dH, and a column sum for the bias.

Everywhere else (the CPU, float32/float64, unaligned rows, torch.compile tracing) the
same function is the composition `gemm(x, W^T) + bias`, torch's GELU, `+ residual`:
the same results, with the matrix product still on gpu-days' GEMM.
"""

from __future__ import annotations

import math

import torch

from . import direct, eager, programs
from .contract import FLOAT_DTYPES, OpSpec, TensorArg, same_device
from .gemm import MojoGEMM, _alpha_beta, _no_c, column_sum, gemm
from .gemm_gpu import (
    FEW_ROWS_TILE,
    FEW_TILES_TILE,
    PINGPONG_KERNEL,
    SPLIT_K_SUM_KERNEL,
    TC_DTYPES,
    TMA_KERNEL,
    V4_KINDS,
    VERSIONS,
    auto_tile,
    broadcast_stride,
    c_fits_blocks,
    current_version,
    few_token_pieces,
    pingpong_launch,
    sm_count,
    tma_split_launches,
)
from .master_weights import bias_grad, cast_parameters, grad_destination, weight_grad
from .mojo_op import MojoOp

ACTIVATIONS = (None, "gelu_tanh")

_INPUTS = (
    TensorArg("x", ("rows", "in_features")),
    TensorArg("weight", ("out_features", "in_features")),
    TensorArg("bias", ("bias_len",)),  # out_features, or one unread element (no bias)
    TensorArg("residual", ("c_rows", "c_cols")),  # each dim 1 or full; unread when beta == 0
    TensorArg("alpha_beta", (2,), dtype=torch.float32),
)
# GELU_DERIVATIVE: the saving form's second output is GELU's derivative at the
# pre-activation instead of the pre-activation (day 020's MLP backward multiplies by it)
_PARAMS = {"BIAS": False, "GELU": False, "GELU_DERIVATIVE": False}
LINEAR = OpSpec(name="linear", outputs=(TensorArg("output", ("rows", "out_features")),), inputs=_INPUTS, params=_PARAMS)
# the training forward of a GELU layer: also the pre-activation, for the backward
LINEAR_SAVING = OpSpec(
    name="linear_saving",
    outputs=(TensorArg("output", ("rows", "out_features")), TensorArg("pre", ("rows", "out_features"))),
    inputs=_INPUTS,
    params=_PARAMS,
)


# --8<-- [start:plan]
# A residual read in 16-byte blocks with a short K (day 019, part 16): the ping-pong's
# epilogue, the residual's reads included, runs while the other consumer multiplies. On
# the H100 (bf16, kernel time, results/.../day019_residual_tiles.txt), K = 768: 8192 x 768
# -> 768 26.6 us against AUTO's 34.0, -> 2304 72.6 against 81.3, -> 3072 94.1 against
# 99.4, at 16384 and 2048 tokens too; at K = 1024 and 3072 it lost (up to 19%).
RESIDUAL_SHORT_K = 768
RESIDUAL_SHORT_K_TILE = ("pingpong_tma", 128, 128)


def linear_tile(
    m: int, n: int, k: int, device_index: int | None, gelu: bool = False, block_residual: bool = False
) -> tuple[str, int, int]:
    """(kind, BM, BN) of the fused launch: a forced PINGPONG_*/MULTICAST_*/COOP_* version's;
    else AUTO's cooperative tile (256 x 128 or 256 x 192) or, where it has few tiles, its
    ping-pong tiles with TMA stores (a few tokens' 64 x 64: day 019, part 19). Where AUTO
    picks version 3's tiles or another ping-pong: version 4's ping-pong 128 x 128 with TMA
    stores (the fused epilogue is version 4's; 1-2 us ahead of the register epilogue at
    512-2048 tokens, part 19).

    With GELU, 256 x 128 instead of 256 x 192: the GELU epilogue over 192 accumulators a
    thread spills ~1 KB (8192 x 768 x 768 took 0.063 ms against 0.040 with 256 x 128).
    GELU at 64 x 256 spills ~400 bytes. `block_residual`: a residual the epilogue reads in
    16-byte blocks (gemm_gpu's c_fits_blocks); with K <= RESIDUAL_SHORT_K, no GELU and more
    than few tiles, RESIDUAL_SHORT_K_TILE."""
    kind, bm, bn = VERSIONS[current_version()]
    if kind in ("coop_streamk", "coop_splitk"):  # no fused epilogue with split tiles: the tile, whole
        return "coop", bm, bn
    if kind == "cluster_splitk":
        return "pingpong", bm, bn
    if kind in V4_KINDS:
        return kind, bm, bn
    kind, bm, bn = auto_tile(m, n, k, 1, sm_count(device_index), plain_epilogue=False)
    if (kind, bm, bn) in (FEW_TILES_TILE, FEW_ROWS_TILE):  # few tiles (or a narrow output)
        return kind, bm, bn
    if block_residual and not gelu and k <= RESIDUAL_SHORT_K:
        return RESIDUAL_SHORT_K_TILE
    if not kind.startswith("coop"):  # version 3's tiles, a short or a long K: TMA stores (part 19)
        return "pingpong_tma", 128, 128
    return ("coop_tma", 256, 128) if gelu and bn == 192 else (kind, bm, bn)


def split_linear(out, x, weight, bias, residual, alpha_beta, c_rs, c_cs, params) -> list[direct.Launch] | None:
    """A few tokens with a long K (day 019, parts 19 and 20): the layer without GELU as
    gemm's split into pieces of K (part 17), whose sum kernel adds the bias (a row) and
    beta c (the residual, or the unread placeholder with beta 0): at 64 x 3072 -> 768 ~8
    us against the fused tile's 12. None where the fused launch stays: GELU (no split
    form), a forced version, or K and the tiles that do not split (`few_token_pieces`)."""
    (m, k), n = x.shape, weight.shape[0]
    if params["GELU"] or current_version() != "AUTO":
        return None
    pieces = few_token_pieces(m, n, k, sm_count(out.get_device()))
    if pieces == 1:
        return None
    sizes = (m, n, k, 0, c_rs, c_cs)
    row = bias if params["BIAS"] else None
    return tma_split_launches(out, x, weight, residual, alpha_beta, sizes, False, True, pieces, row)


@direct.plan(PINGPONG_KERNEL, TMA_KERNEL, SPLIT_K_SUM_KERNEL)
def linear_gpu(outputs, inputs, params) -> list[direct.Launch]:
    out, pre = outputs[0], (outputs[1] if len(outputs) > 1 else None)
    x, weight, bias, residual, alpha_beta = inputs
    (m, k), n = x.shape, weight.shape[0]
    c_rs = broadcast_stride("linear", residual.shape[0], m, residual.shape[1])
    c_cs = broadcast_stride("linear", residual.shape[1], n, 1)
    if pre is None:
        split = split_linear(out, x, weight, bias, residual, alpha_beta, c_rs, c_cs, params)
        if split is not None:
            return split
    gelu = params["GELU"]
    kind, bm, bn = linear_tile(m, n, k, out.get_device(), gelu, c_fits_blocks(residual, 0, c_rs, c_cs, n))
    # x (M, K) and weight (N, K) are both k-contiguous: op(B) = weight^T, TRANSPOSE_B
    return pingpong_launch(
        x,
        weight,
        out,
        residual,
        alpha_beta,
        bias if params["BIAS"] else None,
        pre,
        (m, n, k, 1, 0, c_rs, c_cs),
        False,
        True,
        kind,
        bm,
        bn,
        gelu,
        aux_derivative=params["GELU_DERIVATIVE"],
        # GELU on the producer's idle warps (day 019, part 22) needs beta 0: no residual,
        # whose placeholder (gemm._no_c) is one element where a fused residual has n >= 8
        epi_warps=residual.numel() == 1,
    )


# --8<-- [end:plan]
_fused = MojoOp(LINEAR, gpu=linear_gpu)
_fused_saving = MojoOp(LINEAR_SAVING, gpu=linear_gpu)


# -- argument checks ------------------------------------------------------------------
def check_linear_args(x, weight, bias, activation, residual) -> None:
    for arg, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linear: '{arg}' must be a torch.Tensor, got {type(t).__name__}")
    for arg, t in (("bias", bias), ("residual", residual)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"linear: '{arg}' must be a torch.Tensor or None, got {type(t).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"linear: unknown activation {activation!r}; known: {ACTIVATIONS}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"linear: 'x' has dtype {x.dtype}; supported: float32, float16, bfloat16, float64")
    if weight.dim() != 2:
        raise ValueError(f"linear: weight must be (out_features, in_features), got shape {tuple(weight.shape)}")
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: input of shape {tuple(x.shape)} does not end in in_features={weight.shape[1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    for arg, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        if t is None:
            continue
        if t.dtype != x.dtype:
            raise TypeError(f"linear: '{arg}' is {t.dtype} but 'x' is {x.dtype}")
        if not same_device(t, x):
            raise ValueError(f"linear: '{arg}' is on {t.device} but 'x' is on {x.device}")
    if residual is not None:
        out_shape = (*x.shape[:-1], weight.shape[0])
        try:
            fits = torch.broadcast_shapes(residual.shape, out_shape) == out_shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"linear: residual of shape {tuple(residual.shape)} does not broadcast to the output {out_shape}"
            )


def aligned16(t: torch.Tensor | None) -> torch.Tensor | None:
    """t (None stays None), or a contiguous copy where it is not contiguous or its data
    is not 16-byte aligned: what TMA and the epilogue's loads need."""
    if t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _fusable(x, weight, bias, residual) -> bool:
    """One fused launch can compute this call: CUDA, 16-bit floats, rows of 16-byte
    multiples, 16-byte aligned operands, and a residual that is either the output's full
    shape or one row of n (other broadcasts go the composed way)."""
    if not (x.is_cuda and x.dtype in TC_DTYPES):
        return False
    k, n = weight.shape[1], weight.shape[0]
    aligned = all(t.data_ptr() % 16 == 0 for t in (x, weight))
    rows_ok = k % 8 == 0 and n % 8 == 0 and k > 0 and x.numel() > 0
    full = (*x.shape[:-1], n)
    # one row of n: (n,), (1, n), (1, 1, n)... not (n, 1), which also holds n values but
    # broadcasts along the other axis
    row = residual is not None and residual.numel() == n and (residual.dim() == 0 or residual.shape[-1] == n)
    res_ok = residual is None or tuple(residual.shape) == full or row
    return aligned and rows_ok and res_ok


def _composed(x, weight, bias, activation, residual):
    """The layer as separate calls (CPU, other dtypes, tracing): gemm does x W^T + bias."""
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # not -1: K may be 0
    y = gemm(rows, weight, bias, 1.0, 0.0 if bias is None else 1.0, False, True)
    if activation == "gelu_tanh":
        y = torch.nn.functional.gelu(y, approximate="tanh")
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if residual is None else y + residual


# -- the fused path ---------------------------------------------------------------------
def _fused_forward(x2, weight, bias, activation, residual2, save_pre: bool, derivative: bool = False):
    """(y, pre) for 2-D x2 and a 2-D (or absent) residual2; pre is None unless saved.
    With `derivative`, the second output is GELU's derivative at pre instead of pre."""
    gelu = activation == "gelu_tanh"
    params = {"BIAS": bias is not None, "GELU": gelu, "GELU_DERIVATIVE": derivative}
    # placeholders never read (kept constants: a program passes them again)
    b = bias if bias is not None else _no_c(x2.dtype, x2.device, 1)
    c = programs.contiguous(residual2) if residual2 is not None else _no_c(x2.dtype, x2.device, 2)
    ab = _alpha_beta(1.0, 0.0 if residual2 is None else 1.0, x2.device)
    inputs = [x2, weight, b, c, ab]
    if save_pre and gelu:
        y, pre = _fused_saving(inputs, params=params)
        return y, pre
    (y,) = _fused(inputs, params=params)
    return y, None


def _forward_saving(x2, weight, bias, residual2, activation, _weight_master=None, _bias_master=None):
    """The masters (master_weights.py) are inputs for autograd only: the layer computes
    with their casts, `weight` and `bias`."""
    return _fused_forward(x2, weight, bias, activation, residual2, save_pre=True)


def _forward_plain(x2, weight, bias, residual2, activation):
    """Without autograd: y alone."""
    return _fused_forward(x2, weight, bias, activation, residual2, save_pre=False)[0]


def _split_call(x2, weight, bias, residual2, activation, *masters):
    """A call's tensors and other arguments, as a program's key (programs.py)."""
    tensors, absent = programs.present(x2, weight, bias, residual2, *masters)
    return tensors, (activation, absent)


_saving_replayed = programs.replayed_forward("linear", _forward_saving, _split_call, single=False)
_plain_replayed = programs.replayed_forward("linear_y", _forward_plain, _split_call)


def _setup_context(ctx, inputs, output):
    x2, weight, bias, residual2, _activation = inputs[:5]
    _y, pre = output
    ctx.residual_shape = None if residual2 is None else residual2.shape
    ctx.set_materialize_grads(False)  # no zero-filled gradient for `pre`, which nobody reads
    if pre is not None:
        ctx.mark_non_differentiable(pre)
    ctx.save_for_backward(x2, weight, pre)
    ctx.weight_master = inputs[5]  # a parameter: where its gradient goes may be named (grad_destination)


def _backward(ctx, g, _grad_pre):
    if g is None:
        return (None,) * 7
    x2, weight, pre = ctx.saved_tensors
    need = ctx.needs_input_grad  # x2, weight, bias, residual2, activation, the two masters
    g = aligned16(g)
    dh = g if pre is None else torch.ops.aten.gelu_backward(g, pre, approximate="tanh")
    dx = dw = db = dres = dw_master = db_master = None
    if need[0]:
        dx = gemm(dh, weight)  # (rows, out) @ (out, in)
    if need[1]:
        dw = gemm(dh, x2, transpose_a=True)  # dH^T X: (out, rows) @ (rows, in)
    if need[5]:
        dw_master = weight_grad(dh, x2, grad_destination(ctx.weight_master))  # the same, stored in float32
    if need[2]:  # False for a None bias, as for any non-tensor input
        db = column_sum(dh)
    if need[6]:
        db_master = bias_grad(dh)
    if ctx.residual_shape is not None and need[3]:
        dres = g.sum_to_size(ctx.residual_shape)
    return dx, dw, db, dres, None, dw_master, db_master


# the project's autograd Function helper: the C++ apply, as every other op's grad path
_fused_autograd = eager.function("FusedLinear", _saving_replayed, _setup_context, _backward, programs=True)


# -- public API -------------------------------------------------------------------------
def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(x @ weight.T + bias) + residual; act is None or "gelu_tanh"."""
    low = eager.autocast_dtype(x)
    masters = (None, None)
    params = (weight, bias)
    if low is not None:  # a matrix product: the autocast dtype, as F.linear (then checked)
        x, residual = eager.cast_floats(low, x, residual)
        # float32 parameters may get float32 gradients from the kernels (master_weights.py)
        (weight, bias), masters = cast_parameters(low, x, weight, bias)
    check_linear_args(x, weight, bias, activation, residual)
    way = eager.route(x, weight, bias, residual, *masters)
    if way is eager.OP or not _fusable(x, weight, bias, residual):
        if any(m is not None for m in masters):  # the composition returns bf16 gradients: cast by autograd
            weight, bias = eager.cast_floats(low, *params)
        return _composed(x, weight, bias, activation, residual)
    n = weight.shape[0]
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    weight = weight if weight.is_contiguous() else weight.contiguous()
    bias = aligned16(bias)  # the epilogue reads it a pair at a time
    res2 = None if residual is None else residual.reshape(-1, n)  # (rows, n), or (1, n) broadcast
    if way is eager.AUTOGRAD:
        y, _pre = _fused_autograd(x2, weight, bias, res2, activation, *masters)
    else:
        y = _plain_replayed(x2, weight, bias, res2, activation)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


class MojoLinear(MojoGEMM):
    """`nn.Linear` with an optional fused GELU and residual: forward(x, residual=None)
    returns act(x W^T + b) + residual in one GEMM launch where `linear` can fuse it.

    Parameters are MojoGEMM's (named and initialised as in nn.Linear), so state_dicts
    load either way.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str | None = None,
        device=None,
        dtype=None,
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(f"MojoLinear: unknown activation {activation!r}; known: {ACTIVATIONS}")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.activation, residual)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}"
