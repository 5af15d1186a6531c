"""Day 014's GEMM on CUDA (and day 019's version 4): the kernels it may launch and the plan
that picks one per call.

Since day 016 the host side of the GPU path lives here, not in day014's Mojo files:
which kernel (SIMT, mma.sync, wgmma or TMA), its tile, grid, block and shared memory, and
the TMA descriptors. The Mojo file keeps the kernels. Numbers that both sides need are
passed to the kernel as compile-time parameters (the shared-memory size, the TMA stage
count), and each kernel asserts at build time that the number fits its own layout, so a
plan that drifts from a kernel fails in `gpu_build` instead of overrunning shared memory.

    with gemm_version("WG_128x128"):    # force one kernel (benchmarks, the version ladder)
        pco.gemm(a, b)                    # AUTO (the default) is the op's own choice
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cache

import torch

from . import cuda_driver, direct
from .gpu_kernels import KernelFamily
from .layer_norm import sum_partials_launch
from .mojo_op import device_constant

# one Mojo file per kernel version (days/day014/gemm_v*.mojo)
SIMT_MODULE = "days.day014.gemm_v1_simt"
TC_MODULE = "days.day014.gemm_v1_mma_sync"
WG_MODULE = "days.day014.gemm_v2_wgmma"
TMA_MODULE = "days.day014.gemm_v3_tma"
PINGPONG_MODULE = "days.day019.gemm_v4_pingpong"  # day 019's persistent ping-pong kernel
MAX_BATCH = 65535  # one grid z slice per matrix: the CUDA grid's z limit
# An H100 has 132 SMs: a problem with fewer 128x128 tiles than that (e.g. 1024^2 = 64
# tiles) would leave SMs idle, so it gets 64-row tiles (4x as many blocks for the SIMT
# kernel's 64x64, 2x for the tensor-core kernel's 64x128).
SMALL_GRID = 132

# Threads per block. The kernels index with these counts (SIMT_THREADS, TC_THREADS,
# WG_THREADS in days/day014/gemm_v*.mojo), and their tile-split asserts are written against them.
SIMT_THREADS = 256
TC_THREADS = 256
WG_THREADS = 128  # one warpgroup

# What the shared-memory sizes are made of: the kernels' stage layouts (gemm_v*.mojo). Each
# kernel checks SMEM against its own layout at build time.
TC_BN, TC_BK, TC_STAGES, TC_PAD = 128, 32, 4, 8
WG_BK, WG_STAGES = 64, 4
TMA_SMEM_BUDGET = 192 * 1024  # stage buffers; the H100 allows 227 KiB
TMA_SWIZZLE_BYTES = 128  # CU_TENSOR_MAP_SWIZZLE_128B: a box row is one 128-byte span
PP_THREADS = 3 * WG_THREADS  # a producer and two consumer warpgroups
PP_SMEM_BUDGET = 227 * 1024  # stage buffers + barriers: all the H100 allows one block (232448 B)

TC_DTYPES = (torch.bfloat16, torch.float16)
PAIRS = ((False, False), (False, True), (True, False), (True, True))

# (BM, BK, thread tile) of the SIMT kernel: square tiles, TM = TN
SIMT_SMALL, SIMT_LARGE = (64, 16, 4), (128, 16, 8)
SIMT_FP64 = (64, 8, 4)  # 64x64 tiles, k steps of 8: 8x8 doubles per thread would spill


def tc_smem_bytes(dtype: torch.dtype, ta: bool, tb: bool, bm: int) -> int:
    """mma.sync: TC_STAGES stages of an A and a B tile, each kept in its stored
    orientation with rows padded by TC_PAD ([mn][k] when k-contiguous, else [k][mn])."""

    def tile(k_contiguous: bool, bmn: int) -> int:
        return (bmn if k_contiguous else TC_BK) * ((TC_BK if k_contiguous else bmn) + TC_PAD)

    return TC_STAGES * (tile(not ta, bm) + tile(tb, TC_BN)) * dtype.itemsize


def wg_smem_bytes(dtype: torch.dtype, bm: int, bn: int) -> int:
    return WG_STAGES * (bm + bn) * WG_BK * dtype.itemsize


def tma_bk(dtype: torch.dtype) -> int:
    """k per TMA stage (and the mn width of an mn-contiguous box): one swizzle span."""
    return TMA_SWIZZLE_BYTES // dtype.itemsize


def tma_stage_bytes(dtype: torch.dtype, bm: int, bn: int) -> int:
    """One TMA stage of versions 3 and 4: BM x 64 of A and BN x 64 of B (16-bit elements)."""
    return (bm + bn) * tma_bk(dtype) * dtype.itemsize


def tma_stages(dtype: torch.dtype, bm: int, bn: int) -> int:
    return TMA_SMEM_BUDGET // tma_stage_bytes(dtype, bm, bn)


# TMA_STORE (day 019, part 10): each consumer's two 64 x 64 boxes the epilogue stores from;
# EPI_WARPS (part 22): a copy of the whole tile
def store_box_bytes(dtype: torch.dtype, tma_store: bool, bm: int = 0, bn: int = 0, epi_warps: bool = False) -> int:
    if epi_warps:
        return bm * bn * dtype.itemsize
    return 2 * STORE_BOXES * STORE_BOX * STORE_BOX * dtype.itemsize if tma_store else 0


def cluster_split_bytes(bm: int, bn: int, cluster: int) -> int:
    """Split-K in a cluster (SPLIT = 3, ping-pong tiles; days/day019/cluster_split.mojo):
    what a CTA receives from the other cluster - 1, its share of the tile's units of 64
    rows x 32 columns (8 KB of float32 each), and the `red_full` mbarrier."""
    units = (bm // 64) * (bn // 32)
    return (cluster - 1) * -(-units // cluster) * 8192 + 8


def _pp_fixed_bytes(dtype: torch.dtype, bm: int, bn: int, tma_store: bool, epi_warps: bool, red: int = 0) -> int:
    """All but the stages: the epilogue's boxes, two `turn` mbarriers and, EPI_WARPS, two
    more; `red`, split-K in a cluster's (cluster_split_bytes)."""
    return store_box_bytes(dtype, tma_store, bm, bn, epi_warps) + 16 + (16 if epi_warps else 0) + red


def pp_stages(
    dtype: torch.dtype, bm: int, bn: int, tma_store: bool = False, epi_warps: bool = False, red: int = 0
) -> int:
    """The most stages that fit in PP_SMEM_BUDGET."""
    fixed = _pp_fixed_bytes(dtype, bm, bn, tma_store, epi_warps, red)
    return (PP_SMEM_BUDGET - fixed) // (tma_stage_bytes(dtype, bm, bn) + 16)


def pp_smem_bytes(
    dtype: torch.dtype,
    bm: int,
    bn: int,
    tma_store: bool = False,
    epi_warps: bool = False,
    stages: int | None = None,
    red: int = 0,
) -> int:
    """The stage buffers (`stages`, by default pp_stages'), the epilogue's boxes (TMA_STORE),
    what split-K in a cluster receives (`red`), a `full` and an `empty` mbarrier per stage,
    two `turn` mbarriers (and EPI_WARPS' `epi_full`, `epi_empty`)."""
    stages = stages or pp_stages(dtype, bm, bn, tma_store, epi_warps, red)
    return stages * (tma_stage_bytes(dtype, bm, bn) + 16) + _pp_fixed_bytes(dtype, bm, bn, tma_store, epi_warps, red)


def tma_smem_bytes(dtype: torch.dtype, bm: int, bn: int) -> int:
    """The stage buffers, then a `full` and an `empty` mbarrier (8 B each) per stage."""
    return tma_stages(dtype, bm, bn) * (tma_stage_bytes(dtype, bm, bn) + 16)


# -- the kernels ------------------------------------------------------------------------
_ARGS = ("ptr",) * 5 + ("i64",) * 8  # dst, a, b, c, alpha_beta, m, n, k, a_bs, b_bs, c_bs, c_rs, c_cs

SIMT_KERNEL = KernelFamily(
    SIMT_MODULE,
    "gemm_simt_kernel",
    args=_ARGS + ("i64",) * 2,  # ..., a_ld, b_ld: the operands' stored row strides (split-K)
    variants=tuple(  # (dtype, TA, TB, VEC, BM, BN, BK, TM, TN)
        (dtype, ta, tb, vec, bm, bm, bk, tt, tt)
        for dtype, configs in ((torch.float32, (SIMT_SMALL, SIMT_LARGE)), (torch.float64, (SIMT_FP64,)))
        for ta, tb in PAIRS
        for vec in (False, True)
        for bm, bk, tt in configs
    ),
)
TC_KERNEL = KernelFamily(
    TC_MODULE,
    "gemm_tc_kernel",
    args=_ARGS,
    variants=tuple(  # (dtype, TA, TB, VEC, BM, SMEM)
        (dtype, ta, tb, vec, bm, tc_smem_bytes(dtype, ta, tb, bm))
        for dtype in TC_DTYPES
        for ta, tb in PAIRS
        for vec in (False, True)
        for bm in (64, 128)
    ),
)
WG_TILES = ((64, 128), (128, 128), (128, 256))
WG_KERNEL = KernelFamily(
    WG_MODULE,
    "gemm_wgmma_kernel",
    args=_ARGS,
    variants=tuple(  # (dtype, TA, TB, BM, BN, SMEM)
        (dtype, ta, tb, bm, bn, wg_smem_bytes(dtype, bm, bn))
        for dtype in TC_DTYPES
        for ta, tb in PAIRS
        for bm, bn in WG_TILES
    ),
)
# 192 x 128: three consumer warpgroups (512 threads); a 3072 x 1024 output is 128 such
# tiles, one round on 132 SMs (256 x 128: 96 tiles, 73% of the SMs)
TMA_TILES = ((128, 128), (128, 256), (192, 128))
TF32X3_TILE = (128, 128)  # two accumulators a thread (promotion): at most 128 wide
# F32_OUT (a float32 output from 16-bit operands): a weight gradient dH^T X of float32 master
# weights (A transposed, B not), on the three-consumer tile AUTO gives one round of them
TMA_F32_TILE = (192, 128)
# ... and the pieces of K of a 16-bit GEMM at a few tokens, in float32, on 128 x 64 tiles
TMA_SPLIT_TILE = (128, 64)  # version 3 has two or three consumers: 128 rows at least


def _tma_variant(dtype: torch.dtype, ta: bool, tb: bool, bm: int, bn: int, f32_out: bool = False) -> tuple:
    return (dtype, ta, tb, bm, bn, f32_out, tma_stages(dtype, bm, bn), tma_smem_bytes(dtype, bm, bn))


