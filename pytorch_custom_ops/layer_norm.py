"""`layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5)`: day013's Mojo
LayerNorm as torch ops, and `MojoLayerNorm`, a drop-in for `torch.nn.LayerNorm`.

Two ops are registered with torch.library:
- `gpu_days::layer_norm(x, normalized_shape, weight, bias, eps) -> (y, mean, rstd)`
- `gpu_days::layer_norm_backward(grad_out, x, normalized_shape, weight, mean, rstd)
  -> (grad_x, grad_weight, grad_bias)`
The first is differentiable through the second (the Mojo backward kernels), and both
have fake implementations for torch.compile. mean and rstd are float32 for every input
dtype and have the shape of the leading (not normalized) dims of x; rstd is
1 / sqrt(var + eps), which is what the backward needs. grad_weight and grad_bias come
back in the input dtype (summed in float32, float64 for float64 inputs). For float64 the
backward re-derives the mean from x, but rstd stays the saved float32: float64 gradients
are good to ~1e-7 relative (torch's float64 LayerNorm: ~1e-15). eps reaches the kernels
as a float32 (a runtime value, so that a new eps compiles nothing): where eps is a large
part of a row's variance, float64 outputs are good to ~1e-9 relative (rows of scale 1e-3
with eps = 1e-5: 5e-9).

The Mojo kernels see a contiguous (rows, cols) tensor: the normalized dims are flattened
into cols, the others into rows. A missing weight or bias becomes ones or zeros. On CUDA,
`layer_norm` without autograd makes y alone: the same kernels skip mean and rstd (day 016,
part sixteen).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import direct, eager, programs
from .contract import FLOAT_DTYPES, OpSpec, TensorArg, as_int, check_float_tensor, same_device
from .gpu_kernels import KernelFamily
from .mojo_op import MojoOp, device_constant

LAYER_NORM = OpSpec(
    name="layer_norm",
    outputs=(
        TensorArg("y", ("rows", "cols")),
        TensorArg("mean", ("rows",), dtype=torch.float32),
        TensorArg("rstd", ("rows",), dtype=torch.float32),
    ),
    inputs=(
        TensorArg("x", ("rows", "cols")),
        TensorArg("weight", ("cols",)),
        TensorArg("bias", ("cols",)),
        TensorArg("eps", (1,), dtype=torch.float32),  # a runtime value: no recompile per eps
    ),
)
# The same kernels without the statistics, for CUDA calls without autograd (a GPU-only
# op: MAX's CPU library has only LAYER_NORM, which the CPU calls use)
LAYER_NORM_Y = OpSpec(name="layer_norm", outputs=LAYER_NORM.outputs[:1], inputs=LAYER_NORM.inputs)
LAYER_NORM_BACKWARD = OpSpec(
    name="layer_norm_backward",
    outputs=(
        TensorArg("grad_x", ("rows", "cols")),
        TensorArg("grad_weight", ("cols",)),
        TensorArg("grad_bias", ("cols",)),
    ),
    inputs=(
        TensorArg("grad_out", ("rows", "cols")),
        TensorArg("x", ("rows", "cols")),
        TensorArg("weight", ("cols",)),
        TensorArg("mean", ("rows",), dtype=torch.float32),
        TensorArg("rstd", ("rows",), dtype=torch.float32),
    ),
)

# -- GPU launch plans (day 016: the launch moved here from layer_norm.mojo) ---------------
# --8<-- [start:gpu_tiers]
# A row of `cols` elements is nvec = cols / VEC vectors, VEC elements making one 16-byte
# load (VEC = 1 when cols or a pointer does not allow it). TPR threads share a row, each
# holding at most ITEMS vectors of it in registers; ROWS rows per block.
#   forward:  nvec <= 192   a warp per row, 6 vectors a lane, 8 rows per block (64 registers:
#                           4 blocks an SM; 57 against 65 us for 8 vectors at GPT-2's
#                           16384 x 768, fused, on the H100: day 020)
#             nvec <= 256   a warp per row, 8 rows per block  (fp32 cols <= 1024)
#             nvec <= 1024  256 threads x 4 vectors           (fp32 cols <= 4096)
#             nvec <= 4096  512 threads x 8 vectors           (fp32 cols <= 16384)
#   backward: a warp per row, 6 vectors a lane and 12 warps a block for nvec <= 192 (fp32
#             cols <= 768, GPT-2's width): it holds x, dy and (day 020) the residual
#             gradient, ~150 registers, and 8 warps an SM kept too few loads in flight.
#             Then the forward's tiers, with a 512 x 4 tier before 512 x 8: ptxas
#             spills 16-bit rows of 512 x 8 (128 registers at most). Each worker keeps
#             2 * cols column sums in shared memory, which caps the tiers at SMEM_CAP bytes
#             (only the 512-thread tiers can reach it; the smaller tiers need <= 128 KiB).
#   longer rows: the streaming kernels (two reads of the row, any length).
VECTOR_BYTES = 16
FWD_TIERS = ((32, 6, 8), (32, 8, 8), (256, 4, 1), (512, 8, 1))  # (TPR, ITEMS, ROWS)
# (TPR, ITEMS, ROWS, PER_SM): PER_SM is about how many blocks of the persistent grid
# fit on an SM (registers or shared memory)
BWD_TIERS = ((32, 6, 12, 1), (32, 8, 8, 1), (256, 4, 1, 2), (512, 4, 1, 1), (512, 8, 1, 1))
STREAM_THREADS = 512  # one block per row in the streaming kernels
_BWD_STREAM_TIER = (STREAM_THREADS, 0, 1, 1)  # ITEMS == 0: the streaming kernel
SMEM_CAP = 200 * 1024
MAX_GRID = 1 << 20  # forward grids stop here; the kernels' row loops cover any rows beyond
MIN_ROWS_PER_WORKER = 8  # backward: fewer partial rows to write and re-read
SUM_COLS, SUM_LANES = 32, 16  # stage 2: columns per block (one warp wide) x partial rows read at once
# --8<-- [end:gpu_tiers]


def _accum(dtype: torch.dtype) -> torch.dtype:
    """day009's accum_dtype: float64 for float64, else float32. It sizes the backward's
    shared memory and workspace; the kernels take it as a parameter and assert it."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _vector_widths(dtype: torch.dtype) -> tuple[int, int]:
    return VECTOR_BYTES // dtype.itemsize, 1


