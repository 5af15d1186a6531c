"""`gemm` and `gemm_batched`: day014's Mojo GEMM as torch ops, and `MojoGEMM`, a Linear.

    out = alpha * op(a) @ op(b) + beta * c          op(x) = x, or x.mT when transpose_x

`c` is an input, never written: the result is a new tensor (torch.addmm semantics, not
BLAS's in-place update). beta scales `c` only; with beta == 0 (the default) `c` is not
read at all, so NaN or inf in it cannot reach the result (as in BLAS and torch.addmm).
`c` may broadcast: each of its dims is 1 or full, e.g. a bias row of shape (N,) or
(1, N); `c=None` means no c (beta must then be 0). alpha = 0 is not special-cased: NaN
in a or b still propagates, as in torch.

Autograd runs through the same Mojo kernel with transpose flags instead of copies:
    d a = alpha * g @ op(b)^T    (stored orientation: flip the flags, swap operands)
    d b = alpha * op(a)^T @ g
    d c = beta * g, summed over c's broadcast dims
alpha and beta get no gradient. The kernels apply alpha and beta in float32: a float16,
bfloat16 or float32 GEMM refuses values beyond float32's range, and a float64 one applies
values that float32 would round in float64 itself (a product at alpha 1, then torch's
mul and add). A non-contiguous `a` or `b` that is the transpose of a
contiguous tensor (e.g. `w.t()`) is passed as that tensor with its flag flipped.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from functools import lru_cache

import torch

from . import column_sums, eager, gemm_backward, programs
from .contract import FLOAT_DTYPES, SUPPORTED_DEVICES, OpSpec, TensorArg, f32_exact, same_device
from .gemm_gpu import MAX_BATCH, gemm_gpu
from .gemm_gpu import gemm_version as gemm_version  # the knob that forces a bf16/fp16 kernel
from .mojo_op import MojoOp, device_constant

_TRANSPOSES = {"TRANSPOSE_A": False, "TRANSPOSE_B": False}

GEMM = OpSpec(
    name="gemm",
    outputs=(TensorArg("output", ("m", "n")),),
    inputs=(
        TensorArg("a", ("a_rows", "a_cols")),  # (M, K), or (K, M) when TRANSPOSE_A
        TensorArg("b", ("b_rows", "b_cols")),  # (K, N), or (N, K) when TRANSPOSE_B
        TensorArg("c", ("c_rows", "c_cols")),  # each dim 1 or full
        TensorArg("alpha_beta", (2,), dtype=torch.float32),
    ),
    params=_TRANSPOSES,
)
GEMM_BATCHED = OpSpec(
    name="gemm_batched",
    outputs=(TensorArg("output", ("batch", "m", "n")),),
    inputs=(
        TensorArg("a", ("batch", "a_rows", "a_cols")),
        TensorArg("b", ("batch", "b_rows", "b_cols")),
        TensorArg("c", ("c_batch", "c_rows", "c_cols")),
        TensorArg("alpha_beta", (2,), dtype=torch.float32),
    ),
    params=_TRANSPOSES,
)


def _oriented(spec: OpSpec, transpose_a: bool, transpose_b: bool) -> OpSpec:
    """`spec` with both transposes fixed, so that op(a)'s rows and op(b)'s columns name
    the output's dims: MAX then allocates the output and torch wraps it. With the
    transposes left as call parameters no input dim names (m, n), and the result came
    back through a copy into a torch tensor (10% of the bf16 4096^3 time on the H100).
    """
    m = "a_cols" if transpose_a else "a_rows"
    n = "b_rows" if transpose_b else "b_cols"
    lead = spec.outputs[0].dims[:-2]
    return dataclasses.replace(
        spec,
        outputs=(TensorArg("output", (*lead, m, n)),),
        params={"TRANSPOSE_A": transpose_a, "TRANSPOSE_B": transpose_b},
    )


# what the torch ops call: one MojoOp per (batched, transpose_a, transpose_b); on CUDA
# they share one launch plan (gemm_gpu.py), which reads the transposes from the params
_KERNELS = {
    (batched, ta, tb): MojoOp(_oriented(GEMM_BATCHED if batched else GEMM, ta, tb), gpu=gemm_gpu)
    for batched in (False, True)
    for ta in (False, True)
    for tb in (False, True)
}
gemm_kernel = _KERNELS[(False, False, False)]  # the ones KERNELS lists (no transposes)
gemm_batched_kernel = _KERNELS[(True, False, False)]


# -- argument checks ------------------------------------------------------------------
def _op_shape(t: torch.Tensor, transpose: bool) -> tuple[int, int]:
    rows, cols = t.shape[-2], t.shape[-1]
    return (cols, rows) if transpose else (rows, cols)


_NUMBERS = (float, int)
F32_MAX = torch.finfo(torch.float32).max  # the kernels apply alpha and beta in float32


_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _usual_gemm_shape(a, b, c, alpha, beta, transpose_a, transpose_b, batched: bool) -> tuple[int, ...] | None:
    """The output shape of an ordinary valid call, in a few cheap steps (every call pays
    for this check); None sends the call through `check_gemm_args`' full checks."""
    if (
        a.__class__ not in _TENSORS
        or b.__class__ not in _TENSORS
        or alpha.__class__ not in _NUMBERS
        or beta.__class__ not in _NUMBERS
        or transpose_a.__class__ is not bool
        or transpose_b.__class__ is not bool
        or a.dtype not in FLOAT_DTYPES
        or b.dtype != a.dtype
        or not (a.is_cuda or a.is_cpu)
        or not same_device(b, a)
        or a.dim() != (3 if batched else 2)
        or b.dim() != a.dim()
        or not (-F32_MAX <= alpha <= F32_MAX and -F32_MAX <= beta <= F32_MAX)
    ):
        return None
    m, k = _op_shape(a, transpose_a)
    k2, n = _op_shape(b, transpose_b)
    if k != k2:
        return None
    if batched:
        if a.shape[0] != b.shape[0] or (a.shape[0] > MAX_BATCH and a.is_cuda):
            return None
        out_shape = (a.shape[0], m, n)
    else:
        out_shape = (m, n)
    if c is None:
        return out_shape if beta == 0 else None
    if c.__class__ not in _TENSORS or c.dtype != a.dtype or not same_device(c, a) or c.dim() > a.dim():
        return None
    if any(s != 1 and s != o for s, o in zip(reversed(c.shape), reversed(out_shape), strict=False)):
        return None
    return out_shape


