"""Day 016, part nineteen: a linear layer's backward in one launch
(`gemm_backward_one_kernel` in days/day016/one_launch.mojo, pytorch_custom_ops/gemm_backward.py).

On the CPU: which sizes it takes, and the grid and arguments of its plan. On the GPU: the
gradients of MojoGEMM and of gemm against float64 and against the separate calls (both
layouts of the weight, odd sizes, alpha, no bias, float32 and float64), one launch a
backward, the same under CUDA-graph capture, and the calls it leaves to the old path.
"""

from __future__ import annotations

import pytest
import torch

import pytorch_custom_ops as pco
from pytorch_custom_ops import gemm_backward as GB
from pytorch_custom_ops.gemm_gpu import SIMT_FP64, SIMT_SMALL

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
KERNEL = ".gemm_backward_one_kernel."


def _tensors(m, n, k, tb, dtype, bias=True):
    g, a = torch.empty(m, n, dtype=dtype), torch.empty(m, k, dtype=dtype)
    b = torch.empty((n, k) if tb else (k, n), dtype=dtype)
    outs = [torch.empty(m, k, dtype=dtype), torch.empty_like(b)] + ([torch.empty(n, dtype=dtype)] if bias else [])
    return outs, [g, a, b, torch.empty(2)]


@pytest.mark.parametrize("tb", [False, True])
def test_plan_is_one_grid_of_both_products_and_the_column_blocks(tb):
    outs, ins = _tensors(100, 200, 70, tb, torch.float32)
    (one,) = GB.gemm_backward_gpu(outs, ins, {"TRANSPOSE_B": tb})
    assert one.kernel is GB.GEMM_BWD_ONE[torch.float32, tb, False, *SIMT_SMALL]  # k = 70: element loads
    # dX 100 x 70: 2 x 2 tiles of 64; dW 200 x 70: 4 x 2; 200 columns, 32 a block
    assert one.grid == 4 + 8 + 7 and one.block == 256
    assert one.args[:3] == tuple(t.data_ptr() for t in outs) and one.args[-3:] == (100, 200, 70)


def test_plan_without_bias_has_no_column_blocks_and_vectors_where_they_fit():
    outs, ins = _tensors(64, 96, 128, True, torch.float64, bias=False)
    (one,) = GB.gemm_backward_gpu(outs, ins, {"TRANSPOSE_B": True})
    assert one.kernel is GB.GEMM_BWD_ONE[torch.float64, True, True, *SIMT_FP64]
    assert one.grid == 2 + 4 and one.args[2] == 0  # grad_c: never touched


def test_sizes_it_takes():
    f32, f64 = torch.float32, torch.float64
    assert GB.sizes_serve(64, 64, 64, True, True, f32, None)  # the overhead row's MojoGEMM(64, 64)
    assert GB.sizes_serve(1, 1, 1, False, False, f32, None)
    assert not GB.sizes_serve(8192, 768, 768, True, True, f32, None)  # 3xTF32 or 128-wide tiles
    assert not GB.sizes_serve(64, 768, 3072, True, True, f32, None)  # dW's K = 64: fine, dX splits its K
    assert not GB.sizes_serve(200, 64, 192, True, True, f32, None)  # dW (64 x 192 over 200 rows) splits
    assert GB.sizes_serve(8192, 768, 768, True, True, f64, None)  # float64: the SIMT tile everywhere
    assert not GB.sizes_serve(0, 64, 64, True, True, f32, None)


def test_cpu_tensors_keep_the_separate_calls():
    g, a, b = torch.randn(4, 3), torch.randn(4, 5), torch.randn(3, 5)
    assert not GB.serves(g, a, b, True)


# -- the GPU ------------------------------------------------------------------------------------
def _reference(x, w, bias, g, alpha, tb):
    x, w = (t.detach().double().requires_grad_(True) for t in (x, w))
    bias = None if bias is None else bias.detach().double().requires_grad_(True)
    y = alpha * (x @ (w.t() if tb else w)) + (0 if bias is None else bias)
    y.backward(g.double())
    return [x.grad, w.grad] + ([] if bias is None else [bias.grad])


def _ours(x, w, bias, g, alpha, tb, launched=None):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    bias = None if bias is None else bias.clone().requires_grad_(True)
    y = pco.gemm(x, w, bias, alpha, 0.0 if bias is None else 1.0, False, tb)
    if launched is not None:
        launched.clear()  # the backward's launches only
    y.backward(g)
    return [x.grad, w.grad] + ([] if bias is None else [bias.grad])


def _inputs(m, n, k, tb, dtype, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen, dtype=torch.float64)
    w = torch.randn((n, k) if tb else (k, n), generator=gen, dtype=torch.float64)
    b = torch.randn(n, generator=gen, dtype=torch.float64) if bias else None
    g = torch.randn(m, n, generator=gen, dtype=torch.float64)
    return [None if t is None else t.to("cuda", dtype) for t in (x, w, b, g)]


def _close(got, want, tol, what):
    scale = want.abs().max().item() + 1e-30
    gap = (got.double() - want).abs().max().item()
    assert gap <= tol * scale, f"{what}: {gap:.3g} > {tol:.1g} x {scale:.3g}"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("m, n, k", [(64, 64, 64), (1, 3, 5), (77, 130, 33), (200, 64, 192), (300, 257, 100)])