TMA_KERNEL = KernelFamily(
    TMA_MODULE,
    "gemm_tma_kernel",
    # a_map, b_map, dst, c, alpha_beta, m, n, k, c_bs, c_rs, c_cs
    args=("tensormap", "tensormap") + ("ptr",) * 3 + ("i64",) * 6,
    variants=tuple(  # (dtype, TA, TB, BM, BN, F32_OUT, STAGES, SMEM)
        _tma_variant(dtype, ta, tb, bm, bn)
        for dtype, pairs, tiles in (
            (torch.bfloat16, PAIRS, TMA_TILES),
            (torch.float16, PAIRS, TMA_TILES),
            (torch.float32, ((False, True),), (TF32X3_TILE,)),  # 3xTF32: k-major tf32 planes (day 019, part 9)
        )
        for ta, tb in pairs
        for bm, bn in tiles
    )
    + tuple(_tma_variant(dtype, True, False, *TMA_F32_TILE, f32_out=True) for dtype in (torch.bfloat16, torch.float16))
    + tuple(_tma_variant(dtype, ta, tb, *TMA_SPLIT_TILE, f32_out=True) for dtype in TC_DTYPES for ta, tb in PAIRS),
)
TF32_SPLIT_THREADS, TF32_SPLIT_TILE = 256, 32
TF32_SPLIT_KERNEL = KernelFamily(
    "days.day019.tf32_split",
    "tf32_split_kernel",
    args=("ptr",) * 2 + ("i64",) * 4,  # planes, src, mn, k, kp, src_bs
    variants=((False,), (True,)),  # K_CONTIG: the operand is stored with K innermost
)
# (BM, BN, CLUSTER, COOP, SPLIT): a block's tile, the CTAs of a cluster sharing A's
# tile, whether both consumers split each tile (COOP) or take turns with whole tiles
# (ping-pong), and how tiles split along K: 0 not, 1 stream-K (the k-steps of all tiles
# shared evenly, the last piece of a tile sums it), 2 split-K (S aligned pieces per tile,
# summed by SPLIT_K_SUM_KERNEL), 3 split-K in a cluster (its CLUSTER CTAs split one tile's
# K and add their sums in shared memory: CLUSTER_SPLIT_CONFIGS)
PP_CONFIGS = (
    (64, 256, 1, False, 0),
    (128, 128, 1, False, 0),
    (128, 128, 2, False, 0),
    (128, 256, 1, True, 0),
    (256, 128, 1, True, 0),
    (256, 128, 2, True, 0),
    (256, 192, 1, True, 0),
    (128, 192, 1, True, 0),
    (256, 64, 1, True, 0),
    (128, 64, 1, False, 0),
    (64, 64, 1, False, 0),
    (256, 128, 1, True, 1),
    (256, 128, 1, True, 2),
)
# Split-K in a cluster (day 019, part 28): ping-pong 128 x 128 tiles, one tile a cluster of
# 2, 3 or 4 CTAs, each CTA a share of the k-steps; the shares are added through
# distributed shared memory (days/day019/cluster_split.mojo). For few output tiles and a
# long K, where split-K's workspace and second kernel cost (GPT-2's 768 x 768 weight
# gradient: 36 tiles of 128 x 128, 108 CTAs in clusters of 3).
CLUSTER_SPLITS = (2, 3, 4)
CLUSTER_SPLIT_CONFIGS = tuple((128, 128, s, False, 3) for s in CLUSTER_SPLITS)
PP_CONFIGS += CLUSTER_SPLIT_CONFIGS
# (BIAS, GELU, GELU_GRAD) of the fused linear layer: x @ W^T, W stored like nn.Linear's
PP_LINEAR_EPILOGUES = ((True, False, False), (True, True, False), (False, True, False))
# ... and of the MLP backward's dH @ W (day 020): W read as stored, (out, in)
PP_GELU_GRAD = (False, False, True)
# Weight gradients written in float32 (day 020, `weight_grad`): dW = dH^T X, both read
# as stored (rows, features), so A is transposed and B is not; the tiles AUTO may pick
# for them (version 3's 128 x 128 has no float32 form: F32_AUTO_TILES leaves it out).
# Split-K needs no variant of its own: its pieces are float32, the sum kernel writes.
PP_F32_CONFIGS = ((256, 128, 1, True, 0), (256, 192, 1, True, 0), (128, 192, 1, True, 0))
PLAIN_EPILOGUE = (False, False, False)
# The cooperative tiles that also come with the epilogue through shared memory and TMA
# stores (TMA_STORE, day 019, part 10): 16-bit outputs, whole tiles, one column part.
PP_TMA_STORE_CONFIGS = (
    (256, 128, 1, True, 0),
    (128, 256, 1, True, 0),
    (128, 128, 1, False, 0),
    (128, 64, 1, False, 0),
    (64, 64, 1, False, 0),
)
STORE_BOXES, STORE_BOX = 2, 64  # days/day019/tma_store.mojo
# where these flags sit in a variant (below)
PP_CLUSTER, PP_SPLIT, PP_TMA_STORE, PP_C_BLOCKS, PP_EPI_WARPS = 10, 12, 14, 15, 16
# The tiles whose GELU epilogues also come with the epilogue warps (EPI_WARPS, day 019,
# part 22): GELU applied and stored by the producer warpgroup's idle warps, while the
# consumers run the next tile. Cooperative TMA-store tiles, no residual (beta 0).
PP_EPI_WARPS_CONFIGS = ((256, 128, 1, True, 0),)
# AUTO's rule for them (H200, bf16, kernel time; results/nvidia-h200/day019_gelu_warps.txt):
# at K = 768 and 1024 they win (GPT-2's MLP: 79.0 -> 72.3 us); at K = 3072 the k-loop hides
# the consumers' GELU and the fourth stage they cost shows (73.7 -> 77.4)
EPI_WARPS_MAX_K = 1024
# ... and only with two rounds of tiles or more: a block's last tile waits for the warps'
# GELU with nothing to overlap (GPT-2's MLP at 1024 tokens, 96 tiles: 14.3 -> 16.7 us; at
# 3072 tokens, 2.2 rounds, level; at 6144, 4.4 rounds, 65.5 -> 62.4)
EPI_WARPS_MIN_ROUNDS = 2
# with GELU's derivative saved (day 020's MLP) the three warps have twice the arithmetic
# and lose 2-5% (91.3 -> 93.9 us at the MLP's shape): the consumers keep it
EPI_WARPS_DERIVATIVE = False
PP_GELU_EPILOGUES = tuple(e for e in PP_LINEAR_EPILOGUES if e[1])
# The MLP backward's product dH * GELU' on the epilogue warps (GELU_GRAD with EPI_WARPS,
# day 019, part 23), from the saved derivative or from the saved pre-activation (whose
# derivative only the warps compute): each of the warps' EPI_THREADS threads keeps one
# 16-byte column chunk of the tile, so the column sums come as EPI_THREADS / (BN / 8)
# partial rows a tile (epilogue_warps.mojo's gelu_grad_tile).
EPI_THREADS = 96
# AUTO (H200, bf16, kernel time with the sums, GPT-2's MLP at 8192 and 16384 tokens;
# results/nvidia-h200/day019_gelu_grad_warps.txt): the saved derivative multiplied on the
# warps, 90.9 and 171.9 us against the consumers' 92.5 and 175.4 (90.7 and 170.3 against
# 92.4 and 175.1 in the lease before), under the GELU layer's rule (EPI_WARPS_MAX_K,
# EPI_WARPS_MIN_ROUNDS) ...
EPI_WARPS_GRAD = True
# ... but not from pre: 104.3 and 202.1 us, which the 9 and 18 us its forward saves (GELU
# on the warps without the derivative) do not pay for, so the MLP saves the derivative
EPI_WARPS_GRAD_PRE = False
# The epilogues that also come with c read in 16-byte blocks (C_BLOCKS, day 019, part 16),
# for A @ B^T (TRANSPOSE_B) on every tile without split K: a linear layer's residual, with
# or without bias, and attention's masked scores (q k^T + mask). Other products with c
# read it in 2-byte loads, as before.
PP_C_BLOCKS_EPILOGUES = ((True, False, False), PLAIN_EPILOGUE)


def _pp_variants(dtype: torch.dtype, config: tuple, tma_store: bool = False):
    """Version 4's variants of one PP_CONFIGS tile: (dtype, TA, TB, BM, BN, STAGES, SMEM,
    BIAS, GELU, GELU_GRAD, CLUSTER, COOP, SPLIT, F32_OUT, TMA_STORE, C_BLOCKS, EPI_WARPS)."""
    bm, bn, cluster, coop, split = config
    red = cluster_split_bytes(bm, bn, cluster) if split == 3 else 0

    def variant(pair, epilogue, f32_out=False, c_blocks=False, epi_warps=False):
        stages = pp_stages(dtype, bm, bn, tma_store, epi_warps, red)
        smem = pp_smem_bytes(dtype, bm, bn, tma_store, epi_warps, stages, red)
        flags = (cluster, coop, split, f32_out, tma_store, c_blocks, epi_warps)
        return (dtype, *pair, bm, bn, stages, smem, *epilogue, *flags)

    yield from (variant(pair, PLAIN_EPILOGUE) for pair in PAIRS)
    if not split:  # the fused epilogues: split tiles serve the long-K backward's plain products only
        yield from (variant((False, True), epilogue) for epilogue in PP_LINEAR_EPILOGUES)
        yield variant((False, False), PP_GELU_GRAD)
        yield from (variant((False, True), epilogue, c_blocks=True) for epilogue in PP_C_BLOCKS_EPILOGUES)
        if tma_store and config in PP_EPI_WARPS_CONFIGS:
            yield from (variant((False, True), epilogue, epi_warps=True) for epilogue in PP_GELU_EPILOGUES)
            yield variant((False, False), PP_GELU_GRAD, epi_warps=True)
    if (config in PP_F32_CONFIGS or split == 3) and not tma_store:
        yield variant((True, False), PLAIN_EPILOGUE, f32_out=True)
    if config in PP_TMA_STORE_CONFIGS and not tma_store:
        yield from _pp_variants(dtype, config, tma_store=True)


# One round of ping-pong 128 x 128 tiles with TMA stores and a very long K (AUTO's
# ONE_ROUND_LONG_K_TILE) is not split along K from ONE_ROUND_UNSPLIT_K on: at 16384
# tokens it beats split-K by kernel time and from a flushed L2 (H200, bf16, % of cuBLAS;
# days/day019/README.md, parts 26 and 29: 2304 x 768 x 16384 93% against 85%, 97% against
# 87% flushed). Part 26 ran it with 4 stages, which then beat the 6 that fit; part 29
# found why (the k-loop divided its index by 6 in every step, by 4 a shift) and with the
# division gone the 6 stages win everywhere (89 -> 93%, flushed 89 -> 97%), so every
# stage that fits runs again.
ONE_ROUND_UNSPLIT_K = 16384


# The operand loads' L2 promotion (TensorMapSpec.l2_promotion), in bytes: none (what MAX
# passed). Others use 256 (DeepGEMM, for instance); `l2_promotion` is the A/B switch.
# Measured on the H200 (day 019, part 27; results/nvidia-h200/day019_l2_promotion.txt):
# 256 moved nothing by kernel time (a 124M step's GEMMs 9.37 against 9.38 ms) and gained
# 1-2 points from a flushed L2 on one round at K = 16384 only, so none stays.
_l2_promotion = direct.PlanSetting(0)


def l2_promotion(nbytes: int):
    """Inside the block, the operand tensor maps of versions 3 and 4 and of day 018's
    attention widen each L2 request to `nbytes` (0, 64, 128 or 256)."""
    if nbytes not in cuda_driver.CU_TENSOR_MAP_L2_PROMOTION:
        raise ValueError(f"l2_promotion: {nbytes!r} bytes; one of {sorted(cuda_driver.CU_TENSOR_MAP_L2_PROMOTION)}")
    return _l2_promotion.set_to(nbytes)


