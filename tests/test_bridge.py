"""The torch <-> Mojo bridge: contract checks, drift detection, fallback, real torch op."""

import dataclasses
import os
import time
import warnings

import pytest
import torch

import pytorch_custom_ops as pco
from pytorch_custom_ops import fallback, library, mojo_op
from pytorch_custom_ops.contract import ContractError, OpSpec, TensorArg, declared_parameters, user_ops
from pytorch_custom_ops.softmax import ONLINE_SOFTMAX

KERNEL = pco.online_softmax_kernel


# -- contract: one test per failure mode, all before anything reaches Mojo ---------------
BACKWARD = pco.KERNELS["softmax_backward"]  # two inputs that must agree


@pytest.mark.parametrize(
    "kernel, make, error, message",
    [
        (KERNEL, lambda x: ([x, x], {}), TypeError, r"online_softmax: expected 1 input tensor\(s\) \(x\), got 2"),
        (KERNEL, lambda x: ([x], {"out": [x]}), TypeError, "online_softmax: expected 0 destination tensor"),
        (KERNEL, lambda x: ([x.numpy()], {}), TypeError, "online_softmax: 'x' must be a torch.Tensor"),
        (KERNEL, lambda x: ([x.int()], {}), TypeError, "online_softmax: 'x' has dtype torch.int32"),
        (KERNEL, lambda x: ([x.to("meta")], {}), ValueError, "online_softmax: 'x' is on meta"),
        (KERNEL, lambda x: ([x.view(-1)], {}), ValueError, "online_softmax: 'x' must have rank 2"),
        (KERNEL, lambda x: ([x.t().contiguous().t()], {}), ValueError, "online_softmax: 'x' must be contiguous"),
        (BACKWARD, lambda x: ([x, x.double()], {}), TypeError, "'output' is torch.float64 but 'grad_output'"),
        (BACKWARD, lambda x: ([x, x[:3]], {}), ValueError, "shape mismatch on 'rows'"),
        (BACKWARD, lambda x: ([x, x[:, :9].contiguous()], {}), ValueError, "shape mismatch on 'cols'"),
    ],
)
def test_contract_rejects_bad_calls(kernel, make, error, message):
    inputs, kw = make(torch.randn(4, 10))
    with pytest.raises(error, match=message):
        kernel(inputs, **kw)


def test_outputs_are_fresh_tensors_that_later_calls_leave_alone():
    # the graph returns its outputs (MAX allocates them; torch wraps them, no copy):
    # each call must get its own memory, alive as long as torch holds the tensor
    xs = [torch.randn(5, 33) * (i + 1) for i in range(3)]
    ys = [KERNEL([x])[0] for x in xs]
    for x, y in zip(xs, ys, strict=True):
        assert y.data_ptr() != x.data_ptr() and y.is_contiguous() and y.dtype == x.dtype
        torch.testing.assert_close(y, torch.softmax(x, -1))
    assert len({y.data_ptr() for y in ys}) == 3


# -- the spec is checked against the compiled library ---------------------------------------
def test_every_mojo_op_has_a_verified_python_spec():
    kernels, _, _ = library.load_kernel_library()
    assert set(user_ops(kernels)) == set(pco.KERNELS), "each @register op needs an OpSpec in pytorch_custom_ops"
    for kernel in pco.KERNELS.values():
        kernel.verify()


def test_declared_parameters_come_from_the_library():
    kernels, _, _ = library.load_kernel_library()
    decl = str(kernels._analysis.kernel("online_softmax"))
    assert declared_parameters(decl) == ["target", "dtype", "BLOCK"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"params": {}}, r"declares compile-time parameter\(s\) \['BLOCK'\] that Python does not pass"),
        ({"params": {"BLOCK": 256, "WIDTH": 4}}, r"passes parameter\(s\) \['WIDTH'\]"),
        ({"inputs": (TensorArg("y", ("rows", "cols")),)}, r"Mojo declares tensors \['output', 'x'\]"),
    ],
)
def test_spec_drift_is_caught(change, message):
    spec = dataclasses.replace(ONLINE_SOFTMAX, **change)
    with pytest.raises(ContractError, match=message):
        mojo_op.MojoOp(spec).verify()