def check_gemm_args(name, a, b, c, alpha, beta, transpose_a, transpose_b, batched: bool) -> tuple[int, ...]:
    """Validate like torch does, with messages that name the op; return the output shape."""
    usual = _usual_gemm_shape(a, b, c, alpha, beta, transpose_a, transpose_b, batched)
    if usual is not None:
        return usual
    rank = 3 if batched else 2
    for arg, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: '{arg}' must be a torch.Tensor, got {type(t).__name__}")
    if c is not None and not isinstance(c, torch.Tensor):
        raise TypeError(f"{name}: 'c' must be a torch.Tensor or None, got {type(c).__name__}")
    for arg, v in (("alpha", alpha), ("beta", beta)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name}: {arg} must be a real number, got {type(v).__name__}")
        if not math.isfinite(v):
            raise ValueError(f"{name}: {arg} must be finite, got {v}")
    for arg, v in (("transpose_a", transpose_a), ("transpose_b", transpose_b)):
        if not isinstance(v, bool):
            raise TypeError(f"{name}: {arg} must be a bool, got {type(v).__name__}")
    tensors = [("a", a), ("b", b)] + ([("c", c)] if c is not None else [])
    for arg, t in tensors:
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: '{arg}' has dtype {t.dtype}; supported: float32, float16, bfloat16, float64")
        if t.dtype != a.dtype:
            raise TypeError(f"{name}: '{arg}' is {t.dtype} but 'a' is {a.dtype}")
        if t.device.type not in SUPPORTED_DEVICES:
            raise ValueError(f"{name}: device {t.device} is not supported (cpu, cuda)")
        if t.device != a.device:
            raise ValueError(f"{name}: '{arg}' is on {t.device} but 'a' is on {a.device}")
    if a.dtype != torch.float64:  # float64 applies inexact ones itself (_gemm_eager)
        for arg, v in (("alpha", alpha), ("beta", beta)):
            if abs(v) > F32_MAX:
                raise ValueError(f"{name}: {arg}={v} overflows float32, in which {a.dtype} GEMMs apply it")
    for arg, t in (("a", a), ("b", b)):
        if t.dim() != rank:
            want = "(batch, rows, cols)" if batched else "(rows, cols)"
            raise ValueError(f"{name}: '{arg}' must have rank {rank} {want}, got shape {tuple(t.shape)}")
    m, k = _op_shape(a, transpose_a)
    k2, n = _op_shape(b, transpose_b)
    if k != k2:
        raise ValueError(
            f"{name}: inner dimensions differ: op(a) is {m}x{k} and op(b) is {k2}x{n} "
            f"(a {tuple(a.shape)}, transpose_a={transpose_a}; b {tuple(b.shape)}, transpose_b={transpose_b})"
        )
    out_shape: tuple[int, ...] = (m, n)
    if batched:
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"{name}: batch sizes differ: a has {a.shape[0]}, b has {b.shape[0]}")
        if a.shape[0] > MAX_BATCH and a.device.type == "cuda":
            raise ValueError(f"{name}: batch {a.shape[0]} > {MAX_BATCH} is not supported on the GPU")
        out_shape = (a.shape[0], m, n)
    if c is None:
        if beta != 0:
            raise ValueError(f"{name}: beta is {beta} but c is None")
    else:
        if c.dim() > rank or any(s not in (1, o) for s, o in zip(reversed(c.shape), reversed(out_shape), strict=False)):
            raise ValueError(f"{name}: c of shape {tuple(c.shape)} does not broadcast to the output {out_shape}")
    return out_shape