def operand_l2_promotion() -> int:
    """The CU_TENSOR_MAP_L2_PROMOTION value operand maps take now (l2_promotion)."""
    return cuda_driver.CU_TENSOR_MAP_L2_PROMOTION[_l2_promotion.value]


PINGPONG_KERNEL = KernelFamily(
    PINGPONG_MODULE,
    "gemm_pingpong_kernel",
    # a_map, b_map, out_map, aux_map, dst, c, alpha_beta, bias, aux, partials, counters,
    # m, n, k, batch, c_bs, c_rs, c_cs, store_aux
    args=("tensormap",) * 4 + ("ptr",) * 7 + ("i64",) * 8,
    variants=tuple(v for dtype in TC_DTYPES for config in PP_CONFIGS for v in _pp_variants(dtype, config)),
)
SPLIT_K_SUM_THREADS = 256
SPLIT_K_SUM_KERNEL = KernelFamily(
    "days.day019.stream_k",
    "split_k_sum_kernel",
    # dst, ws, c, alpha_beta, bias, m, n, batch, splits, c_bs, c_rs, c_cs, with_bias
    args=("ptr",) * 5 + ("i64",) * 8,
    # (dtype, odtype); float32 -> float32 sums the SIMT kernel's split-K pieces
    variants=tuple((dtype, out) for dtype in TC_DTYPES for out in (dtype, torch.float32))
    + ((torch.float32, torch.float32),),
)

# -- which kernel: AUTO, or one forced for benchmarks -----------------------------
VERSIONS = {  # name: (kind, BM, BN)
    "AUTO": ("auto", 0, 0),  # version 4 or 3 where TMA applies (auto_tile), else mma.sync
    "MMA_SYNC": ("mma", 0, 0),  # the Ampere-style kernel (ldmatrix + mma.sync)
    "WG_64x128": ("wgmma", 64, 128),  # version 2: wgmma, one warpgroup per block
    "WG_128x128": ("wgmma", 128, 128),
    "WG_128x256": ("wgmma", 128, 256),
    "TMA_128x128": ("tma", 128, 128),  # version 3: TMA + producer warpgroup
    "TMA_128x256": ("tma", 128, 256),
    "TMA_192x128": ("tma", 192, 128),  # three consumers, 64 rows each
    "PINGPONG_64x256": ("pingpong", 64, 256),  # version 4 (day 019): persistent, ping-pong
    "PINGPONG_128x128": ("pingpong", 128, 128),
    "MULTICAST_128x128": ("multicast", 128, 128),  # version 4 in clusters of 2 sharing A (TMA multicast)
    "COOP_128x256": ("coop", 128, 256),  # version 4's schedule, both consumers on each tile (as v3)
    "COOP_256x128": ("coop", 256, 128),  # each consumer 128 x 128: cuBLAS's tile on the H100
    "COOP_TMA_256x128": ("coop_tma", 256, 128),  # ... its epilogue stored by TMA from shared memory
    "COOP_TMA_128x256": ("coop_tma", 128, 256),
    "PINGPONG_TMA_128x128": ("pingpong_tma", 128, 128),  # ping-pong, whose epilogues the other consumer's k-loop hides
    "PINGPONG_TMA_128x64": ("pingpong_tma", 128, 64),
    "PINGPONG_64x64": ("pingpong", 64, 64),  # a few tokens: no half-empty 128-row tile
    "PINGPONG_TMA_64x64": ("pingpong_tma", 64, 64),
    "COOP_MULTICAST_256x128": ("coop_multicast", 256, 128),  # ... in clusters of 2 sharing A
    "COOP_256x192": ("coop", 256, 192),  # each consumer 128 x 192: 8192 x 768 is 128 tiles, one wave
    "COOP_128x192": ("coop", 128, 192),  # each consumer 64 x 192: a 3072 x 768 dW is 96 tiles, not 72
    "COOP_256x64": ("coop", 256, 64),  # outputs 64 wide (attention's P V): no half-empty tile
    "PINGPONG_128x64": ("pingpong", 128, 64),
    "STREAMK_256x128": ("coop_streamk", 256, 128),  # COOP_256x128 with the k-steps shared evenly (stream-K)
    "SPLITK_256x128": ("coop_splitk", 256, 128),  # ... cut into equal pieces per tile, one wave (split-K)
    # ping-pong 128 x 128, a tile's K split among the CTAs of a cluster, summed in shared memory
    "CLUSTER_SPLITK_128x128": ("cluster_splitk", 128, 128),
    # float32 only (other names leave float32 to AUTO: 3xTF32 where it fits and pays, float_kernel)
    "SIMT": ("simt", 0, 0),  # version 1's SIMT kernel: IEEE float32 products
    "TF32X3_128x128": ("tf32x3", 128, 128),  # 3xTF32 on version 3's kernel (day 019, part 9)
}
# version 4's kinds
V4_KINDS = (
    "pingpong",
    "multicast",
    "coop",
    "coop_multicast",
    "coop_streamk",
    "coop_splitk",
    "cluster_splitk",
    "coop_tma",
    "pingpong_tma",
)
_version = direct.PlanSetting("AUTO")
_c_blocks = direct.PlanSetting(True)  # C_BLOCKS where its promise holds (pingpong_launch)
# EPI_WARPS (pingpong_launch): "auto" by EPI_WARPS_MAX_K and the saved output; True where
# the tile and the caller allow it; False never
_epi_warps = direct.PlanSetting("auto")
_forced_pieces = direct.PlanSetting(None)  # split_pieces: None, or the S every split takes


def current_version() -> str:
    return _version.value


@contextmanager
def gemm_version(name: str):
    """Force one kernel inside the block (the op's default is AUTO). A forced wgmma or
    TMA kernel still needs its conditions (16-byte rows and pointers; TMA also K > 0);
    where they fail, mma.sync runs, as in the Mojo host code it replaces. The float32
    names ("SIMT", "TF32X3_128x128") apply to float32 only (3xTF32 also needs an even
    N); every other name leaves float32 to AUTO."""
    if name not in VERSIONS:
        raise ValueError(f"gemm: unknown kernel version {name!r}; known: {', '.join(VERSIONS)}")
    with _version.set_to(name):
        yield


def split_pieces(pieces: int):
    """Inside the block, GEMMs of batch 1 with 16-byte rows take `pieces` pieces of K where
    K allows them (1: never split): float32 on the SIMT kernel, 16-bit on version 3's
    128 x 64 tiles (under AUTO). The sweeps behind the split rules
    (days/day014/time_fp32.py --pieces, days/day019/time_few_tokens.py)."""
    return _forced_pieces.set_to(pieces)


def forced_pieces(k: int, fits) -> int | None:
    """split_pieces' S for this K (1 where `fits(k, S)` says K does not split so), or None
    outside split_pieces."""
    pieces = _forced_pieces.value
    if pieces is None:
        return None
    return pieces if pieces > 1 and fits(k, pieces) else 1


def c_in_pairs():
    """Inside the block, version 4 reads every c in 2-byte loads, as before day 019's part
    16 (C_BLOCKS off): the same kernels otherwise, for an A/B in one process."""
    return _c_blocks.set_to(False)


def gelu_on_consumers():
    """Inside the block, the fused GELU layer applies GELU on the consumers, in registers,
    as before day 019's part 22 (EPI_WARPS off): the same kernels otherwise, for an A/B in
    one process."""
    return _epi_warps.set_to(False)


def gelu_on_epilogue_warps():
    """Inside the block, the fused GELU layer applies GELU on the producer's idle warps
    wherever its tile can (EPI_WARPS), whatever K and the saved output: the other side of
    `gelu_on_consumers`' A/B."""
    return _epi_warps.set_to(True)


def epi_sum_groups(dtype: torch.dtype, bn: int) -> int:
    """The epilogue warps' partial column sums per tile: their threads over the tile's
    16-byte column chunks (gelu_grad_tile)."""
    return EPI_THREADS // (bn * dtype.itemsize // 16)


def _epi_grad_reads(c: torch.Tensor, sizes: tuple) -> bool:
    """The epilogue warps can read GELU_GRAD's c as gelu_grad_tile does: rows of exactly n
    (the output's pitch), row-major, 16-byte chunks. Not c_fits_blocks: that one follows
    the C_BLOCKS A/B switch and allows longer rows."""
    n, c_rs, c_cs = sizes[1], sizes[5], sizes[6]
    return c_rs == n and c_cs == 1 and n % 8 == 0 and c.data_ptr() % 16 == 0


def gelu_grad_on_epilogue_warps(m: int, n: int, k: int, dtype: torch.dtype, device_index: int | None) -> bool:
    """Whether the MLP backward's product (m x k) @ (k x n), times GELU's derivative,
    takes that derivative from the saved pre-activation on the epilogue warps (day 019,
    part 23; `pingpong_launch(gelu_grad_pre=True)`), so that the forward saves the
    pre-activation instead of the derivative. AUTO: where EPI_WARPS_GRAD_PRE and the GELU
    layer's rule hold (K <= EPI_WARPS_MAX_K, EPI_WARPS_MIN_ROUNDS rounds of tiles) under
    the AUTO version; `gelu_on_epilogue_warps` wherever the tile can, `gelu_on_consumers`
    nowhere."""
    setting = _epi_warps.value
    bm, bn = PP_EPI_WARPS_CONFIGS[0][:2]
    if setting is False or dtype not in TC_DTYPES or n % 8 or bm * n >= 2**31:
        return False
    if setting is True:
        return True
    # asked on every MLP call (its forward and its context): the cheap tests first
    if not EPI_WARPS_GRAD_PRE or current_version() != "AUTO" or k > EPI_WARPS_MAX_K:
        return False
    return _cdiv(m, bm) * _cdiv(n, bn) >= EPI_WARPS_MIN_ROUNDS * sm_count(device_index)


# -- TMA descriptors ------------------------------------------------------------------------
_TMA_DTYPES = {
    torch.bfloat16: cuda_driver.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    torch.float16: cuda_driver.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    torch.float32: cuda_driver.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,  # tf32 planes
}


@dataclass(frozen=True)
class TensorMapSpec:
    """A tiled TMA descriptor to encode at launch time (`direct` calls `encode`), so the
    plan makes no driver call and runs on a CPU. Sizes innermost first, as the driver
    takes them; `byte_strides` for every dim but the innermost. Interleave none, no NaN
    fill and by default no L2 promotion: what MAX's `create_tma_descriptor` passed (26.7).
    `l2_promotion` (a CU_TENSOR_MAP_L2_PROMOTION value) widens each L2 request."""

    dtype: torch.dtype
    address: int
    dims: tuple[int, ...]
    byte_strides: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: int = cuda_driver.CU_TENSOR_MAP_SWIZZLE_128B
    what: str = field(default="gemm operand", compare=False)  # for the driver's error message
    l2_promotion: int = cuda_driver.CU_TENSOR_MAP_L2_PROMOTION_NONE

    def encode(self) -> bytes:
        # A pure function of the fields: in a model the weights (and, through torch's
        # caching allocator, most activations) come back at the same addresses, so the
        # driver call (a few us through ctypes) is paid once per layout.
        found = _ENCODED.get(self)
        if found is None:
            found = cuda_driver.encode_tiled_tensor_map(
                _TMA_DTYPES[self.dtype],
                self.address,
                self.dims,
                self.byte_strides,
                self.box,
                self.swizzle,
                self.what,
                self.l2_promotion,
            )
            if len(_ENCODED) >= 4096:
                _ENCODED.clear()
            _ENCODED[self] = found
        return found

    def encode_at(self, address: int) -> bytes:
        """The descriptor of the same view of another tensor (a recipe's next call)."""
        return replace(self, address=address).encode()