NEW_PARAM_OP = """
from extensibility import register, InputTensor, OutputTensor
from max.gpu.host import DeviceContext

@register("scale_rows")
struct ScaleRows:
    @staticmethod
    def execute[target: StaticString, dtype: DType, BLOCK: Int, UNROLL: Int](
        output: OutputTensor[dtype=dtype, rank=2, ...],
        x: InputTensor[dtype=dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        pass
"""


def test_a_mojo_parameter_python_does_not_pass_fails(tmp_path):
    """The day009 segfault class: Mojo grows a parameter, Python keeps the old call."""
    package = tmp_path / "drift"
    package.mkdir()
    (package / "__init__.mojo").write_text("")
    (package / "scale_rows.mojo").write_text(NEW_PARAM_OP)
    from max.graph import KernelLibrary

    kernels = KernelLibrary()
    kernels.load_paths([library.build_library(package, tmp_path / "build")])
    decl = str(kernels._analysis.kernel("scale_rows"))
    spec = OpSpec("scale_rows", (TensorArg("output", ("r", "c")),), (TensorArg("x", ("r", "c")),), params={"BLOCK": 1})
    with pytest.raises(ContractError, match=r"\['UNROLL'\] that Python does not pass"):
        spec.verify_against_library(declared_parameters(decl), ["output", "x"], 1)