# -- the call into Mojo -----------------------------------------------------------------
def _alpha_beta(alpha: float, beta: float, device: torch.device) -> torch.Tensor:
    """A float32 (2,) tensor on the op's device, made once per (alpha, beta, device): the
    kernels read it on the device, so new values recompile and re-plan nothing."""
    return device_constant((alpha, beta), torch.float32, device)


@lru_cache(maxsize=16)
def _no_c(dtype: torch.dtype, device: torch.device, rank: int) -> torch.Tensor:
    """The c passed when there is none: one element, never read (beta is 0)."""
    return programs.keep(torch.zeros((1,) * rank, dtype=dtype, device=device))


def _stored(t: torch.Tensor, transpose: bool) -> tuple[torch.Tensor, bool]:
    """A contiguous tensor and flag for the kernel: a transposed view becomes its
    contiguous base with the flag flipped, so `w.t()` costs no copy."""
    if t.is_contiguous():
        return t, transpose
    if t.mT.is_contiguous():
        return t.mT, not transpose
    return programs.contiguous(t), transpose


def _gemm_eager(a, b, c, alpha, beta, transpose_a, transpose_b, batched: bool) -> torch.Tensor:
    name = "gemm_batched" if batched else "gemm"
    out_shape = check_gemm_args(name, a, b, c, alpha, beta, transpose_a, transpose_b, batched)
    rank = len(out_shape)
    if beta == 0:
        c = None  # never read: don't copy or broadcast it
    if math.prod(out_shape) == 0:
        return torch.empty(out_shape, dtype=a.dtype, device=a.device)
    if a.shape[-1] == 0 or a.shape[-2] == 0 or b.shape[-1] == 0 or b.shape[-2] == 0:
        # K == 0: an empty sum; the kernel would get zero-size inputs MAX cannot wrap
        if c is None:
            return torch.zeros(out_shape, dtype=a.dtype, device=a.device)
        return torch.broadcast_to(c * beta, out_shape).contiguous()
    if a.dtype == torch.float64 and not (f32_exact(alpha) and f32_exact(beta)):
        # the kernels read alpha and beta as float32: apply these in float64 instead
        # out of place: torch's ops make new tensors, so a program of this call (programs.py)
        # is "does not replay" and the scaling is never skipped
        out = _gemm_eager(a, b, None, 1.0, 0.0, transpose_a, transpose_b, batched) * alpha
        return out if c is None else torch.add(out, c, alpha=beta)
    a, transpose_a = _stored(a, transpose_a)
    b, transpose_b = _stored(b, transpose_b)
    if c is None:
        c_in = _no_c(a.dtype, a.device, rank)
    else:
        c_in = c.reshape((1,) * (rank - c.dim()) + tuple(c.shape)).contiguous()
    kernel = _KERNELS[(batched, transpose_a, transpose_b)]

    def torch_impl():
        res = _torch_product(a, b, alpha, transpose_a, transpose_b)
        return [res if c is None else res + beta * c_in]

    (out,) = kernel([a, b, c_in, _alpha_beta(float(alpha), float(beta), a.device)], torch_impl=torch_impl)
    return out


