"""Day 019, part 3: stream-K (version 4's cooperative 256 x 128 tile with the k-steps of
all tiles shared evenly among the blocks, the last piece of a tile summing it) and
split-K (S aligned pieces per tile, summed by a second kernel; AUTO's choice for GPT-2's
weight gradients until part 28), and on the GPU split-K in a cluster (part 28: a tile's
k-steps shared by the CTAs of a cluster, summed in shared memory).

CPU: the split of the iterations and the fix-up's bookkeeping, emulated with the
kernel's own formulas (days/day019/stream_k.mojo), for many grids and problem sizes: every
k-step of every tile runs exactly once, the pieces of a split tile are found where they
were written, and no two pieces share a workspace slot. CUDA (strict): results against
float64 at GPT-2's weight-gradient shapes, bitwise-repeatable sums, the launch recipe
(its zeroed counters), CUDA-graph capture and side streams.
"""

import itertools

import pytest
import torch

import pytorch_custom_ops as pco
from days.day014.test_day014_gemm import _planned, check, rand, stored
from pytorch_custom_ops import gemm_gpu
from pytorch_custom_ops.gemm_gpu import PP_SPLIT

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16, FP16 = torch.bfloat16, torch.float16


# -- the kernel's bookkeeping, in Python (the same formulas as stream_k.mojo) ----------------
def iter_start(b, total, grid):
    return b * total // grid


def iter_owner(i, total, grid):
    return ((i + 1) * grid - 1) // total


def units(b, total, grid, num_k):
    """(tile, kb, ke) of block b, as `Units[True].next()` walks them."""
    cur, end = iter_start(b, total, grid), iter_start(b + 1, total, grid)
    while cur < end:
        t = cur // num_k
        kb, ke = cur - t * num_k, min(num_k, end - t * num_k)
        cur = t * num_k + ke
        yield t, kb, ke


def slot(b, t, total, grid, num_k):
    return 0 if iter_start(b, total, grid) // num_k == t else 1


@pytest.mark.parametrize("tiles,num_k", [(1, 1), (1, 200), (18, 128), (54, 128), (72, 128), (3, 5), (576, 12), (7, 1)])
def test_stream_k_split_covers_every_k_step_once_and_finds_every_piece(tiles, num_k):
    total = tiles * num_k
    for grid in sorted({1, 2, 7, 131, 132, min(total, 132), total} - {0}):
        if grid > total:  # the plan never launches more blocks than k-steps
            continue
        seen = [[0] * num_k for _ in range(tiles)]
        written = {}  # (block, slot) -> tile of the piece written there
        pieces = {t: [] for t in range(tiles)}
        for b in range(grid):
            mine = list(units(b, total, grid, num_k))
            assert mine, "every block gets at least one k-step"
            partial = [u for u in mine if u[2] - u[1] < num_k]
            assert len(partial) <= 2  # only the ends of a block's range can be pieces
            for t, kb, ke in mine:
                for kt in range(kb, ke):
                    seen[t][kt] += 1
                if ke - kb < num_k:
                    key = (b, slot(b, t, total, grid, num_k))
                    assert key not in written, "two pieces in one workspace slot"
                    written[key] = t
                    pieces[t].append(b)
        assert all(c == 1 for row in seen for c in row)
        for t, blocks in pieces.items():
            if not blocks:
                continue
            first, last = iter_owner(t * num_k, total, grid), iter_owner(t * num_k + num_k - 1, total, grid)
            # the last piece to arrive counts last - first earlier ones and sums these slots
            assert blocks == list(range(first, last + 1))
            assert all(written[(b, slot(b, t, total, grid, num_k))] == t for b in blocks)


