"""The direct launch path (day 016): kernels built ahead of time, launched on torch's stream.

Without a GPU these tests still prove the GPU side: every declared kernel compiles to
PTX, each launcher's argument list matches its kernel's `.entry` parameters, every launch
plan picks declared kernels with launchable grids, and a broken build gives a clear
error. With a GPU they check stream ordering, CUDA-graph capture, torch.compile, other
devices and the behaviour when a kernel cannot load.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

import pytorch_custom_ops as pco
from pytorch_custom_ops import direct, fallback, gpu_build, launcher
from pytorch_custom_ops.gpu_kernels import abi_mismatch, all_kernels, entry_params

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def builds():
    return gpu_build.build()


# -- ahead-of-time build, no GPU needed ---------------------------------------------------------
def test_every_declared_kernel_is_built_with_a_matching_abi(builds):
    kernels = all_kernels()
    assert {k.family.module.split(".")[1] for k in kernels} == set(builds)
    for day, path in builds.items():
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["target"] == "sm_90a" and manifest["mojo"] != "unknown"
        for k in (k for k in kernels if k.key in manifest["kernels"]):
            info = manifest["kernels"][k.key]
            ptx = (path / f"{k.key}.ptx").read_text()
            assert ".target sm_90a" in ptx
            params = entry_params(ptx, info["entry"])
            assert abi_mismatch(k, params) is None, (day, k.key, params)
        assert len(manifest["kernels"]) == len([k for k in kernels if k.family.module.split(".")[1] == day])


def test_abi_check_catches_a_launcher_that_disagrees_with_its_kernel():
    k = pco.online_softmax_kernel.gpu_kernels()[0]
    assert abi_mismatch(k, ["ptr", "ptr", "i64"]) is None
    assert "launcher passes ['ptr', 'ptr', 'i64']" in abi_mismatch(k, ["ptr", "ptr", "i32"])
    assert abi_mismatch(k, ["ptr", "ptr"]) is not None
    assert abi_mismatch(k, ["ptr", "i64", "ptr"]) is not None


def test_build_is_cached_and_keyed_by_the_sources(builds, tmp_path):
    day, path = next(iter(builds.items()))
    stamp = (path / "manifest.json").stat().st_mtime_ns
    assert gpu_build.build(days=[day])[day] == path  # unchanged sources: reused, not rebuilt
    assert (path / "manifest.json").stat().st_mtime_ns == stamp
    kernels = gpu_build.by_day(all_kernels())[day]
    assert gpu_build.day_key(day, kernels, b"other sources") != path.name


def test_every_op_has_a_launch_plan_for_cuda():
    for name, op in pco.KERNELS.items():
        assert op.gpu is not None, f"{name} has no GPU launch plan"
        assert op.gpu_kernels(), f"{name}'s launch plan declares no kernel families"


# -- faults: a missing or corrupt build is a clear Python error ---------------------------------
@pytest.fixture
def private_build(builds, tmp_path, monkeypatch):
    """A copy of the build that a test may break; the loader's caches are reset around it."""
    root = tmp_path / "gpu"
    for path in builds.values():
        shutil.copytree(path, root / path.name)
    monkeypatch.setenv(gpu_build.ENV_GPU_KERNELS, str(root))
    monkeypatch.setattr(gpu_build, "mojo_executable", _no_compiler)
    direct._day_build.cache_clear()
    direct._loaded.clear()
    yield root
    direct._day_build.cache_clear()
    direct._loaded.clear()


def _no_compiler():
    raise pco.KernelBuildError("no mojo here (as on the GPU machine)")


def _day009_kernel():
    return pco.online_softmax_kernel.gpu_kernels()[0]


def test_missing_build_names_what_to_run(private_build):
    shutil.rmtree(next(private_build.glob("day009-*")))
    with pytest.raises(direct.KernelLoadError, match=r"no GPU build of day009 .*gpu_build"):
        direct.LoadedKernel(_day009_kernel(), 0)


def test_corrupt_ptx_is_reported_before_the_driver_sees_it(private_build):
    k = _day009_kernel()
    path = next(private_build.glob("day009-*"))
    (path / f"{k.key}.cubin").unlink(missing_ok=True)
    (path / f"{k.key}.ptx").write_text(".version 8.5\n.target sm_90a\n// truncated\n")
    with pytest.raises(direct.KernelLoadError, match=rf"{k.family.function}.*not the PTX the manifest names"):
        direct.LoadedKernel(k, 0)