def _torch_product(a, b, alpha, transpose_a: bool, transpose_b: bool) -> torch.Tensor:
    """alpha op(a) @ op(b) by torch: the fallback's meaning of a product."""
    return alpha * torch.matmul(a.mT if transpose_a else a, b.mT if transpose_b else b)


def _backward_product(a, b, alpha, transpose_a: bool, transpose_b: bool, batched: bool) -> torch.Tensor:
    """alpha op(a) @ op(b) for a GEMM's backward. The operands are the forward's checked
    inputs and a gradient that autograd made in the output's shape, so a plain call goes
    straight to the kernel: on a busy host the public function's checks cost as much as
    the launch. Anything else takes the public path: grad mode (a double backward),
    autocast, a tensor subclass (torch.compile's tracing), an empty operand."""
    if (
        torch.is_grad_enabled()
        or a.__class__ not in _TENSORS
        or b.__class__ not in _TENSORS
        or a.numel() == 0
        or b.numel() == 0
        or eager.autocast_dtype(a) is not None
        or (a.dtype == torch.float64 and not f32_exact(alpha))  # float64 applies it itself: _gemm_eager
    ):
        return (gemm_batched if batched else gemm)(a, b, None, alpha, 0.0, transpose_a, transpose_b)
    a, transpose_a = _stored(a, transpose_a)
    b, transpose_b = _stored(b, transpose_b)
    kernel = _KERNELS[(batched, transpose_a, transpose_b)]
    inputs = [a, b, _no_c(a.dtype, a.device, a.dim()), _alpha_beta(float(alpha), 0.0, a.device)]
    (out,) = kernel(inputs, torch_impl=lambda: [_torch_product(a, b, alpha, transpose_a, transpose_b)])
    return out


def _gemm_2d(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    alpha: float,
    beta: float,
    transpose_a: bool,
    transpose_b: bool,
) -> torch.Tensor:
    return _gemm_eager(a, b, c, alpha, beta, transpose_a, transpose_b, batched=False)


def _gemm_3d(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    alpha: float,
    beta: float,
    transpose_a: bool,
    transpose_b: bool,
) -> torch.Tensor:
    return _gemm_eager(a, b, c, alpha, beta, transpose_a, transpose_b, batched=True)


_gemm_op = torch.library.custom_op("gpu_days::gemm", mutates_args=())(_gemm_2d)
_gemm_batched_op = torch.library.custom_op("gpu_days::gemm_batched", mutates_args=())(_gemm_3d)


def _fake(batched: bool):
    def fake(a, b, c, alpha, beta, transpose_a, transpose_b):
        name = "gemm_batched" if batched else "gemm"
        shape = check_gemm_args(name, a, b, c, alpha, beta, transpose_a, transpose_b, batched)
        return a.new_empty(shape)

    return fake


_gemm_op.register_fake(_fake(batched=False))
_gemm_batched_op.register_fake(_fake(batched=True))


# -- autograd ---------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    a, b, c, alpha, beta, transpose_a, transpose_b = inputs
    ctx.alpha, ctx.beta, ctx.ta, ctx.tb = alpha, beta, transpose_a, transpose_b
    ctx.c_shape = None if c is None else c.shape
    ctx.save_for_backward(a, b)


# --8<-- [start:column_sum]
def column_sum(g: torch.Tensor) -> torch.Tensor:
    """g.sum(0) of a 2-D g: a linear layer's bias gradient. On CUDA in 16-bit floats with
    many rows, day 013's column sums (`column_sums.py`, 2026-11-27); before them, and
    still where those do not apply (torch.compile, a double backward), cuBLAS's matrix-vector
    product gᵀ 1 (float32 accumulation, as sum's), which read 16384 x 768-3072 bf16
    gradients 1.2-1.8x faster than torch's column reduction on the H100 (day 020): 20
    against 36 us at 768 wide, 50 against 61 at 3072. With few rows the kernels take a few
    microseconds and the host decides: torch.mv cost ~3x sum's host time in day 016's
    profile of a 64-token block."""
    if g.is_cuda and g.dtype in (torch.bfloat16, torch.float16) and g.shape[0] >= GEMV_MIN_ROWS:
        if column_sums_serve(g):
            return column_sums.column_sums(g)  # a MojoOp: a recording program notes the call itself
        gt, ones = g.t(), ones_like_rows(g)
        summed = torch.mv(gt, ones)
        if programs.recording:  # a backward being recorded: its program does the same in C++
            programs.note_primitive("mv", (gt, ones), summed)
        return summed
    summed = g.sum(0)
    if programs.recording:
        programs.note_primitive("sum_rows", (g,), summed)
    return summed


