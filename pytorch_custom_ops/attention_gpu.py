"""Day 018's FlashAttention forward on CUDA: the Mojo kernels it may launch and the plan
that builds one launch per call (grid, tensor maps, shared memory).

The kernel file (days/day018/attention_v*.mojo) keeps the kernel; the numbers both sides
need (kv tile, stages, shared-memory bytes) reach it as compile-time parameters, and the
kernel asserts that SMEM matches its own layout, so a drift fails in `gpu_build`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from . import direct
from .gemm_gpu import TensorMapSpec, operand_l2_promotion, sm_count
from .gpu_kernels import KernelFamily

FWD_MODULE = "days.day018.attention_fwd"
BWD_MODULE = "days.day018.attention_bwd"
DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)
# The backward's blocks: a producer warpgroup and `nc` consumer warpgroups of 64 fixed rows
# each (2; 3 in version 7's passes at head_dim 64: `bwd_consumers`).
BOX = 64  # a TMA box row: 64 16-bit elements = one 128-byte swizzle span
SMEM_LIMIT = 227 * 1024  # the H100's opt-in maximum per block
LOG2E = 1.4426950408889634
BN = 128  # keys per K/V tile of the forward


def consumers_for(d: int) -> int:
    """Consumer warpgroups of the forward (64 query rows each): 3 at head_dim 64, where a
    tile's products are half as long against the same softmax work, else 2."""
    return 3 if d == 64 else 2


def smem_bytes(d: int, bn: int, stages: int, itemsize: int = 2, nc: int = 2, split: bool = False, qbuf: int = 1) -> int:
    """qbuf x Q (nc x 64 rows x d), `stages` x (K and V: bn x d each), 2 qbuf + 3 stages
    mbarriers (+ stages with `split`: V's own empty barriers)."""
    return (qbuf * nc * 64 * d + stages * 2 * bn * d) * itemsize + 8 * (2 * qbuf + (4 if split else 3) * stages)


def q_buffers(d: int, bn: int, stages: int, nc: int, split: bool, version: int) -> int:
    """Qs in the forward's shared memory: 2 for the persistent version 4 where they fit
    beside the stages (head_dim 64), so that the next work tile's Q loads while this
    one's runs; else 1. The kernel reads the count from the shared memory it is given."""
    two = smem_bytes(d, bn, stages, nc=nc, split=split, qbuf=2)
    return 2 if version == 4 and two <= SMEM_LIMIT else 1


def stages_for(d: int, bn: int, nc: int = 2, split: bool = False) -> int:
    """As many K/V stages as fit (at most 4)."""
    s = 4
    while s > 2 and smem_bytes(d, bn, s, nc=nc, split=split) > SMEM_LIMIT:
        s -= 1
    return s


# The forward's K/V tile: (keys, SPLIT). SPLIT: the consumers free a stage's K as soon as
# S = Q K^T is done and its V after P V (FlashAttention-3's two pipelines), instead of
# both after P V, which versions 2-4 issue a tile later. 192 keys: head_dim 128 only
# (at 64 the name means 128 keys with its SPLIT). "auto": 192_split at head_dim 128 from
# LONG_KEYS keys on, else 128 (day 018's journal, "192-key tiles, part 2").
FWD_TILES = {"128": (128, False), "128_split": (128, True), "192_split": (192, True)}
TILE_NAMES = ("auto", *FWD_TILES)
DEFAULT_FWD_TILE = "128"  # "auto": level on the H200 but for +3% causal at seq 8192 (journal)
LONG_KEYS = 4096  # below it a 192-key tile wastes more of its last tile and lost (H200)


def fwd_tile(d: int, name: str | None = None, lk: int = 0) -> tuple[int, bool]:
    """(keys per K/V tile, SPLIT) of the forward at head_dim d and lk keys: tile `name`,
    or the one chosen (attention_fwd_tile, else DEFAULT_FWD_TILE)."""
    name = name or _chosen["tile"]
    if name == "auto":
        name = "192_split" if d == 128 and lk >= LONG_KEYS else "128"
    bn, split = FWD_TILES[name]
    return (bn if d == 128 else BN), split