def test_unreadable_manifest_is_reported(private_build):
    (next(private_build.glob("day009-*")) / "manifest.json").write_text("{not json")
    with pytest.raises(direct.KernelLoadError, match="manifest .* is unreadable"):
        direct.LoadedKernel(_day009_kernel(), 0)


def test_launch_arguments_are_packed_as_the_kernel_reads_them():
    letters = launcher.kind_letters(("ptr", "i32", "i64", "f32", "tensormap"))
    _, offsets, _ = launcher.arg_struct(letters)
    descriptor = bytes(8) + bytes(range(1, 121))  # zero bytes first: no C-string truncation
    raw = bytes(memoryview(launcher.pack_args(letters, (2**40 + 8, -3, 2**33, 1.5, descriptor))).cast("B"))
    assert int.from_bytes(raw[offsets[0] : offsets[0] + 8], "little") == 2**40 + 8
    assert int.from_bytes(raw[offsets[1] : offsets[1] + 4], "little", signed=True) == -3
    assert int.from_bytes(raw[offsets[2] : offsets[2] + 8], "little") == 2**33
    assert raw[offsets[4] : offsets[4] + 128] == descriptor
    with pytest.raises(ValueError, match="a tensor map is 128 bytes, got 64"):
        launcher.pack_args(letters, (0, 0, 0, 0.0, bytes(64)))


def test_a_tensormap_argument_may_be_encoded_at_launch_time():
    class Spec:  # what a plan may pass instead of bytes (no driver call while planning)
        calls = 0

        def encode(self):
            Spec.calls += 1
            return bytes(range(128))

    letters = launcher.kind_letters(("tensormap", "ptr", "tensormap"))
    args = direct.resolve_tensormaps(letters, (Spec(), 16, bytes(128)))
    assert Spec.calls == 1
    assert args == (bytes(range(128)), 16, bytes(128))


# -- on the GPU ---------------------------------------------------------------------------------
@needs_cuda
def test_cuda_call_never_touches_max(monkeypatch):
    def no_max(*args, **kwargs):
        raise AssertionError("MAX was used on the CUDA path")

    monkeypatch.setattr(pco.online_softmax_kernel, "model", no_max)
    x = torch.randn(37, 1001, device="cuda")
    torch.testing.assert_close(pco.online_softmax(x), torch.softmax(x, -1))


