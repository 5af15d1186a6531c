"""The torch <-> Mojo bridge: contract checks, drift detection, fallback, real torch op."""

import warnings

import pytest
import torch

import pytorch_custom_ops as pco
from pytorch_custom_ops import fallback, library, mojo_op
from pytorch_custom_ops.contract import ContractError, OpSpec, TensorArg, declared_parameters, user_ops
from pytorch_custom_ops.softmax import ONLINE_SOFTMAX

KERNEL = pco.online_softmax_kernel


# -- contract: one test per failure mode, all before anything reaches Mojo ---------------
def _pair(shape=(4, 10), **kw):
    x = torch.randn(shape, **kw)
    return torch.empty_like(x), x


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda o, x: ([], [x]), TypeError, "expected 1 output tensor"),
        (lambda o, x: ([o], [x, x]), TypeError, "expected 1 input tensor"),
        (lambda o, x: ([o], [x.numpy()]), TypeError, "'x' must be a torch.Tensor"),
        (lambda o, x: ([o.int()], [x.int()]), TypeError, "'output' has dtype torch.int32"),
        (lambda o, x: ([o], [x.double()]), TypeError, "'x' is torch.float64 but 'output' is torch.float32"),
        (lambda o, x: ([o], [x.to("meta")]), ValueError, "'x' is on meta"),
        (lambda o, x: ([o.view(-1)], [x.view(-1)]), ValueError, "'output' must have rank 2"),
        (lambda o, x: ([o], [x.t().contiguous().t()]), ValueError, "'x' must be contiguous"),
        (lambda o, x: ([o[:3]], [x]), ValueError, "shape mismatch on 'rows'"),
        (lambda o, x: ([o[:, :9].contiguous()], [x]), ValueError, "shape mismatch on 'cols'"),
        (lambda o, x: ([x], [x]), ValueError, "output 'output' overlaps 'x'"),
    ],
)
def test_contract_rejects_bad_calls(make, error, message):
    out, x = _pair()
    outputs, inputs = make(out, x)
    with pytest.raises(error, match=f"online_softmax: .*{message}"):
        KERNEL(outputs, inputs)


def test_contract_accepts_views_that_do_not_overlap():
    buf = torch.randn(2, 4, 10)
    KERNEL([buf[0]], [buf[1]])  # same storage, disjoint halves
    torch.testing.assert_close(buf[0], torch.softmax(buf[1], -1))


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
    spec = OpSpec(**{**ONLINE_SOFTMAX.__dict__, **change})
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
    assert second != first and second.exists() and not first.exists()


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
    out = torch.empty_like(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            broken_kernel([out], [x], torch_impl=lambda: out.copy_(torch.softmax(x, -1)))
    fallbacks = [w for w in caught if issubclass(w.category, pco.MojoFallbackWarning)]
    assert len(fallbacks) == 1 and "simulated: MAX is not installed" in str(fallbacks[0].message)
    assert not broken_kernel.ready()
    torch.testing.assert_close(out, torch.softmax(x, -1))


def test_strict_mode_turns_fallback_into_an_error(broken_kernel):
    assert fallback.strict()  # conftest.py: the suite runs strict
    x = torch.randn(3, 7)
    out = torch.empty_like(x)
    with pytest.raises(pco.MojoUnavailableError, match="GPU_DAYS_STRICT=1 forbids the torch fallback"):
        broken_kernel([out], [x], torch_impl=lambda: out.copy_(torch.softmax(x, -1)))


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


def _stats_call(dtype=torch.bfloat16, mean_dtype=torch.float32, eps_size=1):
    x = torch.randn(3, 5).to(dtype)
    return [torch.empty_like(x), torch.empty(3, dtype=mean_dtype)], [x, torch.ones(eps_size)]


def test_contract_fixed_dtype_side_tensors():
    STATS_SPEC.check_call(*_stats_call())  # bf16 data with float32 statistics is fine
    with pytest.raises(TypeError, match="norm_like: 'mean' must be torch.float32, got torch.bfloat16"):
        STATS_SPEC.check_call(*_stats_call(mean_dtype=torch.bfloat16))


def test_contract_fixed_size_dims():
    with pytest.raises(ValueError, match=r"norm_like: 'eps' must have shape \(1,\), got \(2,\)"):
        STATS_SPEC.check_call(*_stats_call(eps_size=2))


def test_call_params_override_defaults_and_reject_unknown_or_mistyped():
    assert STATS_SPEC.call_params(None) == {"BLOCK": 128, "TRANSPOSE": False}
    assert STATS_SPEC.call_params({"TRANSPOSE": True}) == {"BLOCK": 128, "TRANSPOSE": True}
    with pytest.raises(TypeError, match=r"norm_like: unknown compile-time parameter\(s\) \['UNROLL'\]"):
        STATS_SPEC.call_params({"UNROLL": 4})
    with pytest.raises(TypeError, match="norm_like: parameter 'TRANSPOSE' must be bool, got int"):
        STATS_SPEC.call_params({"TRANSPOSE": 1})