def fwd_kernel_params(dtype, d: int, causal: bool, version: int, tile: str | None = None, lk: int = 0) -> tuple:
    """(dtype, D, BN, STAGES, CAUSAL, VERSION, NC, SPLIT, SMEM) of the forward."""
    nc = consumers_for(d)
    bn, split = fwd_tile(d, tile, lk)
    stages = stages_for(d, bn, nc, split)
    qbuf = q_buffers(d, bn, stages, nc, split, version)
    return (dtype, d, bn, stages, causal, version, nc, split, smem_bytes(d, bn, stages, nc=nc, split=split, qbuf=qbuf))


# 1: S, softmax, P V in turn; 2: the softmax overlaps the next products; 3: 2 + ping-pong;
# 4: 3 in a persistent grid (a block per SM walks the work tiles)
VERSIONS = (1, 2, 3, 4)
# "auto": version 4 at head_dim 64 with the causal mask, where its two Qs (`q_buffers`)
# win 2-5% (H200, seq 1024-8192; version 3 by 1-4% without the mask), else version 3,
# the fastest at head_dim 128 (the journal's "Short rows").
DEFAULT_VERSION = "auto"
VERSION_CHOICES = (*VERSIONS, "auto")
FWD_KERNEL = KernelFamily(
    FWD_MODULE,
    "attention_fwd_kernel",
    # q_map, k_map, v_map, out, lse, Lq, Lk, heads, batch, group, o_bs, o_hs, o_rs, scale_log2
    args=("tensormap",) * 3 + ("ptr",) * 2 + ("i64",) * 8 + ("f32",),
    variants=tuple(  # fwd_kernel_params
        sorted(
            {
                fwd_kernel_params(dtype, d, causal, version, tile)
                for dtype in DTYPES
                for d in HEAD_DIMS
                for causal in (False, True)
                for version in VERSIONS
                for tile in FWD_TILES
            },
            key=repr,
        )
    ),
)
_chosen = {"forward": DEFAULT_VERSION, "tile": DEFAULT_FWD_TILE}  # and "backward", below


@contextmanager
def _choose(which: str, name: str, version, known: tuple):
    if version not in known:
        raise ValueError(f"{name}: unknown version {version!r}; known: {known}")
    before, _chosen[which] = _chosen[which], version
    try:
        yield
    finally:
        _chosen[which] = before


def attention_version(version: int | str):
    """Run day 018's forward version `version` (1 to 4, or "auto") inside the block: the
    ladder's rungs for benchmarks and tests. The default is DEFAULT_VERSION."""
    return _choose("forward", "attention_version", version, VERSION_CHOICES)


def fwd_version(d: int, causal: bool) -> int:
    """The forward version that runs at head_dim d: the one chosen (attention_version,
    else DEFAULT_VERSION), "auto" resolved."""
    chosen = _chosen["forward"]
    if chosen != "auto":
        return chosen
    return 4 if d == 64 and causal else 3


def attention_fwd_tile(name: str):
    """Run the forward on K/V tile `name` ("auto" or one of FWD_TILES) inside the block:
    benchmarks, tests."""
    return _choose("tile", "attention_fwd_tile", name, TILE_NAMES)


def tma_map(t: torch.Tensor, box_rows: int) -> TensorMapSpec:
    """A (batch, heads, seq, head_dim) tensor with a unit last stride as a 4-D TMA view
    (head_dim, seq, heads, batch): boxes of 64 x box_rows, 128-byte swizzle."""
    b, h, n, d = t.shape
    size = t.element_size()
    strides = (t.stride(2) * size, t.stride(1) * size, t.stride(0) * size)
    dims, box = (d, n, h, b), (BOX, box_rows, 1, 1)
    return TensorMapSpec(
        t.dtype, t.data_ptr(), dims, strides, box, what="attention operand", l2_promotion=operand_l2_promotion()
    )