@needs_cuda
def test_cuda_graph_capture_and_replay_match_eager():
    x = torch.randn(64, 3000, device="cuda")
    g = torch.randn(64, 3000, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (kernel loads, allocator)
        pco.softmax(x, -1), pco.online_softmax(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = pco.softmax(x, -1)
        dx = pco.softmax_backward(g, y, -1)
        z = pco.online_softmax(x)
    for trial in range(3):
        x.copy_(torch.randn_like(x) * (trial + 1))
        graph.replay()
        torch.testing.assert_close(y, torch.softmax(x, -1))
        torch.testing.assert_close(z, torch.softmax(x, -1))
        ref = torch.softmax(x, -1)
        torch.testing.assert_close(dx, ref * (g - (g * ref).sum(-1, keepdim=True)))


@needs_cuda
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_torch_compile_fullgraph_on_cuda(mode):
    def f(x):
        return pco.softmax(x * 2, dim=-1) + pco.online_softmax(x, dim=0)

    compiled = torch.compile(f, fullgraph=True, mode=mode)
    for _ in range(3):
        x = torch.randn(33, 257, device="cuda")
        torch.testing.assert_close(compiled(x), torch.softmax(x * 2, -1) + torch.softmax(x, 0))


@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_tensor_on_second_gpu_launches_there():
    x = torch.randn(17, 999, device="cuda:1")
    before = torch.cuda.current_device()
    y = pco.online_softmax(x)
    z = pco.softmax(x, -1)
    assert y.device == x.device and z.device == x.device and torch.cuda.current_device() == before
    torch.testing.assert_close(y, torch.softmax(x, -1))
    torch.testing.assert_close(z, torch.softmax(x, -1))


@needs_cuda
@pytest.mark.parametrize("seen_before", [False, True])  # planned in the thread, or replayed there
def test_cuda_work_from_a_fresh_thread_launches(seen_before):
    """A new thread may have no current CUDA context: the first launch there, planned or
    replayed (in C++, which hands a failed launch back to Python), must still run."""
    import threading

    x = torch.randn(8, 100 + seen_before, device="cuda")
    if seen_before:
        pco.online_softmax(x)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("y", pco.online_softmax(x)))
    thread.start()
    thread.join()
    torch.testing.assert_close(result["y"], torch.softmax(x, -1))


@needs_cuda
def test_cuda_kernel_that_cannot_load_fails_strictly_or_falls_back_with_a_warning(private_build, monkeypatch):
    k = _day009_kernel()  # float32
    path = next(private_build.glob("day009-*"))
    (path / f"{k.key}.cubin").unlink(missing_ok=True)
    ptx = (path / f"{k.key}.ptx").read_text()
    (path / f"{k.key}.ptx").write_text(ptx.replace("ret;", "this is not ptx;", 1))  # entry intact, body broken
    op = pco.online_softmax_kernel
    monkeypatch.setattr(op, "_gpu_broken", None)
    x = torch.randn(4, 50, device="cuda")
    with pytest.raises(fallback.MojoUnavailableError, match=r"online_softmax: .*online_softmax_kernel"):
        op([x])
    monkeypatch.setenv(fallback.STRICT_ENV, "0")
    monkeypatch.setattr(fallback, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (y,) = op([x], torch_impl=lambda: [torch.softmax(x, -1)])
    assert any(issubclass(w.category, fallback.MojoFallbackWarning) for w in caught)
    torch.testing.assert_close(y, torch.softmax(x, -1))


def test_device_constants_are_made_once(device):
    from pytorch_custom_ops.mojo_op import device_constant

    dev = torch.device(device) if device == "cpu" else torch.empty(0, device=device).device
    a = device_constant((1e-5,), torch.float32, dev)
    assert device_constant((1e-5,), torch.float32, dev) is a
    assert device_constant((2.0, 0.5), torch.float32, dev).tolist() == [2.0, 0.5]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_first_loaded_inside_a_graph_capture(dtype):
    # no warm-up call: the kernels' modules are loaded (and their shared memory opted in)
    # while torch.cuda.graph captures, which must neither fail nor invalidate the capture
    torch.manual_seed(5)
    a, b = torch.randn(1040, 1032, device="cuda", dtype=dtype), torch.randn(1032, 2056, device="cuda", dtype=dtype)
    kept = dict(direct._loaded)
    direct._loaded.clear()  # every kernel loads again on its next use...
    direct.plans_changed()  # ... and no recipe holds an old one
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = pco.gemm(a, b)
        graph.replay()
        torch.cuda.synchronize()
    finally:
        direct._loaded.update(kept)
        direct.plans_changed()
    err = (y.double() - a.double() @ b.double()).abs() / (a.double().abs() @ b.double().abs())
    assert err.max() < (2e-6 if dtype == torch.float32 else 1e-2)


@needs_cuda
def test_cuda_constant_first_made_inside_a_graph_capture_is_not_kept():
    from pytorch_custom_ops.mojo_op import _constants, device_constant

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        t = device_constant((0.125, 3.5), torch.float32, torch.empty(0, device="cuda").device)
    graph.replay()
    assert t.tolist() == [0.125, 3.5]
    assert not any(k[0] == (0.125, 3.5) for k in _constants)  # it lives in the graph's pool


def test_a_refused_tensor_map_names_the_operand_its_strides_and_alignment(monkeypatch):
    """The driver's CUDA_ERROR_INVALID_VALUE says nothing of why: the message carries what
    the map was for, its strides and the address's alignment (TMA needs 16 bytes)."""
    from pytorch_custom_ops import cuda_driver
    from pytorch_custom_ops.gemm_gpu import TensorMapSpec

    class RefusingDriver:
        def cuTensorMapEncodeTiled(self, *args):
            return 1  # CUDA_ERROR_INVALID_VALUE

        def cuGetErrorName(self, code, out):
            return 0

        cuGetErrorString = cuGetErrorName

    monkeypatch.setattr(cuda_driver, "_lib", RefusingDriver)
    spec = TensorMapSpec(torch.bfloat16, 0x7F0000001002, (64, 129, 5, 3), (128, 8256, 41280), (64, 64, 1, 1))
    with pytest.raises(cuda_driver.CudaDriverError) as caught:
        TensorMapSpec(**{**spec.__dict__, "what": "attention operand"}).encode()
    message = str(caught.value)
    assert "attention operand: dims (64, 129, 5, 3), byte strides (128, 8256, 41280), box (64, 64, 1, 1)" in message
    assert "address 0x7f0000001002, 2 bytes past a 16-byte boundary" in message
    assert spec == TensorMapSpec(**{**spec.__dict__, "what": "another label"})  # the label is not part of the key