_MODULE = "days.day013.layer_norm"
# (dtype, ldtype): x, weight and bias in dtype, y (and delta, dy) in ldtype. Plain calls
# use (d, d); the fused form of day 020 also takes a float32 residual stream with bf16 or
# fp16 on its low side (what autocast's matrix products read and write).
DTYPE_PAIRS = tuple((d, d) for d in FLOAT_DTYPES) + ((torch.float32, torch.bfloat16), (torch.float32, torch.float16))
# y, mean, rstd, x, weight, bias, eps, delta, x_sum | rows, cols, flags
_FWD_ARGS = ("ptr",) * 9 + ("i64",) * 3
# grad_x, partials, grad_out, x, weight, mean, rstd, grad_resid, grad_low | rows, cols, flags
_BWD_ARGS = ("ptr",) * 9 + ("i64",) * 3
# flags (the kernels' ADD_DELTA, NO_STATS, ADD_GRAD, WRITE_LOW)
ADD_DELTA = 1  # forward: normalise x + delta and write that sum
NO_STATS = 2  # forward: no mean and rstd (a call without autograd)
ADD_GRAD, WRITE_LOW = 1, 2  # backward: add grad_resid into grad_x; write grad_x in ldtype too
LN_FWD = KernelFamily(
    _MODULE,
    "layer_norm_fwd_kernel",
    args=_FWD_ARGS,
    variants=tuple((d, ld, v, *t) for d, ld in DTYPE_PAIRS for v in _vector_widths(d) for t in FWD_TIERS),
)
LN_FWD_STREAM = KernelFamily(
    _MODULE,
    "layer_norm_fwd_stream_kernel",
    args=_FWD_ARGS,
    variants=tuple((d, ld, v, STREAM_THREADS) for d, ld in DTYPE_PAIRS for v in _vector_widths(d)),
)
LN_BWD = KernelFamily(
    _MODULE,
    "layer_norm_bwd_kernel",
    args=_BWD_ARGS,
    variants=tuple(
        (d, ld, _accum(d), v, *t[:3]) for d, ld in DTYPE_PAIRS for v in _vector_widths(d) for t in BWD_TIERS
    ),
)
LN_BWD_STREAM = KernelFamily(
    _MODULE,
    "layer_norm_bwd_stream_kernel",
    args=_BWD_ARGS,
    variants=tuple((d, ld, _accum(d), v, STREAM_THREADS) for d, ld in DTYPE_PAIRS for v in _vector_widths(d)),
)
LN_SUM_PARTIALS = KernelFamily(
    _MODULE,
    "sum_partials_kernel",
    args=("ptr", "ptr", "ptr", "i64", "i64", "i64"),  # grad_weight, grad_bias, partials, parts, cols, width
    variants=tuple((d, _accum(d), SUM_COLS, SUM_LANES) for d in FLOAT_DTYPES),
)

