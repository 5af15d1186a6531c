"""Recipes: a call seen before replays its first call's launches with new addresses.

The property that makes this safe: for any two calls with the same key (shapes, dtypes,
contiguity, device, 16-byte alignment, parameters), the recipe made from the first gives
exactly the launches the op's plan gives for the second. Checked here on the CPU with
the real plans (they only read shapes and addresses) and a stand-in for the loaded
kernels; the CUDA tests at the end check the same through the ops on the GPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import pytorch_custom_ops as pco
from pytorch_custom_ops import cuda_driver, direct
from pytorch_custom_ops.gemm import _KERNELS as GEMM_OPS
from pytorch_custom_ops.gemm_gpu import PP_SPLIT
from pytorch_custom_ops.softmax_family import softmax_kernel as SOFTMAX

LN = importlib.import_module("pytorch_custom_ops.layer_norm")  # pco.layer_norm is the function

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class FakeKernel:
    """What `direct.loaded` returns; its `function` stands for the driver's handle."""

    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log
        self.function, self.letters = self, direct.kind_letters(kernel.family.args)

    def ensure_smem(self, smem):
        pass

    def enqueue(self, grid, block, smem, stream, cluster, args):
        raise AssertionError("a replay launches through the launcher; enqueue is its error path")


@pytest.fixture
def fake_gpu(monkeypatch):
    """Every launch a recipe makes, recorded into the returned list (no driver)."""
    log: list = []

    def launch(function, grid, block, smem, stream, cluster, letters, args):
        assert letters == function.letters
        log.append((str(function.kernel), grid, block, smem, cluster or None, args))
        return 0

    monkeypatch.setattr(direct, "loaded", lambda k, i: FakeKernel(k, log))
    monkeypatch.setattr(direct, "launcher", lambda: launch)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 0, raising=False)
    # a tensor map's bytes, as a function of what the driver would be told
    monkeypatch.setattr(
        cuda_driver, "encode_tiled_tensor_map", lambda *a: repr(a).encode().ljust(128, b".")[:128], raising=True
    )
    return log


def expected(launches):
    """What enqueue should see for a plan's launches (tensor maps as their bytes)."""
    out = []
    for launch in launches:
        letters = direct.kind_letters(launch.kernel.family.args)
        args = direct.resolve_tensormaps(letters, launch.args)
        out.append((str(launch.kernel), launch.grid, launch.block, launch.smem, launch.cluster, args))
    return out


def replayed(log, recipe, outputs, inputs):
    log.clear()
    recipe.run(outputs, inputs)
    return list(log)


def replayed_with_workspace(log, monkeypatch, op, make):
    """Plan a call of `make()`'s tensors, make its recipe, replay it on a second call's:
    (the plan's launches, its scratch, the replay's launches, the one tensor the replay
    made, the second call's (outputs, inputs))."""
    (out1, in1), (out2, in2) = make(), make()
    with direct.planning() as scratch:
        first = op.gpu(out1, in1, op.spec.params)
    recipe = direct.recipe(out1, in1, scratch, first, 0, op.spec.returned)
    assert recipe is not None
    made = []
    real_empty = torch.empty
    monkeypatch.setattr(
        torch, "empty", lambda *a, **k: made.append(real_empty(*a, **{**k, "device": "cpu"})) or made[-1]
    )
    calls = replayed(log, recipe, out2, in2)
    monkeypatch.setattr(torch, "empty", real_empty)
    (workspace,) = made
    return first, scratch, calls, workspace, (out2, in2)


