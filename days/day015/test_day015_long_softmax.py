"""Day 015: the multi-block long-row softmax (both pipelines) against a float64 reference."""

import pytest
import torch

import pytorch_custom_ops as pco
from pytorch_custom_ops.long_softmax import PARTIALS, workspace_slots

TOL = {torch.float32: 2e-6, torch.float64: 1e-10, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
PIPELINES = ("fused", "four_stage")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(x.double(), dim=dim)


def check(x: torch.Tensor, dim: int = -1, pipeline: str = "fused") -> torch.Tensor:
    y = pco.long_softmax(x, dim, pipeline)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert torch.isfinite(y).all()
    want = reference(x, dim)
    # relative per element; the absolute floor scales with 1/n, so that the tiny outputs
    # of a long row are still checked (a drifting row sum shows up there)
    n = x.shape[dim] if x.dim() else 1
    tol = TOL[x.dtype]
    torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol / n)
    torch.testing.assert_close(y.double().sum(dim), torch.ones_like(want.sum(dim)), atol=tol * 8, rtol=0)
    return y


def test_mojo_path_is_live():
    assert pco.use_mojo("long_softmax"), pco.long_softmax_kernel.failure


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize(
    "shape",
    [
        (1,),  # N = 1
        (4097,),  # one fp32 tile + a 1-element tail
        (70001,),  # odd: 16-byte loads for the body, scalar tail
        (3, 70001),  # rows > 1 with odd N: rows are not 16-byte aligned, scalar path
        (5, 50152),  # N % 4 == 0 but not a multiple of a tile: partial tile
        (8, 2**18),  # rows that each get many blocks
        (2**24,),  # the long vector (64 MiB), many blocks, two reduce passes
    ],
    ids=lambda s: "x".join(map(str, s)),
)
def test_fp32_shapes(shape, pipeline, device):
    torch.manual_seed(sum(shape))
    check(torch.randn(shape, device=device) * 3, pipeline=pipeline)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes(dtype, device):
    torch.manual_seed(1)
    x = (torch.randn(3, 20001, device=device) * 4).to(dtype)
    check(x)
    if dtype == torch.bfloat16:  # 8 elements per 16-byte load: the other vector width
        check(x, pipeline="four_stage")


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_large_magnitudes(pipeline, device):
    torch.manual_seed(2)
    x = torch.randn(4, 30000, device=device) * 3
    x[0] += 1e4  # a +1e4 offset: exp without the max shift would overflow
    x[1] -= 1e4
    x[2] *= 1e4  # values up to ~4e4 apart: nearly one-hot
    x[3, 12345] = 1e4  # a single huge entry
    check(x, pipeline=pipeline)
    edge = torch.randn(2, 4100, device=device)
    edge[:, :8] = torch.tensor([3e38, 3e38, -3e38, -3e38] * 2)  # near the float max, both signs
    y = pco.long_softmax(edge, pipeline=pipeline)
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y, torch.softmax(edge, -1))


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_masked_entries_and_rows(pipeline, device):
    torch.manual_seed(3)
    x = torch.randn(6, 9000, device=device)
    x[0, ::3] = float("-inf")  # partly masked row: those entries get exactly 0
    x[1, :8999] = float("-inf")  # one survivor: exactly 1 there
    y = pco.long_softmax(x, pipeline=pipeline)
    assert (y[0, ::3] == 0).all()
    assert y[1, 8999] == 1 and (y[1, :8999] == 0).all()
    torch.testing.assert_close(y[:2].double(), reference(x[:2]), atol=2e-6 / 9000, rtol=2e-6)
    x[2] = float("-inf")  # fully masked: NaN, as in torch
    x[3, 4000] = float("nan")  # a NaN anywhere: NaN row
    x[4, 17] = float("inf")  # +inf: NaN row (inf - inf)
    x[5, 8000:] = float("-inf")  # masked tail only: a normal row
    y = pco.long_softmax(x, pipeline=pipeline)
    assert torch.equal(torch.isnan(y), torch.isnan(torch.softmax(x, -1)))
    assert torch.isnan(y[2:5]).all() and not torch.isnan(y[[0, 1, 5]]).any()
    torch.testing.assert_close(y[5].double(), reference(x[5]), atol=2e-6 / 9000, rtol=2e-6)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_any_dim_and_layout(dim, device):
    torch.manual_seed(4)
    x = torch.randn(5, 6000, 3, device=device)
    check(x, dim)
    check(x.transpose(0, 2), dim)  # non-contiguous input
    check(x[1:, 1:], dim)  # an offset view: rows not 16-byte aligned