def tma_ready(t: torch.Tensor) -> bool:
    """TMA needs a 16-byte aligned base, positive 16-byte multiples for every stride but
    the last (an expanded, stride-0 dim is copied), and a unit last stride."""
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all((t.stride(i) > 0 and (t.stride(i) * size) % 16 == 0) or t.shape[i] == 1 for i in range(3))
    )


@direct.plan(FWD_KERNEL)
def attention_gpu(outputs, inputs, params) -> list[direct.Launch]:
    """One launch: grid (ceil(Lq / (64 consumers)), q heads, batch), or for the persistent
    version 4 one block per SM (at most one per work tile)."""
    out, lse = outputs
    q, k, v = inputs
    if not tma_ready(out):  # the kernel stores O in 16-byte blocks (store_rows's BLOCKS)
        raise ValueError(f"attention forward: out needs 16-byte aligned rows, got strides {out.stride()}")
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    causal = params["CAUSAL"]
    kparams = fwd_kernel_params(q.dtype, d, causal, fwd_version(d, causal), lk=lk)
    _, _, bn, _, _, version, nc, _, smem = kparams
    kernel = FWD_KERNEL[kparams]
    args = (
        tma_map(q, BOX),
        tma_map(k, bn),
        tma_map(v, BOX),
        out.data_ptr(),
        lse.data_ptr(),
        lq,
        lk,
        hq,
        b,
        hq // hkv,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        params["SCALE_LOG2"],
    )
    grid = (-(-lq // (64 * nc)), hq, b)
    if version == 4:
        grid = (min(grid[0] * hq * b, sm_count(q.get_device())), 1, 1)
    return [direct.Launch(kernel, grid, 128 * (1 + nc), args, smem)]


# -- the backward (days/day018/attention_bwd.mojo) ------------------------------------------------
# 1: two passes of one kernel, dQ (which also computes delta) then dK/dV; 7 products a tile
# pair. 2: delta, then one pass that also adds dQ's share into float32 with atomics; 5.
# 3: version 1 with the two consumers taking turns to issue each batch of products
# (ping-pong), in both passes. 4: as 3, except the dK/dV pass at head_dim 128 without the
# causal mask, which keeps version 1's free issue: turns made it 11-12% slower there (and
# 7-8% faster in the other three cases; day 018's journal, "The backward, part 3").
# 5: as 4, and the dQ pass overlaps tile j - 1's dQ product with tile j's elementwise
# step: that pass 3-6% faster (the journal's "The backward, part 3").
# 6: version 2's one pass with dS shared between the consumers and dQ added by whole
# 16 KB pieces through the TMA unit (days/day018/attention_bwd_tiles.mojo).
# 7: version 5 with three consumers in both passes at head_dim 64 (192 fixed rows a block,
# 512 threads, the consumers at 160 registers: 12 consumer warps where Triton's kernels
# have up to 20 an SM; the dK/dV pass's consumers pass the query tiles their keys never
# see; the journal's "The backward, parts 7 to 9"); at 128, version 5.
# 8: version 7 with its dQ pass in a persistent grid (days/day018/attention_bwd_persistent.mojo:
# a block per SM takes work tiles from a counter, loading the next one's Q, dO and first
# K/V tiles, and its rows of O into L2, while it works on this one); its dK/dV pass is
# version 7's (the journal's "The backward, part 10").
BWD_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)
# "auto": at head_dim 128 version 6 from 4096 keys, version 5 below (H200, forward +
# backward, median of 3 rounds, results/nvidia-h200/day018_backward_v6_branch.txt:
# version 6 +1-5% from 4096 keys with either mask, -1 to -6% below; the journal's "The
# backward, part 6"). At head_dim 64 version 7 with either mask (seq 1024 to 8192, one
# lease, with three consumers in both passes: +7-12% over version 5, and over version 6
# +10-14% without the mask and +7-10% with it;
# results/nvidia-h200/day018_backward_dkdv_three_consumers.txt, "part 9"), and version 8
# up to V8_UP_TO_KEYS keys: its dQ pass, against version 7's, with the mask -5.4, -3,
# -4.4 and -1.8% at 512, 768, 1024 and 1536 keys, level at 2048, +0.6-1.1% from 4096;
# without it -1 and -1.6% at 768 and 1024, +4.1% at 1536, +2.4% at 4096
# (results/nvidia-h200/day018_backward_persistent_dq.txt, "part 10").
DEFAULT_BWD_VERSION = "auto"
BWD_CHOICES = (*BWD_VERSIONS, "auto")
# (head_dim, causal): the fewest keys where "auto" takes version 6 (None: never)
V6_FROM_KEYS = {(128, False): 4096, (128, True): 4096, (64, False): None, (64, True): None}
V8_UP_TO_KEYS = {False: 1024, True: 1536}  # head_dim 64, by the mask: "auto"'s version 8
DQ_ADD = {2: 1, 6: 2}  # the kernel's FUSED: how a one-pass version adds dQ (0: a dQ pass)
PIECE = 64  # version 6's dq32: 64 x 64 float32 pieces


def bwd_config(version: int, d: int, causal: bool, dq_pass: bool) -> tuple[bool, bool]:
    """(TURNS, OVERLAP) of the dQ pass (dq_pass) or the dK/dV pass in backward `version`."""
    if version in (1, 2, 6):
        return False, False
    if version == 3:
        return True, False
    return dq_pass or causal or d != 128, version in (5, 7, 8) and dq_pass


def bwd_consumers(version: int, d: int) -> int:
    """Consumer warpgroups of a backward pass: 3 in versions 7 and 8 at head_dim 64."""
    return 3 if version in (7, 8) and d == 64 else 2


BWD_TILE = 64  # rows of a streamed tile
BWD_STAGES = 4


def bwd_smem_bytes(
    d: int, itemsize: int = 2, fused: int = 0, stages: int = BWD_STAGES, dq_pass: bool = False, nc: int = 2
) -> int:
    """Two fixed tensors (nc x 64 rows x d each), `stages` x two streamed 64 x d tiles, then
    fused 1 (version 2): a 64 x 64 dS box per consumer; fused 2 (version 6): two pairs of
    boxes and a 64 x 64 float32 piece per consumer; the dK/dV pass's (lse2, delta) pairs
    (512 bytes a stage); 1 + 3 stages mbarriers (+ stages for the pairs)."""
    ds = {0: 0, 1: 2 * 64 * 64, 2: 4 * 64 * 64 + 2 * PIECE * PIECE * 4 // itemsize}[fused]
    pairs = 0 if dq_pass else stages * (BWD_TILE * 2 * 4 + 8)
    return (2 * nc * 64 * d + stages * 2 * BWD_TILE * d + ds) * itemsize + pairs + 8 * (1 + 3 * stages)


def bwd_stages(d: int, fused: int) -> int:
    """BWD_STAGES, or as many as fit (version 6 at head_dim 128: 3)."""
    s = BWD_STAGES
    while bwd_smem_bytes(d, fused=fused, stages=s) > SMEM_LIMIT:
        s -= 1
    return s


def bwd_kernel_params(dtype, d: int, causal: bool, version: int, dq_pass: bool) -> tuple:
    """(dtype, D, STAGES, CAUSAL, DQ, FUSED, TURNS, OVERLAP, NC, SMEM) of one pass."""
    fused = DQ_ADD.get(version, 0)
    stages = bwd_stages(d, fused)
    config = bwd_config(version, d, causal, dq_pass)
    nc = bwd_consumers(version, d)
    smem = bwd_smem_bytes(d, fused=fused, stages=stages, dq_pass=dq_pass, nc=nc)
    return (dtype, d, stages, causal, dq_pass, fused, *config, nc, smem)


def one_block_per_sm(params: tuple) -> tuple[str, ...]:
    """Version 7's three-consumer passes (NC = 3): `.minnctapersm 1`, so that ptxas
    honours `setmaxnreg` and the consumers grow to 160 registers. Without it they kept 128
    and the pass spilled 144 bytes with its wgmmas serialized (C7512; ptxas -v)."""
    return (".minnctapersm 1",) if params[-2] == 3 else ()


BWD_KERNEL = KernelFamily(
    BWD_MODULE,
    "attention_bwd_kernel",
    # f0, f1, s0, s1 maps, dst0, dst1, lse, pairs, o, do, dq32, Lq, Lk, group,
    # d_bs, d_hs, d_rs, o_bs, o_hs, o_rs, do_bs, do_hs, do_rs, scale_log2, scale
    args=("tensormap",) * 4 + ("ptr",) * 7 + ("i64",) * 12 + ("f32",) * 2,
    entry_directives=one_block_per_sm,
    variants=tuple(
        sorted(
            {
                bwd_kernel_params(dtype, d, causal, version, dq)
                for dtype in DTYPES
                for d in HEAD_DIMS
                for causal in (False, True)
                for version in BWD_VERSIONS
                for dq in ((False,) if version in DQ_ADD else (False, True))
            },
            key=repr,
        )
    ),
)
DQ_PERSISTENT_MODULE = "days.day018.attention_bwd_persistent"
DQ_FIXED_BUFFERS = 2  # version 8: the next work tile's Q and dO load beside this one's


def dq_persistent_smem_bytes(d: int, stages: int, nc: int, itemsize: int = 2) -> int:
    """Version 8's dQ pass: two buffers of the fixed Q and dO (nc x 64 rows x d each),
    `stages` x (K and V: 64 x d each), 2 x 2 + 3 stages mbarriers, a work slot (8 bytes)
    per buffer."""
    fixed = DQ_FIXED_BUFFERS * 2 * nc * 64 * d
    return (fixed + stages * 2 * BWD_TILE * d) * itemsize + 8 * (3 * DQ_FIXED_BUFFERS + 3 * stages)


def dq_work_counter(version: int, device) -> torch.Tensor | None:
    """Version 8's tile scheduler counter: one int32, zeroed (a fill launch), else None."""
    return torch.zeros(1, dtype=torch.int32, device=device) if version == 8 else None


def dq_persistent_params(dtype, d: int, causal: bool) -> tuple:
    """(dtype, D, STAGES, CAUSAL, NC, SMEM) of version 8's dQ pass: version 7's consumers
    and BWD_STAGES stages, or as many as fit beside two fixed buffers (head_dim 128: 3)."""
    nc = bwd_consumers(8, d)
    stages = BWD_STAGES
    while dq_persistent_smem_bytes(d, stages, nc) > SMEM_LIMIT:
        stages -= 1
    return (dtype, d, stages, causal, nc, dq_persistent_smem_bytes(d, stages, nc))


DQ_PERSISTENT_KERNEL = KernelFamily(
    DQ_PERSISTENT_MODULE,
    "attention_dq_persistent_kernel",
    # q, do, k, v, o maps, dq, lse, pairs, o, do, work (the scheduler's int32 counter, 0),
    # Lq, Lk, heads, batch, group, d_bs, d_hs, d_rs, o_bs, o_hs, o_rs, do_bs, do_hs, do_rs,
    # scale_log2, scale
    args=("tensormap",) * 5 + ("ptr",) * 6 + ("i64",) * 14 + ("f32",) * 2,
    # one block per SM anyway: ptxas then honours setmaxnreg (`one_block_per_sm`)
    entry_directives=lambda params: (".minnctapersm 1",),
    variants=tuple(
        dq_persistent_params(dtype, d, causal) for dtype in DTYPES for d in HEAD_DIMS for causal in (False, True)
    ),
)
DELTA_KERNEL = KernelFamily(
    BWD_MODULE,
    "attention_delta_kernel",
    # pairs, lse, o, do, dq32, Lq, o_bs, o_hs, o_rs, do_bs, do_hs, do_rs
    args=("ptr",) * 5 + ("i64",) * 7,
    # (dtype, D, ZERO): ZERO also zeroes version 6's dq32, a 64-row tile a block
    variants=tuple((dtype, d, zero) for dtype in DTYPES for d in HEAD_DIMS for zero in (False, True)),
)
DQ_ROWS_KERNEL = KernelFamily(
    BWD_MODULE,
    "attention_dq_rows_kernel",
    args=("ptr",) * 2 + ("i64",) * 4,  # dq, dq32, Lq, dq_bs, dq_hs, dq_rs
    variants=tuple((dtype, d) for dtype in DTYPES for d in HEAD_DIMS),
)
_chosen["backward"] = DEFAULT_BWD_VERSION


def attention_bwd_version(version: int | str):
    """Run backward version `version` (1 to 7, or "auto") inside the block (benchmarks,
    tests)."""
    return _choose("backward", "attention_bwd_version", version, BWD_CHOICES)


def bwd_version(d: int, causal: bool, lk: int) -> int:
    """The backward version that runs at head_dim d with lk keys: the one chosen
    (attention_bwd_version, else DEFAULT_BWD_VERSION), "auto" resolved."""
    chosen = _chosen["backward"]
    if chosen != "auto":
        return chosen
    keys = V6_FROM_KEYS[d, causal]
    if keys is not None and lk >= keys:
        return 6
    if d == 64:
        return 8 if lk <= V8_UP_TO_KEYS[causal] else 7
    return 5


def pairs_rows(lq: int) -> int:
    """Rows per head of the backward's (lse2, delta) pairs: whole 64-row tiles."""
    return -(-lq // BWD_TILE) * BWD_TILE


def dq32_shape(q: torch.Tensor, version: int) -> tuple[int, ...] | None:
    """The float32 dQ a one-pass version adds into, or None: version 2: q's shape (zeroed
    by the caller); version 6: whole 64-row tiles per head (zeroed by the delta kernel)."""
    if version not in DQ_ADD:
        return None
    b, h, lq, d = q.shape
    return (b, h, pairs_rows(lq), d) if version == 6 else (b, h, lq, d)


def dq_from_pieces(dq32: torch.Tensor, lq: int) -> torch.Tensor:
    """Version 6's dq32 (b, h, tiles x 64, d) in rows: every 64 x 64 piece holds float4
    jj of the consumer's thread 32 w + 4 g + t at 16 (128 jj + 32 w + 4 g + t) bytes, its
    floats rows 16 w + 8 half + g, columns 8 jj + 2 t + e (index 2 half + e); a view, to
    copy or cast."""
    b, h, rows, d = dq32.shape
    pieces = dq32.view(b, h, rows // PIECE, d // PIECE, 8, 4, 8, 4, 2, 2)
    # (b, h, tile, piece, jj, w, g, t, half, e) -> (b, h, tile, w, half, g, piece, jj, t, e)
    return pieces.permute(0, 1, 2, 5, 8, 6, 3, 4, 7, 9).reshape(b, h, rows, d)[:, :, :lq]


@direct.plan(BWD_KERNEL, DQ_PERSISTENT_KERNEL, DELTA_KERNEL, DQ_ROWS_KERNEL)
def attention_bwd_gpu(outputs, inputs, params) -> list[direct.Launch]:
    """Version 1 (params["VERSION"]): dQ (grid: 128 queries per block, q heads, batch),
    which also writes the (lse2, delta = rowsum(dO * O)) pairs (float32, (b, q heads,
    `pairs_rows`, 2)), then dK and dV (128 keys per block, kv heads, batch), which read
    them. Version 2: the pairs (64 rows per block), then dK and dV, which also add
    scale * dS K into dq32. Versions 3 to 5:
    version 1's launches, their consumers taking turns to issue products, in version 5
    the dQ pass overlapping its product with the elementwise step (`bwd_config`).
    Version 7: version 5 with three consumers in both passes at head_dim 64 (192 fixed
    rows a block, 512 threads: `bwd_consumers`). Version 8: version 7 with its dQ pass
    in a persistent grid (DQ_PERSISTENT_KERNEL: up to one block per SM).
    Version 6: version 2's launches, dq32 in pieces (`dq32_shape`), zeroed by the delta
    kernel, then a third launch that puts dq32's rows in order into dq and casts them
    (`dq_from_pieces` says the order).
    inputs: q, k, v, do, lse2, out (the forward's output; do and out TMA-ready: 16-byte
    aligned rows); outputs: dq (versions 1, 3-8; version 6: contiguous), dk, dv (all
    with 16-byte aligned rows; dk and dv with the same strides), pairs, dq32 (versions
    2, 6: float32, `dq32_shape`; version 2: zeroed), and for version 8 its tile
    scheduler's counter (one int32, zeroed: `dq_work_counter`)."""
    dq, dk, dv, pairs, dq32, *counter = outputs
    q, k, v, do, lse, out = inputs
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
        # the passes store in 16-byte blocks (store_rows's BLOCKS); dk and dv share strides
        if grad is not None and not tma_ready(grad):
            raise ValueError(f"attention backward: {name} needs 16-byte aligned rows, got strides {grad.stride()}")
    if dk.stride() != dv.stride():
        raise ValueError(f"attention backward: dk and dv need the same strides, got {dk.stride()} and {dv.stride()}")
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    causal, version = params["CAUSAL"], params.get("VERSION", 1)
    fused = version in DQ_ADD
    dq32_ptr = dq32.data_ptr() if fused else 0
    tail = (lse.data_ptr(), pairs.data_ptr(), out.data_ptr(), do.data_ptr(), dq32_ptr, lq, lk, hq // hkv)
    row_strides = (*out.stride()[:3], *do.stride()[:3])
    scales = (params["SCALE"] * LOG2E, params["SCALE"])
    maps_kv = (tma_map(k, BOX), tma_map(v, BOX))
    maps_q = (tma_map(q, BOX), tma_map(do, BOX))

    def one_pass(dq_pass: bool, fixed, streamed, dst0, dst1, rows: int, heads: int) -> direct.Launch:
        args = (*fixed, *streamed, dst0.data_ptr(), dst1.data_ptr(), *tail, *dst0.stride()[:3], *row_strides, *scales)
        kparams = bwd_kernel_params(q.dtype, d, causal, version, dq_pass)
        nc = kparams[-2]
        grid = (-(-rows // (64 * nc)), heads, b)
        return direct.Launch(BWD_KERNEL[kparams], grid, 128 * (1 + nc), args, kparams[-1])

    dkdv = one_pass(False, maps_kv, maps_q, dk, dv, lk, hkv)
    if version == 8:
        kparams = dq_persistent_params(q.dtype, d, causal)
        tiles = -(-lq // (64 * kparams[-2])) * hq * b
        if not counter or counter[0] is None or counter[0].dtype != torch.int32 or counter[0].numel() != 1:
            raise ValueError("attention backward version 8: outputs need a 6th, its zeroed int32 work counter")
        args = (
            *maps_q,
            *maps_kv,
            tma_map(out, BOX),
            dq.data_ptr(),
            *tail[:4],
            counter[0].data_ptr(),
            lq,
            lk,
            hq,
            b,
            hq // hkv,
        )
        args += (*dq.stride()[:3], *row_strides, *scales)
        grid = (min(tiles, sm_count(q.get_device())), 1, 1)
        return [direct.Launch(DQ_PERSISTENT_KERNEL[kparams], grid, 128 * (1 + kparams[-2]), args, kparams[-1]), dkdv]
    if not fused:
        return [one_pass(True, maps_q, maps_kv, dq, dq, lq, hq), dkdv]
    tiles = (-(-lq // 64), hq, b)
    pieces = version == 6  # dq32 zeroed by the delta kernel, cast by DQ_ROWS_KERNEL
    pairs_args = (pairs.data_ptr(), lse.data_ptr(), out.data_ptr(), do.data_ptr(), dq32_ptr, lq, *row_strides)
    launches = [direct.Launch(DELTA_KERNEL[q.dtype, d, pieces], tiles, 128, pairs_args, 0), dkdv]
    if pieces:
        if not dq.is_contiguous():  # the rows kernel stores 16-byte blocks in rows of d
            raise ValueError(f"attention backward version 6: dq must be contiguous, got strides {dq.stride()}")
        rows_args = (dq.data_ptr(), dq32_ptr, lq, *dq.stride()[:3])
        launches.append(direct.Launch(DQ_ROWS_KERNEL[q.dtype, d], tiles, 128, rows_args, 0))
    return launches
