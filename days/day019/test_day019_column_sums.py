"""Day 019, part 11: GELU_GRAD's column sums (tma_store.mojo), checked without a GPU.

The kernel runs in the CUDA tests (days/day020/test_day020_mlp.py). Here, in CI:

* `reduce_scatter_rows`' three shuffle stages, emulated lane by lane, leave lane g with
  column pair g summed over the 8 lanes that hold those columns;
* the partial rows the kernel writes (one per warp of each consumer's rows) cover every
  output row once, and every row of the workspace the plan allocates gets written;
* the plan: the product's launch asks for the sums (store_aux = 1, the workspace as
  `partials`) and day 013's sum_partials_kernel adds the workspace's rows into the vector.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

LANES = 32


def reduce_scatter_rows(values: np.ndarray) -> np.ndarray:
    """The warp's (32, 16) per-lane values after tma_store.mojo's reduce_scatter_rows:
    (32, 2), each lane's first pair, following the Mojo code step by step."""
    s = values.copy()
    lanes = np.arange(LANES)
    g = lanes // 4
    for b in range(3):
        m = 1 << b
        hi = (g >> b) & 1 == 1
        for e0 in range(0, 8, 2 * m):
            e1 = e0 + m
            for f in range(2):
                send = np.where(hi, s[:, 2 * e0 + f], s[:, 2 * e1 + f])
                keep = np.where(hi, s[:, 2 * e1 + f], s[:, 2 * e0 + f])
                s[:, 2 * e0 + f] = keep + send[lanes ^ (4 * m)]  # shuffle_xor(send, 4 m)
    return s[:, :2]


def test_each_lane_ends_with_its_column_pair_summed_over_the_warps_rows():
    rng = np.random.default_rng(1)
    for _ in range(20):
        v = rng.integers(-1000, 1000, size=(LANES, 16)).astype(np.float64)  # exact sums
        got = reduce_scatter_rows(v)
        for lane in range(LANES):
            g, t = lane // 4, lane % 4
            holders = [4 * gg + t for gg in range(8)]  # the lanes with columns 8 jc + 2 t, + 1
            np.testing.assert_array_equal(got[lane], v[holders][:, 2 * g : 2 * g + 2].sum(0))


def partial_rows(m: int, bm: int, batch: int, coop: bool = True) -> dict[int, list[tuple[int, int]]]:
    """Which output rows (matrix, row) each workspace row sums, as the kernel writes them:
    consumer `me` of tile row i has rows i bm + me bm / 2 ... (coop; ping-pong: a whole
    tile's bm rows, row_off 0), its warp w rows 16 w + g + 8 half of each 64-row block;
    row (bt ceil(M / WG) + base / WG) 4 + w is written where base < M."""
    wg_rows = bm // 2 if coop else bm
    rows: dict[int, list[tuple[int, int]]] = {}
    for bt in range(batch):
        for tile in range(math.ceil(m / bm)):
            for me in range(2 if coop else 1):
                base = tile * bm + me * wg_rows
                if base >= m:
                    continue
                for w in range(4):
                    prow = (bt * math.ceil(m / wg_rows) + base // wg_rows) * 4 + w
                    assert prow not in rows, prow  # each workspace row written once
                    rows[prow] = [
                        (bt, r)
                        for block in range(wg_rows // 64)
                        for r in range(base + 64 * block + 16 * w, base + 64 * block + 16 * w + 16)
                        if r < m
                    ]
    return rows


@pytest.mark.parametrize("coop", [True, False])
@pytest.mark.parametrize("m,bm,batch", [(4096, 256, 1), (1100, 256, 1), (1100, 128, 1), (64, 256, 2), (300, 128, 3)])
def test_the_partial_rows_cover_every_output_row_once(m, bm, batch, coop):
    rows = partial_rows(m, bm, batch, coop)
    parts = batch * math.ceil(m / (bm // 2 if coop else bm)) * 4  # what the plan allocates (pingpong_launch)
    assert sorted(rows) == list(range(parts))
    covered = sorted(r for v in rows.values() for r in v)
    assert covered == [(bt, r) for bt in range(batch) for r in range(m)]


@pytest.mark.parametrize(
    "version,wg_rows", [("COOP_TMA_256x128", 128), ("COOP_TMA_128x256", 64), ("PINGPONG_TMA_128x128", 128)]
)
@pytest.mark.parametrize("sums_dtype", [None, torch.float32])
def test_the_plan_sums_the_partials_into_the_vector(version, wg_rows, sums_dtype):
    import pytorch_custom_ops as pco
    from pytorch_custom_ops import direct
    from pytorch_custom_ops.gemm_gpu import PP_TMA_STORE
    from pytorch_custom_ops.layer_norm import LN_SUM_PARTIALS, SUM_COLS, SUM_LANES
    from pytorch_custom_ops.mlp import gelu_grad_product_gpu

    m, k, n = 1100, 72, 392
    g, w, d = (torch.empty(*s, dtype=torch.bfloat16) for s in ((m, k), (k, n), (m, n)))
    out = torch.empty(m, n, dtype=torch.bfloat16)
    sums = torch.empty(n, dtype=sums_dtype or torch.bfloat16)
    with pco.gemm_version(version), direct.planning() as scratch:
        gemm, total = gelu_grad_product_gpu([out, sums], [g, w, d, torch.empty(2)], {})
    (ws,) = scratch
    parts = math.ceil(m / wg_rows) * 4  # a row per warp of each consumer's rows of a tile
    assert ws.shape == (parts, n) and ws.dtype == torch.float32
    assert gemm.kernel.params[PP_TMA_STORE] is True and gemm.kernel.params[7:10] == (False, False, True)
    assert gemm.args[9] == ws.data_ptr() and gemm.args[-1] == 1  # partials; store_aux asks for the sums
    assert total.kernel is LN_SUM_PARTIALS[sums.dtype, torch.float32, SUM_COLS, SUM_LANES]
    assert total.args == (sums.data_ptr(), 0, ws.data_ptr(), parts, n, n)
    assert total.grid == -(-n // SUM_COLS) and total.block == SUM_COLS * SUM_LANES
    with pco.gemm_version(version), direct.planning():  # without the vector: no sums asked
        (plain,) = gelu_grad_product_gpu([out], [g, w, d, torch.empty(2)], {})
    assert plain.args[-1] == 0 and plain.kernel is gemm.kernel


def test_the_plan_refuses_sums_on_tiles_that_cannot_make_them():
    import pytorch_custom_ops as pco
    from pytorch_custom_ops import direct
    from pytorch_custom_ops.mlp import gelu_grad_product_gpu

    g, w, d = (torch.empty(*s, dtype=torch.bfloat16) for s in ((300, 64), (64, 136), (300, 136)))
    out, sums = torch.empty(300, 136, dtype=torch.bfloat16), torch.empty(136, dtype=torch.bfloat16)
    for version in ("COOP_256x128", "PINGPONG_128x128"):
        with pco.gemm_version(version), direct.planning(), pytest.raises(ValueError, match="column sums come"):
            gelu_grad_product_gpu([out, sums], [g, w, d, torch.empty(2)], {})
