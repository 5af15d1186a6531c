"""Day 014's CUDA launch plan (pytorch_custom_ops/gemm_gpu.py), checked on the CPU.

The plan reads only shapes, dtypes and data pointers, so it runs on CPU tensors: every
launch must name a declared kernel with a launchable grid, block and shared memory, the
argument list the kernel takes, and the kernel the rules pick (TMA, wgmma, mma.sync or
SIMT, and the tile) for the shape, dtype, alignment and forced version. float32 runs
3xTF32 (day 019, part 9): two split launches, then version 3's kernel on their planes.
"""

import itertools
import re

import pytest
import torch

from pytorch_custom_ops import direct, gemm_gpu
from pytorch_custom_ops.gemm_gpu import PP_CLUSTER, PP_SPLIT, TensorMapSpec, gemm_version
from pytorch_custom_ops.library import REPO_ROOT

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
PAIRS = gemm_gpu.PAIRS
FAMILIES = (gemm_gpu.SIMT_KERNEL, gemm_gpu.TC_KERNEL, gemm_gpu.WG_KERNEL, gemm_gpu.TMA_KERNEL, gemm_gpu.PINGPONG_KERNEL)


def tensor(shape, dtype, offset=0):
    """An uninitialised CPU tensor; `offset` elements into its storage (unaligned views)."""
    n = 1
    for s in shape:
        n *= s
    return torch.empty(n + offset, dtype=dtype)[offset:].view(shape)


def plan(m, n, k, dtype, ta=False, tb=False, batch=None, c_shape=None, a_offset=0):
    lead = () if batch is None else (batch,)
    a = tensor((*lead, *((k, m) if ta else (m, k))), dtype, a_offset)
    b = tensor((*lead, *((n, k) if tb else (k, n))), dtype)
    c = tensor(c_shape or (1,) * (2 + len(lead)), dtype)
    out = tensor((*lead, m, n), dtype)
    launches = gemm_gpu.gemm_gpu([out], [a, b, c, torch.empty(2)], {"TRANSPOSE_A": ta, "TRANSPOSE_B": tb})
    if launches[0].kernel.family is gemm_gpu.TF32_SPLIT_KERNEL:  # 3xTF32: split a, split b, multiply
        check_tf32x3(launches, a, b, out, m, n, k, ta, tb, batch or 1)
        return launches[2]
    if len(launches) == 2 and launches[0].kernel.family is gemm_gpu.SIMT_KERNEL:  # fp32 split-K
        pieces, total = launches
        assert total.kernel.family is gemm_gpu.SPLIT_K_SUM_KERNEL and total.args[0] == out.data_ptr()
        assert total.args[1] == pieces.args[0] and total.args[8] == direct.dim3(pieces.grid)[2]  # workspace, S
        check_launch(pieces, m, n, direct.dim3(pieces.grid)[2])
        return pieces
    if len(launches) == 2 and launches[0].kernel.family is gemm_gpu.TMA_KERNEL:  # 16-bit few-token split-K
        pieces, total = launches
        assert total.kernel.family is gemm_gpu.SPLIT_K_SUM_KERNEL and total.args[0] == out.data_ptr()
        assert total.args[1] == pieces.args[2] and total.args[8] == direct.dim3(pieces.grid)[2]  # workspace, S
        check_launch(pieces, m, n, direct.dim3(pieces.grid)[2])
        return pieces
    if len(launches) == 2:  # split-K: the GEMM, then the kernel that sums its pieces
        gemm, total = launches
        assert gemm.kernel.params[PP_SPLIT] == 2 and total.kernel.family is gemm_gpu.SPLIT_K_SUM_KERNEL
        assert total.args[0] == out.data_ptr() and total.args[1] == gemm.args[9]  # out, the workspace
        assert total.args[8] == gemm.grid // (-(-m // 256) * -(-n // 128) * (batch or 1))  # S
    else:
        assert len(launches) == 1
    check_launch(launches[0], m, n, batch or 1)
    return launches[0]


