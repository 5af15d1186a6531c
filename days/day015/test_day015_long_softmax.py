"""Day 015: the multi-block long-row softmax (both pipelines) against a float64 reference,
and its CUDA launch plan (day016) checked on the CPU."""

import importlib
import re

import pytest
import torch

import pytorch_custom_ops as pco
from pytorch_custom_ops import direct
from pytorch_custom_ops.library import REPO_ROOT
from pytorch_custom_ops.long_softmax import PARTIALS, workspace_slots

ls = importlib.import_module("pytorch_custom_ops.long_softmax")  # the package exports a function of that name

# float64 1e-13: Mojo 1.2's own float64 exp was ~3e-13 off (days/day009/exp_f64.mojo)
TOL = {torch.float32: 2e-6, torch.float64: 1e-13, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
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
def test_cuda_benchmark_shapes(shape, pipeline):
    torch.manual_seed(8)
    check(torch.randn(shape, device="cuda") * 3, pipeline=pipeline)


# -- the CUDA launch plan (pytorch_custom_ops/long_softmax.py), on CPU tensors -------------------
FAMILIES = ls._long_softmax_gpu.families
H100_SMS = 132


@pytest.fixture
def sms(monkeypatch):
    """The plan's SM count for CPU tensors (device index None); returns a setter."""

    def set_count(count: int = H100_SMS):
        monkeypatch.setitem(ls._SM_COUNT, None, count)

    set_count()
    return set_count


def tensor(shape, dtype=torch.float32, offset=0, huge=False):
    """A CPU tensor of `shape`, `offset` elements into its storage; `huge` fakes one with
    no memory behind it (the plan only reads shapes, dtypes and pointers)."""
    if huge:
        return torch.empty(1, dtype=dtype).expand(shape)
    n = 1
    for s in shape:
        n *= s
    return torch.empty(n + offset, dtype=dtype)[offset:].view(shape)


def plan(x, pipeline="fused", slots=None, y=None, huge=False):
    rows, n = x.shape
    y = tensor(x.shape, x.dtype, huge=huge) if y is None else y
    ws = tensor((rows, workspace_slots(n) if slots is None else slots), torch.float64, huge=huge)
    launches = ls._long_softmax_gpu([y, ws], [x], {"PIPELINE": pipeline, "BLOCK": ls.BLOCK})
    for launch in launches:
        check_launch(launch, rows)
    return launches, ws


def check_launch(launch: direct.Launch, rows: int):
    kernel = launch.kernel
    assert kernel.family in FAMILIES and kernel in kernel.family.kernels()
    grid, block = direct.dim3(launch.grid), direct.dim3(launch.block)
    assert 0 < grid[0] < 2**31 and grid[1:] == (1, 1)
    assert block == (ls.BLOCK, 1, 1) and kernel.params[-1] == ls.BLOCK <= 1024  # the BLOCK the kernel was built for
    assert launch.smem == 0 and launch.cluster is None
    assert len(launch.args) == len(kernel.family.args) and all(type(a) is int for a in launch.args)
    assert grid[0] == rows * launch.args[-1]  # every kernel: `blocks` (last arg) blocks a row


def expected_blocks(n, rows, cap, sms=H100_SMS):
    return max(1, min(-(-n // 4096), sms * 4 // rows, cap))


def vec(dtype, *ok):
    return 16 // dtype.itemsize if all(ok) else 1


def names(launches):
    return [launch.kernel.family.function for launch in launches]


SHAPES = [(1, 1), (1, 4097), (1, 70001), (3, 70001), (5, 50152), (8, 2**18), (1, 2**24), (1000, 3), (2, 24576)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("offset", [0, 1])
def test_fused_plan_two_launches_per_shape(dtype, offset, sms):
    for rows, n in SHAPES:
        x = tensor((rows, n), dtype, offset)
        launches, ws = plan(x)
        assert names(launches) == ["online_partials_kernel", "normalize_kernel"]
        blocks = expected_blocks(n, rows, (ws.shape[1] - PARTIALS) // 2)
        width = vec(dtype, offset == 0, rows == 1 or n % (16 // dtype.itemsize) == 0)
        for launch in launches:
            assert launch.kernel.params[:2] == (dtype, width) and launch.args[-1] == blocks, (rows, n)
        partials, normalize = launches
        assert partials.args == (ws.data_ptr(), ws.shape[1], (ws.shape[1] - PARTIALS) // 2, x.data_ptr(), n, blocks)
        assert normalize.kernel.params[2] is True  # the second read goes last tile first (L2 reuse)


@pytest.mark.parametrize(
    "rows,n,want",
    [
        ((1, 2**28, 528)),  # one row fills the H100: 132 SMs x 4
        ((8, 2**22, 66)),
        ((1, 2**20, 256)),  # 4096 elements a block at least
        ((1, 2**30, 528)),
        ((2**20, 2**10, 1)),  # many short rows: one block each (day009's regime)
    ],
)
def test_block_counts_of_the_benchmark_shapes(rows, n, want, sms):
    launches, _ = plan(tensor((rows, n), huge=True), huge=True)
    assert [launch.args[-1] for launch in launches] == [want, want]
    assert launches[0].grid == rows * want


def schedule(launches, x, ws) -> dict[str, int]:
    """Follow the 4-stage launches through the workspace: every reduction pass reads what
    the launch before it wrote (never the region it writes), the max and the sum end in
    their slots, and every pass gets the 16-byte loads its source allows. Returns the
    number of passes of each reduction."""
    rows, n = x.shape
    base, slots = ws.data_ptr(), ws.shape[1]
    cap = (slots - PARTIALS) // 2
    result_slot = {"reduce_max_kernel": ls.MAX_SLOT, "reduce_sum_kernel": ls.SUM_SLOT}
    passes = dict.fromkeys(result_slot, 0)
    blocks = written = None  # written: (slot, count) of the partials the last launch left
    for launch in launches:
        name, args = launch.kernel.family.function, launch.args
        if name in result_slot:
            dst, dst_stride, src, src_stride, m, nb = args
            assert dst_stride == slots and (dst - base) % 8 == 0
            out = (dst - base) // 8
            if name == "reduce_max_kernel" and passes[name] == 0:
                assert (src, src_stride, m) == (x.data_ptr(), n, n)
                blocks = nb
                assert launch.kernel.params[:2] == (
                    x.dtype,
                    vec(x.dtype, src % 16 == 0, rows == 1 or n % (16 // x.dtype.itemsize) == 0),
                )
            else:
                assert src_stride == slots and ((src - base) // 8, m) == written, (name, written)
                assert out != written[0]
                assert launch.kernel.params[:2] == (
                    torch.float64,
                    vec(torch.float64, src % 16 == 0, rows == 1 or slots % 2 == 0),
                )
            assert (nb == 1 and out == result_slot[name]) or (1 < nb <= cap and out in (PARTIALS, PARTIALS + cap))
            assert nb == 1 or nb < m  # each pass shrinks the row
            passes[name] += 1
            written = None if nb == 1 else (out, nb)
        elif name == "exp_sum_kernel":
            assert passes["reduce_max_kernel"] and written is None and not passes["reduce_sum_kernel"]
            assert args[-1] == blocks
            written = (PARTIALS, blocks)  # one partial sum per block into region A
        else:
            assert name == "scale_kernel" and launch is launches[-1]
            assert passes["reduce_sum_kernel"] and written is None
    return passes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("offset", [0, 1])
def test_four_stage_plan_reduces_through_the_workspace(dtype, offset, sms):
    for rows, n in SHAPES:
        x = tensor((rows, n), dtype, offset)
        launches, ws = plan(x, "four_stage")
        passes = schedule(launches, x, ws)
        blocks = expected_blocks(n, rows, (ws.shape[1] - PARTIALS) // 2)
        assert passes == {"reduce_max_kernel": 1 + (blocks > 1), "reduce_sum_kernel": 1}, (rows, n)
        assert len(launches) == 3 + (blocks > 1) + 1
        width = vec(dtype, offset == 0, rows == 1 or n % (16 // dtype.itemsize) == 0)
        (exp_sum,) = (launch for launch in launches if launch.kernel.family is ls.EXP_SUM_KERNEL)
        assert exp_sum.kernel.params[:2] == (dtype, width)  # it reads x and writes y
        assert launches[-1].kernel.params[:2] == (dtype, vec(dtype, rows == 1 or n % (16 // dtype.itemsize) == 0))


def test_four_stage_plan_on_huge_rows_and_a_bigger_device(sms):
    x = tensor((1, 2**28), huge=True)
    launches, ws = plan(x, "four_stage", huge=True)
    assert schedule(launches, x, ws) == {"reduce_max_kernel": 2, "reduce_sum_kernel": 1}
    assert [launch.args[-1] for launch in launches] == [528, 1, 528, 1, 528]  # five launches, as on the H100
    # more than 4096 blocks a row (a wide workspace, a device with 10000 SMs): 3 passes each way
    sms(10000)
    launches, ws = plan(x, "four_stage", slots=PARTIALS + 2 * 20000, huge=True)
    assert schedule(launches, x, ws) == {"reduce_max_kernel": 3, "reduce_sum_kernel": 2}
    assert [launch.args[-1] for launch in launches] == [20000, 5, 1, 20000, 5, 1, 20000]


def test_plan_partials_fall_back_to_scalar_loads_when_the_workspace_rows_are_odd(sms):
    x = tensor((2, 50000))
    for slots in (PARTIALS + 2, PARTIALS + 6, PARTIALS + 7):  # 1 block a row, 3 blocks, 3 blocks on odd rows
        launches, ws = plan(x, "four_stage", slots=slots)
        schedule(launches, x, ws)  # checks each pass's VEC against the workspace's alignment
        assert launches[0].args[-1] == min(3, (slots - PARTIALS) // 2)


def test_plan_rejects_a_workspace_without_room(sms):
    with pytest.raises(ValueError, match=r"long_softmax: workspace must be \(rows, >= 6\), got \(2, 5\)"):
        plan(tensor((2, 100)), slots=PARTIALS + 1)


def test_every_declared_kernel_is_one_the_plan_picks(sms):
    picked = set()
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for pipeline in ls.PIPELINES:
            for shape, offset in (((2, 24576), 0), ((3, 20001), 0)):
                picked |= {launch.kernel for launch in plan(tensor(shape, dtype, offset), pipeline)[0]}
    picked |= {launch.kernel for launch in plan(tensor((2, 50000)), "four_stage", slots=PARTIALS + 7)[0]}
    declared = {k for family in FAMILIES for k in family.kernels()}
    assert picked == declared, sorted(k.key for k in declared - picked)


def test_the_plan_and_the_kernels_agree_on_the_workspace_layout():
    """The kernels index the workspace with these constants (long_softmax.mojo owns them);
    the plan mirrors them, and the CPU branch's block sizing mirrors the plan's."""
    sources = {
        f: (REPO_ROOT / "days" / "day015" / f).read_text() for f in ("long_softmax.mojo", "multiblock_reduce.mojo")
    }
    constants = {}
    for text in sources.values():
        constants.update({k: int(v) for k, v in re.findall(r"^comptime (\w+) = (\d+)\b", text, re.M)})
    assert (constants["MAX_SLOT"], constants["SUM_SLOT"], constants["PARTIALS"]) == (ls.MAX_SLOT, ls.SUM_SLOT, PARTIALS)
    assert constants["MIN_BLOCK_ELEMS"] == ls.MIN_BLOCK_ELEMS == ls.BLOCK * constants["UNROLL"] * 4  # one fp32 tile
    assert "BLOCK" not in constants  # a parameter, given by the op: one source for the launch and the kernels


# -- on CUDA: every kernel the plan may pick runs and is right ----------------------------------
@cuda_only
def test_cuda_runs_launch_every_declared_kernel(monkeypatch):
    picked = set()
    plan_fn = pco.long_softmax_kernel.gpu

    def recording(outputs, inputs, params):
        launches = plan_fn(outputs, inputs, params)
        picked.update(launch.kernel for launch in launches)
        return launches

    recording.families = plan_fn.families
    monkeypatch.setattr(pco.long_softmax_kernel, "gpu", recording)
    direct.plans_changed()  # a call replayed from an earlier test's recipe would not plan
    torch.manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for pipeline in PIPELINES:
            for shape in ((2, 24576), (3, 20001)):  # 16-byte loads; scalar loads (odd rows)
                check((torch.randn(shape, device="cuda") * 3).to(dtype), pipeline=pipeline)
    x = torch.randn(2, 50000, device="cuda")
    ws = torch.empty(2, PARTIALS + 7, dtype=torch.float64, device="cuda")  # odd rows: scalar loads of partials
    out, _ = pco.long_softmax_kernel([x], out=[ws], params={"PIPELINE": "four_stage"})
    torch.testing.assert_close(out.double(), reference(x), rtol=2e-6, atol=1e-12)
    declared = {k for family in FAMILIES for k in family.kernels()}
    assert picked == declared, sorted(k.key for k in declared - picked)


@cuda_only
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_three_reduction_passes_on_cuda(pipeline, monkeypatch):
    """More than 4096 blocks a row (an H100 uses 528): the reductions take 3 and 2 passes,
    ping-ponging between both workspace regions; the fused merge folds 4098 pairs."""
    torch.manual_seed(10)
    x = torch.randn(1, 2**24 + 4100, device="cuda") * 3
    monkeypatch.setitem(ls._SM_COUNT, x.device.index, 10000)  # "one wave" is 40000 blocks
    ws = torch.full((1, PARTIALS + 2 * 4200), float("nan"), dtype=torch.float64, device="cuda")
    y = torch.empty_like(x)
    launches = ls._long_softmax_gpu([y, ws], [x], {"PIPELINE": pipeline, "BLOCK": ls.BLOCK})
    if pipeline == "four_stage":
        assert [launch.args[-1] for launch in launches] == [4098, 2, 1, 4098, 2, 1, 4098]
    out, _ = pco.long_softmax_kernel([x], out=[ws], params={"PIPELINE": pipeline})
    want = reference(x)
    torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=2e-6 / x.shape[1])
    torch.testing.assert_close(ws[:, 0], x.max(-1).values.double(), rtol=0, atol=0)
    want_sum = torch.exp(x.double() - x.double().max(-1, keepdim=True).values).sum(-1)
    torch.testing.assert_close(ws[:, 1], want_sum, rtol=1e-6, atol=0)


@pytest.mark.parametrize("pipeline", ["fused", "four_stage"])
def test_the_public_cuda_plan_makes_its_own_workspace(sms, pipeline):
    """On CUDA `long_softmax` passes no workspace: its plan makes one as a scratch tensor,
    of the size the function used to allocate, so that a replay allocates it in C++. The
    launches are the workspace plan's for that workspace."""
    x = tensor((3, 70001))
    y = tensor(x.shape)
    params = {"PIPELINE": pipeline, "BLOCK": ls.BLOCK}
    with direct.planning() as scratch:
        launches = ls._long_softmax_rows_gpu([y], [x], params)
    (workspace,) = scratch
    assert workspace.shape == (3, workspace_slots(70001)) and workspace.dtype == torch.float64
    assert launches == ls._long_softmax_gpu([y, workspace], [x], params)
    assert ls.long_softmax_rows_kernel.spec.destinations == ()  # nothing for the caller to give
