"""A linear layer's whole backward in one launch, for float32 and float64 (day 016, part
nineteen).

The backward of y = alpha x @ op(w) + bias is three independent ops: dX = alpha dY op(w)^T,
dW = alpha (dY^T x or x^T dY) and the bias gradient, the column sums of dY. On day 014's
SIMT kernel each product is one launch, and the sum was torch's: three launches for a few
microseconds of GPU work each, and a backward node of ~33 us of host time where the budget
is 30. `gemm_backward_one_kernel` (days/day016/one_launch.mojo) runs all three in one grid:
dX's tiles, dW's tiles, then the bias gradient's column blocks.

It serves (`serves`) where gemm's own plan would run both products on the SIMT kernel's
tile in one piece (float32's 64 x 64 tiles without split-K, or float64): the same tiles
with the same arithmetic, one launch instead of three. Elsewhere (3xTF32, split-K, the
16-bit kernels) the backward keeps its separate calls.
"""

from __future__ import annotations

import torch

from . import direct, eager
from .column_sums import WARP  # a column block is a warp wide: 32 vectors of columns
from .contract import PLAIN_TENSORS, OpSpec, TensorArg
from .gemm_gpu import SIMT_FP64, SIMT_SMALL, SIMT_THREADS, _cdiv, simt_choice, vector_friendly
from .gpu_kernels import KernelFamily
from .mojo_op import MojoOp

DTYPES = (torch.float32, torch.float64)
_CONFIGS = {torch.float32: SIMT_SMALL, torch.float64: SIMT_FP64}

GEMM_BWD_ONE = KernelFamily(
    "days.day016.one_launch",
    "gemm_backward_one_kernel",
    args=("ptr",) * 7 + ("i64",) * 3,  # grad_a, grad_b, grad_c, g, a, b, alpha_beta | m, n, k
    variants=tuple(  # (dtype, TB, VEC, BM, BK, TM)
        (dtype, tb, vec, *_CONFIGS[dtype]) for dtype in DTYPES for tb in (False, True) for vec in (False, True)
    ),
)


def _vectors(g, a, b, m: int, n: int, k: int, tb: bool, out_ptrs=(0, 0)) -> bool:
    """Both products' 16-byte vectors are safe (gemm's own test, for each product as
    gemm's backward would call it)."""
    dx = vector_friendly(out_ptrs[0], g, b, m, k, n, False, not tb)
    dw = (
        vector_friendly(out_ptrs[1], g, a, n, k, m, True, False)
        if tb
        else vector_friendly(out_ptrs[1], a, g, k, n, m, True, False)
    )
    return dx and dw


# an A/B switch for tests and timings: False sends every backward to the separate calls
ONE_LAUNCH = direct.PlanSetting(True)


def serves(g, a, b, tb: bool) -> bool:
    """Does the one launch take this backward? Plain contiguous 2-D CUDA float32/float64
    tensors with no empty dim, no autograd graph to record, and `sizes_serve`. (The
    caller checks that alpha is float32-exact: the kernel reads it as float32.)"""
    if not (
        ONE_LAUNCH.value
        and g.__class__ in PLAIN_TENSORS
        and a.__class__ in PLAIN_TENSORS
        and b.__class__ in PLAIN_TENSORS
        and g.is_cuda
        and g.dtype in DTYPES
        and a.dtype == g.dtype == b.dtype
        and g.dim() == a.dim() == b.dim() == 2
        and g.is_contiguous()
        and a.is_contiguous()
        and b.is_contiguous()
        and not torch.is_grad_enabled()
        and eager.autocast_dtype(a) is None
    ):
        return False
    (m, n), k = g.shape, a.shape[1]
    return sizes_serve(m, n, k, tb, _vectors(g, a, b, m, n, k, tb), g.dtype, g.get_device())


def sizes_serve(m: int, n: int, k: int, tb: bool, vec: bool, dtype: torch.dtype, device_index) -> bool:
    """No empty dim, and gemm's plan would run both products (dX: m x k over n, dW: n x k
    over m) on the SIMT kernel's own tile in one piece: then one launch does the same
    tiles' work. (Not 3xTF32, split-K, or float32's 128 x 128 tiles.)"""
    if m == 0 or n == 0 or k == 0:
        return False
    config = _CONFIGS[dtype]
    dx = simt_choice(m, k, n, 1, False, not tb, vec, dtype, device_index, 0)
    dw = simt_choice(n, k, m, 1, True, False, vec, dtype, device_index, 0)
    return dx == dw == (config, 1)


# --8<-- [start:plan]
@direct.plan(GEMM_BWD_ONE)
def gemm_backward_gpu(outputs, inputs, params) -> list[direct.Launch]:
    """One grid: dX's tiles, dW's tiles, then (with a bias) a column block per 32 vectors
    of dY's columns."""
    grad_a, grad_b = outputs[:2]
    grad_c = outputs[2] if len(outputs) > 2 else None
    g, a, b, alpha_beta = inputs
    tb = params["TRANSPOSE_B"]
    (m, n), k = g.shape, a.shape[1]
    dtype = g.dtype
    bm, bk, tm = _CONFIGS[dtype]
    vec = _vectors(g, a, b, m, n, k, tb, (grad_a.data_ptr(), grad_b.data_ptr()))
    vw = 16 // g.element_size() if vec else 1
    tiles = (_cdiv(m, bm) + _cdiv(n, bm)) * _cdiv(k, bm)
    col_blocks = 0 if grad_c is None else _cdiv(n, WARP * vw)
    ptrs = (grad_a.data_ptr(), grad_b.data_ptr(), 0 if grad_c is None else grad_c.data_ptr())
    args = (*ptrs, g.data_ptr(), a.data_ptr(), b.data_ptr(), alpha_beta.data_ptr(), m, n, k)
    kernel = GEMM_BWD_ONE[dtype, tb, vec, bm, bk, tm]
    return [direct.Launch(kernel, tiles + col_blocks, SIMT_THREADS, args)]


# --8<-- [end:plan]
def _spec(tb: bool, bias: bool) -> OpSpec:
    b_dims = ("n", "k") if tb else ("k", "n")
    outputs = (TensorArg("grad_a", ("m", "k")), TensorArg("grad_b", b_dims))
    if bias:
        outputs += (TensorArg("grad_c", ("n",)),)
    return OpSpec(
        name="gemm_backward",
        outputs=outputs,
        inputs=(
            TensorArg("g", ("m", "n")),
            TensorArg("a", ("m", "k")),
            TensorArg("b", b_dims),
            TensorArg("alpha_beta", (2,), dtype=torch.float32),
        ),
        params={"TRANSPOSE_B": tb},
    )


_ops = {(tb, bias): MojoOp(_spec(tb, bias), gpu=gemm_backward_gpu) for tb in (False, True) for bias in (False, True)}


def gemm_backward(g, a, b, alpha_beta, alpha: float, tb: bool, bias: bool) -> list[torch.Tensor]:
    """[dX, dW] (and the bias gradient with `bias`) of y = alpha a @ op(b) + bias, for g
    where `serves` said yes; alpha_beta: the float32 (alpha, 0) on g's device. Where the
    kernel cannot load: torch's products and sum, after the fallback's warning (an error
    in strict mode)."""

    def torch_impl():
        grads = [alpha * (g @ (b if tb else b.t())), alpha * (g.t() @ a if tb else a.t() @ g)]
        return grads + [g.sum(0)] if bias else grads

    return _ops[tb, bias]([g, a, b, alpha_beta], torch_impl=torch_impl)