CASES = {
    "softmax 8x128 fp32": (
        SOFTMAX,
        lambda: ([torch.empty(8, 128)], [torch.randn(8, 128)]),
    ),
    "softmax 3x1001 bf16 (scalar loads)": (
        SOFTMAX,
        lambda: ([torch.empty(3, 1001, dtype=torch.bfloat16)], [torch.randn(3, 1001, dtype=torch.bfloat16)]),
    ),
    "softmax 2x300000 (cluster kernel)": (
        SOFTMAX,
        lambda: ([torch.empty(2, 300000)], [torch.randn(2, 300000)]),
    ),
    "gemm fp32 65x33x17 (SIMT)": (
        GEMM_OPS[(False, False, False)],
        lambda: (
            [torch.empty(65, 17)],
            [torch.randn(65, 33), torch.randn(33, 17), torch.zeros(1, 1), torch.tensor([1.0, 0.0])],
        ),
    ),
    "gemm bf16 256x512x128 NT (TMA)": (
        GEMM_OPS[(False, False, True)],
        lambda: (
            [torch.empty(256, 128, dtype=torch.bfloat16)],
            [
                torch.randn(256, 512, dtype=torch.bfloat16),
                torch.randn(128, 512, dtype=torch.bfloat16),
                torch.zeros(1, 1, dtype=torch.bfloat16),
                torch.tensor([1.0, 0.0]),
            ],
        ),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_recipe_gives_the_launches_the_plan_gives(fake_gpu, case):
    op, make = CASES[case]
    (out1, in1), (out2, in2) = make(), make()
    with direct.planning() as scratch:
        first = op.gpu(out1, in1, op.spec.params)
    recipe = direct.recipe(out1, in1, scratch, first, 0, op.spec.returned)
    assert recipe is not None
    assert replayed(fake_gpu, recipe, out2, in2) == expected(op.gpu(out2, in2, op.spec.params))


def test_a_failed_replay_launch_goes_through_the_checked_enqueue(fake_gpu, monkeypatch):
    """The replay calls the launcher itself; a non-zero CUresult must reach `enqueue`
    (which retries with the primary context, or raises naming the kernel), never be lost."""
    op, make = CASES["softmax 8x128 fp32"]
    (out1, in1), (out2, in2) = make(), make()
    recipe = direct.recipe(out1, in1, [], op.gpu(out1, in1, op.spec.params), 0, op.spec.returned)
    monkeypatch.setattr(direct, "launcher", lambda: lambda *a: cuda_driver.CUDA_ERROR_INVALID_CONTEXT)
    checked = []
    for step in recipe.steps:
        step.kernel.enqueue = lambda *a: checked.append(a)
    recipe.run(out2, in2)
    assert len(checked) == len(recipe.steps) == 1
    assert out2[0].data_ptr() in checked[0][-1] and in2[0].data_ptr() in checked[0][-1]


def test_a_recipe_allocates_every_output_shape_and_keeps_given_destinations(monkeypatch):
    """Sizes go to torch.empty as positional arguments (faster to parse): a 0-dim and an
    empty output must still come out with their shapes, and destinations as given."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **{**k, "device": "cpu"}))
    dest = torch.zeros(4)
    shapes = [((), torch.float32), (None, None), ((0, 3), torch.bfloat16), ((2, 5, 7), torch.float64)]
    recipe = direct.Recipe(shapes, [((), torch.float32, False)], [], 0)
    made = recipe.allocate([dest])
    assert [t.shape for t in made] == [(), (4,), (0, 3), (2, 5, 7)]
    assert [t.dtype for t in made] == [torch.float32, torch.float32, torch.bfloat16, torch.float64]
    assert made[1] is dest
    assert [t.shape for t in recipe.allocate([dest])] == [t.shape for t in made]


def test_layer_norm_backward_recipe_allocates_its_workspace_per_call(fake_gpu, monkeypatch):
    """Day 013's two kernels (rows over ONE_LAUNCH_ROWS): the recipe makes the partial sums'
    workspace anew for every call."""
    op = pco.layer_norm_backward_kernel
    rows, cols = 37, 96
    monkeypatch.setattr(LN.ONE_LAUNCH_ROWS, "value", 0)  # 37 rows: else day 016's one launch

    def make():
        outs = [torch.empty(rows, cols), torch.empty(cols), torch.empty(cols)]
        ins = [
            torch.randn(rows, cols),
            torch.randn(rows, cols),
            torch.randn(cols),
            torch.randn(rows),
            torch.randn(rows),
        ]
        return outs, ins

    _, scratch, calls, workspace, (out2, in2) = replayed_with_workspace(fake_gpu, monkeypatch, op, make)
    assert len(scratch) == 1  # the partial-sums workspace
    assert workspace.shape == scratch[0].shape and workspace.dtype == scratch[0].dtype
    stage1, stage2 = calls
    assert workspace.data_ptr() in stage1[-1] and workspace.data_ptr() in stage2[-1]
    assert out2[0].data_ptr() in stage1[-1] and in2[0].data_ptr() in stage1[-1]
    # the fused form's residual-gradient pointers are null in a plain call: constants, kept
    assert stage1[-1][7:9] == (0, 0)


def test_layer_norm_backward_one_launch_recipe_has_no_scratch(fake_gpu):
    """Day 016's one launch (a few rows): nothing to allocate but the three outputs, and
    one launch a call on the second call's addresses."""
    op = pco.layer_norm_backward_kernel
    rows, cols = 37, 96

    def make():
        outs = [torch.empty(rows, cols), torch.empty(cols), torch.empty(cols)]
        return outs, [torch.randn(rows, cols), torch.randn(rows, cols), torch.randn(cols), *torch.randn(2, rows)]

    (out1, in1), (out2, in2) = make(), make()
    with direct.planning() as scratch:
        (first,) = op.gpu(out1, in1, op.spec.params)
    assert scratch == [] and first.kernel.family is LN.LN_BWD_ONE
    recipe = direct.recipe(out1, in1, scratch, [first], 0, op.spec.returned)
    assert recipe is not None
    (call,) = replayed(fake_gpu, recipe, out2, in2)
    assert call[-1][:3] == tuple(t.data_ptr() for t in out2) and call[-1][3] == in2[0].data_ptr()


@pytest.mark.parametrize("ta", [False, True])
def test_fp32_split_k_recipe_keeps_its_constant_and_makes_its_workspace(fake_gpu, monkeypatch, ta):
    """The SIMT kernel's split-K pieces take alpha = 1, beta = 0 from a constant kept for
    the process (device_constant): the recipe keeps that address as it is (without it,
    every call planned again in Python: ~100 us a call on the H100's host), makes a new
    workspace per call, and passes the caller's alpha and beta to the sum kernel."""
    op = GEMM_OPS[(False, ta, False)]
    m, n, k = (64, 768, 3072) if not ta else (768, 768, 8192)  # a few tokens; a weight gradient

    def make():
        a = torch.randn(k, m) if ta else torch.randn(m, k)
        return [torch.empty(m, n)], [a, torch.randn(k, n), torch.zeros(1, 1), torch.tensor([0.5, 0.0])]

    first, scratch, (pieces, total), workspace, (out2, in2) = replayed_with_workspace(fake_gpu, monkeypatch, op, make)
    assert len(first) == 2 and len(scratch) == 1  # the pieces, the sum; the workspace
    assert workspace.shape == scratch[0].shape
    want_pieces = expected(first)[0]
    assert pieces[-1][0] == total[-1][1] == workspace.data_ptr()  # pieces write it, the sum reads it
    assert pieces[-1][1:3] == (in2[0].data_ptr(), in2[1].data_ptr())
    assert pieces[-1][4] == want_pieces[-1][4]  # the kept alpha = 1, beta = 0
    assert pieces[-1][5:] == want_pieces[-1][5:] and pieces[:-1] == want_pieces[:-1]
    assert total[-1][0] == out2[0].data_ptr() and total[-1][3] == in2[3].data_ptr()  # the caller's alpha, beta
    # an alpha_beta that is a kept constant too stays a per-call argument: it is an input
    kept = direct.kept_for_the_process(torch.tensor([1.0, 0.0]))
    in3 = [*make()[1][:3], kept]
    with direct.planning() as scratch3:
        launches = op.gpu(out2, in3, op.spec.params)
    recipe3 = direct.recipe(out2, in3, scratch3, launches, 0, op.spec.returned)
    assert recipe3.steps[1].template[3] is None  # alpha_beta: filled in per call


def test_16_bit_split_k_recipe_keeps_its_constant(fake_gpu, monkeypatch):
    """Day 019's few-token split (version 3 over strided tensor maps) has the same kept
    constant: its recipe exists, and a replay encodes the new operands' maps, makes a new
    workspace and keeps the constant's address."""
    op = GEMM_OPS[(False, False, False)]

    def make():
        a, b = torch.randn(64, 3072).to(torch.bfloat16), torch.randn(3072, 768).to(torch.bfloat16)
        return [torch.empty(64, 768, dtype=torch.bfloat16)], [
            a,
            b,
            torch.zeros(1, 1, dtype=torch.bfloat16),
            torch.tensor([1.0, 0.0]),
        ]

    first, _, (pieces, total), workspace, (out2, in2) = replayed_with_workspace(fake_gpu, monkeypatch, op, make)
    assert [launch.kernel.family.function for launch in first] == ["gemm_tma_kernel", "split_k_sum_kernel"]
    with direct.planning():
        want = expected(op.gpu(out2, in2, op.spec.params))[0]
    assert pieces[-1][:2] == want[-1][:2]  # the maps of the new operands, as the plan encodes them
    assert pieces[-1][2] == total[-1][1] == workspace.data_ptr() and pieces[-1][4] == want[-1][4]  # the kept constant
    assert total[-1][0] == out2[0].data_ptr() and total[-1][3] == in2[3].data_ptr()


def test_no_recipe_when_an_address_is_ambiguous_or_offset(fake_gpu):
    op = SOFTMAX
    x = torch.randn(8, 128)
    launches = op.gpu([x], [x], op.spec.params)  # in place: one address, two tensors
    assert direct.recipe([x], [x], [], launches, 0, op.spec.returned) is None
    base = torch.randn(9, 128)
    view = base[1:]  # a plan that points inside another tensor cannot be traced
    launches = op.gpu([torch.empty(8, 128)], [view], op.spec.params)
    assert direct.recipe([torch.empty(8, 128)], [base], [], launches, 0, op.spec.returned) is None


# -- on the GPU ---------------------------------------------------------------------------------
@needs_cuda
def test_cuda_repeated_calls_use_the_recipe_and_stay_correct(monkeypatch):
    x = torch.randn(33, 1001, device="cuda")
    pco.softmax(x, -1)  # makes the recipe
    assert SOFTMAX._recipes
    monkeypatch.setattr(SOFTMAX, "gpu", None)  # a replayed call must not plan
    for _ in range(3):
        x = torch.randn(33, 1001, device="cuda")
        torch.testing.assert_close(pco.softmax(x, -1), torch.softmax(x, -1))


@needs_cuda
def test_cuda_repeated_fp32_split_k_calls_replay_without_planning(monkeypatch):
    # 64 x 3072 @ 3072 x 768: 12 tiles, K in pieces; the pieces' alpha-beta constant is kept
    a, b = torch.randn(64, 3072, device="cuda"), torch.randn(3072, 768, device="cuda")
    pco.gemm(a, b)  # makes the recipe
    op = GEMM_OPS[(False, False, False)]
    monkeypatch.setattr(op, "gpu", None)  # a replayed call must not plan
    for _ in range(3):
        a = torch.randn(64, 3072, device="cuda")
        want = (a.double() @ b.double()).float()
        torch.testing.assert_close(pco.gemm(a, b), want, rtol=1e-4, atol=1e-3)


@needs_cuda
def test_cuda_repeated_calls_replay_in_cpp_without_python_replay_or_plan(monkeypatch):
    from pytorch_custom_ops import replay

    x = torch.randn(31, 999, device="cuda")
    pco.softmax(x, -1)  # planned in Python; the recipe goes to the C++ book too
    assert replay.module() is not None, replay.replay_kind()
    assert replay.module().size(SOFTMAX._book) >= 1
    monkeypatch.setattr(SOFTMAX, "gpu", None)
    monkeypatch.setattr(direct.Recipe, "run", lambda *a: pytest.fail("the Python replay ran"))
    for _ in range(3):
        x = torch.randn(31, 999, device="cuda")
        torch.testing.assert_close(pco.softmax(x, -1), torch.softmax(x, -1))


@needs_cuda
def test_cuda_failed_launch_in_cpp_resumes_in_python_from_that_step(monkeypatch):
    """The C++ replay bound to a driver whose every launch fails (201, no context): the
    Python recipe goes on from the failed step with the real launcher, and the result is
    right."""
    import ctypes

    from pytorch_custom_ops import replay

    x = torch.randn(8, 100, device="cuda")
    pco.online_softmax(x)
    resumed = []
    real = direct.Recipe.resume
    monkeypatch.setattr(direct.Recipe, "resume", lambda self, *a: resumed.append(a[-1]) or real(self, *a))
    failing = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: cuda_driver.CUDA_ERROR_INVALID_CONTEXT)
    address = ctypes.cast(failing, ctypes.c_void_p).value
    replay.load(replay.build(), (address, address))
    try:
        y = pco.online_softmax(x)
    finally:
        replay.load(replay.build())  # the real driver again
    assert resumed == [0]
    torch.testing.assert_close(y, torch.softmax(x, -1))


@needs_cuda
def test_cuda_recipe_never_skips_a_check_that_would_fail():
    x = torch.randn(64, 64, device="cuda")
    pco.softmax(x, -1)
    with pytest.raises(ValueError, match="contiguous"):
        SOFTMAX([x.t()])  # same shape and dtype, not contiguous
    with pytest.raises(TypeError, match="dtype"):
        SOFTMAX([x.to(torch.int32)])
    misaligned = torch.randn(64 * 64 + 1, device="cuda")[1:].view(64, 64)  # 4-byte offset
    torch.testing.assert_close(SOFTMAX([misaligned])[0], torch.softmax(misaligned, -1))


@needs_cuda
def test_cuda_changing_the_gemm_version_forgets_recipes():
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    reference = (a.double() @ b.double()).to(torch.bfloat16)
    for version in ("AUTO", "MMA_SYNC", "WG_64x128", "TMA_128x128", "AUTO"):
        with pco.gemm_version(version):
            for _ in range(2):
                torch.testing.assert_close(pco.gemm(a, b), reference, atol=0.5, rtol=2e-2)
            (recipe,) = GEMM_OPS[(False, False, False)]._recipes.values()  # the version change forgot the others
            names = [str(s.kernel.kernel) for s in recipe.steps]
            want = {"MMA_SYNC": "gemm_tc", "WG_64x128": "gemm_wgmma", "TMA_128x128": "gemm_tma"}.get(version, "gemm")
            assert all(want in n for n in names), (version, names)


@needs_cuda
def test_recipes_replay_under_cuda_graph_capture():
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
    xb = x.float()
    pco.layer_norm(xb, (4096,), w, b)  # the recipe exists before the capture
    graph = torch.cuda.CUDAGraph()
    static_in = xb.clone()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static_out = pco.layer_norm(static_in, (4096,), w, b)
    static_in.copy_(torch.randn_like(static_in))
    graph.replay()
    torch.testing.assert_close(static_out, torch.nn.functional.layer_norm(static_in, (4096,), w, b))


@pytest.mark.parametrize("version", ["STREAMK_256x128", "SPLITK_256x128"])
def test_split_tile_recipes_remake_their_workspace_and_zeroed_counters_per_call(fake_gpu, monkeypatch, version):
    """Day 019's stream-K GEMM counts the pieces of each tile in int32 counters that must
    start at zero on every call: the recipe makes them with torch.zeros, per call, and its
    float32 workspace with torch.empty. Split-K has only the workspace (and a second
    launch that sums it)."""
    op = GEMM_OPS[(False, True, False)]  # dW = X^T dY

    def make():
        x, dy = torch.randn(4096, 768, dtype=torch.bfloat16), torch.randn(4096, 768, dtype=torch.bfloat16)
        ab = torch.tensor([1.0, 0.0])
        return [torch.empty(768, 768, dtype=torch.bfloat16)], [x, dy, torch.zeros(1, 1, dtype=torch.bfloat16), ab]

    (out1, in1), (out2, in2) = make(), make()
    with pco.gemm_version(version), direct.planning() as scratch:
        first = op.gpu(out1, in1, op.spec.params)
    streamk = version.startswith("STREAMK")
    assert first[0].kernel.params[PP_SPLIT] == (1 if streamk else 2)
    assert len(first) == (1 if streamk else 2)
    assert [t.dtype for t in scratch] == ([torch.float32, torch.int32] if streamk else [torch.float32])
    recipe = direct.recipe(out1, in1, scratch, first, 0, op.spec.returned)
    made = {"empty": [], "zeros": []}
    for name in made:
        real = getattr(torch, name)
        monkeypatch.setattr(
            torch,
            name,
            lambda *a, _r=real, _n=name, **k: made[_n].append(_r(*a, **{**k, "device": "cpu"})) or made[_n][-1],
        )
    launches = replayed(fake_gpu, recipe, out2, in2)
    assert len(launches) == len(first)
    (workspace,) = made["empty"]
    assert workspace.shape == scratch[0].shape and all(workspace.data_ptr() in launch[-1] for launch in launches)
    if streamk:
        (counters,) = made["zeros"]
        assert counters.shape == scratch[1].shape and counters.data_ptr() in launches[0][-1]
    else:
        assert made["zeros"] == [] and out2[0].data_ptr() in launches[1][-1]