def check_tf32x3(launches, a, b, out, m, n, k, ta, tb, batch):
    split_a, split_b, gemm = launches
    assert len(launches) == 3 and split_b.kernel.family is gemm_gpu.TF32_SPLIT_KERNEL
    bm, bn = gemm.kernel.params[3:5]
    operands = ((split_a, a, not ta, m, bm, gemm.args[0]), (split_b, b, tb, n, bn, gemm.args[1]))
    for split, x, kc, mn, bmn, spec in operands:
        assert split.kernel.params == (kc,) and split.block == gemm_gpu.TF32_SPLIT_THREADS and split.smem == 0
        kp = -(-k // 4) * 4
        planes, src = split.args[:2]
        assert src == x.data_ptr() and split.args[2:5] == (mn, k, kp)
        assert split.args[5] == (mn * k if batch > 1 else 0)  # the operand's batch stride
        assert direct.dim3(split.grid) == (-(-k // 32), -(-mn // 32), batch)
        # the planes (batch, 2, MN, KP), read k-major up to K (TMA fills zeros beyond)
        assert spec.address == planes and spec.dtype == FP32 and spec.dims == (k, mn, 2 * batch)
        assert spec.byte_strides == (kp * 4, mn * kp * 4) and spec.box == (32, bmn, 1)
    assert gemm.kernel.params[:3] == (FP32, False, True) and gemm.args[2] == out.data_ptr()
    check_launch(gemm, m, n, batch)


def check_launch(launch: direct.Launch, m: int, n: int, batch: int):
    kernel = launch.kernel
    assert kernel.family in FAMILIES and kernel in kernel.family.kernels()
    grid, block = direct.dim3(launch.grid), direct.dim3(launch.block)
    assert 0 < grid[0] < 2**31 and 0 < grid[1] <= 65535 and 0 < grid[2] <= 65535
    if kernel.family is gemm_gpu.PINGPONG_KERNEL:  # persistent: one block per SM at most
        bm, bn = kernel.params[3], kernel.params[4]
        cluster, split = kernel.params[PP_CLUSTER], kernel.params[PP_SPLIT]
        units = -(-m // bm) * -(-n // (bn * cluster)) * batch
        if split == 3:  # split-K in a cluster: a cluster of S CTAs a tile, one round
            tiles = -(-m // bm) * -(-n // bn) * batch
            assert grid == (tiles * cluster, 1, 1) and tiles * cluster <= gemm_gpu.sm_count(None)
            assert tiles <= gemm_gpu.CLUSTER_FIT_PLANNED[cluster]  # all resident at once
        elif split:  # stream-K: one block per SM or per k-step; split-K: tiles x S blocks, one wave
            k_steps = -(-launch.args[13] // 64)
            assert grid[0] in (min(units * k_steps, gemm_gpu.sm_count(None)), units) or (
                grid[0] % units == 0 and grid[0] <= min(units * k_steps, gemm_gpu.sm_count(None))
            )
        else:
            assert grid == (min(units, gemm_gpu.sm_count(None) // cluster) * cluster, 1, 1)
        assert launch.cluster == (cluster if cluster > 1 else None)
        assert launch.smem == kernel.params[6] and block == (gemm_gpu.PP_THREADS, 1, 1)
        assert len(launch.args) == len(kernel.family.args)
        return
    assert grid[2] == batch
    assert 0 < block[0] * block[1] * block[2] <= 1024
    assert 0 <= launch.smem <= 227 * 1024
    assert len(launch.args) == len(kernel.family.args)
    for kind, arg in zip(kernel.family.args, launch.args, strict=True):
        assert isinstance(arg, TensorMapSpec) if kind == "tensormap" else isinstance(arg, int), (kind, arg)
    assert launch.cluster is None
    tile_m, tile_n = tile(launch)
    assert grid[0] == -(-m // tile_m) * -(-n // tile_n)  # every output tile, once
    if kernel.family is not gemm_gpu.SIMT_KERNEL:
        assert launch.smem == kernel.params[-1]  # the size the kernel was built to check


def tile(launch) -> tuple[int, int]:
    family, p = launch.kernel.family, launch.kernel.params
    if family is gemm_gpu.SIMT_KERNEL:
        return p[4], p[5]
    if family is gemm_gpu.TC_KERNEL:
        return p[4], gemm_gpu.TC_BN
    return p[3], p[4]


def choice(launch) -> str:
    """'tma 128x256', 'wgmma 64x128', 'mma 64 vec', 'simt 128 novec'..."""
    family, p = launch.kernel.family, launch.kernel.params
    if family is gemm_gpu.TMA_KERNEL:
        return f"{'tf32x3' if p[0] == FP32 else 'tma'} {p[3]}x{p[4]}"
    if family is gemm_gpu.WG_KERNEL:
        return f"wgmma {p[3]}x{p[4]}"
    if family is gemm_gpu.PINGPONG_KERNEL:  # ... CLUSTER, COOP, SPLIT, F32_OUT, TMA_STORE, C_BLOCKS, EPI_WARPS
        cluster, coop, split, f32, tma_store, c_blocks, epi_warps = p[PP_CLUSTER:]
        kind = {1: "streamk", 2: "splitk", 3: "clustersplit"}.get(split) or ("coop" if coop else "pingpong")
        extra = (f" cluster {cluster}" if cluster > 1 else "") + (" f32" if f32 else "") + (" tma" if tma_store else "")
        extra += (" c_blocks" if c_blocks else "") + (" epi_warps" if epi_warps else "")
        red = gemm_gpu.cluster_split_bytes(p[3], p[4], cluster) if split == 3 else 0
        assert p[5] == gemm_gpu.pp_stages(p[0], p[3], p[4], tma_store, epi_warps, red)  # every stage that fits
        return f"{kind} {p[3]}x{p[4]}" + extra
    vec = "vec" if p[3] else "novec"
    return f"{'mma' if family is gemm_gpu.TC_KERNEL else 'simt'} {p[4]} {vec}"


# (m, n, k, dtype, batch) -> the AUTO choice
AUTO = [
    # day 019, part 2: version 4's cooperative 256 x 128 tile wherever it fills the SMs
    ((4096, 4096, 4096, BF16, None), "coop 256x128 tma"),  # 16 x 32 wide tiles: 4 waves (8 of 128x128)
    ((1024, 1024, 1024, BF16, None), "pingpong 128x64 tma"),  # FEW_TILES; 256 of 64 x 64: two rounds
    ((1536, 2816, 64, FP16, None), "coop 256x128 tma"),  # 132 wide tiles: one wave; 264 square: two
    ((8192, 2304, 768, BF16, None), "coop 256x192"),  # GPT-2's QKV: 384 tiles (3 rounds); 576 of 256x128 (5)
    ((16384, 2304, 768, BF16, None), "coop 256x128 tma"),  # 1152 of them (9 rounds); 768 of 256x192 (6)
    ((8192, 768, 768, BF16, None), "coop 256x192"),  # 128 tiles: one round; 192 wide: 2, 384 square: 3
    ((1536, 2560, 64, FP16, None), "coop 256x128 tma"),  # 120 wide tiles against 240 square
    ((256, 512, 72, BF16, 33), "coop 256x128 tma"),  # 1 x 4 x 33 = 132: the batch counts
    ((256, 512, 72, BF16, 32), "coop 256x128 tma"),
    ((8192, 3072, 3072, BF16, None), "coop 256x128 tma"),
    # GPT-2's dW: few tiles and a long K: split-K in a cluster (part 28), 36 square tiles in
    # clusters of 3 (108 CTAs), each CTA a third of the k-steps
    ((768, 768, 8192, BF16, None), "clustersplit 128x128 cluster 3"),
    ((768, 768, 8192, BF16, 4), "tma 192x128"),  # 144 square tiles: no cluster makes one round
    ((1024, 1024, 8192, FP16, None), "clustersplit 128x128 cluster 2"),  # 64 tiles: 3 x 64 > 132
    ((512, 512, 8192, BF16, 2), "clustersplit 128x128 cluster 3"),  # 32 tiles: 30 clusters of 4 fit
    ((256, 512, 8192, BF16, 2), "splitk 256x128"),  # 16 tiles: clusters of 4 level (512^2 x 8192: 63 against 64%)
    ((768, 768, 4096, BF16, None), "clustersplit 128x128 cluster 3"),  # CLUSTER_SPLIT_MIN_K
    ((768, 768, 4032, BF16, None), "splitk 256x128"),  # below it: split-K, as before
    ((768, 768, 16384, BF16, None), "splitk 256x128"),  # a long K: split-K's second kernel costs less
    ((768, 2304, 8192, BF16, None), "pingpong 128x128 tma"),  # 108 square tiles, one wave: 2 pieces do not
    # pay; K >= 1024: ONE_ROUND_LONG_K (4096 until day 019's part 29)
    ((2304, 768, 1024, BF16, None), "pingpong 128x128 tma"),  # the same tiles at K = 1024 (part 29) ...
    ((2304, 768, 1016, BF16, None), "tma 128x128"),  # ... and a shorter K: version 3
    ((768, 2304, 16384, BF16, None), "pingpong 128x128 tma"),  # ... and at twice the K (the 124M step),
    # not split: ahead of split-K by kernel time and from a flushed L2 (parts 26, 29)
    ((768, 1024, 16384, BF16, None), "splitk 256x128"),  # 48 square tiles: FEW_TILES; 2 x 8 wide ones, split
    # one round of version 3's three-consumer 192 x 128 tiles where K is long (part 12)
    ((3072, 768, 8192, BF16, None), "tma 192x128"),  # 96 tiles; 72 wide ones (55% of the SMs)
    ((768, 3072, 16384, BF16, None), "tma 192x128"),  # the 124M step's other 3072-wide dW
    ((3072, 1024, 4096, BF16, None), "tma 192x128"),  # day 016's QKV dW at 4096 tokens: 128 tiles
    ((384, 1024, 4096, BF16, 8), "tma 192x128"),  # 2 x 8 x 8 = 128: the batch counts
    ((384, 1024, 4096, BF16, 9), "tma 128x128"),  # 144 of them: more than a round
    ((3072, 1024, 1024, BF16, None), "coop 256x128 tma"),  # K = 1024: not long enough
    ((3072, 768, 1024, BF16, None), "coop 128x192"),  # ... 96 of 128 x 192 then
    ((64, 2304, 768, BF16, None), "pingpong 64x64 tma"),  # 64 tokens: 18 square tiles, 36 of 64 x 64 (FEW_TILES)
    ((512, 768, 768, BF16, None), "pingpong 64x64 tma"),  # 24 square tiles, 96 of 64 x 64: one round
    ((256, 3072, 768, BF16, None), "pingpong 128x64 tma"),  # 48 square tiles, 192 of 64 x 64: two rounds
    ((1000, 1000, 1000, BF16, None), "pingpong 128x64 tma"),  # 64 square tiles (FEW_TILES)
    ((1152, 1152, 1000, BF16, None), "tma 128x128"),  # 81 square tiles: more than half a round, K < 1024
    ((1, 8, 8, BF16, None), "pingpong 128x64 tma"),  # at most 64 wide: no half-empty tiles
    ((4097, 8, 8, BF16, None), "pingpong 128x64 tma"),
    ((1024, 64, 1024, BF16, 96), "pingpong 128x64 tma"),  # day 016's attention: P V of 96 heads
    ((128, 64, 128, FP16, 512), "pingpong 128x64 tma"),
    ((128, 128, 64, BF16, 512), "pingpong 128x128 tma"),  # 512 tiles of two k-steps or less
    ((128, 128, 64, BF16, 96), "tma 128x128"),  # one round: nothing to overlap
    ((128, 128, 192, BF16, 512), "tma 128x128"),  # three k-steps
    ((1024, 72, 1024, BF16, 96), "coop 256x128 tma"),  # wider than 64: the cost model
    ((17, 1000, 33, BF16, None), "mma 64 novec"),  # K = 33: rows are not 16-byte multiples
    ((2000, 2000, 33, FP16, None), "mma 128 novec"),  # 256 tiles of 128x128
    ((8, 12, 8, BF16, None), "mma 64 novec"),  # N % 8 != 0
    ((64, 64, 0, BF16, None), "mma 64 vec"),  # K = 0: no tensor map (out = beta * c)
    ((3000, 3000, 0, BF16, None), "mma 128 vec"),
    # float32: 3xTF32 (day 019, part 9) where its cost model beats the SIMT kernel
    ((2048, 2048, 2048, FP32, None), "tf32x3 128x128"),
    ((4096, 4096, 4096, FP32, None), "tf32x3 128x128"),
    ((8192, 2304, 768, FP32, None), "tf32x3 128x128"),  # GPT-2's linear layers at 8192 tokens
    ((8192, 768, 3072, FP32, None), "tf32x3 128x128"),
    ((1024, 1024, 64, FP32, 96), "tf32x3 128x128"),  # attention's Q K^T at seq 1024
    ((1024, 64, 1024, FP32, 96), "simt 64 vec"),  # ... its P V: splitting P costs more than it saves
    ((768, 768, 8192, FP32, None), "simt 64 vec"),  # 36 tiles of 128 x 128 for 132 SMs
    ((256, 256, 256, FP32, None), "simt 64 vec"),  # 4 tiles
    ((17, 1000, 3, FP32, None), "simt 64 novec"),
    ((1601, 1601, 1700, FP32, None), "simt 128 novec"),  # N odd: no 8-byte pairs
    ((1, 1, 1, FP32, None), "simt 64 novec"),
    ((64, 64, 0, FP32, None), "simt 64 vec"),  # K = 0: no tensor map
    ((4096, 4096, 4096, FP64, None), "simt 64 vec"),  # fp64: always 64x64, k steps of 8
    ((33, 17, 1000, FP64, None), "simt 64 novec"),
    ((8, 8, 8, FP64, 65535), "simt 64 vec"),  # the largest batch the grid allows
]


@pytest.mark.parametrize("shape,want", AUTO, ids=[f"{s[0]}x{s[1]}x{s[2]}-{s[3]}-b{s[4]}" for s, _ in AUTO])
def test_auto_choice_per_shape(shape, want):
    m, n, k, dtype, batch = shape
    assert choice(plan(m, n, k, dtype, batch=batch)) == want


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32, FP64])
def test_every_shape_transpose_and_alignment_gives_a_valid_launch(dtype):
    sizes = (1, 7, 8, 17, 64, 129, 1000, 4097)
    vw = 16 // dtype.itemsize
    for (m, n, k), (ta, tb) in itertools.product(itertools.product(sizes, repeat=3), PAIRS):
        launch = plan(m, n, k, dtype, ta, tb)
        a_ld, b_ld = (m if ta else k), (k if tb else n)
        vec = a_ld % vw == 0 and b_ld % vw == 0 and n % vw == 0
        kind = choice(launch)
        if dtype == FP32 and kind.startswith("tf32x3"):  # 3xTF32 reads its own planes: any a and b
            assert n % 2 == 0 and gemm_gpu.float_kernel(m, n, k, 1, ta, tb, vec, FP32, 132, True)[0] == "tf32x3"
            assert choice(plan(m, n, k, dtype, ta, tb, a_offset=1)) == kind
            continue
        assert ("novec" not in kind) == vec, (m, n, k, ta, tb, kind)
        if dtype in (BF16, FP16):
            assert kind.startswith(("tma", "pingpong", "coop", "streamk", "splitk", "clustersplit")) == (vec and k > 0)
        # an unaligned a (one element into its storage) never takes the vector paths
        assert "novec" in choice(plan(m, n, k, dtype, ta, tb, a_offset=1))


@gemm_version("SIMT")
def test_fp32_weight_gradients_split_k_where_few_tiles_meet_a_long_k():
    # dW = dY^T X: both operands run along K (the tokens) in memory, so piece s of K is
    # batch entry s of the SIMT kernel (strides K/S rows); day 019's sum kernel adds them
    for m, n, k, pieces in ((768, 768, 8192, 16), (3072, 768, 8192, 8), (768, 1024, 4096, 8), (1024, 1024, 4096, 2)):
        launch = plan(m, n, k, FP32, ta=True)
        assert direct.dim3(launch.grid)[2] == pieces and launch.kernel.params[:4] == (FP32, True, False, True)
        ks = k // pieces
        assert launch.args[5:10] == (m, n, ks, ks * m, ks * n)  # m, n, k, a_bs, b_bs of one piece
    assert direct.dim3(plan(4096, 4096, 4096, FP32, ta=True).grid)[2] == 1  # enough tiles: no split
    # A along M: the weight gradient's rule does not apply; 144 tiles of 64 x 64 take the
    # few-token rule's pieces (test_fp32_few_tokens_split_choice)
    assert direct.dim3(plan(768, 768, 8192, FP32).grid)[2] == gemm_gpu.simt_small_split(768, 768, 8192, 132)
    assert direct.dim3(plan(768, 768, 8209, FP32, ta=True).grid)[2] == 1  # no S divides K into >= 512
    assert direct.dim3(plan(768, 768, 8192, FP64, ta=True).grid)[2] == 1  # float64 has no sum kernel


def split_pieces_result(launch, a, b, ta, tb) -> torch.Tensor:
    """What the SIMT kernel computes on a split launch's arguments, in float64: batch
    entry s is op(A) (m x ks) at s * a_bs in rows of a_ld, times op(B) at s * b_bs in rows
    of b_ld (the addressing of stored_offset in gemm_v1_simt.mojo), summed over s."""
    m, n, ks, a_bs, b_bs = launch.args[5:10]
    a_ld, b_ld = launch.args[13:15]
    a_flat, b_flat = a.double().flatten(), b.double().flatten()
    total = torch.zeros(m, n, dtype=torch.float64)
    for s in range(direct.dim3(launch.grid)[2]):
        pa = a_flat.as_strided((m, ks), (1, a_ld) if ta else (a_ld, 1), s * a_bs)
        pb = b_flat.as_strided((ks, n), (1, b_ld) if tb else (b_ld, 1), s * b_bs)
        total += pa @ pb
    return total


@pytest.mark.parametrize("ta,tb", PAIRS)
@pytest.mark.parametrize(
    "m,n,k,pieces", [(64, 768, 3072, 16), (64, 768, 768, 8), (64, 2304, 768, 6), (52, 100, 2048, 16)]
)
def test_fp32_few_tokens_split_k_in_the_rows_of_the_whole_operands(m, n, k, pieces, ta, tb):
    """A linear layer at a few dozen tokens (M small, K long; day 016's float32 block at
    1 x 64 x 768): fewer 64 x 64 tiles than SMs, so K splits into pieces read inside the
    rows of the whole operands (ta = 1 with tb = 0 is the weight gradient's split, on
    128 x 128 tiles). The pieces' arguments must add up to op(A) op(B)."""
    with gemm_version("SIMT"):
        launch = plan(m, n, k, FP32, ta, tb)
    torch.manual_seed(0)
    a = torch.randn(*((k, m) if ta else (m, k)))
    b = torch.randn(*((n, k) if tb else (k, n)))
    if ta and not tb and gemm_gpu.simt_split_k(m, n, k, 132) > 1:  # the weight gradient's rule
        assert k // direct.dim3(launch.grid)[2] >= 512 and launch.kernel.params[4] == 128
    else:
        assert direct.dim3(launch.grid)[2] == pieces and launch.kernel.params[4] == 64
    assert launch.args[13:15] == ((m if ta else k), (k if tb else n))
    want = (a.double().mT if ta else a.double()) @ (b.double().mT if tb else b.double())
    assert torch.allclose(split_pieces_result(launch, a, b, ta, tb), want, rtol=1e-12, atol=1e-9)


def test_fp32_few_tokens_split_choice():
    # S: the cost model's best (fitted to the sweep of S on the H100, which it matches)
    assert gemm_gpu.simt_small_split(64, 768, 3072, 132) == 16  # 12 tiles: 192 blocks of 192 k-steps
    assert gemm_gpu.simt_small_split(64, 768, 768, 132) == 8
    assert gemm_gpu.simt_small_split(64, 2304, 768, 132) == 6  # 36 tiles
    assert gemm_gpu.simt_small_split(256, 3072, 768, 132) == 2  # 192 tiles: the workspace costs more
    assert gemm_gpu.simt_small_split(64, 768, 100, 132) == 1  # no piece of >= 64 that is a multiple of 4
    assert gemm_gpu.simt_small_split(1024, 2304, 768, 132) == 1  # 576 tiles: beyond what was measured
    assert gemm_gpu.simt_small_split(64, 768, 3070, 132) == 1  # 3070 = 2 x 5 x 307: no aligned piece
    us = [gemm_gpu.simt_small_split_us(64, 768, 3072, s, 132) for s in (1, 8, 16, 24)]
    assert us[0] > us[1] > us[2] < us[3]  # past 132 blocks, a second block shares the SM
    # only float32 with 16-byte rows, batch 1
    assert gemm_gpu.float_kernel(64, 768, 3072, 1, False, False, True, FP32, 132, False) == ("simt_small", 16)
    assert gemm_gpu.float_kernel(64, 768, 3072, 1, False, False, False, FP32, 132, False)[1] == 1
    assert gemm_gpu.float_kernel(64, 768, 3072, 2, False, False, True, FP32, 132, False)[1] == 1
    assert gemm_gpu.float_kernel(64, 768, 3072, 1, False, False, True, FP64, 132, False)[1] == 1
    with gemm_gpu.split_pieces(1):  # the sweep's switch: no split at all
        assert gemm_gpu.float_kernel(64, 768, 3072, 1, False, False, True, FP32, 132, False)[1] == 1
        assert gemm_gpu.float_kernel(768, 768, 8192, 1, True, False, True, FP32, 132, False)[1] == 1
    with gemm_gpu.split_pieces(5):  # forced, where K allows it
        assert gemm_gpu.float_kernel(64, 768, 3080, 1, False, True, True, FP32, 132, False) == ("simt_small", 5)
        assert gemm_gpu.float_kernel(64, 768, 3072, 1, False, True, True, FP32, 132, False)[1] == 1


def map_view(t: torch.Tensor, spec: TensorMapSpec) -> torch.Tensor:
    """What a tensor map over `t` names, as a float64 (batch, rows, cols) view."""
    flat, size = t.flatten().double(), t.element_size()
    cols, rows, batch = spec.dims
    strides = (spec.byte_strides[1] // size, spec.byte_strides[0] // size, 1)
    return flat.as_strided((batch, rows, cols), strides, (spec.address - t.data_ptr()) // size)


@pytest.mark.parametrize("ta,tb", PAIRS)
@pytest.mark.parametrize("m,n,k,pieces", [(64, 768, 3072, 16), (72, 200, 640, 5), (64, 2304, 768, 6)])
def test_16_bit_few_token_split_maps_read_the_pieces_of_k(m, n, k, pieces, ta, tb):
    """Day 019: a 16-bit GEMM in S pieces of K on version 3's 128 x 64 tiles. The tensor
    maps (dims and strides as the driver gets them) must name, for batch entry s, the
    piece of K from s K/S on inside the whole operands, and the pieces add up to op(A) op(B)."""
    torch.manual_seed(m + k)
    a = torch.randn(*((k, m) if ta else (m, k))).to(BF16)
    b = torch.randn(*((n, k) if tb else (k, n))).to(BF16)
    out, c = torch.empty(m, n, dtype=BF16), torch.zeros(1, 1, dtype=BF16)
    with gemm_gpu.split_pieces(pieces):
        launches = gemm_gpu.gemm_gpu([out], [a, b, c, torch.empty(2)], {"TRANSPOSE_A": ta, "TRANSPOSE_B": tb})
    gemm, total = launches
    assert gemm.kernel.family is gemm_gpu.TMA_KERNEL and gemm.kernel.params[:6] == (BF16, ta, tb, 128, 64, True)
    assert direct.dim3(gemm.grid) == (-(-m // 128) * -(-n // 64), 1, pieces) and gemm.smem == gemm.kernel.params[-1]
    assert total.kernel.family is gemm_gpu.SPLIT_K_SUM_KERNEL and total.args[1] == gemm.args[2]  # the workspace
    assert total.args[0] == out.data_ptr() and total.args[5:9] == (m, n, 1, pieces)
    assert total.args[4] == 0 == total.args[-1]  # no bias row
    ks = k // pieces
    assert gemm.args[5:8] == (m, n, ks)
    a_map, b_map = gemm.args[:2]
    for spec in (a_map, b_map):
        assert all(stride % 16 == 0 for stride in spec.byte_strides)  # what the driver requires
    pa = map_view(a, a_map)  # (S, rows, cols) as stored
    pb = map_view(b, b_map)
    pa = pa if not ta else pa.mT  # op(A) pieces: (S, m, ks)
    pb = pb.mT if tb else pb  # op(B) pieces: (S, ks, n)
    assert pa.shape == (pieces, m, ks) and pb.shape == (pieces, ks, n)
    want = (a.double().mT if ta else a.double()) @ (b.double().mT if tb else b.double())
    torch.testing.assert_close((pa @ pb).sum(0), want, rtol=1e-10, atol=1e-8)


def test_16_bit_few_token_split_rule():
    # day 019's sweep: long K (>= 2048), pieces of >= 384, one block per SM, few tiles
    sms = 132
    assert gemm_gpu.few_token_pieces(64, 768, 3072, sms) == 8  # 12 tiles of 128 x 64: 11.1 -> 7.4 us
    assert gemm_gpu.few_token_pieces(64, 768, 2304, sms) == 6
    assert gemm_gpu.few_token_pieces(256, 768, 3072, sms) == 4
    assert gemm_gpu.few_token_pieces(512, 768, 2304, sms) == 2  # 48 tiles: two pieces at most
    assert gemm_gpu.few_token_pieces(1024, 768, 3072, sms) == 1  # 96 tiles: two pieces lost
    assert gemm_gpu.few_token_pieces(64, 3072, 768, sms) == 1  # K = 768: every S lost
    assert gemm_gpu.few_token_pieces(64, 768, 2052, sms) == 1  # no piece of >= 384 at a multiple of 8
    assert choice(plan(64, 768, 3072, BF16)) == "tma 128x64"  # AUTO takes it: dX at 64 tokens
    assert choice(plan(64, 768, 3072, FP16, ta=True, tb=True)) == "tma 128x64"
    assert choice(plan(64, 768, 3072, BF16, batch=2)) != "tma 128x64"  # batch 1 only


def test_16_bit_split_only_where_forced_and_k_allows():
    a, b = torch.empty(64, 3072, dtype=BF16), torch.empty(3072, 768, dtype=BF16)
    out, c = torch.empty(64, 768, dtype=BF16), torch.zeros(1, 1, dtype=BF16)

    def kinds(pieces=None, version="AUTO", aa=a):
        with gemm_version(version), gemm_gpu.split_pieces(pieces):
            params = {"TRANSPOSE_A": False, "TRANSPOSE_B": False}
            return [
                launch.kernel.family.function for launch in gemm_gpu.gemm_gpu([out], [aa, b, c, torch.empty(2)], params)
            ]

    assert kinds(8) == ["gemm_tma_kernel", "split_k_sum_kernel"]
    assert kinds(5) != kinds(8)  # 3072 / 5 is no whole piece
    assert kinds(8, "PINGPONG_TMA_128x64") == ["gemm_pingpong_kernel"]  # a forced version: no split
    assert gemm_gpu.tma_split_fits(3072, 8) and not gemm_gpu.tma_split_fits(3072 + 4, 2)  # 1538: not 8-aligned


def test_huge_and_batched_shapes():
    assert choice(plan(2**20, 8, 8, BF16)) == "pingpong 128x64 tma"  # K = 8, 8192 narrow tiles
    assert choice(plan(2**20, 8, 2048, BF16, ta=True, tb=True)) == "pingpong 128x64 tma"
    launch = plan(2**22, 1, 1, FP32)  # 65536 blocks in x (an output 1 wide: 64 x 64 tiles)
    assert direct.dim3(launch.grid) == (65536, 1, 1)
    for ta, tb in PAIRS:
        assert choice(plan(40, 24, 16, BF16, ta, tb, batch=3)) == "pingpong 128x64 tma"
        assert choice(plan(40, 24, 16, FP32, ta, tb, batch=3)) == "simt 64 vec"
        with gemm_version("TF32X3_128x128"):
            assert choice(plan(40, 24, 16, FP32, ta, tb, batch=3)) == "tf32x3 128x128"


def test_forced_versions_apply_where_their_conditions_hold():
    want = {
        "AUTO": "pingpong 64x64 tma",  # 2 x 3 square tiles: FEW_TILES, 4 x 5 of 64 x 64
        "MMA_SYNC": "mma 64 vec",
        "WG_64x128": "wgmma 64x128",
        "WG_128x128": "wgmma 128x128",
        "WG_128x256": "wgmma 128x256",
        "TMA_128x128": "tma 128x128",
        "TMA_128x256": "tma 128x256",
        "TMA_192x128": "tma 192x128",
        "PINGPONG_128x128": "pingpong 128x128",
        "PINGPONG_64x256": "pingpong 64x256",
        "MULTICAST_128x128": "pingpong 128x128",  # n = 264: 3 tiles of 128, an odd count: no pairs
        "COOP_128x256": "coop 128x256",
        "COOP_256x128": "coop 256x128",
        "COOP_TMA_256x128": "coop 256x128 tma",
        "COOP_TMA_128x256": "coop 128x256 tma",
        "PINGPONG_TMA_128x128": "pingpong 128x128 tma",
        "PINGPONG_TMA_128x64": "pingpong 128x64 tma",
        "PINGPONG_64x64": "pingpong 64x64",
        "PINGPONG_TMA_64x64": "pingpong 64x64 tma",
        "COOP_MULTICAST_256x128": "coop 256x128",  # 3 tiles of 128 in n: no pairs
        "COOP_256x192": "coop 256x192",
        "COOP_128x192": "coop 128x192",
        "COOP_256x64": "coop 256x64",
        "PINGPONG_128x64": "pingpong 128x64",
        "STREAMK_256x128": "streamk 256x128",
        "SPLITK_256x128": "splitk 256x128",
        "CLUSTER_SPLITK_128x128": "coop 256x128",  # 3 k-steps cannot be split: the whole tile
        "SIMT": "mma 64 vec",  # float32's names: 16-bit operands take mma.sync
        "TF32X3_128x128": "mma 64 vec",
    }
    fp32 = {"TF32X3_128x128": "tf32x3 128x128"}
    assert set(want) == set(gemm_gpu.VERSIONS)
    for version, kind in want.items():
        with gemm_version(version):
            for dtype, (ta, tb) in itertools.product((BF16, FP16), PAIRS):
                assert choice(plan(200, 264, 136, dtype, ta, tb)) == kind
                assert choice(plan(200, 260, 136, dtype, ta, tb)) == "mma 64 novec"  # no 16-byte rows
                # float32: its own names, else AUTO (6 tiles: the SIMT kernel)
                assert choice(plan(200, 264, 136, FP32, ta, tb)) == fp32.get(version, "simt 64 vec")
            if version.startswith(("TMA", "PINGPONG", "MULTICAST", "COOP")):  # K = 0: wgmma may run, TMA may not
                assert choice(plan(200, 264, 0, BF16)) == "mma 64 vec"
    assert gemm_gpu.current_version() == "AUTO"


def test_every_version_4_launch_runs_every_stage_that_fits():
    # day 019, part 29: one round of ping-pong 128 x 128 tiles with a very long K runs its 6
    # stages again (part 26's 4 lost once the k-loop stopped dividing by 6), and is not split
    for ta, tb in PAIRS:
        assert choice(plan(768, 2304, 16384, BF16, ta, tb)) == "pingpong 128x128 tma"
    with gemm_version("PINGPONG_TMA_128x128"):
        assert choice(plan(1000, 520, 16392, FP16, batch=2)) == "pingpong 128x128 tma"
    stages = {v[5] for v in gemm_gpu.PINGPONG_KERNEL.variants if v[3:5] == (128, 128) and v[14] and v[12] == 0}
    assert stages == {gemm_gpu.pp_stages(BF16, 128, 128, tma_store=True)} == {6}


def test_l2_promotion_widens_the_operand_loads_only():
    # gemm_gpu.l2_promotion: the A/B switch for the operand maps' L2 promotion (day 019, part 26)
    a_map, b_map, out_map = plan(768, 2304, 16384, BF16, True, False).args[:3]  # ping-pong, TMA stores
    assert a_map.l2_promotion == b_map.l2_promotion == out_map.l2_promotion == 0  # none, as MAX passed
    with gemm_gpu.l2_promotion(256):
        a_map, b_map, out_map = plan(768, 2304, 16384, BF16, True, False).args[:3]
        assert a_map.l2_promotion == b_map.l2_promotion == 3  # CU_TENSOR_MAP_L2_PROMOTION_L2_256B
        assert out_map.l2_promotion == 0  # the epilogue's stores
        with gemm_version("TMA_128x128"):
            assert plan(300, 264, 136, BF16).args[0].l2_promotion == 3  # version 3 too
        tf32 = plan(2056, 2056, 1032, FP32)  # 3xTF32: version 3 on the tf32 planes
        assert tf32.args[0].l2_promotion == tf32.args[1].l2_promotion == 3
    assert plan(768, 2304, 16384, BF16, True, False).args[0].l2_promotion == 0
    with pytest.raises(ValueError, match=r"l2_promotion: 100 bytes; one of \[0, 64, 128, 256\]"):
        gemm_gpu.l2_promotion(100)


def test_multicast_pairs_tiles_along_n_in_clusters_of_two():
    with gemm_version("MULTICAST_128x128"):
        for ta, tb in PAIRS:
            launch = plan(8192, 2304, 768, BF16, ta, tb)  # 18 tiles of 128 in n: 9 pairs
            assert choice(launch) == "pingpong 128x128 cluster 2" and launch.cluster == 2
            assert launch.args[0].box[1 if not ta else 0] == 64  # each CTA loads half of A's 128 rows
        assert choice(plan(300, 512, 64, FP16, batch=5)) == "pingpong 128x128 cluster 2"
        assert choice(plan(8192, 2400, 768, BF16)) == "pingpong 128x128"  # 19 tiles: no pairs
    with gemm_version("COOP_MULTICAST_256x128"):
        for ta, tb in PAIRS:
            launch = plan(4096, 4096, 4096, BF16, ta, tb)
            assert choice(launch) == "coop 256x128 cluster 2" and launch.cluster == 2
            assert launch.args[0].box[1 if not ta else 0] == 64  # 128 rows each, in 64-row boxes


def test_gemm_version_rejects_unknown_names_and_restores():
    with pytest.raises(ValueError, match="gemm: unknown kernel version 'WG_64x64'"):
        with gemm_version("WG_64x64"):
            pass
    with gemm_version("WG_128x128"):
        with gemm_version("MMA_SYNC"):
            assert gemm_gpu.current_version() == "MMA_SYNC"
        assert gemm_gpu.current_version() == "WG_128x128"
    assert gemm_gpu.current_version() == "AUTO"


def test_gpt2_linear_layers_take_tensor_cores():
    # forward y = x W^T (NT), dX = dY W (NN), dW = dY^T X (TN) at GPT-2 small's shapes
    for tokens, (d_in, d_out) in itertools.product(
        (64, 512, 1024, 4096, 8192), ((768, 2304), (768, 768), (768, 3072), (3072, 768))
    ):
        for m, n, k, ta, tb in (
            (tokens, d_out, d_in, False, True),
            (tokens, d_in, d_out, False, False),
            (d_out, d_in, tokens, True, False),
        ):
            kind, where = choice(plan(m, n, k, BF16, ta, tb)), (tokens, d_in, d_out, ta, tb)
            assert kind.startswith(
                (
                    "tma",
                    "coop",
                    "splitk",
                    "clustersplit",
                    "pingpong 128x64 tma",
                    "pingpong 64x64 tma",
                    "pingpong 128x128 tma",
                )
            ), where
            if tokens >= 8192 and k <= 1024:  # short K, many tiles: day 019's version 4
                assert kind.startswith("coop 256x"), where
            if tokens >= 4096 and k < tokens:  # float32: 3xTF32 for every forward and dX product
                assert choice(plan(m, n, k, FP32, ta, tb)) == "tf32x3 128x128", where


def test_tma_descriptors_view_each_operand_as_stored():
    with gemm_version("TMA_128x256"):
        launch = plan(300, 264, 136, BF16, batch=3)
    a_map, b_map = launch.args[:2]
    # A stored (3, 300, 136), k-contiguous: box 64 k x 128 rows
    assert a_map.dims == (136, 300, 3) and a_map.byte_strides == (272, 300 * 272) and a_map.box == (64, 128, 1)
    # B stored (3, 136, 264), mn-contiguous: boxes of 64 n x 64 k (the kernel issues 4 per stage)
    assert b_map.dims == (264, 136, 3) and b_map.byte_strides == (528, 136 * 528) and b_map.box == (64, 64, 1)
    with gemm_version("TMA_128x256"):
        launch = plan(296, 264, 136, FP16, ta=True, tb=True)
    a_map, b_map = launch.args[:2]
    assert a_map.dims == (296, 136, 1) and a_map.box == (64, 64, 1)  # A stored (K, M): mn-contiguous
    assert b_map.dims == (136, 264, 1) and b_map.box == (64, 256, 1)  # B stored (N, K): k-contiguous
    for spec in launch.args[:2]:
        assert spec.dtype == FP16 and spec.swizzle == 3  # CU_TENSOR_MAP_SWIZZLE_128B
        assert spec.address % 16 == 0 and all(s % 16 == 0 for s in spec.byte_strides)
        assert spec.box[0] * 2 == 128 and max(spec.box) <= 256  # one swizzle span; the driver's box limit
    stages, smem = launch.kernel.params[-2:]
    assert stages == 4 and smem == 4 * ((128 + 256) * 64 * 2 + 16)


def test_c_broadcast_strides():
    def strides(c_shape, batch=None):
        launch = plan(5, 7, 3, FP32, batch=batch, c_shape=c_shape)
        return launch.args[10:13]  # c_bs, c_rs, c_cs (then the SIMT kernel's a_ld, b_ld)

    assert strides((5, 7)) == (0, 7, 1)
    assert strides((1, 7)) == (0, 0, 1)  # a bias row
    assert strides((5, 1)) == (0, 1, 0)  # a column
    assert strides((1, 1)) == (0, 0, 0)
    assert strides((2, 5, 7), batch=2) == (35, 7, 1)
    assert strides((1, 1, 7), batch=2) == (0, 0, 1)
    assert strides((2, 1, 1), batch=2) == (1, 0, 0)


def test_c_in_16_byte_blocks_only_where_its_promise_holds():
    """Day 019, part 16: version 4 reads a full, row-major, 16-byte aligned c in 16-byte
    blocks (C_BLOCKS) where that variant exists (x @ W^T, the plain or bias epilogue);
    a row, a column, an unaligned c or another layout keeps the 2-byte reads."""

    def c_blocks(c_shape=None, c_offset=0, tb=True, batch=None, n=768):
        lead = () if batch is None else (batch,)
        a, b = tensor((*lead, 8192, 768), BF16), tensor((*lead, n, 768) if tb else (*lead, 768, n), BF16)
        c = tensor(c_shape or (*lead, 8192, n), BF16, c_offset)
        out = tensor((*lead, 8192, n), BF16)
        params = {"TRANSPOSE_A": False, "TRANSPOSE_B": tb}
        (launch,) = gemm_gpu.gemm_gpu([out], [a, b, c, torch.empty(2)], params)
        assert launch.kernel.family is gemm_gpu.PINGPONG_KERNEL
        return launch.kernel.params[gemm_gpu.PP_C_BLOCKS]

    assert c_blocks() is True
    assert c_blocks(batch=2) is True and c_blocks((1, 8192, 768), batch=2) is True  # one c for every matrix
    assert c_blocks(c_offset=1) is False  # 2 bytes past alignment
    assert c_blocks(c_offset=8) is True  # 16 bytes: aligned again
    assert c_blocks((1, 768)) is False and c_blocks((8192, 1)) is False  # a row, a column
    assert c_blocks(tb=False) is False  # no such variant: W stored (in, out)
    assert c_blocks(n=776) is True  # 776 x 2 bytes a row: still 16-byte rows
    assert all(v[gemm_gpu.PP_C_BLOCKS] is False for v in gemm_gpu.PINGPONG_KERNEL.variants if v[12] or v[13])


def test_bad_problems_raise_naming_the_op():
    with pytest.raises(ValueError, match="gemm: c has size 3 where the output has 5"):
        plan(5, 7, 3, FP32, c_shape=(3, 7))
    with pytest.raises(ValueError, match="gemm_batched: batch 65536 > 65535"):
        plan(1, 1, 1, FP32, batch=65536)
    out, a, b, c = tensor((4, 5), FP32), tensor((4, 3), FP32), tensor((2, 5), FP32), tensor((1, 1), FP32)
    with pytest.raises(ValueError, match=r"gemm: inner dims differ: op\(a\) is 4x3, op\(b\) is 2x5"):
        gemm_gpu.gemm_gpu([out], [a, b, c, torch.empty(2)], {"TRANSPOSE_A": False, "TRANSPOSE_B": False})


def test_tf32x3_cost_model_picks_the_faster_kernel_in_every_measured_row():
    # AUTO's float32 choice (tf32x3_pays) against the H100's kernel times of a GPT block's
    # products at three model shapes (days/day019/time_tf32x3.py): 3xTF32 (split + GEMM)
    # where it was faster, the SIMT kernel where it was
    rows = (REPO_ROOT / "results/nvidia-h100-80gb-hbm3/day019_tf32x3.txt").read_text()
    found = re.findall(r"(\d+)x(\d+)x(\d+) b(\d+) ta=(\d) tb=(\d): .*= +([\d.]+) \| SIMT +([\d.]+)", rows)
    assert len(found) >= 45
    for *sizes, ta, tb, tf32x3_us, simt_us in found:
        m, n, k, batch = map(int, sizes)
        choice, _ = gemm_gpu.float_kernel(m, n, k, batch, ta == "1", tb == "1", True, FP32, 132, True)
        assert (choice == "tf32x3") == (float(tf32x3_us) < float(simt_us)), (m, n, k, batch, ta, tb)
    # day 014's squares (day019_tf32x3_fp32.txt): 1024^3 is 64 tiles, where the SIMT
    # kernel runs 64 x 64 tiles at 72 us against 3xTF32's 59
    assert gemm_gpu.float_kernel(1024, 1024, 1024, 1, False, False, True, FP32, 132, True)[0] == "tf32x3"