def test_a_grid_of_tiles_times_s_cuts_every_tile_in_s_aligned_pieces():
    """Split-K runs the stream-K kernel on tiles x S blocks: the even shares then fall on
    the split points, block t * S + s taking k-steps [s num_k / S, (s + 1) num_k / S) of
    tile t, so the blocks working at once on tiles of one row read the same k-steps of A
    (L2 reuse that stream-K's uneven shares lose)."""
    for tiles, num_k, splits in [(18, 128, 7), (54, 128, 2), (9, 64, 5), (3, 5, 5)]:
        total, grid = tiles * num_k, tiles * splits
        for b in range(grid):
            t, s = divmod(b, splits)
            assert list(units(b, total, grid, num_k)) == [(t, s * num_k // splits, (s + 1) * num_k // splits)]


def test_plan_sizes_the_workspace_and_zeroes_the_counters():
    from days.day014.test_day014_launch_plan import plan

    with pco.gemm_version("STREAMK_256x128"):
        launch = plan(768, 768, 8192, BF16, True, False)  # a dW: 18 tiles x 128 k-steps
    assert launch.grid == 132 and launch.kernel.params[PP_SPLIT] == 1
    launch = plan(768, 768, 16384, BF16, True, False)  # AUTO: split-K, then its sum (checked in `plan`)
    assert launch.grid == 18 * gemm_gpu.split_k(768, 768, 16384, 1, 132)[0] and launch.kernel.params[PP_SPLIT] == 2
    assert gemm_gpu.split_k(768, 2304, 16384, 1, 132)[0] == 2  # 54 tiles: 2 pieces, 108 blocks
    launch = plan(256, 128, 128, BF16)  # AUTO: one tile, 2 k-steps: too small for stream-K
    assert launch.kernel.family is not gemm_gpu.PINGPONG_KERNEL or launch.kernel.params[PP_SPLIT] == 0
    with pco.gemm_version("STREAMK_256x128"):
        launch = plan(256, 128, 128, BF16)  # forced: at most one block per k-step
    assert launch.grid == 2


# -- on the GPU -----------------------------------------------------------------------------
DW_SHAPES = [(768, 768, 16384), (768, 1024, 16384), (600, 392, 12296)]  # AUTO: split-K (tails in m, n, k)


@needs_cuda
@pytest.mark.parametrize("m,n,k", DW_SHAPES, ids=lambda s: str(s))
def test_cuda_weight_gradient_shapes_take_stream_k_and_match_float64(m, n, k):
    torch.manual_seed(m + n + k)
    # dW = X^T dY: op(A) = X^T with X stored (tokens, in)
    x, dy = rand(k, m, device="cuda", dtype=BF16), rand(k, n, device="cuda", dtype=BF16)
    c = rand(n, device="cuda", dtype=BF16)
    assert _planned(x, dy, c.reshape(1, n), True, False) == "splitk 256x128"
    check(pco.gemm(x, dy, transpose_a=True), x, dy, ta=True)
    check(pco.gemm(x, dy, c, alpha=0.5, beta=2.0, transpose_a=True), x, dy, c, 0.5, 2.0, ta=True)


# ... and split-K in a cluster (part 28): the owner of a unit adds the other CTAs' sums in
# a fixed order, so its bits repeat too
SPLITS = ["STREAMK_256x128", "SPLITK_256x128", "CLUSTER_SPLITK_128x128"]


@needs_cuda
@pytest.mark.parametrize("version", SPLITS)
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_cuda_split_tiles_are_repeatable_and_recipes_stay_right(version, dtype):
    # Stream-K sums a tile's pieces in block order whoever arrives last, split-K's second
    # kernel in slice order, so equal inputs give equal bits. The second and later calls
    # replay the recipe: stream-K's counters must be zero again (stale counts would leave
    # tiles unwritten), and split-K's workspace is a new one each time.
    a = rand(16392, 520, device="cuda", dtype=dtype)  # 6 tiles x 257 k-steps
    b = rand(16392, 264, device="cuda", dtype=dtype)
    with pco.gemm_version(version):
        first = pco.gemm(a, b, transpose_a=True)
        for _ in range(3):
            assert torch.equal(pco.gemm(a, b, transpose_a=True), first)
        check(first, a, b, ta=True)
        a2 = rand(16392, 520, device="cuda", dtype=dtype)
        check(pco.gemm(a2, b, transpose_a=True), a2, b, ta=True)


@needs_cuda
@pytest.mark.parametrize("version", SPLITS)
def test_cuda_split_tiles_under_graph_capture_and_on_a_side_stream(version):
    a, b = rand(16392, 520, device="cuda", dtype=BF16), rand(16392, 264, device="cuda", dtype=BF16)
    c = rand(520, 264, device="cuda", dtype=BF16)
    with pco.gemm_version(version):
        pco.gemm(a, b, c, beta=0.5, transpose_a=True)  # warm-up: load the kernels, make the recipe
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = pco.gemm(a, b, c, beta=0.5, transpose_a=True)
        for _ in range(2):  # each replay zeroes stream-K's counters again
            a.copy_(rand(16392, 520, device="cuda", dtype=BF16))
            graph.replay()
            torch.cuda.synchronize()
            check(y, a, b, c, beta=0.5, ta=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y2 = pco.gemm(a, b, transpose_a=True)
        torch.cuda.current_stream().wait_stream(side)
        check(y2, a, b, ta=True)


@needs_cuda
@pytest.mark.parametrize("version", SPLITS)
@pytest.mark.parametrize("ta,tb", list(itertools.product((False, True), repeat=2)))
def test_cuda_split_tiles_batched_with_a_broadcast_c(version, ta, tb):
    torch.manual_seed(3)
    a, b = rand(3, 200, 2104, device="cuda", dtype=BF16), rand(3, 2104, 136, device="cuda", dtype=BF16)
    c = rand(1, 1, 136, device="cuda", dtype=BF16)
    with pco.gemm_version(version):
        kind = {"STREAMK": "streamk", "SPLITK": "splitk", "CLUSTER": "clustersplit"}[version.split("_")[0]]
        assert _planned(stored(a, ta), stored(b, tb), c, ta, tb).split()[0] == kind
        y = pco.gemm_batched(stored(a, ta), stored(b, tb), c, alpha=1.5, beta=-1.0, transpose_a=ta, transpose_b=tb)
    check(y, a, b, c, 1.5, -1.0)


@needs_cuda
def test_cuda_linear_weight_gradient_through_a_split():
    torch.manual_seed(5)
    layer = pco.MojoGEMM(768, 768, device="cuda", dtype=BF16)
    x = rand(8, 1024, 768, device="cuda", dtype=BF16).requires_grad_()  # dW: K = 8192 (clusters of 3)
    y = layer(x)
    g = rand(*y.shape, device="cuda", dtype=BF16)
    y.backward(g)
    check(layer.weight.grad, g.reshape(-1, 768), x.detach().reshape(-1, 768), ta=True)