_ENCODED: dict[TensorMapSpec, bytes] = {}


# --8<-- [start:tma_map]
def operand_tma_map(
    t: torch.Tensor, k_contiguous: bool, bmn: int, batch: int, mn: int, k: int, ld: int | None = None, bs: int = 0
) -> TensorMapSpec:
    """The descriptor of one operand viewed as (batch, rows, cols) as stored: rows = MN
    and cols = K when k-contiguous, else the reverse. A box is one stage's tile
    (BMN x 64) or, mn-contiguous, 64 x 64 (the kernel issues BMN/64 copies). Packed by
    default; `ld` and `bs` (elements) give other row and batch strides: split-K's pieces
    are batch entries K/S apart inside the rows of the whole operand (the driver takes a
    batch stride below the row stride), and TMA reads zeros past a piece's K."""
    rows, cols = (mn, k) if k_contiguous else (k, mn)
    bk = tma_bk(t.dtype)
    box_rows, box_cols = (bmn, bk) if k_contiguous else (bk, bk)
    size = t.dtype.itemsize
    ld, bs = (cols if ld is None else ld), (bs or rows * cols)
    strides, box = (ld * size, bs * size), (box_cols, box_rows, 1)
    return TensorMapSpec(t.dtype, t.data_ptr(), (cols, rows, batch), strides, box, l2_promotion=operand_l2_promotion())


def output_tma_map(t: torch.Tensor, batch: int, m: int, n: int) -> TensorMapSpec:
    """The descriptor TMA stores an output through (TMA_STORE): the contiguous
    (batch, M, N) matrix in 64 x 64 boxes, 128-byte swizzled as the epilogue writes them."""
    size = t.dtype.itemsize
    return TensorMapSpec(t.dtype, t.data_ptr(), (n, m, batch), (n * size, m * n * size), (STORE_BOX, STORE_BOX, 1))


# --8<-- [end:tma_map]


# -- the plan -------------------------------------------------------------------------------
def broadcast_stride(name: str, size: int, full: int, stride: int) -> int:
    """The stride of one dim of c: 0 when it broadcasts (size 1), else `stride`."""
    if size == full:
        return stride if full != 1 else 0
    if size == 1:
        return 0
    raise ValueError(f"{name}: c has size {size} where the output has {full} (must be 1 or equal)")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --8<-- [start:launch]
def vector_friendly(out_ptr: int, a, b, m: int, n: int, k: int, ta: bool, tb: bool) -> bool:
    """16-byte global vectors are safe: every stored row length is a multiple of the
    vector and every base pointer is 16-byte aligned (batch offsets then are too).
    `out_ptr`: the output's address (0 for one not allocated yet: torch aligns them)."""
    vw = 16 // a.dtype.itemsize
    a_ld = m if ta else k
    b_ld = k if tb else n
    return (
        a_ld % vw == 0
        and b_ld % vw == 0
        and n % vw == 0
        and a.data_ptr() % 16 == 0
        and b.data_ptr() % 16 == 0
        and out_ptr % 16 == 0
    )


# --8<-- [start:auto]
# AUTO's choice among the TMA kernels, from day 019's kernel-time ladder on the H100 (bf16,
# % of cuBLAS; days/day019/README.md, "Part 2"). A persistent grid (or a grid of
# one-shot blocks) takes the tiles in rounds of one tile per SM, so a problem costs
# about rounds x (the time of one tile), and the tile that wins is the one whose last
# round is full. Candidates, with a tile's time in units of a 128 x 128 tile's:
#   * version 3's 128 x 128 (1.0): the many-tile choice where few tiles exist.
#   * version 4's cooperative 256 x 128 (both consumers on every tile, 128 x 128 each):
#     twice the work at ~1.35x the rate, once the epilogue stored whole 16-byte blocks.
#   * version 4's cooperative 256 x 192 (each consumer 128 x 192, 192 accumulators a
#     thread): three times the work at ~1.25x the rate (its two wgmma column parts read
#     A twice). Worth it where it saves a round: 8192 x 768 outputs (GPT-2's projections
#     and dX) are 192 tiles of 256 x 128 (two rounds on 132 SMs, the second 45% full) but
#     128 of 256 x 192 (one): 82-86% of cuBLAS against 72-73% at K = 2304 and 3072, level
#     at K = 768. GPT-2's QKV (8192 x 2304, K = 768) is 3 rounds of them against 5 of
#     256 x 128: 85-87% of cuBLAS against 82-84% in the stored rows of 5 of the last 6
#     runs on both chips, 86-87% against 83% timed in turn (part 24). Part 2 had priced
#     it at ~1.09x, when it lost there (64% against 76%, before the 16-byte stores).
#   * version 4's cooperative 128 x 192 (each consumer 64 x 192): 1.5 times the work at
#     ~1.07x the rate (day 020, 16384 tokens). For outputs whose 256 x 128 tiles leave SMs
#     idle: a 3072 x 768 dW is 72 of them (55% of 132 SMs) but 96 of these, 72% of cuBLAS
#     against 68%. Last in the list, so near-ties never pick it.
# The 256 x 128 tile stores its epilogue through shared memory by TMA (part 10): level on
# the squares, 1-3 points ahead at K = 768 and 5% on 4096 x 1024 -> 4096 (61.0 -> 58.1
# us); the other tiles have no such form (two column parts) or were not faster with it.
# Near-ties (within 2%) go to the earlier, smaller tile. Examples: a dW of GPT-2
# (768 x 2304, K = 8192) has 108 square tiles (one round) and 54 wide ones: 128 x 128.
AUTO_TILES = (
    ("tma", 128, 128, 1.0),
    ("coop_tma", 256, 128, 2 / 1.35),
    ("coop", 256, 192, 3 / 1.25),
    ("coop", 128, 192, 1.5 / 1.07),
)
# Outputs at most 64 wide (attention's P V and its gradients, d = 64 heads) fill half of
# every tile above; version 4's ping-pong 128 x 64 computes no empty half and overlaps each
# tile's epilogue with the other consumer's k-loop. Measured on the H100 (day 016's block,
# batch x seq x 64, K = seq): 10 us against 19 (512 x 128 x 64), 86 against 89 (96 x 1024
# x 64), 206 against 216 (64 x 2048 x 64): results/nvidia-h100-80gb-hbm3/day016_attention_gemms.txt.
# Since day 019's part 12 its epilogue goes through shared memory and TMA stores
# (PINGPONG_TMA_128x64), which the TMA unit finishes while the consumer goes on: level or
# ahead everywhere (P V at 32 x 128 x 1024: 9.4 -> 8.9 us; day016_attention_gemms_part12.txt).
NARROW_TILE = ("pingpong_tma", 128, 64)
# Where AUTO picks version 3's 128 x 128 for more than one round of tiles with a short K
# (at most two k-steps), each block of version 3 loads, multiplies and stores one tile in
# turn; version 4's ping-pong 128 x 128 overlaps a tile's epilogue with the next one's
# loads and k-steps. Day 016's 512 heads of 128 x 128 x 64: 12.6 us against 17.0
# (day016_attention_gemms.txt); one round or less (96 heads) stays on version 3 (4.6 us
# against 6.0).
# Those tiles are mostly epilogue (a k-step or two, then 32 KB to store), so their
# epilogue also goes through TMA stores (day 019, part 12): the 512 heads' dP 13.6 -> 10.6 us,
# the scores with the mask 17.3 -> 15.8.
SHORT_K = 128
SHORT_K_TILE = ("pingpong_tma", 128, 128)
# Where AUTO picks version 3's 128 x 128 for less than half a round of tiles (a dW with a
# small output: 1024 x 1024 is 64 tiles for 132 SMs), half the SMs idle; the ping-pong
# 128 x 64 (FEW_TILES_TILE) makes twice the tiles and still runs them in one round. Measured
# on the H100, bf16, % of cuBLAS (days/day019/README.md, part 8): dW 1024 x 1024 x 4096
# 54 -> 69%, 1024 x 1024 x 1024 58 -> 70%, 768 x 768 x 1024 48 -> 59%. With more tiles
# (768 x 2304 x 8192: 108) it lost (78 -> 51%), and where AUTO splits K it keeps splitting.
FEW_TILES = 0.5  # of a round
# Day 019, part 19: there, the 128 x 64 tile with TMA stores beat the register epilogue at
# every measured problem (+1 to +10 points of cuBLAS, results/.../day019_few_rows.txt), and
# where 64 x 64 tiles still make one round (a few tokens: 64 x 2304 is 36 of them, 512 x 768
# 96) they beat both: a 128-row tile of 64 tokens multiplies half rows of zeros. 64 tokens:
# 55-62 -> 66-73%; 256 and 512 tokens x 768: 59-71 -> 71-75%. More than a round of them
# lost (256 x 3072: 57 against 77%).
FEW_TILES_TILE = ("pingpong_tma", 128, 64)
FEW_ROWS_TILE = ("pingpong_tma", 64, 64)


def few_tiles_tile(m: int, n: int, batch: int, sms: int) -> tuple[str, int, int]:
    """The FEW_TILES rule's tile: 64 x 64 where those make at most one round, else 128 x 64."""
    return FEW_ROWS_TILE if _cdiv(m, 64) * _cdiv(n, 64) * batch <= sms else FEW_TILES_TILE


# Where AUTO picks version 3's 128 x 128 for one round (more than FEW_TILES of it) with a
# long K, version 4's ping-pong 128 x 128 with TMA stores is faster, though each block has
# one tile and so one busy consumer. Measured on the H100 (bf16, % of cuBLAS, two runs;
# results/nvidia-h100-80gb-hbm3/day019_one_round_tiles.txt): GPT-2's dW 2304 x 768 x 8192
# 75-76 -> 83-84%, 1280 x 1280 x 8192 76 -> 84%, 1536 x 1024 x 8192 90-92 -> 99-101%,
# 1024 x 1536 x 4096 58 -> 67%, 2048 x 1024 x 4096 77 -> 77-81%. At K = 1024 it lost
# (2304 x 768: 81-83 -> 75-77%) and at K = 2048 it was mixed (-2 to +5 points). Since its
# k-loop stopped dividing by 6 (day 019, part 29; H200, results/nvidia-h200/day019_part29.txt)
# it wins from K = 1024: in turn by kernel time in all 21 one-round problems at K = 1024,
# 2048 and 3072 (+2 to +19 points; 2304 x 768 x 2048: 80 -> 94%), end to end from a
# flushed L2 in 19 of them (K = 1024: +1 to +10, level in 1, -2 at 1024 x 2048 x 1024).
ONE_ROUND_LONG_K = 1024
ONE_ROUND_LONG_K_TILE = ("pingpong_tma", 128, 128)
# Split-K (part 3), for few output tiles and a long K (GPT-2's weight gradients): each
# 256 x 128 tile's k-steps are cut into S aligned pieces, one block each, all in one
# wave (stream-K's walk on a grid of tiles x S: its even shares fall on the split
# points). Each piece is stored as float32 in slice s of a (S, batch, M, N) workspace,
# and a second kernel on every SM sums the slices. Fitted to the H100 (e4e6373, dW
# 768 x 768 at S = 1...7): the split GEMM costs SPLIT_K_FIXED k-steps more than its
# pieces' k-steps (its pipeline fill and float32 stores: ~12 us), the sum SPLIT_K_SUM_US
# plus its bytes at SPLIT_K_SUM_GBPS (the slices are still in L2). In AUTO_TILES's unit a
# k-step of a 128 x 128 tile takes K_STEP_US. AUTO splits only where it clearly wins.
K_STEP_US = 0.46
SPLIT_K_FIXED = 25.0
SPLIT_K_SUM_US = 1.7
SPLIT_K_SUM_GBPS = 7500.0
SPLIT_K_MARGIN = 0.9