# -- build cache -------------------------------------------------------------------------
def test_library_rebuilds_when_a_mojo_file_changes(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.mojo").write_text("")
    (package / "k.mojo").write_text("def f() -> Int:\n    return 1\n")
    first = library.build_library(package, tmp_path / "build")
    assert first.name == "pkg.mojoc" and library.build_library(package, tmp_path / "build") == first
    (package / "k.mojo").write_text("def f() -> Int:\n    return 2\n")
    second = library.build_library(package, tmp_path / "build")
    # a process may still compile from the first library: it stays until a day old
    assert second != first and second.exists() and first.exists()
    day_old = time.time() - library.OLD_LIBRARY_S - 60
    os.utime(first.parent, (day_old, day_old))
    (package / "k.mojo").write_text("def f() -> Int:\n    return 3\n")
    third = library.build_library(package, tmp_path / "build")
    assert third.exists() and second.exists() and not first.exists()


def test_build_error_names_the_compiler_message(tmp_path):
    package = tmp_path / "bad"
    package.mkdir()
    (package / "__init__.mojo").write_text("")
    (package / "k.mojo").write_text("def f() -> Int:\n    return undefined_name\n")
    with pytest.raises(library.KernelBuildError, match="undefined_name|use of unknown declaration"):
        library.build_library(package, tmp_path / "build")


def test_precompiled_library_env_must_name_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv(library.ENV_LIBRARY, str(tmp_path / "missing.mojoc"))
    with pytest.raises(library.KernelBuildError, match="does not name a file"):
        library.library_path()


# -- fallback: warned once, or an error when strict ---------------------------------------
@pytest.fixture
def broken_kernel(monkeypatch):
    def fail():
        raise library.KernelBuildError("simulated: MAX is not installed")

    monkeypatch.setattr(mojo_op, "load_kernel_library", fail)
    monkeypatch.setattr(fallback, "_warned", set())
    return mojo_op.MojoOp(ONLINE_SOFTMAX)


def test_fallback_warns_once_per_op_and_uses_torch(broken_kernel, monkeypatch):
    monkeypatch.setenv(fallback.STRICT_ENV, "0")
    x = torch.randn(3, 7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            (out,) = broken_kernel([x], torch_impl=lambda: [torch.softmax(x, -1)])
    fallbacks = [w for w in caught if issubclass(w.category, pco.MojoFallbackWarning)]
    assert len(fallbacks) == 1 and "simulated: MAX is not installed" in str(fallbacks[0].message)
    assert not broken_kernel.ready()
    torch.testing.assert_close(out, torch.softmax(x, -1))


def test_strict_mode_turns_fallback_into_an_error(broken_kernel):
    assert fallback.strict()  # conftest.py: the suite runs strict
    x = torch.randn(3, 7)
    with pytest.raises(pco.MojoUnavailableError, match="GPU_DAYS_STRICT=1 forbids the torch fallback"):
        broken_kernel([x], torch_impl=lambda: [torch.softmax(x, -1)])


def test_use_mojo_reports_the_live_path():
    assert pco.use_mojo("online_softmax")
    assert pco.MojoSoftmax().use_mojo
    with pytest.raises(KeyError, match="unknown op"):
        pco.use_mojo("nope")


# -- a real torch op ------------------------------------------------------------------------
def test_opcheck():
    for args in [(torch.randn(5, 33), -1), (torch.randn(2, 3, 9), 1), (torch.randn(4, 6, requires_grad=True), 0)]:
        torch.library.opcheck(torch.ops.gpu_days.online_softmax.default, args)


def test_gradcheck_float64():
    x = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: pco.online_softmax(t, 1), (x,))
    assert torch.autograd.gradcheck(lambda t: pco.online_softmax(t, 0), (x,))


def test_module_in_a_model_trains():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 5), pco.MojoSoftmax(-1))
    x = torch.randn(16, 8)
    loss = -(model(x)[:, 0] + 1e-6).log().mean()
    loss.backward()
    ref = torch.nn.Sequential(model[0], torch.nn.Softmax(-1))
    grad = model[0].weight.grad.clone()
    model[0].weight.grad = None
    (-(ref(x)[:, 0] + 1e-6).log().mean()).backward()
    torch.testing.assert_close(grad, model[0].weight.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_torch_compile_fullgraph_and_shape_changes():
    def f(x):
        return pco.online_softmax(x * 2, dim=-1) + 1

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for shape in [(4, 10), (7, 33)]:
        x = torch.randn(shape)
        torch.testing.assert_close(compiled(x), torch.softmax(x * 2, -1) + 1)


def test_vmap_goes_through_the_registered_op():
    """Under torch.vmap an eager call would hand the kernels a batched tensor, which has no
    storage (a crash deep inside: "Batching rule not implemented for aten::is_pinned");
    the registered op computes it one example at a time."""
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    w, b = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    targets = torch.randint(0, 5, (3, 4))
    torch.testing.assert_close(torch.vmap(lambda a: pco.gemm(a, w, transpose_b=True))(x), x @ w.T)
    torch.testing.assert_close(torch.vmap(lambda a: pco.linear(a, w, b))(x), torch.nn.functional.linear(x, w, b))
    torch.testing.assert_close(torch.vmap(lambda a: pco.long_softmax(a))(x), torch.softmax(x, -1))
    per_example = torch.stack([torch.nn.functional.cross_entropy(x[i], targets[i]) for i in range(3)])
    torch.testing.assert_close(torch.vmap(pco.cross_entropy)(x, targets), per_example)


@pytest.mark.parametrize(
    "name, fn",
    [
        ("softmax", lambda x: pco.softmax(x, -1)),
        ("gemm", lambda x: pco.gemm(x, x, transpose_b=True)),
        ("layer_norm", lambda x: pco.layer_norm(x, (5,))),
        ("add_layer_norm", lambda x: pco.add_layer_norm(x, x, (5,))[1]),
        ("long_softmax", lambda x: pco.long_softmax(x)),
        ("cross_entropy", lambda x: pco.cross_entropy(x, torch.tensor([0, 4, 2]))),
    ],
)
def test_torch_func_grad_is_refused_naming_the_op(name, fn):
    """torch.func.grad over a torch.library op's autograd fails inside torch with a message
    about autograd.Function's setup_context that names nothing of ours."""
    x = torch.randn(3, 5, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=rf"^{name}: torch\.func's grad.*torch\.vmap is"):
        torch.func.grad(lambda a: fn(a).square().sum())(x)


def test_new_shapes_do_not_recompile():
    x = torch.randn(3, 5)
    pco.online_softmax(x)
    n_models = len(KERNEL._models)
    for shape in [(1, 1), (9, 123), (2, 4097)]:
        pco.online_softmax(torch.randn(shape))
    assert len(KERNEL._models) == n_models  # one compiled graph per (dtype, device), any shape


# -- side tensors with a fixed dtype or size, and per-call compile-time parameters ---------
STATS_SPEC = OpSpec(
    name="norm_like",
    outputs=(TensorArg("y", ("rows", "cols")), TensorArg("mean", ("rows",), dtype=torch.float32)),
    inputs=(TensorArg("x", ("rows", "cols")), TensorArg("eps", (1,), dtype=torch.float32)),
    params={"BLOCK": 128, "TRANSPOSE": False},
)


def _stats_call(dtype=torch.bfloat16, eps_dtype=torch.float32, eps_size=1):
    x = torch.randn(3, 5).to(dtype)
    return [x, torch.ones(eps_size, dtype=eps_dtype)]


def test_contract_fixed_dtype_side_tensors():
    assert STATS_SPEC.check_call(_stats_call()) == {"rows": 3, "cols": 5}  # bf16 data, float32 eps
    with pytest.raises(TypeError, match="norm_like: 'eps' must be torch.float32, got torch.bfloat16"):
        STATS_SPEC.check_call(_stats_call(eps_dtype=torch.bfloat16))


def test_contract_fixed_size_dims():
    with pytest.raises(ValueError, match=r"norm_like: 'eps' must have shape \(1,\), got \(2,\)"):
        STATS_SPEC.check_call(_stats_call(eps_size=2))


# outputs sized by the inputs come back from the graph; the others are passed in
DEST_SPEC = OpSpec(
    name="matmul_like",
    outputs=(TensorArg("out", ("m", "n")), TensorArg("row_max", ("rows",), dtype=torch.float32)),
    inputs=(TensorArg("a", ("rows", "k")), TensorArg("b", ("k", "n"))),
)


def test_contract_returns_outputs_the_inputs_size_and_asks_for_the_rest():
    assert STATS_SPEC.returned == (True, True) and STATS_SPEC.destinations == ()
    assert DEST_SPEC.returned == (False, True)
    assert [a.name for a in DEST_SPEC.destinations] == ["out"]
    a, b = torch.randn(4, 3), torch.randn(3, 6)
    with pytest.raises(TypeError, match=r"matmul_like: expected 1 destination tensor\(s\) \(out\), got 0"):
        DEST_SPEC.check_call([a, b])
    out = torch.empty(4, 6)
    sizes = DEST_SPEC.check_call([a, b], [out])
    assert DEST_SPEC.output_shapes(sizes, [out]) == [(4, 6), (4,)]
    base = torch.randn(24)
    with pytest.raises(ValueError, match="matmul_like: output 'out' overlaps 'a' in memory"):
        DEST_SPEC.check_call([base[:12].view(4, 3), b], [base.view(4, 6)])


def test_call_params_override_defaults_and_reject_unknown_or_mistyped():
    assert STATS_SPEC.call_params(None) == {"BLOCK": 128, "TRANSPOSE": False}
    assert STATS_SPEC.call_params({"TRANSPOSE": True}) == {"BLOCK": 128, "TRANSPOSE": True}
    with pytest.raises(TypeError, match=r"norm_like: unknown compile-time parameter\(s\) \['UNROLL'\]"):
        STATS_SPEC.call_params({"UNROLL": 4})
    with pytest.raises(TypeError, match="norm_like: parameter 'TRANSPOSE' must be bool, got int"):
        STATS_SPEC.call_params({"TRANSPOSE": 1})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (stream ordering)")
@pytest.mark.parametrize("side_stream", [False, True], ids=["current_stream", "side_stream"])
def test_cuda_results_are_ordered_with_torchs_stream(side_stream):
    # A slow producer on torch's stream, the op, then a consumer: if MAX ran on its own
    # stream without waiting, or torch read the returned buffer before the kernel
    # finished, the row sums would be stale or partial.
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        slow = torch.randn(2048, 2048, device="cuda")
        for trial in range(3):
            for _ in range(30):
                slow = torch.tanh(slow @ slow)  # ~ms of work queued ahead of x
            x = torch.randn(1024, 4097, device="cuda") * 10 + slow[:1024, :1]
            (y,) = KERNEL([x])
            sums = y.double().sum(-1)
            y2 = pco.softmax(x, -1)
            del y  # its memory goes back to MAX while y2 is still in use
            torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-5, msg=f"trial {trial}")
            torch.testing.assert_close(y2, torch.softmax(x, -1), msg=f"trial {trial}")
    stream.synchronize()
