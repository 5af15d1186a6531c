"""Day 011: online softmax and fused softmax(X) @ V (Triton) against float64 references.

Without CUDA the kernels run in Triton's interpreter (see conftest.py): shapes stay small.
"""

import math

import pytest
import torch

from days.day011.fused_softmax import (
    autotuned_config,
    fused_softmax,
    fused_softmax_autotuned,
    online_softmax,
    softmax_mult,
)

# The Triton kernels need CUDA tensors, or CPU tensors under the interpreter: one device.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative to max |reference|. float32 on a GPU goes through TF32 in tl.dot (~5e-4); the
# interpreter multiplies in exact float32. 16-bit: P and the output are rounded to 16 bits.
FUSED_TOL = {torch.float32: 5e-3 if DEVICE == "cuda" else 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SOFTMAX_TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def reference(x: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    return softmax_mult(x.double(), V.double())


def check_fused(out: torch.Tensor, x: torch.Tensor, V: torch.Tensor, tol: float | None = None) -> None:
    batch, d1, _ = x.shape
    assert out.shape == (batch, d1, V.shape[2])
    assert out.dtype == x.dtype and out.device == x.device
    assert torch.isfinite(out).all()
    want = reference(x, V)
    tol = FUSED_TOL[x.dtype] if tol is None else tol
    scale = want.abs().max().item() or 1.0
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * scale)


def check_softmax(y: torch.Tensor, x: torch.Tensor) -> None:
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert torch.isfinite(y).all()
    want = torch.softmax(x.double(), dim=-1)
    tol = SOFTMAX_TOL[x.dtype]
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol / x.shape[-1])
    torch.testing.assert_close(y.double().sum(-1), torch.ones_like(want.sum(-1)), rtol=0, atol=8 * tol)


# --- online softmax ---------------------------------------------------------------------