# Day 016, part eighteen: for a few rows, grad_x and the column sums in one launch
# (days/day016/one_launch.mojo): blocks [0, col_blocks) sum COL_THREADS vectors
# of columns over every row, the others are the row workers of the tiers above. One
# launch and three tensors instead of two launches and four. Up to ONE_LAUNCH_ROWS rows
# it is also no slower on the GPU (measured there); a PlanSetting, for A/Bs and tests.
ONE_LAUNCH_ROWS = direct.PlanSetting(2048)
COL_THREADS = 8  # COL_THREADS in days/day016/one_launch.mojo: vectors of columns per column block
LN_BWD_ONE = KernelFamily(
    "days.day016.one_launch",
    "layer_norm_bwd_one_kernel",
    # grad_x, grad_weight, grad_bias, grad_out, x, weight, mean, rstd, grad_resid, grad_low
    # | rows, cols, flags, col_blocks
    args=("ptr",) * 10 + ("i64",) * 4,
    variants=tuple(
        (d, ld, _accum(d), v, *t[:3])
        for d, ld in DTYPE_PAIRS
        if d != torch.float64  # float64 re-derives each row's mean: day 013's kernels
        for v in _vector_widths(d)
        for t in BWD_TIERS
    ),
)


def sum_partials_launch(partials: torch.Tensor, first: torch.Tensor, second: torch.Tensor | None = None):
    """The second stage's launch: the column sums of `partials` (parts, width), the first
    `first.numel()` of them into `first`, the rest into `second`. The layer norm's
    workspace is [dw | db] (width 2 cols); day 019's GEMM writes one vector's partials
    (a bias gradient's: `second` None, never touched)."""
    parts, width = partials.shape
    cols = first.numel()
    kernel = LN_SUM_PARTIALS[first.dtype, partials.dtype, SUM_COLS, SUM_LANES]
    args = (first.data_ptr(), 0 if second is None else second.data_ptr(), partials.data_ptr(), parts, cols, width)
    return direct.Launch(kernel, grid=_ceildiv(width, SUM_COLS), block=SUM_COLS * SUM_LANES, args=args)


_SM_COUNTS: dict[torch.device, int] = {}
H100_SMS = 132  # what a plan assumes for a CPU tensor (the plan tests): the H100's count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (what Mojo read with ctx.get_attribute), cached."""
    n = _SM_COUNTS.get(device)
    if n is None:
        n = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else H100_SMS
        _SM_COUNTS[device] = n
    return n


def _vector_width(cols: int, *tensors: torch.Tensor) -> int:
    """16-byte loads when the row length and every pointer allow them, else element loads
    (odd cols, offset views): the same kernels either way."""
    vec = VECTOR_BYTES // tensors[0].element_size()
    if cols % vec == 0 and all(t.data_ptr() % VECTOR_BYTES == 0 for t in tensors):
        return vec
    return 1