GEMV_MIN_ROWS = 4096  # below: the host-cheaper sum


def column_sums_serve(g: torch.Tensor) -> bool:
    """A bias gradient that day 013's column sums take (column_sum, and master_weights'
    float32 bias_grad): many rows, and a tensor their kernels accept."""
    return g.shape[0] >= GEMV_MIN_ROWS and column_sums.usable(g)


def ones_like_rows(g: torch.Tensor) -> torch.Tensor:
    """(rows,) ones in g's dtype and device: for a plain tensor made once per shape and
    kept (a fill kernel less per column sum). Not kept when made for a traced tensor (fake,
    functional), nor while a CUDA graph captures: that fill would run only at replay. A
    vector made before the capture (its warm-up) is used inside it."""
    key = (g.shape[0], g.dtype, g.device)
    found = _ONES.get(key) if g.__class__ is torch.Tensor else None
    if found is not None:
        return found
    ones = g.new_ones(g.shape[0])
    if g.__class__ is torch.Tensor and not (g.is_cuda and torch.cuda.is_current_stream_capturing()):
        if len(_ONES) >= 32:
            _ONES.clear()
        _ONES[key] = programs.keep(ones)  # never written: callers only read it
    return ones


_ONES: dict[tuple, torch.Tensor] = {}


# --8<-- [end:column_sum]


def _backward_with(batched: bool):
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        alpha, ta, tb = ctx.alpha, ctx.ta, ctx.tb
        g = programs.contiguous(g)
        grad_a = grad_b = grad_c = None
        if not batched:
            grads = _one_launch(ctx, g, a, b)
            if grads is not None:
                return (*grads, None, None, None, None)
        if ctx.needs_input_grad[0]:
            # op(a) = g @ op(b)^T; stored a is op(a) or its transpose
            if ta:  # a = (g @ op(b)^T)^T = op(b) @ g^T
                grad_a = _backward_product(b, g, alpha, tb, True, batched)
            else:
                grad_a = _backward_product(g, b, alpha, False, not tb, batched)
        if ctx.needs_input_grad[1]:
            # op(b) = op(a)^T @ g
            if tb:  # b = g^T @ op(a)
                grad_b = _backward_product(g, a, alpha, True, ta, batched)
            else:
                grad_b = _backward_product(a, g, alpha, not ta, False, batched)
        if ctx.c_shape is not None and ctx.needs_input_grad[2]:
            gc = g if ctx.beta == 1 else g * ctx.beta  # a bias: no multiply
            is_row = g.dim() == 2 and tuple(ctx.c_shape) in ((g.shape[1],), (1, g.shape[1]))
            grad_c = column_sum(gc).view(*ctx.c_shape) if is_row else gc.sum_to_size(ctx.c_shape)
        return grad_a, grad_b, grad_c, None, None, None, None

    return backward


def _one_launch(ctx, g, a, b) -> tuple | None:
    """(grad_a, grad_b, grad_c) of a 2-D call by day 016's one-launch backward
    (gemm_backward.py), or None where it does not serve: both products needed, a stored
    as op(a), a bias (beta 1, a row) or none, and `gemm_backward.serves`."""
    needs = ctx.needs_input_grad
    if ctx.ta or not (needs[0] and needs[1]) or not f32_exact(ctx.alpha):
        return None
    bias = ctx.c_shape is not None and needs[2]
    if bias and (ctx.beta != 1 or tuple(ctx.c_shape) not in ((g.shape[1],), (1, g.shape[1]))):
        return None
    if not gemm_backward.serves(g, a, b, ctx.tb):
        return None
    alpha_beta = _alpha_beta(float(ctx.alpha), 0.0, g.device)
    grads = gemm_backward.gemm_backward(g, a, b, alpha_beta, ctx.alpha, ctx.tb, bias)
    if bias:
        grads[2] = grads[2].view(*ctx.c_shape)
    return grads[0], grads[1], grads[2] if bias else None