@pytest.mark.parametrize("shape, block", [((1, 1), None), ((3, 17), 16), ((5, 100), 16), ((4, 1000), None)])
def test_online_softmax_shapes(shape, block):
    x = randn(*shape, scale=3.0, seed=shape[1])
    check_softmax(online_softmax(x, BLOCK=block), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_online_softmax_dtypes(dtype):
    x = randn(6, 130, dtype=dtype, scale=4.0, seed=1)
    check_softmax(online_softmax(x, BLOCK=32), x)


def test_online_softmax_large_values_and_leading_dims():
    x = randn(2, 3, 77, scale=100.0, seed=2)  # exp(100 * x) overflows without the max shift
    x[..., 40] = 500.0  # the max arrives in a later tile: l must be rescaled
    check_softmax(online_softmax(x, BLOCK=16), x)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on 1 / 0
def test_online_softmax_minus_inf_like_torch():
    x = randn(3, 40, seed=3)
    x[0, :20] = -math.inf  # whole first tiles are -inf: no NaN from exp(-inf - -inf)
    x[1] = -math.inf  # all -inf: torch gives NaN, so do we
    y = online_softmax(x, BLOCK=16)
    torch.testing.assert_close(y, torch.softmax(x, -1), equal_nan=True)


# --- fused softmax @ V ------------------------------------------------------------------


def test_reference_is_softmax_then_matmul():
    x, V = randn(2, 5, 7, seed=4), randn(2, 7, 3, seed=5)
    torch.testing.assert_close(softmax_mult(x, V), torch.softmax(x, -1) @ V)
    torch.testing.assert_close(softmax_mult(x.transpose(1, 2), V[:, :5], dim=1), torch.softmax(x, -1).mT @ V[:, :5])


@pytest.mark.parametrize(
    "batch, d1, d2, d3",
    [
        (1, 1, 1, 1),  # everything masked but one element
        (2, 17, 33, 20),  # no dim a multiple of 16
        (1, 32, 64, 16),  # exact multiples
        (3, 5, 100, 1),
        (1, 40, 16, 70),  # d3 spans several BLOCK_3 tiles
    ],
)
def test_fused_shapes(batch, d1, d2, d3):
    x, V = randn(batch, d1, d2, seed=d2), randn(batch, d2, d3, seed=d3)
    check_fused(fused_softmax(x, V), x, V)


@pytest.mark.parametrize("b1, b2, b3", [(16, 16, 16), (32, 16, 32), (16, 64, 16), (64, 32, 64)])
def test_fused_block_sizes(b1, b2, b3):
    x, V = randn(2, 37, 90, seed=6), randn(2, 90, 45, seed=7)
    check_fused(fused_softmax(x, V, BLOCK_1=b1, BLOCK_2=b2, BLOCK_3=b3), x, V)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_dtypes(dtype):
    x, V = randn(2, 17, 50, dtype=dtype, scale=2.0, seed=8), randn(2, 50, 24, dtype=dtype, seed=9)
    check_fused(fused_softmax(x, V, BLOCK_2=32), x, V)


def test_fused_ieee_is_exact_float32():
    x, V = randn(2, 17, 40, seed=10), randn(2, 40, 20, seed=11)
    check_fused(fused_softmax(x, V, input_precision="ieee"), x, V, tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_large_values(dtype):
    x = randn(2, 20, 70, dtype=dtype, seed=12) * 100  # naive exp overflows at ~88
    x[:, :, 60] = 1000.0  # the max comes in the last chunk: acc and l are rescaled late
    V = randn(2, 70, 18, dtype=dtype, seed=13)
    check_fused(fused_softmax(x, V), x, V)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on 0 / 0
def test_fused_minus_inf_like_torch():
    x, V = randn(2, 17, 40, seed=14), randn(2, 40, 20, seed=15)
    x[0, :, :20] = -math.inf  # a causal-style mask: the first chunks are all -inf
    x[1, 3] = -math.inf  # a fully masked row: NaN, as in torch
    want = reference(x, V)
    tol = FUSED_TOL[torch.float32]
    torch.testing.assert_close(fused_softmax(x, V).double(), want, rtol=tol, atol=tol, equal_nan=True)
    assert torch.isnan(want[1, 3]).all()


def test_fused_non_contiguous_inputs():
    x = randn(2, 40, 17, seed=16).transpose(1, 2)  # (2, 17, 40), stride 1 along d1
    V = randn(2, 20, 40, seed=17).transpose(1, 2)  # (2, 40, 20)
    assert not x.is_contiguous() and not V.is_contiguous()
    check_fused(fused_softmax(x, V), x, V)


def test_fused_empty_dims_like_torch():
    x, V = randn(2, 3, 0), randn(2, 0, 4)
    torch.testing.assert_close(fused_softmax(x, V), softmax_mult(x, V))  # zeros
    assert fused_softmax(randn(0, 3, 5), randn(0, 5, 4)).shape == (0, 3, 4)


def test_autotuned_matches_reference():
    x, V = randn(2, 17, 33, seed=18), randn(2, 33, 20, seed=19)
    check_fused(fused_softmax_autotuned(x, V), x, V)
    assert autotuned_config() is not None


# --- bad inputs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x_shape, v_shape, match",
    [
        ((4, 5), (4, 5, 6), "x must be 3-D"),
        ((2, 4, 5), (5, 6), "V must be 3-D"),
        ((2, 4, 5), (3, 5, 6), "batch sizes differ"),
        ((2, 4, 5), (2, 6, 6), "d2 differs"),
    ],
)
def test_fused_rejects_bad_shapes(x_shape, v_shape, match):
    with pytest.raises(ValueError, match=f"fused_softmax: {match}"):
        fused_softmax(torch.zeros(x_shape, device=DEVICE), torch.zeros(v_shape, device=DEVICE))
    with pytest.raises(ValueError, match=f"fused_softmax_autotuned: {match}"):
        fused_softmax_autotuned(torch.zeros(x_shape, device=DEVICE), torch.zeros(v_shape, device=DEVICE))


def test_fused_rejects_bad_dtypes_and_devices():
    x, V = randn(1, 4, 5), randn(1, 5, 6)
    with pytest.raises(ValueError, match="fused_softmax: x has dtype torch.int32"):
        fused_softmax(x.int(), V)
    with pytest.raises(ValueError, match="fused_softmax: V has dtype torch.float64"):
        fused_softmax(x, V.double())
    with pytest.raises(ValueError, match="fused_softmax: x and V must have the same dtype"):
        fused_softmax(x, V.half())
    with pytest.raises(ValueError, match="fused_softmax: x and V must be on the same device"):
        fused_softmax(x, V.to("meta"))
    with pytest.raises(TypeError, match="fused_softmax: V must be a torch.Tensor"):
        fused_softmax(x, V.tolist())


@pytest.mark.parametrize("kwargs", [{"BLOCK_1": 8}, {"BLOCK_2": 24}, {"BLOCK_3": 0}, {"BLOCK_2": 16.0}])
def test_fused_rejects_bad_blocks(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"fused_softmax: {name} must be a power of 2 >= 16"):
        fused_softmax(randn(1, 4, 5), randn(1, 5, 6), **kwargs)


def test_rejects_bad_precision_and_online_softmax_inputs():
    with pytest.raises(ValueError, match="fused_softmax: input_precision"):
        fused_softmax(randn(1, 4, 5), randn(1, 5, 6), input_precision="fp8")
    with pytest.raises(ValueError, match="online_softmax: x has dtype torch.int64"):
        online_softmax(torch.ones(2, 3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="online_softmax: BLOCK must be a power of 2"):
        online_softmax(randn(2, 3), BLOCK=12)
    with pytest.raises(ValueError, match="online_softmax: x must have at least 1 dimension"):
        online_softmax(torch.tensor(1.0, device=DEVICE))


# --- the benchmark's smoke configuration ------------------------------------------------


def test_benchmark_quick_writes_csv_and_store(tmp_path):
    pd = pytest.importorskip("pandas")
    from benchmark.store import load
    from days.day011 import bench_softmax_matmul as bench

    assert bench.main(["--quick", "--out-dir", str(tmp_path / "out"), "--results-dir", str(tmp_path / "res")]) == 0

    df = bench.read_csv(tmp_path / "out" / bench.CSV_NAME)
    assert list(df.columns) == bench.CSV_COLUMNS == [
        "batch_size", "d1", "d2", "d3", "triton", "BLOCK", "forward_ms_mean", "forward_ms_std", "forward_peak_MiB",
    ]  # fmt: skip
    assert {c: str(t) for c, t in df.dtypes.items()} == bench.CSV_DTYPES
    # also the raw file, read without hints: bools parse as bools, BLOCK has blanks
    raw = pd.read_csv(tmp_path / "out" / bench.CSV_NAME)
    assert raw["triton"].dtype == bool
    n_d2 = df["d2"].nunique()
    assert len(df) == 5 * n_d2  # torch, B16, B32, B64, autotune per d2
    torch_rows = df[~df["triton"]]
    assert len(torch_rows) == n_d2 and torch_rows["BLOCK"].isna().all()
    assert sorted(df.loc[df["triton"], "BLOCK"].dropna().unique().tolist()) == [16, 32, 64]
    assert df["forward_ms_mean"].notna().all()  # every implementation ran and validated
    assert df["forward_peak_MiB"].isna().all() == (DEVICE == "cpu")

    stored = load(day="day011", results_dir=tmp_path / "res")
    assert len(stored) == len(df)
    assert set(stored["impl"]) == {"torch", "triton_B16", "triton_B32", "triton_B64", "triton_autotune"}
    assert set(stored["status"]) == {"ok"} and set(stored["op"]) == {"softmax_matmul"}