def _ceildiv(a: int, b: int) -> int:
    return -(-a // b)


# --8<-- [start:gpu_plan]
def forward_launches(y, mean, rstd, x, weight, bias, eps, delta=None, x_sum=None) -> list[direct.Launch]:
    """The forward's launch: y (in its own dtype, x's or a lower one) = LayerNorm of x, or
    of x + delta with that sum written to x_sum (day 020's fused residual add). mean and
    rstd None: the kernel writes neither (NO_STATS)."""
    rows, cols = x.shape
    fused = delta is not None
    stats = mean is not None
    vec = _vector_width(cols, x, y, weight, bias, *((delta, x_sum) if fused else ()))  # VEC counts x's elements
    args = (y.data_ptr(), mean.data_ptr() if stats else 0, rstd.data_ptr() if stats else 0)
    args += (x.data_ptr(), weight.data_ptr(), bias.data_ptr())
    args += (eps.data_ptr(), delta.data_ptr() if fused else 0, x_sum.data_ptr() if fused else 0)
    args += (rows, cols, (ADD_DELTA if fused else 0) | (0 if stats else NO_STATS))
    nvec = cols // vec
    for tpr, items, per_block in FWD_TIERS:
        if nvec <= tpr * items:
            kernel = LN_FWD[x.dtype, y.dtype, vec, tpr, items, per_block]
            grid = min(_ceildiv(rows, per_block), MAX_GRID)
            return [direct.Launch(kernel, grid=grid, block=tpr * per_block, args=args)]
    kernel = LN_FWD_STREAM[x.dtype, y.dtype, vec, STREAM_THREADS]
    return [direct.Launch(kernel, grid=min(rows, MAX_GRID), block=STREAM_THREADS, args=args)]


@direct.plan(LN_FWD, LN_FWD_STREAM)
def _layer_norm_gpu(outputs, inputs, params) -> list[direct.Launch]:
    (y, mean, rstd), (x, weight, bias, eps) = outputs, inputs
    return forward_launches(y, mean, rstd, x, weight, bias, eps)


def _workers(groups: int, sms: int, per_sm: int) -> int:
    """Blocks of the persistent backward grid: about `per_sm` per SM, but at least
    MIN_ROWS_PER_WORKER row groups each once there are enough rows, since every block
    writes (and stage 2 reads) 2 * cols partial sums."""
    return min(groups, max(sms, min(sms * per_sm, groups // MIN_ROWS_PER_WORKER)))


class _LaunchesWithWorkspace(list):
    """Launches that use a workspace tensor: `direct.run` holds this list while it enqueues
    them, so the workspace goes back to torch's caching allocator only after both kernels
    are queued; the allocator reuses it in stream order (what MAX's enqueued free did)."""

    workspace: torch.Tensor


def backward_launches(
    grad_x, grad_weight, grad_bias, grad_out, x, weight, mean, rstd, grad_resid=None, grad_low=None
) -> list[direct.Launch]:
    """Stage 1: grad_x and one row of [sum dy * xhat | sum dy] per block into a
    (blocks, 2 * cols) workspace. Stage 2: sum_partials adds those rows up.
    grad_out is in the forward's y dtype; the fused form adds grad_resid into grad_x and
    writes grad_x again as grad_low (in grad_out's dtype)."""
    rows, cols = x.shape
    dtype, acc = x.dtype, _accum(x.dtype)
    extra = tuple(t for t in (grad_resid, grad_low) if t is not None)
    vec = _vector_width(cols, grad_x, grad_out, x, weight, *extra)
    nvec = cols // vec
    worker_smem = 2 * cols * acc.itemsize  # the kernel's [dw | db] column sums per worker
    tpr, items, per_block, per_sm = next(
        (t for t in BWD_TIERS if nvec <= t[0] * t[1] and t[2] * worker_smem <= SMEM_CAP), _BWD_STREAM_TIER
    )
    ldtype = grad_out.dtype
    ptrs = (grad_out.data_ptr(), x.data_ptr(), weight.data_ptr(), mean.data_ptr(), rstd.data_ptr())
    fused_ptrs = (0 if grad_resid is None else grad_resid.data_ptr(), 0 if grad_low is None else grad_low.data_ptr())
    flags = (ADD_GRAD if grad_resid is not None else 0) | (WRITE_LOW if grad_low is not None else 0)
    if items and acc == torch.float32 and rows <= ONE_LAUNCH_ROWS.value:
        return [one_launch(tpr, items, per_block, vec, ldtype, grad_x, grad_weight, grad_bias, ptrs, fused_ptrs, flags)]
    if items:
        kernel = LN_BWD[dtype, ldtype, acc, vec, tpr, items, per_block]
        block, smem = tpr * per_block, per_block * worker_smem
    else:  # streaming: the block keeps its sums in its row of the workspace
        kernel, block, smem = LN_BWD_STREAM[dtype, ldtype, acc, vec, tpr], tpr, 0
    grid = _workers(_ceildiv(rows, per_block), sm_count(x.device), per_sm)
    partials = direct.scratch((grid, 2 * cols), acc, x.device)
    launches = _LaunchesWithWorkspace(
        [
            direct.Launch(
                kernel,
                grid=grid,
                block=block,
                smem=smem,
                args=(grad_x.data_ptr(), partials.data_ptr(), *ptrs, *fused_ptrs, rows, cols, flags),
            ),
            sum_partials_launch(partials, grad_weight, grad_bias),
        ]
    )
    launches.workspace = partials
    return launches


def one_launch(
    tpr, items, per_block, vec, ldtype, grad_x, grad_weight, grad_bias, ptrs, fused_ptrs, flags
) -> direct.Launch:
    """Day 016's one-launch backward (rows <= ONE_LAUNCH_ROWS, not float64): the column
    blocks first (they walk every row, so they should start first), then a row worker
    per `per_block` rows. Shared memory: the column blocks' partial sums."""
    rows, cols = grad_x.shape
    acc = _accum(grad_x.dtype)
    col_blocks = _ceildiv(cols // vec, COL_THREADS)
    kernel = LN_BWD_ONE[grad_x.dtype, ldtype, acc, vec, tpr, items, per_block]
    block = tpr * per_block
    args = (grad_x.data_ptr(), grad_weight.data_ptr(), grad_bias.data_ptr(), *ptrs, *fused_ptrs)
    args += (rows, cols, flags, col_blocks)
    grid = col_blocks + max(1, _ceildiv(rows, per_block))
    return direct.Launch(kernel, grid=grid, block=block, smem=block * vec * 2 * acc.itemsize, args=args)


@direct.plan(LN_FWD, LN_FWD_STREAM)
def _layer_norm_y_gpu(outputs, inputs, params) -> list[direct.Launch]:
    (y,), (x, weight, bias, eps) = outputs, inputs
    return forward_launches(y, None, None, x, weight, bias, eps)


@direct.plan(LN_BWD, LN_BWD_STREAM, LN_SUM_PARTIALS, LN_BWD_ONE)
def _layer_norm_backward_gpu(outputs, inputs, params) -> list[direct.Launch]:
    (grad_x, grad_weight, grad_bias), (grad_out, x, weight, mean, rstd) = outputs, inputs
    return backward_launches(grad_x, grad_weight, grad_bias, grad_out, x, weight, mean, rstd)


# --8<-- [end:gpu_plan]
layer_norm_kernel = MojoOp(LAYER_NORM, gpu=_layer_norm_gpu)
layer_norm_y_kernel = MojoOp(LAYER_NORM_Y, gpu=_layer_norm_y_gpu)
layer_norm_backward_kernel = MojoOp(LAYER_NORM_BACKWARD, gpu=_layer_norm_backward_gpu)


# -- argument checks: torch's rules, with messages that name the op ----------------------
def _size(d):
    """d as a size: a Python int (numpy's too), a SymInt as it is (torch.compile's dynamic
    widths), anything else None."""
    if isinstance(d, torch.SymInt):
        return d
    d = as_int(d)
    return d if isinstance(d, int) and not isinstance(d, bool) else None


def normalized_shape_tuple(name: str, normalized_shape) -> tuple[int, ...]:
    if _size(normalized_shape) is not None:
        normalized_shape = (normalized_shape,)
    sizes = [_size(d) for d in normalized_shape] if isinstance(normalized_shape, Sequence) else [None]
    if any(d is None for d in sizes):
        raise TypeError(f"{name}: normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}")
    shape = tuple(sizes)
    if not shape:
        raise ValueError(f"{name}: normalized_shape must have at least one dim, got ()")
    if any(d < 0 for d in shape):
        raise ValueError(f"{name}: normalized_shape {shape} has a negative size")
    return shape


_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _usual_normalized_shape(x, normalized_shape, weight, bias, eps) -> tuple[int, ...] | None:
    """normalized_shape of an ordinary valid call (one trailing dim, weight and bias of
    the input's dtype and device, a float eps), in a few cheap steps; None sends the call
    through the full checks."""
    if type(normalized_shape) is int:
        shape = (normalized_shape,)
    elif type(normalized_shape) in (tuple, list, torch.Size) and len(normalized_shape) == 1:
        shape = tuple(normalized_shape)
        if type(shape[0]) is not int:
            return None
    else:
        return None
    if x.__class__ not in _TENSORS or x.dtype not in FLOAT_DTYPES or not (x.is_cuda or x.is_cpu):
        return None
    if x.dim() < 1 or x.shape[-1] != shape[0] or shape[0] < 0:
        return None
    for p in (weight, bias):
        if p is not None and (
            p.__class__ not in _TENSORS or p.shape != shape or p.dtype != x.dtype or not same_device(p, x)
        ):
            return None
    if eps.__class__ is not float or not (0 <= eps < math.inf):
        return None
    return shape


def check_layer_norm_args(name: str, x, normalized_shape, weight, bias, eps) -> tuple[int, ...]:
    """Validate like torch does; return normalized_shape as a tuple."""
    usual = _usual_normalized_shape(x, normalized_shape, weight, bias, eps)
    if usual is not None:
        return usual
    check_float_tensor(name, x)
    shape = normalized_shape_tuple(name, normalized_shape)
    if x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape) :]) != shape:
        raise ValueError(
            f"{name}: normalized_shape {shape} does not match the last {len(shape)} dim(s) "
            f"of the input, whose shape is {tuple(x.shape)}"
        )
    for pname, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name}: {pname} must be a torch.Tensor or None, got {type(p).__name__}")
        if tuple(p.shape) != shape:
            raise ValueError(f"{name}: {pname} must have shape {shape} (normalized_shape), got {tuple(p.shape)}")
        if p.dtype != x.dtype:
            raise TypeError(f"{name}: {pname} is {p.dtype} but the input is {x.dtype}; they must match")
        if p.device != x.device:
            raise ValueError(f"{name}: {pname} is on {p.device} but the input is on {x.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{name}: eps must be a float, got {type(eps).__name__}")
    if not (0 <= eps < math.inf):  # finite and >= 0 (NaN compares false); no math.isfinite: dynamo cannot trace it
        raise ValueError(f"{name}: eps must be finite and >= 0, got {eps}")
    return shape


def check_layer_norm_backward_args(grad_out, x, normalized_shape, weight, mean, rstd) -> tuple[int, ...]:
    """x, normalized_shape and weight as the forward checks them; grad_out like x; mean and
    rstd floating point with one value per normalized row (torch refuses an integer mean:
    cast, a truncated one gave wrong gradients)."""
    name = "layer_norm_backward"
    shape = check_layer_norm_args(name, x, normalized_shape, weight, None, 0.0)
    for arg, t in (("grad_out", grad_out), ("mean", mean), ("rstd", rstd)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: {arg} has dtype {t.dtype}; it must be a floating-point tensor")
        if not same_device(t, x):
            raise ValueError(f"{name}: {arg} is on {t.device} but x is on {x.device}")
    if grad_out.shape != x.shape:
        raise ValueError(f"{name}: grad_out {tuple(grad_out.shape)} must match x {tuple(x.shape)}")
    rows = math.prod(x.shape[: x.dim() - len(shape)])
    if mean.numel() != rows or rstd.numel() != rows:
        raise ValueError(
            f"{name}: mean and rstd must hold one value per row ({rows}), got {mean.numel()} and {rstd.numel()}"
        )
    return shape


def _split(x: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Size, int, int]:
    """(leading dims, rows, cols) of x normalized over its trailing `shape`."""
    lead = x.shape[: x.dim() - len(shape)]
    return lead, math.prod(lead), math.prod(shape)


def _param(p: torch.Tensor | None, x: torch.Tensor, cols: int, fill: float) -> torch.Tensor:
    if p is None:
        return torch.full((cols,), fill, dtype=x.dtype, device=x.device)
    if p.dim() == 1 and p.is_contiguous():  # the usual case: no view to make (~1 us each)
        return p
    return p.contiguous().view(cols)


# -- forward ------------------------------------------------------------------------------
def _torch_forward(x2, w, b, eps):
    """The fallback (and the meaning of the outputs): statistics in float32 or float64,
    stored as float32."""
    acc = torch.float64 if x2.dtype == torch.float64 else torch.float32
    xa = x2.to(acc)
    var, mu = torch.var_mean(xa, dim=1, unbiased=False)
    r = torch.rsqrt(var + eps)
    y = (xa - mu[:, None]) * r[:, None] * w.to(acc) + b.to(acc)
    return [y.to(x2.dtype), mu.float(), r.float()]


def _as_rows(x: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Size, int, int, bool, torch.Tensor]:
    """(lead, rows, cols, as_is, x2): x2 is x as a contiguous (rows, cols) tensor, x itself
    where it already is one (as_is)."""
    lead, rows, cols = _split(x, shape)
    as_is = x.dim() == 2 and len(shape) == 1 and x.is_contiguous()
    return lead, rows, cols, as_is, (x if as_is else programs.contiguous(x).view(rows, cols))


def _kernel_inputs(x2, weight, bias, cols: int, eps) -> list[torch.Tensor]:
    w, b = _param(weight, x2, cols, 1.0), _param(bias, x2, cols, 0.0)
    return [x2, w, b, device_constant((float(eps),), torch.float32, x2.device)]


def _layer_norm_eager(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = check_layer_norm_args("layer_norm", x, normalized_shape, weight, bias, eps)
    lead, rows, cols, as_is, x2 = _as_rows(x, shape)
    if rows == 0 or cols == 0:
        y = torch.empty_like(x2)
        # what torch.native_layer_norm gives for an empty normalized shape
        mean = torch.zeros(rows, dtype=torch.float32, device=x.device)
        rstd = torch.full((rows,), math.nan, dtype=torch.float32, device=x.device)
    else:
        inputs = _kernel_inputs(x2, weight, bias, cols, eps)
        y, mean, rstd = layer_norm_kernel(inputs, torch_impl=lambda: _torch_forward(*inputs[:3], float(eps)))
        if as_is:
            return y, mean, rstd
    return y.view(x.shape), mean.view(lead), rstd.view(lead)


def _layer_norm_y_eager(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """y alone, for calls that autograd will not differentiate: on CUDA the kernels skip
    mean and rstd, which saves their two allocations."""
    if not isinstance(x, torch.Tensor) or not x.is_cuda:  # the CPU (and bad x: the checks name it)
        return _layer_norm_eager(x, normalized_shape, weight, bias, eps)[0]
    shape = check_layer_norm_args("layer_norm", x, normalized_shape, weight, bias, eps)
    _lead, rows, cols, as_is, x2 = _as_rows(x, shape)
    if rows == 0 or cols == 0:
        return _layer_norm_eager(x, shape, weight, bias, eps)[0]
    inputs = _kernel_inputs(x2, weight, bias, cols, eps)
    (y,) = layer_norm_y_kernel(inputs, torch_impl=lambda: _torch_forward(*inputs[:3], float(eps))[:1])
    return y if as_is else y.view(x.shape)


_layer_norm_op = torch.library.custom_op("gpu_days::layer_norm", _layer_norm_eager, mutates_args=())


@_layer_norm_op.register_fake
def _(x, normalized_shape, weight, bias, eps):
    shape = check_layer_norm_args("layer_norm", x, normalized_shape, weight, bias, eps)
    lead = x.shape[: x.dim() - len(shape)]
    stats = torch.empty(lead, dtype=torch.float32, device=x.device)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


# -- backward -----------------------------------------------------------------------------
def _torch_backward(go2, x2, w, mean, rstd):
    acc = torch.float64 if x2.dtype == torch.float64 else torch.float32
    dy = go2.to(acc)
    xhat = (x2.to(acc) - mean.to(acc)[:, None]) * rstd.to(acc)[:, None]
    g = dy * w.to(acc)
    a = g.mean(dim=1, keepdim=True)
    b = (g * xhat).mean(dim=1, keepdim=True)
    gx = rstd.to(acc)[:, None] * (g - a - xhat * b)
    return [t.to(x2.dtype) for t in (gx, (dy * xhat).sum(0), dy.sum(0))]


def _layer_norm_backward_eager(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = check_layer_norm_backward_args(grad_out, x, normalized_shape, weight, mean, rstd)
    # the usual case (a (rows, cols) LayerNorm's own saved tensors) needs no copy or view
    as_is = x.dim() == 2 and len(shape) == 1 and x.is_contiguous() and grad_out.is_contiguous()
    if as_is:  # no .to() call either when the dtypes agree: each torch call is ~1 us on the host
        lead, (rows, cols) = x.shape[:1], x.shape
        go2 = grad_out if grad_out.dtype == x.dtype else grad_out.to(x.dtype)
        x2 = x
    else:
        lead, rows, cols = _split(x, shape)
        go2 = programs.contiguous(grad_out.to(x.dtype)).view(rows, cols)
        x2 = programs.contiguous(x).view(rows, cols)
    if rows == 0 or cols == 0:
        gx = torch.empty_like(x2)
        gw = torch.zeros(cols, dtype=x.dtype, device=x.device)
        gb = torch.zeros(cols, dtype=x.dtype, device=x.device)
    else:
        w = _param(weight, x, cols, 1.0)
        plain = as_is and mean.dtype == rstd.dtype == torch.float32 and mean.dim() == rstd.dim() == 1
        m = mean if plain and mean.is_contiguous() else mean.to(torch.float32).contiguous().view(rows)
        r = rstd if plain and rstd.is_contiguous() else rstd.to(torch.float32).contiguous().view(rows)
        gx, gw, gb = layer_norm_backward_kernel(
            [go2, x2, w, m, r], torch_impl=lambda: _torch_backward(go2, x2, w, m, r)
        )
        if as_is and len(shape) == 1:
            return gx, gw, gb
    return gx.view(x.shape), gw.view(shape), gb.view(shape)


_layer_norm_backward_op = torch.library.custom_op(
    "gpu_days::layer_norm_backward", _layer_norm_backward_eager, mutates_args=()
)


@_layer_norm_backward_op.register_fake
def _(grad_out, x, normalized_shape, weight, mean, rstd):
    shape = check_layer_norm_backward_args(grad_out, x, normalized_shape, weight, mean, rstd)
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    return grad_x, x.new_empty(shape), x.new_empty(shape)


def _setup_context(ctx, inputs, output):
    x, normalized_shape, weight, bias, _eps = inputs
    _y, mean, rstd = output
    ctx.normalized_shape = normalized_shape
    ctx.has_weight = weight is not None
    ctx.has_bias = bias is not None
    # no zero-filled gradients for mean and rstd, which nobody differentiates: materialised,
    # they cost two allocations and two fill kernels per backward (day 016 found them)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)


def _backward(ctx, grad_y, _grad_mean, _grad_rstd):
    if grad_y is None:
        return None, None, None, None, None
    eager.refuse_double_backward("layer_norm")
    x, weight, mean, rstd = ctx.saved_tensors
    grad_x, grad_w, grad_b = layer_norm_backward(grad_y, x, ctx.normalized_shape, weight, mean, rstd)
    return grad_x, None, grad_w if ctx.has_weight else None, grad_b if ctx.has_bias else None, None


_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


def _split_call(x, normalized_shape, weight, bias, eps):
    """A call's tensors and other arguments, as a program's key (programs.py)."""
    tensors, absent = programs.present(x, weight, bias)
    return tensors, (normalized_shape, eps, eps.__class__, absent)


_layer_norm_replayed = programs.replayed_forward("layer_norm", _layer_norm_eager, _split_call, single=False)
_layer_norm_y_replayed = programs.replayed_forward("layer_norm_y", _layer_norm_y_eager, _split_call)


def _split_backward_call(grad_out, x, normalized_shape, weight, mean, rstd):
    tensors, absent = programs.present(grad_out, x, weight, mean, rstd)  # argument order
    return tensors, (normalized_shape, absent)


_layer_norm_backward_replayed = programs.replayed_forward(
    "layer_norm_backward", _layer_norm_backward_eager, _split_backward_call, single=False
)
_layer_norm_autograd = eager.function("LayerNorm", _layer_norm_replayed, _setup_context, _backward, programs=True)


# -- public API ---------------------------------------------------------------------------
def layer_norm(
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """`torch.nn.functional.layer_norm`, computed by day013's Mojo kernels (forward and
    backward). normalized_shape may span several trailing dims, or be an int. Under
    torch.autocast it runs in float32 (torch's CUDA policy for layer_norm)."""
    if eager.autocast_dtype(x) is not None:
        x, weight, bias = eager.cast_floats(torch.float32, x, weight, bias)
    way = eager.route(x, weight, bias)
    if way is eager.EAGER:  # no autograd: y alone (mean and rstd are never written)
        return _layer_norm_y_replayed(x, normalized_shape, weight, bias, eps)
    if way is eager.AUTOGRAD:
        return _layer_norm_autograd(x, normalized_shape, weight, bias, eps)[0]
    shape = check_layer_norm_args("layer_norm", x, normalized_shape, weight, bias, eps)
    return eager.run_op("layer_norm", torch.ops.gpu_days.layer_norm, x, list(shape), weight, bias, float(eps))[0]


def layer_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight, grad_bias) of `layer_norm` from the mean and rstd that
    `torch.ops.gpu_days.layer_norm` returned (the Mojo backward kernels)."""
    if eager.route(grad_out, x, weight, mean, rstd) is eager.EAGER:
        return _layer_norm_backward_replayed(grad_out, x, normalized_shape, weight, mean, rstd)
    # the registered op (it has no autograd of its own: no double backward through it)
    shape = check_layer_norm_args("layer_norm_backward", x, normalized_shape, weight, None, 0.0)
    return torch.ops.gpu_days.layer_norm_backward(grad_out, x, list(shape), weight, mean, rstd)


class MojoLayerNorm(torch.nn.LayerNorm):
    """Drop-in for `torch.nn.LayerNorm` backed by day013's Mojo kernels.

    Same constructor (normalized_shape, eps, elementwise_affine, bias, device, dtype),
    same parameters and state_dict keys: an `nn.LayerNorm`'s state loads as is."""

    @property
    def use_mojo(self) -> bool:
        return layer_norm_kernel.ready() and layer_norm_backward_kernel.ready()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