def _split(a, b, c, alpha, beta, transpose_a, transpose_b):
    """A call's tensors and other arguments, as a program's key (programs.py). Each value
    with its type: True == 1 == 1.0 in Python, and the checks a replay skips tell them apart."""
    types = (alpha.__class__, beta.__class__, transpose_a.__class__, transpose_b.__class__)
    return ([a, b] if c is None else [a, b, c]), (alpha, beta, transpose_a, transpose_b, types, c is None)


_gemm_2d_replayed = programs.replayed_forward("gemm", _gemm_2d, _split)
_gemm_3d_replayed = programs.replayed_forward("gemm_batched", _gemm_3d, _split)
_gemm_op.register_autograd(_backward_with(False), setup_context=_setup_context)
_gemm_batched_op.register_autograd(_backward_with(True), setup_context=_setup_context)
_gemm_autograd = eager.function("GEMM", _gemm_2d_replayed, _setup_context, _backward_with(False), programs=True)
_gemm_batched_autograd = eager.function(
    "GEMMBatched", _gemm_3d_replayed, _setup_context, _backward_with(True), programs=True
)


# -- public API -------------------------------------------------------------------------
def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    transpose_a: bool = False,
    transpose_b: bool = False,
) -> torch.Tensor:
    """alpha * op(a) @ op(b) + beta * c for 2-D a, b (c broadcasts; beta == 0: c unread)."""
    return _dispatch(_gemm_op, False, a, b, c, alpha, beta, transpose_a, transpose_b)


def gemm_batched(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    transpose_a: bool = False,
    transpose_b: bool = False,
) -> torch.Tensor:
    """`gemm` for each of the (batch, ., .) matrices of a and b; c broadcasts to (batch, M, N)."""
    return _dispatch(_gemm_batched_op, True, a, b, c, alpha, beta, transpose_a, transpose_b)


def _dispatch(op, batched, a, b, c, alpha, beta, transpose_a, transpose_b):
    low = eager.autocast_dtype(a)
    if low is not None:  # under torch.autocast: a matrix product in the autocast dtype, as torch.mm
        a, b, c = eager.cast_floats(low, a, b, c)
    way = eager.route(a, b, c)
    if way is eager.EAGER:
        return (_gemm_3d_replayed if batched else _gemm_2d_replayed)(a, b, c, alpha, beta, transpose_a, transpose_b)
    if way is eager.AUTOGRAD:
        fn = _gemm_batched_autograd if batched else _gemm_autograd
        return fn(a, b, c, alpha, beta, transpose_a, transpose_b)
    name = "gemm_batched" if batched else "gemm"
    check_gemm_args(name, a, b, c, alpha, beta, transpose_a, transpose_b, batched)  # our message first
    return eager.run_op(name, op, a, b, c, float(alpha), float(beta), transpose_a, transpose_b)


class MojoGEMM(torch.nn.Linear):
    """Drop-in for `torch.nn.Linear`: y = x @ weight^T + bias, any leading dims.

    An nn.Linear subclass (constructor, `weight` and `bias`, initialisation, repr), so
    its state_dicts load either way and code that looks for nn.Linear finds it (a model's
    `_init_weights`, weight-decay groups, LoRA targets): as a plain Module those skipped it
    silently. Only forward differs. The whole layer is one GEMM call: x as (rows, in) with
    transpose_b=True reads the weight in place, and the bias is c = bias, broadcast over
    the rows, with beta = 1 (no separate add).
    """

    @property
    def use_mojo(self) -> bool:
        return gemm_kernel.ready()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MojoGEMM: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"MojoGEMM: input of shape {tuple(x.shape)} does not end in in_features={self.in_features}"
            )
        # a 2-D input and the 1-D bias go in as they are: in grad mode each reshape or view
        # would be one more autograd node (microseconds forward and backward)
        rows = x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), self.in_features)
        bias = self.bias
        y = gemm(rows, self.weight, bias, 1.0, 0.0 if bias is None else 1.0, False, True)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