def test_pipelines_agree_and_leave_max_and_sum_in_the_workspace(device):
    torch.manual_seed(5)
    x = torch.randn(3, 2**20 + 4, device=device) * 5
    rows, n = x.shape
    results = {}
    for pipeline in PIPELINES:
        ws = torch.full((rows, workspace_slots(n)), float("nan"), dtype=torch.float64, device=device)
        out, ws_back = pco.long_softmax_kernel([x], out=[ws], params={"PIPELINE": pipeline})
        assert ws_back is ws
        torch.testing.assert_close(ws[:, 0], x.max(-1).values.double(), rtol=0, atol=0)  # exact
        want_sum = torch.exp(x.double() - x.double().max(-1, keepdim=True).values).sum(-1)
        torch.testing.assert_close(ws[:, 1], want_sum, rtol=1e-6, atol=0)
        assert not torch.isnan(ws[:, PARTIALS + 1]).any(), "a second block per row wrote its partial"
        results[pipeline] = out
    torch.testing.assert_close(results["fused"], results["four_stage"], rtol=2e-6, atol=1e-12)


def test_a_small_workspace_means_fewer_blocks_not_wrong_results(device):
    torch.manual_seed(6)
    x = torch.randn(2, 50000, device=device)
    for slots in (PARTIALS + 2, PARTIALS + 6):  # one block a row, then three
        ws = torch.empty(2, slots, dtype=torch.float64, device=device)
        out, _ = pco.long_softmax_kernel([x], out=[ws], params={"PIPELINE": "four_stage"})
        torch.testing.assert_close(out.double(), reference(x), rtol=2e-6, atol=1e-12)


def test_workspace_too_small_or_wrong_raises(device):
    x = torch.randn(2, 100, device=device)
    with pytest.raises(ValueError, match="long_softmax: workspace must be"):
        pco.long_softmax_kernel([x], out=[torch.empty(2, PARTIALS + 1, dtype=torch.float64, device=device)])
    with pytest.raises(TypeError, match="long_softmax: 'workspace' must be torch.float64"):
        pco.long_softmax_kernel([x], out=[torch.empty(2, 64, device=device)])
    with pytest.raises(ValueError, match="long_softmax: shape mismatch on 'rows'"):
        pco.long_softmax_kernel([x], out=[torch.empty(3, 64, dtype=torch.float64, device=device)])


def test_scalar_and_empty(device):
    assert pco.long_softmax(torch.tensor(3.0, device=device)).item() == 1.0
    assert pco.long_softmax(torch.empty(0, device=device)).shape == (0,)
    assert pco.long_softmax(torch.empty(0, 5, device=device)).shape == (0, 5)
    assert pco.long_softmax(torch.empty(5, 0, device=device)).shape == (5, 0)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(TypeError, match="long_softmax: dtype torch.int64"):
        pco.long_softmax(torch.arange(6))
    with pytest.raises(IndexError, match="long_softmax: dim 1 is out of range"):
        pco.long_softmax(torch.randn(3), dim=1)
    with pytest.raises(TypeError, match="long_softmax: expected a torch.Tensor"):
        pco.long_softmax([1.0, 2.0])
    with pytest.raises(TypeError, match="long_softmax: dim must be an int"):
        pco.long_softmax(torch.randn(3), dim=0.0)
    with pytest.raises(ValueError, match="long_softmax: device meta is not supported"):
        pco.long_softmax(torch.randn(3, device="meta"))
    with pytest.raises(ValueError, match="long_softmax: pipeline must be one of"):
        pco.long_softmax(torch.randn(3), pipeline="three_stage")
    with pytest.raises(TypeError, match="long_softmax: pipeline must be a str"):
        pco.MojoLongSoftmax(pipeline=2)


def test_opcheck():
    for args in [(torch.randn(3, 5000), -1, "fused"), (torch.randn(2, 3, 9, requires_grad=True), 1, "fused")]:
        torch.library.opcheck(torch.ops.gpu_days.long_softmax.default, args)


def test_gradcheck_float64():
    x = torch.randn(2, 37, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: pco.long_softmax(t, 1), (x,))
    assert torch.autograd.gradcheck(lambda t: pco.long_softmax(t, 0), (x,))


def test_backward_matches_torch_fp32():
    torch.manual_seed(7)
    x = torch.randn(2, 10000, requires_grad=True)
    g = torch.randn(2, 10000)
    (gx,) = torch.autograd.grad(pco.long_softmax(x), x, g)
    (want,) = torch.autograd.grad(torch.softmax(x, -1), x, g)
    torch.testing.assert_close(gx, want, rtol=1e-5, atol=1e-9)


def test_torch_compile_fullgraph():
    def f(x):
        return pco.long_softmax(x * 2, dim=-1) + 1

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for shape in [(5000,), (2, 7000)]:
        x = torch.randn(shape)
        torch.testing.assert_close(compiled(x), torch.softmax(x * 2, -1) + 1)


def test_module(device):
    x = torch.randn(2, 5000, device=device)
    module = pco.MojoLongSoftmax(dim=-1, pipeline="four_stage")
    assert module.use_mojo and "four_stage" in repr(module)
    torch.testing.assert_close(module(x), pco.long_softmax(x))


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("shape", [(1, 2**26), (8, 2**22), (2, 2**24 + 12)], ids=lambda s: "x".join(map(str, s)))
def test_benchmark_shapes_on_gpu(shape, pipeline):
    torch.manual_seed(8)
    check(torch.randn(shape, device="cuda") * 3, pipeline=pipeline)