def test_cuda_one_launch_matches_float64_and_the_separate_calls(m, n, k, tb, bias, dtype, launched):
    x, w, b, g = _inputs(m, n, k, tb, dtype, bias, m * 31 + n * 7 + k)
    alpha = 1.0 if bias else -0.75
    one = _ours(x, w, b, g, alpha, tb, launched)
    # float32's dW of 64 x 192 over 200 rows is split in K: three calls (sizes_serve)
    served = not (dtype == torch.float32 and (m, n, k) == (200, 64, 192))
    ours = [key for key in launched if KERNEL in key]
    assert (launched == ours and len(ours) == 1) if served else (launched and not ours), launched
    with GB.ONE_LAUNCH.set_to(False):
        apart = _ours(x, w, b, g, alpha, tb, launched)
    assert not any(KERNEL in key for key in launched)
    want = _reference(x, w, b, g, alpha, tb)
    for got, other, ref, name in zip(one, apart, want, ("grad_x", "grad_w", "grad_bias")[: len(want)], strict=True):
        assert got.dtype == dtype and got.shape == ref.shape, name
        tol = TOL[dtype] * max(1, m, n, k) ** 0.5
        _close(got, ref, tol, f"{name} {m}x{n}x{k} tb={tb} {dtype}")
        _close(got, other.double(), tol, f"{name} against the separate calls")
    # the products run the same tiles as the separate calls: the same bits
    assert torch.equal(one[0], apart[0]) and torch.equal(one[1], apart[1])


@needs_cuda
def test_cuda_mojo_gemm_module_backward_is_one_launch(launched):
    torch.manual_seed(0)
    layer = pco.MojoGEMM(64, 48).cuda()
    x = torch.randn(5, 7, 64, device="cuda", requires_grad=True)  # leading dims, as nn.Linear
    ref = torch.nn.Linear(64, 48).cuda().double()
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    g = torch.randn(5, 7, 48, device="cuda")
    launched.clear()
    layer(x).backward(g)
    assert sum(KERNEL in key for key in launched) == 1, launched
    xr = x.detach().double().requires_grad_(True)
    ref(xr).backward(g.double())
    for got, want, name in (
        (x.grad, xr.grad, "x"),
        (layer.weight.grad, ref.weight.grad, "w"),
        (layer.bias.grad, ref.bias.grad, "bias"),
    ):
        _close(got, want, 1e-5 * 64**0.5, name)


@needs_cuda
@pytest.mark.parametrize("case", ["x_frozen", "beta_2", "grad_mode"])
def test_cuda_calls_it_leaves_to_the_separate_path(case, launched):
    x, w, b, g = _inputs(64, 64, 64, True, torch.float32, True, 5)
    x.requires_grad_(case != "x_frozen")
    w.requires_grad_(True)
    b.requires_grad_(True)
    beta = 2.0 if case == "beta_2" else 1.0
    y = pco.gemm(x, w, b, 1.0, beta, False, True)
    launched.clear()
    grads = torch.autograd.grad(y, [t for t in (x, w, b) if t.requires_grad], g, create_graph=case == "grad_mode")
    assert not any(KERNEL in key for key in launched), launched
    want = _reference(x, w, b * beta, g, 1.0, True)
    if case == "x_frozen":
        want = want[1:]
    if case == "beta_2":
        want[-1] = want[-1] * beta
    for got, ref in zip(grads, want, strict=True):
        _close(got, ref, 1e-5 * 8, case)


@needs_cuda
def test_cuda_one_launch_under_graph_capture():
    layer = pco.MojoGEMM(96, 40).cuda()
    x = torch.randn(33, 96, device="cuda", requires_grad=True)
    g = torch.randn(33, 40, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: programs recorded, kernels loaded
            layer.zero_grad(set_to_none=True)
            x.grad = None
            layer(x).backward(g)
    torch.cuda.current_stream().wait_stream(stream)
    eager = [t.grad.clone() for t in (x, layer.weight, layer.bias)]
    graph = torch.cuda.CUDAGraph()
    layer.zero_grad(set_to_none=True)
    x.grad = None
    with torch.cuda.graph(graph):
        layer(x).backward(g)
    grads = (x.grad, layer.weight.grad, layer.bias.grad)
    for t in grads:
        t.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(grads, eager, strict=True):
        assert torch.equal(got, want)


def test_plan_switch_empties_every_program_book(monkeypatch):
    """A C++ node replays its programs without asking Python, so a PlanSetting switch must
    empty their books at once (direct.on_plans_changed), not at the next Python call."""
    from pytorch_custom_ops import programs

    emptied = []
    monkeypatch.setattr(programs.Program, "_forget", lambda self: emptied.append(self.name))
    with GB.ONE_LAUNCH.set_to(False):
        assert {"GEMM.backward", "gemm"} <= set(emptied)
    assert emptied.count("GEMM.backward") == 2  # on the way in and on the way out


@needs_cuda
def test_cuda_node_made_before_a_plan_switch_follows_it():
    """Recipes and programs on (no `launched` fixture): the layer's node is C++ after two
    calls, and a node made under the one launch runs the three calls once it is switched
    off (the kernels' names, from the profiler)."""
    layer = pco.MojoGEMM(64, 64).cuda()
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    g = torch.randn(64, 64, device="cuda")

    def kernels(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    for _ in range(3):
        layer(x).backward(g)
    y = layer(x)
    with GB.ONE_LAUNCH.set_to(False):
        apart = kernels(lambda: y.backward(g))
    assert not any("gemm_bwd1" in k for k in apart) and sum("gemm_v1_simt" in k for k in apart) == 2, apart
    assert any("gemm_bwd1" in k for k in kernels(lambda: layer(x).backward(g)))