def split_k(m: int, n: int, k: int, batch: int, sms: int) -> tuple[int, float]:
    """(S, cost): the best split of each 256 x 128 tile's K that still runs in one wave
    (S = 1: none), and its time in AUTO_TILES's unit (a 128 x 128 tile over the whole K)."""
    tiles, num_k = _cdiv(m, 256) * _cdiv(n, 128) * batch, _cdiv(k, 64)
    options = range(1, max(1, min(sms // tiles, num_k)) + 1)

    def sum_steps(s: int) -> float:  # the second kernel, in k-steps
        if s == 1:
            return 0.0
        moved = batch * m * n * (4 * s + 2)  # read the slices, write the output
        return (SPLIT_K_SUM_US + moved / (SPLIT_K_SUM_GBPS * 1e3)) / K_STEP_US

    cost = {s: (_cdiv(num_k, s) * 2 / 1.35 + (SPLIT_K_FIXED if s > 1 else 0) + sum_steps(s)) / num_k for s in options}
    best = min(cost, key=cost.get)
    return best, cost[best]


# Split-K in a cluster (day 019, part 28; CLUSTER_SPLIT_CONFIGS): one round of clusters,
# each one tile whose k-steps its S CTAs share, summed through shared memory. Fitted to
# the H200 (bf16, kernel time, in turn; results/nvidia-h200/day019_cluster_split.txt): a
# CTA's k-step takes CLUSTER_SPLIT_STEP of AUTO_TILES' k-step (K_STEP_US), and a fixed
# CLUSTER_SPLIT_FIXED k-steps more (~7 us: the pipeline's fill, the exchange, the
# epilogue), so that its ratio to split-K's model matches the measured one at 768 x 768 x
# 8192 (23.1 against 25.8 us) and x 16384 (39.8 against 38.0). Below CLUSTER_SPLIT_MIN_K
# the FEW_TILES tiles won on every measured problem (768 x 768 x 2048: 62 against 57% of
# cuBLAS; 1024 x 768 x 2304: 72 against 60%). A cluster sits inside one GPC, so not every
# SMs / S clusters fit at once: cluster_fit asks the driver (cuOccupancyMaxActiveClusters);
# plans made without a GPU (tests) take CLUSTER_FIT_PLANNED, the H200's answer.
CLUSTER_SPLIT_STEP = 0.87
CLUSTER_SPLIT_FIXED = 18.0
CLUSTER_SPLIT_MIN_STEPS = 8  # each CTA walks at least this many k-steps
CLUSTER_SPLIT_MIN_K = 4096
CLUSTER_SPLIT_MARGIN = 0.9  # only where it clearly wins
CLUSTER_FIT_PLANNED = {2: 66, 3: 39, 4: 30}


@cache
def cluster_fit(cluster: int, device_index: int | None) -> int:
    """How many clusters of `cluster` CTAs of split-K in a cluster fit on the device at
    once (CLUSTER_FIT_PLANNED without a GPU)."""
    if device_index is None or device_index < 0 or not torch.cuda.is_available():
        return CLUSTER_FIT_PLANNED[cluster]
    config = next(c for c in CLUSTER_SPLIT_CONFIGS if c[2] == cluster)
    # its first variant (bf16, no transposes, the plain epilogue): every variant of a
    # config takes the same shared memory and threads
    variant = next(_pp_variants(TC_DTYPES[0], config))
    smem = variant[6]
    return direct.loaded(PINGPONG_KERNEL[variant], device_index).max_active_clusters(cluster, PP_THREADS, smem)


def cluster_split(m: int, n: int, k: int, batch: int, sms: int, device_index: int | None = None) -> int:
    """S for split-K in a cluster: the largest of CLUSTER_SPLITS whose clusters of 128 x 128
    tiles make one round (tiles x S CTAs on the SMs, the clusters all resident at once),
    each CTA keeping CLUSTER_SPLIT_MIN_STEPS k-steps; 1 where none does."""
    tiles, num_k = _cdiv(m, 128) * _cdiv(n, 128) * batch, _cdiv(k, 64)
    for s in sorted(CLUSTER_SPLITS, reverse=True):
        if tiles * s <= sms and num_k >= CLUSTER_SPLIT_MIN_STEPS * s and tiles <= cluster_fit(s, device_index):
            return s
    return 1


def cluster_split_cost(k: int, s: int) -> float:
    """Split-K in a cluster's time in AUTO_TILES' unit (a 128 x 128 tile over the whole K)."""
    num_k = _cdiv(k, 64)
    return (_cdiv(num_k, s) * CLUSTER_SPLIT_STEP + CLUSTER_SPLIT_FIXED) / num_k


# Version 3 with three consumers, 192 x 128 (day 019, part 12): 1.5 times the work of a
# 128 x 128 tile at ~1.2x the rate, but only where its tiles fit one round and K is long.
# Measured on the H100 (bf16, % of cuBLAS): dW 3072 x 1024 x 4096 97% (128 tiles; 256 x 128:
# 96 tiles, 79%), dW 3072 x 768 x 16384 and 768 x 3072 x 16384 87% (96 tiles; AUTO's
# 128 x 192 and 256 x 128: 80-81%). With K = 768-1024 and several rounds it lost (62-75%):
# version 3 overlaps no epilogue with the next tile.
ONE_ROUND_TILE = ("tma", 192, 128, 1.5 / 1.2)
ONE_ROUND_MIN_K = 2048


def auto_tile(
    m: int,
    n: int,
    k: int,
    batch: int,
    sms: int,
    plain_epilogue: bool = True,
    tiles=AUTO_TILES,
    device_index: int | None = None,
) -> tuple[str, int, int]:
    """(kind, BM, BN) of the TMA kernel AUTO runs for this problem. `plain_epilogue`:
    out = alpha A B + beta c, which split-K and version 3 also serve (the fused linear
    layer's epilogues are version 4's only); `tiles`: the candidates; `device_index`:
    whose clusters split-K in a cluster counts (cluster_fit)."""
    if n <= NARROW_TILE[2] and tiles is AUTO_TILES:
        return NARROW_TILE
    plain_auto = plain_epilogue and (tiles is AUTO_TILES or tiles is F32_AUTO_TILES)
    if plain_auto and k >= ONE_ROUND_MIN_K:
        if _cdiv(m, ONE_ROUND_TILE[1]) * _cdiv(n, ONE_ROUND_TILE[2]) * batch <= sms:
            tiles = (*tiles, ONE_ROUND_TILE)  # last: near-ties go to the others
    cost = [_cdiv(_cdiv(m, bm) * _cdiv(n, bn) * batch, sms) * t for _, bm, bn, t in tiles]
    best = min(cost)
    kind, bm, bn, _ = tiles[next(i for i, c in enumerate(cost) if c <= 1.02 * best)]
    tiles128 = _cdiv(m, 128) * _cdiv(n, 128) * batch
    few = kind == "tma" and bm == 128 and tiles128 <= FEW_TILES * sms
    one_round_long_k = kind == "tma" and bm == 128 and not few and tiles128 <= sms and k >= ONE_ROUND_LONG_K
    unsplit = one_round_long_k and k >= ONE_ROUND_UNSPLIT_K  # one round beats split-K there (parts 26, 29)
    cs = cluster_split(m, n, k, batch, sms, device_index) if plain_auto and k >= CLUSTER_SPLIT_MIN_K else 1
    cluster_cost = cluster_split_cost(k, cs) if cs > 1 else best
    if plain_epilogue and not unsplit:
        s, split_cost = split_k(m, n, k, batch, sms)
        if s > 1 and split_cost < SPLIT_K_MARGIN * best and split_cost < cluster_cost:
            return "coop_splitk", 256, 128
    if cs > 1 and cluster_cost < CLUSTER_SPLIT_MARGIN * best:
        return "cluster_splitk", 128, 128
    if few:
        return few_tiles_tile(m, n, batch, sms)  # under half a round: more tiles, every SM busy
    if one_round_long_k:
        return ONE_ROUND_LONG_K_TILE  # one round, long k-loops
    if kind == "tma" and k <= SHORT_K and tiles128 > sms:
        return SHORT_K_TILE  # more than a round of short tiles: overlap their epilogues
    return kind, bm, bn


# the candidates for a float32 output: AUTO_TILES' cooperative tiles with an F32_OUT variant
# (a float32 output has no TMA_STORE form: "coop_tma" runs as "coop" there)
F32_AUTO_TILES = tuple(
    ("coop", *t[1:]) for t in AUTO_TILES if t[0].startswith("coop") and (*t[1:3], 1, True, 0) in PP_F32_CONFIGS
)


# --8<-- [end:auto]
@cache
def sm_count(device_index: int | None) -> int:
    """Streaming multiprocessors of the device: a persistent kernel's grid. Plans also run
    on a CPU (tests, no GPU): there the H100's 132 stand in."""
    if device_index is None or device_index < 0 or not torch.cuda.is_available():
        return SMALL_GRID
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_k_sum_launch(kernel, args: tuple, out, bias: torch.Tensor | None = None) -> direct.Launch:
    """The launch of a split_k_sum_kernel variant: 4 outputs a thread, a few blocks per SM.
    `args` is (dst, ws, c, alpha_beta, m, n, batch, splits, c_bs, c_rs, c_cs); `bias`, a
    row added to every output row (with c: a linear layer's bias and residual)."""
    outputs = args[4] * args[5] * args[6]
    grid = max(1, min(_cdiv(outputs // 4, SPLIT_K_SUM_THREADS), 8 * sm_count(out.get_device())))
    bias_args = (0,) if bias is None else (bias.data_ptr(),)
    args = (*args[:4], *bias_args, *args[4:], int(bias is not None))
    return direct.Launch(kernel, grid, SPLIT_K_SUM_THREADS, args)


def c_fits_blocks(c: torch.Tensor, c_bs: int, c_rs: int, c_cs: int, n: int) -> bool:
    """Whether version 4 may read `c` in 16-byte blocks (C_BLOCKS, day 019 part 16): full
    (rows of at least n), row-major, 16-byte aligned. A residual, attention's mask. A row
    (MojoGEMM's bias) or any other c is read in pairs: a row in blocks measured level or
    1-2 us slower."""
    size = c.element_size()
    return (
        _c_blocks.value
        and c_cs == 1
        and c_rs >= n
        and (c_rs * size) % 16 == 0
        and (c_bs * size) % 16 == 0
        and c.data_ptr() % 16 == 0
    )


def pingpong_launch(
    a,
    b,
    out,
    c,
    alpha_beta,
    bias,
    aux,
    sizes,
    ta,
    tb,
    kind: str,
    bm: int,
    bn: int,
    gelu=False,
    gelu_grad=False,
    aux_derivative=False,
    column_sums=None,
    epi_warps=False,
    gelu_grad_pre=False,
) -> list[direct.Launch]:
    """Version 4's launch: a persistent grid of at most one block per SM. `sizes` is
    (m, n, k, batch, c_bs, c_rs, c_cs); `bias` and `aux` may be None (not read/written).
    With `gelu`, aux gets the pre-activation, or with `aux_derivative` GELU's derivative
    there; `gelu_grad` multiplies the product by c (such a derivative) instead of adding c.
    `kind` is one of V4_KINDS: "multicast" and "coop_multicast" ask for clusters of 2 CTAs
    sharing A's tile, where the tiles along n pair up (an even count; else one CTA per
    cluster); "coop" and "coop_multicast" have both consumers split every tile;
    "coop_streamk" shares the k-steps of all tiles evenly among one block per SM
    (stream-K: a float32 workspace for the pieces of split tiles, a zeroed counter per
    tile and warp), "coop_splitk" cuts each tile's into `split_k`'s S pieces on a grid
    of tiles x S and adds the launch that sums them; "cluster_splitk" (plain epilogue)
    gives each tile a cluster of `cluster_split`'s S CTAs that share its k-steps and sum
    in shared memory, or where no S makes one round, runs the cooperative 256 x 128. A float32 `out` (16-bit operands)
    takes the F32_OUT variants (PP_F32_CONFIGS) or, split, the sum kernel's.
    `column_sums`, an (n,) vector (float32 or out's dtype): with `gelu_grad` and kind
    "coop_tma" or "pingpong_tma" only, it gets out's column sums over all rows and matrices (a bias
    gradient): the epilogue writes per-warp partial sums, day 013's sum_partials_kernel
    adds them up. `epi_warps`: a GELU epilogue may run on the producer warpgroup's idle
    warps (EPI_WARPS, PP_EPI_WARPS_CONFIGS' tiles): the caller's c is not read (beta 0);
    or GELU_GRAD's (c full rows of n, 16-byte aligned; neither operand transposed).
    `gelu_grad_pre` (with `gelu_grad`): c is GELU's input, not its derivative; only the
    epilogue warps compute the derivative from it, so the launch must take them and
    raises where it cannot."""
    m, n, k, batch = sizes[:4]
    dtype = a.dtype
    sms = sm_count(out.get_device())
    cluster = 2 if kind.endswith("multicast") and _cdiv(n, bn) % 2 == 0 else 1
    if kind == "cluster_splitk":
        if bias is not None or gelu or gelu_grad:
            raise ValueError("pingpong_launch: split-K in a cluster has the plain epilogue only")
        cluster = cluster_split(m, n, k, batch, sms, out.get_device())
        if cluster == 1:  # no cluster of it makes one round: whole tiles
            kind, bm, bn = "coop", 256, 128
    tiles = _cdiv(m, bm) * _cdiv(n, bn) * batch
    coop = kind.startswith("coop")
    split = {"coop_streamk": 1, "coop_splitk": 2, "cluster_splitk": 3}.get(kind, 0)
    red = cluster_split_bytes(bm, bn, cluster) if split == 3 else 0
    # a multicast cluster's CTAs load half of A's tile each, in 64-row boxes
    a_map = operand_tma_map(a, not ta, 64 if cluster > 1 and split != 3 else bm, batch, m, k)
    b_map = operand_tma_map(b, tb, bn, batch, n, k)
    epilogue = (bias is not None, gelu, gelu_grad)
    f32_out = out.dtype == torch.float32 and split != 2  # split-K: the sum kernel writes out
    # TMA stores write 16-bit outputs only (the 16-byte row pitch their maps need, N % 8
    # == 0, is the register epilogue's condition too: the plans check it before this)
    tma_store = kind.endswith("_tma") and not f32_out
    if column_sums is not None and not (gelu_grad and tma_store):
        raise ValueError(f"pingpong_launch: column sums come with gelu_grad on TMA-store tiles, not {kind}")
    # whether this launch's variant and operands allow the epilogue warps at all
    warps_fit = (
        tma_store
        and (bm, bn, cluster, coop, split) in PP_EPI_WARPS_CONFIGS
        and bm * n < 2**31  # the epilogue warps' 32-bit offsets inside a tile
        and (
            (gelu and (ta, tb) == (False, True))
            or (gelu_grad and (ta, tb) == (False, False) and _epi_grad_reads(c, sizes))
        )
    )
    if gelu_grad_pre and not (gelu_grad and warps_fit):
        raise ValueError(
            f"pingpong_launch: GELU's gradient from its input runs on the epilogue warps only "
            f"({PP_EPI_WARPS_CONFIGS[0][:2]} cooperative TMA-store tiles, neither operand transposed, the "
            f"input full, 16-byte aligned rows); not {kind} {bm} x {bn}, transposes {(ta, tb)}"
        )
    if not gelu_grad_pre and _epi_warps.value == "auto":  # where they measured faster (day 019, parts 22-23)
        epi_warps = epi_warps and k <= EPI_WARPS_MAX_K and tiles >= EPI_WARPS_MIN_ROUNDS * sms
        epi_warps = epi_warps and (EPI_WARPS_DERIVATIVE or not aux_derivative)
        epi_warps = epi_warps and (EPI_WARPS_GRAD or not gelu_grad)
    epi_warps = gelu_grad_pre or (epi_warps and _epi_warps.value is not False and warps_fit)
    out_map = aux_map = a_map  # unused without TMA_STORE, and by the epilogue warps' stores
    if tma_store and not epi_warps:
        out_map = aux_map = output_tma_map(out, batch, m, n)
        if aux is not None:
            aux_map = output_tma_map(aux, batch, m, n)
    stages = pp_stages(dtype, bm, bn, tma_store, epi_warps, red)
    smem = pp_smem_bytes(dtype, bm, bn, tma_store, epi_warps, stages, red)
    flags = (*epilogue, cluster, coop, split, f32_out, tma_store)
    # c in 16-byte blocks where it fits and the variant exists (PP_C_BLOCKS_EPILOGUES)
    c_blocks = c_fits_blocks(c, *sizes[4:7], n) and not epi_warps
    c_blocks = c_blocks and (dtype, ta, tb, bm, bn, stages, smem, *flags, True, False) in PINGPONG_KERNEL
    kernel = PINGPONG_KERNEL[dtype, ta, tb, bm, bn, stages, smem, *flags, c_blocks, epi_warps]
    units = _cdiv(m, bm) * _cdiv(n, bn * cluster) * batch  # what one cluster takes at a time
    blocks = sms  # at most one per SM
    pieces = 1
    if split == 2:  # tiles x S blocks: the even shares fall on the split points
        pieces = split_k(m, n, k, batch, sms)[0]
        units *= pieces
        blocks = units
    elif split == 1:  # every SM, each with at least one k-step
        units *= _cdiv(k, tma_bk(dtype))
    elif split == 3:  # a cluster a tile (cluster_split made sure they fit)
        units = tiles
    grid = min(units, blocks // cluster) * cluster
    dummy = out.data_ptr()  # a pointer the kernel's compile-time flags say it never touches
    partials = counters = dummy
    if split == 1:
        partials = direct.scratch((grid, 2, bm * bn), torch.float32, out.device).data_ptr()
        counters = direct.scratch((tiles, 8), torch.int32, out.device, zeroed=True).data_ptr()
    elif split == 2:
        partials = direct.scratch((pieces, batch, m, n), torch.float32, out.device).data_ptr()
    sums = None
    if column_sums is not None:  # a row per warp of each consumer's rows of a tile (gemm_v4_pingpong)
        rows = batch * _cdiv(m, bm // 2 if coop else bm) * 4
        if epi_warps:  # ... or per group of the epilogue warps' rows (gelu_grad_tile)
            rows = batch * _cdiv(m, bm) * epi_sum_groups(dtype, bn)
        sums = direct.scratch((rows, n), torch.float32, out.device)
        partials = sums.data_ptr()
    ptrs = (
        out.data_ptr(),
        c.data_ptr(),
        alpha_beta.data_ptr(),
        dummy if bias is None else bias.data_ptr(),
        dummy if aux is None else aux.data_ptr(),
        partials,
        counters,
    )
    store_aux = 0 if aux is None else 2 if aux_derivative else 1
    if gelu_grad:  # GELU_GRAD has no aux of its own: bit 0 asks for the sums, bit 1 says c is pre
        store_aux = (sums is not None) | (2 * gelu_grad_pre)
    args = (a_map, b_map, out_map, aux_map, *ptrs, *sizes, store_aux)
    launches = [direct.Launch(kernel, grid, PP_THREADS, args, smem, cluster if cluster > 1 else None)]
    if sums is not None:
        launches.append(sum_partials_launch(sums, column_sums))
    if split == 2:  # the second kernel: 4 outputs a thread, a few blocks per SM
        sum_args = (out.data_ptr(), partials, c.data_ptr(), alpha_beta.data_ptr(), m, n, batch, pieces, *sizes[4:])
        launches.append(split_k_sum_launch(SPLIT_K_SUM_KERNEL[dtype, out.dtype], sum_args, out))
    return launches


# --8<-- [start:simt_split]
# fp32 weight gradients (dW = dY^T X: few output tiles, K = the tokens) left most SMs idle:
# 768 x 768 x 8192 is 36 tiles of 128 x 128 for 132 SMs, and ran at 37% of cuBLAS (day 016,
# part six). Split-K: S pieces of K / S each, as a batch of S GEMMs (the SIMT kernel's
# batch strides step along K; its row strides stay those of the whole operands), into a
# float32 workspace (S, M, N); day 019's sum kernel then adds the pieces in order and
# applies alpha, beta and c. For these, S minimises the time in rounds of full-K 128 x 128
# blocks (one block per SM: 168+ registers a thread): rounds(S) / S, plus the workspace's
# traffic (S M N float32 written and read) in the same unit. On the H100 a round takes
# K x 128^2 x 2 flops at ~0.34 TFLOP/s per SM and the workspace moves at ~3 TB/s, so an
# element of it costs SIMT_SPLIT_WS / K rounds.
SIMT_SPLIT_MAX = 16
SIMT_SPLIT_MIN_K = 512  # each piece keeps at least this much of K
SIMT_SPLIT_WS = 2.8e-5


def simt_split_k(m: int, n: int, k: int, sms: int) -> int:
    """S for a float32 GEMM whose operands both run along K in memory (1: no split)."""
    tiles = _cdiv(m, SIMT_LARGE[0]) * _cdiv(n, SIMT_LARGE[0])

    def cost(s: int) -> float:
        return _cdiv(tiles * s, sms) / s + (s * m * n * SIMT_SPLIT_WS / k if s > 1 else 0.0)

    options = [s for s in range(2, SIMT_SPLIT_MAX + 1) if k % s == 0 and k // s >= SIMT_SPLIT_MIN_K]
    best = min(options, key=cost, default=1)
    if tiles < SMALL_GRID:  # unsplit, these would run as 64 x 64 tiles (37-47% of cuBLAS)
        return best
    return best if cost(best) < SPLIT_K_MARGIN * cost(1) else 1  # only where it clearly wins


# A linear layer at a few dozen tokens has the opposite shape: M small, K long. At 64
# tokens, 64 x 768 x 3072 (the MLP's dX) is 12 tiles of 64 x 64 for 132 SMs, each walking
# all of K: 139 us against cuBLAS's 18 (day 016's float32 block at 1 x 64 x 768 spent 687
# of its 1232 us there). These split on 64 x 64 tiles, S chosen by a cost model fitted on
# the H100 to the sweep of S at 64-256 tokens (days/day014/time_fp32.py --pieces,
# results/.../day014_fp32_few_tokens.txt; it picks the measured best S to within 4%, 0.3%
# in the geometric mean): a block takes K / S k-steps of SIMT_K_STEP_US when alone on its
# SM, and each more block on the busiest SM adds SIMT_SHARED_SM of that; the workspace
# costs its S M N float32, written and read, at SIMT_SPLIT_GBPS. Only for grids of at
# most 2 blocks per SM unsplit: the sweep's range (192 tiles at most).
SIMT_K_STEP_US = 0.04
SIMT_SHARED_SM = 0.7
SIMT_SPLIT_GBPS = 3000.0
SIMT_SMALL_SPLIT_MAX = 24  # the sweep's largest S
SIMT_SMALL_SPLIT_MIN_K = 64


def simt_small_split_us(m: int, n: int, k: int, pieces: int, sms: int) -> float:
    """The model's time of a 64 x 64-tile SIMT GEMM in `pieces` pieces of K (plus its sum)."""
    tiles = _cdiv(m, SIMT_SMALL[0]) * _cdiv(n, SIMT_SMALL[0])
    busiest = _cdiv(tiles * pieces, sms)
    work = k / pieces * SIMT_K_STEP_US * (1 + SIMT_SHARED_SM * (busiest - 1))
    return work + (pieces * m * n * 8 / (SIMT_SPLIT_GBPS * 1e3) if pieces > 1 else 0.0)


def simt_small_split(m: int, n: int, k: int, sms: int) -> int:
    """S for a float32 GEMM of at most two 64 x 64 tiles per SM (1: no split)."""
    if _cdiv(m, SIMT_SMALL[0]) * _cdiv(n, SIMT_SMALL[0]) > 2 * sms:
        return 1
    options = [s for s in range(2, SIMT_SMALL_SPLIT_MAX + 1) if split_fits(k, s) and k // s >= SIMT_SMALL_SPLIT_MIN_K]
    return min([1, *options], key=lambda s: simt_small_split_us(m, n, k, s, sms))


def split_fits(k: int, pieces: int) -> bool:
    """Equal pieces of K whose starts keep 16-byte alignment (float32)."""
    return k % pieces == 0 and (k // pieces) % 4 == 0


def piece_strides(m: int, n: int, k: int, ks: int, ta: bool, tb: bool) -> tuple[int, int, int, int]:
    """(a_ld, b_ld, a_bs, b_bs) of split-K's pieces of `ks`, in elements: the row strides of
    the whole (packed) operands, and the batch strides from one piece to the next: `ks`
    rows down an operand stored (K, MN), `ks` columns into one stored (MN, K)."""
    return (m if ta else k), (k if tb else n), (ks * m if ta else ks), (ks if tb else ks * n)


def simt_split_launches(out, ptrs, sizes, pieces: int, ta: bool, tb: bool, config) -> list[direct.Launch]:
    """The pieces (the SIMT kernel on a batch of S, alpha 1, beta 0, into the workspace),
    then the sum kernel (alpha * sum + beta * c into out). `ptrs`: the op's (out, a, b, c,
    alpha_beta); `sizes`: (m, n, k, c_rs, c_cs); `config`: the SIMT tile (BM, BK, TM)."""
    m, n, k, c_rs, c_cs = sizes
    ks = k // pieces
    a_ld, b_ld, a_bs, b_bs = piece_strides(m, n, k, ks, ta, tb)
    ws = direct.scratch((pieces, m, n), torch.float32, out.device)
    plain = device_constant((1.0, 0.0), torch.float32, out.device)
    bm, bk, tt = config
    kernel = SIMT_KERNEL[torch.float32, ta, tb, True, bm, bm, bk, tt, tt]
    piece_args = (ws.data_ptr(), ptrs[1], ptrs[2], ptrs[3], plain.data_ptr(), m, n, ks, a_bs, b_bs, 0, 0, 0)
    grid = (_cdiv(m, bm) * _cdiv(n, bm), 1, pieces)
    sum_args = (ptrs[0], ws.data_ptr(), ptrs[3], ptrs[4], m, n, 1, pieces, 0, c_rs, c_cs)
    return [
        direct.Launch(kernel, grid, SIMT_THREADS, (*piece_args, a_ld, b_ld)),
        split_k_sum_launch(SPLIT_K_SUM_KERNEL[torch.float32, torch.float32], sum_args, out),
    ]


# --8<-- [end:simt_split]


def tma_launch(a, b, out, c, alpha_beta, sizes, ta: bool, tb: bool, bm: int, bn: int) -> list[direct.Launch]:
    """Version 3's launch: a block per BM x BN tile of each matrix, a producer warpgroup and
    one consumer per 64 rows. `sizes` is (m, n, k, batch, c_bs, c_rs, c_cs); a float32 `out`
    from 16-bit operands takes the F32_OUT variant (TMA_F32_TILE, A transposed)."""
    m, n, k, batch, c_bs, c_rs, c_cs = sizes
    a_map = operand_tma_map(a, not ta, bm, batch, m, k)
    b_map = operand_tma_map(b, tb, bn, batch, n, k)
    kernel = TMA_KERNEL[_tma_variant(a.dtype, ta, tb, bm, bn, out.dtype != a.dtype)]
    args = (a_map, b_map, out.data_ptr(), c.data_ptr(), alpha_beta.data_ptr(), m, n, k, c_bs, c_rs, c_cs)
    grid = (_cdiv(m, bm) * _cdiv(n, bn), 1, batch)
    return [direct.Launch(kernel, grid, (1 + bm // 64) * WG_THREADS, args, smem_of(kernel))]


# --8<-- [start:tma_split]
# The sweep of S on the H100 (days/day019/time_few_tokens.py, results/.../
# day019_few_tokens_split.txt): a piece costs ~5 us (its block, the sum kernel) plus ~0.25
# us a k-step, and a block of 196 KiB of stages has its SM to itself. So the split won only
# where K is long (2304 and 3072: 64 x 768 x 3072 11.1 -> 7.4 us; at K = 768 it lost at
# every S), with pieces of at least FEW_TOKEN_PIECE_K and one wave of blocks (at 1024
# tokens, two pieces already lost). The rule below is that, fitted by hand to those rows.
FEW_TOKEN_MIN_K = 2048
FEW_TOKEN_PIECE_K = 384  # six k-steps of 64


def few_token_pieces(m: int, n: int, k: int, sms: int) -> int:
    """S for a 16-bit GEMM of batch 1 (1: AUTO's tile, no split): the most pieces of at
    least FEW_TOKEN_PIECE_K that keep one block per SM, where K >= FEW_TOKEN_MIN_K and the
    unsplit tiles fill at most half the SMs. `split_pieces` overrides it."""
    forced = forced_pieces(k, tma_split_fits)
    if forced is not None:
        return forced
    tiles = _cdiv(m, TMA_SPLIT_TILE[0]) * _cdiv(n, TMA_SPLIT_TILE[1])
    if k < FEW_TOKEN_MIN_K or 2 * tiles > sms:
        return 1
    options = [s for s in range(2, sms // tiles + 1) if tma_split_fits(k, s) and k // s >= FEW_TOKEN_PIECE_K]
    return max(options, default=1)


def tma_split_launches(
    out, a, b, c, alpha_beta, sizes, ta: bool, tb: bool, pieces: int, bias: torch.Tensor | None = None
) -> list[direct.Launch]:
    """A 16-bit GEMM of few output tiles in `pieces` pieces of K: version 3 on 128 x 64
    tiles, batch entry s reading K/S of K from s K/S on (strided tensor maps) into a
    float32 workspace (S, M, N), then day 019's sum kernel (alpha, beta, c, and a `bias`
    row where given) into out."""
    m, n, k, c_bs, c_rs, c_cs = sizes
    ks = k // pieces
    bm, bn = TMA_SPLIT_TILE
    a_ld, b_ld, a_bs, b_bs = piece_strides(m, n, k, ks, ta, tb)
    a_map = operand_tma_map(a, not ta, bm, pieces, m, ks, a_ld, a_bs)
    b_map = operand_tma_map(b, tb, bn, pieces, n, ks, b_ld, b_bs)
    ws = direct.scratch((pieces, m, n), torch.float32, out.device)
    plain = device_constant((1.0, 0.0), torch.float32, out.device)
    kernel = TMA_KERNEL[_tma_variant(a.dtype, ta, tb, bm, bn, f32_out=True)]
    args = (a_map, b_map, ws.data_ptr(), c.data_ptr(), plain.data_ptr(), m, n, ks, 0, 0, 0)
    grid = (_cdiv(m, bm) * _cdiv(n, bn), 1, pieces)
    sum_args = (out.data_ptr(), ws.data_ptr(), c.data_ptr(), alpha_beta.data_ptr(), m, n, 1, pieces, c_bs, c_rs, c_cs)
    return [
        direct.Launch(kernel, grid, (1 + bm // 64) * WG_THREADS, args, smem_of(kernel)),
        split_k_sum_launch(SPLIT_K_SUM_KERNEL[a.dtype, out.dtype], sum_args, out, bias),
    ]


def tma_split_fits(k: int, pieces: int) -> bool:
    """Equal pieces of K whose starts keep the tensor maps' 16-byte strides (16-bit)."""
    return k % pieces == 0 and (k // pieces) % 8 == 0


# --8<-- [end:tma_split]


def smem_of(kernel) -> int:
    """A version 3 variant's dynamic shared memory (its SMEM parameter, the last)."""
    return kernel.params[-1]


# --8<-- [start:tf32x3]
# float32 on tensor cores (day 019, part 9): each operand is split into tf32 planes, hi
# and lo (days/day019/tf32_split.mojo, which also transposes it k-major), and version 3's
# kernel multiplies lo*hi + hi*lo + hi*hi in three passes over K, 128 x 128 tiles.
# AUTO runs it where a cost model fitted on the H100 says it beats the SIMT kernel: the
# split costs its bytes (4 read, 8 written an element of A and B) at TF32X3_SPLIT_GBPS;
# the GEMM its float32 flops at TF32X3_TFLOPS times the last round's fill (a round is one
# tile per SM); the SIMT kernel runs at SIMT_TFLOPS (SIMT_SMALL_TFLOPS on 64 x 64 tiles).
# So attention's P V (K = the sequence, N = 64: splitting P costs more than its product
# saves) and a small weight gradient (36 tiles for 132 SMs) stay on the SIMT kernel.
SIMT_TFLOPS = 40.0
SIMT_SMALL_TFLOPS = 30.0  # its 64 x 64 tiles (1024^3: 72 us, against 59 for 3xTF32)
TF32X3_TFLOPS = 88.0
TF32X3_SPLIT_GBPS = 2500.0


def tf32x3_pays(m: int, n: int, k: int, batch: int, sms: int, simt_small: bool = False) -> bool:
    """Is 3xTF32 faster than the SIMT kernel here? (`simt_small`: the SIMT kernel would
    run its 64 x 64 tiles, at SIMT_SMALL_TFLOPS.)"""
    flops = 2.0 * m * n * k * batch
    tiles = _cdiv(m, TF32X3_TILE[0]) * _cdiv(n, TF32X3_TILE[1]) * batch
    fill = tiles / (_cdiv(tiles, sms) * sms)
    split_s = 12.0 * (m + n) * k * batch / (TF32X3_SPLIT_GBPS * 1e9)
    simt_tflops = SIMT_SMALL_TFLOPS if simt_small else SIMT_TFLOPS
    return flops / (TF32X3_TFLOPS * 1e12 * fill) + split_s < flops / (simt_tflops * 1e12)


def float_kernel(
    m: int, n: int, k: int, batch: int, ta: bool, tb: bool, vec: bool, dtype: torch.dtype, sms: int, tf32x3: bool
) -> tuple[str, int]:
    """AUTO's float32 / float64 choice: ("tf32x3", 1), ("simt_small" or "simt_large", S),
    S > 1 being the SIMT kernel's split-K (`tf32x3`: may 3xTF32 run).

    The SIMT kernel splits K on 128 x 128 tiles where both operands run along K in memory
    (a weight gradient), and on 64 x 64 tiles where M N is small and K long; otherwise it
    runs 64 x 64 tiles under a round of 128 x 128 ones, or for an output at most 64 wide
    (attention's P V, d = 64 heads: half of each 128 x 128 tile would be empty)."""
    splits = dtype == torch.float32 and vec and batch == 1
    forced = forced_pieces(k, split_fits) if splits else None
    pieces = 1
    if forced is not None:
        pieces = forced
    elif splits and ta and not tb:
        pieces = simt_split_k(m, n, k, sms)
    small = _cdiv(m, 128) * _cdiv(n, 128) * batch < SMALL_GRID or min(m, n) <= SIMT_SMALL[0]
    if tf32x3 and tf32x3_pays(m, n, k, batch, sms, small and pieces == 1):
        return "tf32x3", 1
    if pieces > 1:
        return ("simt_large" if ta and not tb else "simt_small"), pieces
    if splits and forced is None:  # after 3xTF32's choice, whose model has the unsplit SIMT kernel
        pieces = simt_small_split(m, n, k, sms)
    return ("simt_small" if small or pieces > 1 else "simt_large"), pieces


def tf32x3_fits(m: int, n: int, k: int, out_ptr: int) -> bool:
    """Can the 3xTF32 launches run this float32 problem? (8-byte pair stores, a split
    grid's y <= 65535 tiles, and no empty tensor map.)"""
    return m > 0 and n > 0 and k > 0 and n % 2 == 0 and out_ptr % 8 == 0 and max(m, n) <= TF32_SPLIT_TILE * 65535


def simt_choice(
    m: int, n: int, k: int, batch: int, ta: bool, tb: bool, vec: bool, dtype: torch.dtype, device, out_ptr: int
) -> tuple[tuple | None, int]:
    """The float32 / float64 plan's choice under the current version: the SIMT kernel's
    tile config (BM, BK, TM) and its pieces of K, or (None, 1) for 3xTF32. `out_ptr`: as
    in vector_friendly."""
    kind = VERSIONS[_version.value][0]
    fits = dtype == torch.float32 and kind != "simt" and tf32x3_fits(m, n, k, out_ptr)
    choice, pieces = float_kernel(m, n, k, batch, ta, tb, vec, dtype, sm_count(device), fits)
    if choice == "tf32x3" or (fits and kind == "tf32x3"):
        return None, 1
    return (SIMT_FP64 if dtype == torch.float64 else SIMT_SMALL if choice == "simt_small" else SIMT_LARGE), pieces


def tf32_planes(x: torch.Tensor, k_contiguous: bool, mn: int, k: int, batch: int, bs: int, bmn: int):
    """The split launch of one operand and the tensor map of its planes (2 batch, MN, K)."""
    kp = _cdiv(k, 4) * 4  # 16-byte rows for the tensor map
    planes = direct.scratch((batch, 2, mn, kp), torch.float32, x.device)
    grid = (_cdiv(k, TF32_SPLIT_TILE), _cdiv(mn, TF32_SPLIT_TILE), batch)
    args = (planes.data_ptr(), x.data_ptr(), mn, k, kp, bs)
    split = direct.Launch(TF32_SPLIT_KERNEL[k_contiguous], grid, TF32_SPLIT_THREADS, args)
    dims, strides, box = (k, mn, 2 * batch), (kp * 4, mn * kp * 4), (32, bmn, 1)
    spec = TensorMapSpec(torch.float32, planes.data_ptr(), dims, strides, box, l2_promotion=operand_l2_promotion())
    return split, spec


def tf32x3_launches(out, a, b, c, alpha_beta, sizes, ta: bool, tb: bool) -> list[direct.Launch]:
    m, n, k, a_bs, b_bs, c_bs, c_rs, c_cs = sizes
    batch = a.shape[0] if a.dim() == 3 else 1
    bm, bn = TF32X3_TILE
    split_a, a_map = tf32_planes(a, not ta, m, k, batch, a_bs, bm)
    split_b, b_map = tf32_planes(b, tb, n, k, batch, b_bs, bn)
    kernel = TMA_KERNEL[_tma_variant(torch.float32, False, True, bm, bn)]
    args = (a_map, b_map, out.data_ptr(), c.data_ptr(), alpha_beta.data_ptr(), m, n, k, c_bs, c_rs, c_cs)
    grid = (_cdiv(m, bm) * _cdiv(n, bn), 1, batch)
    return [split_a, split_b, direct.Launch(kernel, grid, (1 + bm // 64) * WG_THREADS, args, smem_of(kernel))]


# --8<-- [end:tf32x3]
@direct.plan(SIMT_KERNEL, TC_KERNEL, WG_KERNEL, TMA_KERNEL, PINGPONG_KERNEL, SPLIT_K_SUM_KERNEL, TF32_SPLIT_KERNEL)
def gemm_gpu(outputs, inputs, params) -> list[direct.Launch]:
    """One launch: grid (output tiles, 1, batch) for versions 1-3 (tiles walked in groups
    of 8 tile rows inside the kernel, tile_coords, so the grid is flat in x), or day 019's
    persistent grid of at most one block per SM (pingpong_launch; split-K adds a second
    launch that sums the pieces)."""
    (out,), (a, b, c, alpha_beta) = outputs, inputs
    ta, tb = params["TRANSPOSE_A"], params["TRANSPOSE_B"]
    batched = a.dim() == 3
    name = "gemm_batched" if batched else "gemm"
    m, k = (a.shape[-1], a.shape[-2]) if ta else (a.shape[-2], a.shape[-1])
    k2, n = (b.shape[-1], b.shape[-2]) if tb else (b.shape[-2], b.shape[-1])
    if k2 != k:
        raise ValueError(f"{name}: inner dims differ: op(a) is {m}x{k}, op(b) is {k2}x{n}")
    batch = a.shape[0] if batched else 1
    if batch > MAX_BATCH:
        raise ValueError(f"{name}: batch {batch} > {MAX_BATCH} is not supported on the GPU")
    if batched:
        c_cs = broadcast_stride(name, c.shape[2], n, 1)
        c_rs = broadcast_stride(name, c.shape[1], m, c.shape[2])
        c_bs = broadcast_stride(name, c.shape[0], batch, c.shape[1] * c.shape[2])
        a_bs, b_bs = m * k, k * n
    else:
        c_rs = broadcast_stride(name, c.shape[0], m, c.shape[1])
        c_cs = broadcast_stride(name, c.shape[1], n, 1)
        c_bs = a_bs = b_bs = 0
    dtype = a.dtype
    vec = vector_friendly(out.data_ptr(), a, b, m, n, k, ta, tb)
    tiles128 = _cdiv(m, 128) * _cdiv(n, 128) * batch
    small = tiles128 < SMALL_GRID
    ptrs = (out.data_ptr(), a.data_ptr(), b.data_ptr(), c.data_ptr(), alpha_beta.data_ptr())
    sizes = (m, n, k, a_bs, b_bs, c_bs, c_rs, c_cs)

    def tiled(kernel, bm, bn, threads, smem=0, args=ptrs + sizes):
        return [direct.Launch(kernel, (_cdiv(m, bm) * _cdiv(n, bn), 1, batch), threads, args, smem)]

    kind, bm, bn = VERSIONS[_version.value]
    if dtype not in TC_DTYPES:  # float32 (3xTF32 or SIMT), float64 (SIMT)
        config, pieces = simt_choice(m, n, k, batch, ta, tb, vec, dtype, out.get_device(), out.data_ptr())
        if config is None:
            return tf32x3_launches(out, a, b, c, alpha_beta, sizes, ta, tb)
        if pieces > 1:
            return simt_split_launches(out, ptrs, (m, n, k, c_rs, c_cs), pieces, ta, tb, config)
        bm, bk, tt = config
        lds = piece_strides(m, n, k, k, ta, tb)[:2]  # one piece: the whole, packed operands
        return tiled(SIMT_KERNEL[dtype, ta, tb, vec, bm, bm, bk, tt, tt], bm, bm, SIMT_THREADS, args=ptrs + sizes + lds)

    # the TMA maps view A and B as (batch, rows, cols) with packed batches, and a tensor
    # map cannot have a dimension of size 0 (K == 0: out = beta * c)
    tma = vec and k > 0 and (batch == 1 or (a_bs == m * k and b_bs == k * n))
    if kind == "auto" and tma and batch == 1:
        pieces = few_token_pieces(m, n, k, sm_count(out.get_device()))
        if pieces > 1:
            return tma_split_launches(out, a, b, c, alpha_beta, (m, n, k, c_bs, c_rs, c_cs), ta, tb, pieces)
    if kind == "auto" and tma:
        kind, bm, bn = auto_tile(m, n, k, batch, sm_count(out.get_device()), device_index=out.get_device())
    if kind in V4_KINDS and tma:
        sizes = (m, n, k, batch, c_bs, c_rs, c_cs)
        return pingpong_launch(a, b, out, c, alpha_beta, None, None, sizes, ta, tb, kind, bm, bn)
    if kind == "tma" and tma:
        return tma_launch(a, b, out, c, alpha_beta, (m, n, k, batch, c_bs, c_rs, c_cs), ta, tb, bm, bn)
    if kind == "wgmma" and vec:
        smem = wg_smem_bytes(dtype, bm, bn)
        return tiled(WG_KERNEL[dtype, ta, tb, bm, bn, smem], bm, bn, (bm // 64) * WG_THREADS, smem)
    bm = 64 if small else 128  # mma.sync
    smem = tc_smem_bytes(dtype, ta, tb, bm)
    return tiled(TC_KERNEL[dtype, ta, tb, vec, bm, smem], bm, TC_BN, TC_THREADS, smem)


# --8<-- [end:launch]
