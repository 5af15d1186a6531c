"""The native launch paths hand the driver the same launch, byte for byte: the two
launchers (C and ctypes) for one launch, and the C++ replay (replay.cpp) for a recipe,
against the Python replay of the same recipe.

No GPU here: each is bound to a stand-in for cuLaunchKernel / cuLaunchKernelEx (a ctypes
callback with the driver's signature) that decodes what it was given. They bind copies of
the builds (`private_builds`), never the builds the process itself launches with.
"""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
import torch

from pytorch_custom_ops import cuda_driver as cu
from pytorch_custom_ops import direct, launcher, programs, replay
from pytorch_custom_ops.gemm import _KERNELS as GEMM_OPS
from pytorch_custom_ops.softmax_family import softmax_kernel as SOFTMAX

LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *([ctypes.c_uint] * 7),
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_void_p,
)
LAUNCH_EX = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(cu._LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p
)
SIZES = {"p": 8, "q": 8, "i": 4, "f": 4, "t": 128}


class FakeDriver:
    """Records each launch as (function, grid, block, smem, stream, cluster, arg bytes).
    `letters`: the argument kinds of every function, or a dict of them by function."""

    def __init__(self, letters: bytes | dict[int, bytes], code: int = 0):
        self.letters, self.code, self.seen = letters, code, []
        self.plain = LAUNCH(self._plain)
        self.ex = LAUNCH_EX(self._ex)

    def _args(self, params, f):
        letters = self.letters if isinstance(self.letters, bytes) else self.letters[f]
        return [ctypes.string_at(params[i], SIZES[k]) for i, k in enumerate(letters.decode())]

    def _plain(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.seen.append((f, (gx, gy, gz), (bx, by, bz), smem, stream or 0, 0, self._args(params, f)))
        return self.code

    def _ex(self, config, f, params, extra):
        c = config.contents
        attr = c.attrs.contents
        assert c.numAttrs == 1 and attr.id == cu.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        cluster = tuple(attr.value.clusterDim)
        assert cluster[1:] == (1, 1)
        grid, block = (c.gridDimX, c.gridDimY, c.gridDimZ), (c.blockDimX, c.blockDimY, c.blockDimZ)
        self.seen.append((f, grid, block, c.sharedMemBytes, c.hStream or 0, cluster[0], self._args(params, f)))
        return self.code

    def address(self, fn) -> int:
        return ctypes.cast(fn, ctypes.c_void_p).value


@pytest.fixture(scope="session")
def private_builds(tmp_path_factory) -> dict[str, Path]:
    """Copies of the C launcher and the C++ replay to bind to stand-in drivers. A module's
    driver binding is global to its file, so binding the build itself would leave this
    process's real launches (the CUDA tests that follow, on a GPU machine) calling a
    stand-in that no longer exists. A copy is another file: another binding."""
    folder = tmp_path_factory.mktemp("private_builds")
    found = {}
    for name, build in (("launcher", lambda: launcher._compile(launcher.SOURCE)), ("replay", replay.build)):
        try:
            built = build()
        except OSError:
            continue  # the tests that need it skip for want of a compiler
        found[name] = folder / built.name
        shutil.copy(built, found[name])
    return found


def both_launchers(driver: FakeDriver, private_builds):
    c = launcher.c_launcher(driver.address(driver.plain), driver.address(driver.ex), private_builds["launcher"])
    return {"c": c, "ctypes": launcher._ctypes_launch(driver.plain, driver.ex)}


needs_cc = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")), reason="no C compiler on this machine"
)

LETTERS = launcher.kind_letters(("tensormap", "ptr", "i64", "i32", "f32", "ptr"))
DESCRIPTOR = bytes(8) + bytes(range(1, 121))  # zero bytes first: no C-string truncation
ARGS = (DESCRIPTOR, 2**47 + 16, -(2**40), -7, 0.375, 2**64 - 64)


@needs_cc
@pytest.mark.parametrize(
    "grid, block, smem, stream, cluster",
    [(5, 128, 0, 0, 0), ((7, 2), (32, 4, 2), 4096, 0x7F00_1234_5670, 0), (16, 512, 200 * 1024, 0xABC0, 4)],
)
def test_c_and_ctypes_launchers_pass_the_driver_the_same_launch(grid, block, smem, stream, cluster, private_builds):
    driver = FakeDriver(LETTERS)
    for launch in both_launchers(driver, private_builds).values():
        assert launch(0xF00D, grid, block, smem, stream, cluster, LETTERS, ARGS) == 0
    c_seen, ctypes_seen = driver.seen
    assert c_seen == ctypes_seen
    f, g, b, s, st, cl, raw = c_seen
    assert (f, g, b, s, st, cl) == (0xF00D, launcher.dim3(grid), launcher.dim3(block), smem, stream, cluster)
    assert raw[0] == DESCRIPTOR
    assert int.from_bytes(raw[1], "little") == 2**47 + 16
    assert int.from_bytes(raw[2], "little", signed=True) == -(2**40)
    assert int.from_bytes(raw[3], "little", signed=True) == -7
    assert ctypes.c_float.from_buffer_copy(raw[4]).value == 0.375
    assert int.from_bytes(raw[5], "little") == 2**64 - 64


@needs_cc
def test_the_driver_result_comes_back(private_builds):
    driver = FakeDriver(b"p", code=700)
    for launch in both_launchers(driver, private_builds).values():
        assert launch(1, 1, 32, 0, 0, 0, b"p", (0,)) == 700


@needs_cc
@pytest.mark.parametrize(
    "letters, args, error, message",
    [
        (b"pq", (1,), ValueError, "1 arguments for 2 declared kinds"),
        (b"t", (bytes(64),), ValueError, "a tensor map is 128 bytes, got 64"),
        (b"t", ("x" * 128,), TypeError, "a tensor map must be bytes"),
        (b"i", (2**31,), OverflowError, "does not fit int32"),
        (b"pq", (1, "7"), TypeError, "kernel argument 1"),
        (b"p", (-1,), OverflowError, "kernel argument 0"),
    ],
)
def test_the_c_launcher_names_a_bad_argument(letters, args, error, message, private_builds):
    driver = FakeDriver(letters)
    launch = both_launchers(driver, private_builds)["c"]
    with pytest.raises(error, match=message):
        launch(1, 1, 32, 0, 0, 0, letters, args)
    assert driver.seen == []  # nothing reached the driver


@needs_cc
def test_the_c_launcher_is_cached_by_source_hash(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "BUILD_DIR", tmp_path)
    first = launcher._compile(launcher.SOURCE)
    assert first.parent == tmp_path and first.exists()
    assert launcher._compile(launcher.SOURCE) == first  # no second compile
    changed = tmp_path / "launcher.c"
    changed.write_text(launcher.SOURCE.read_text() + "\n/* changed */\n")
    assert launcher._compile(changed) != first


def test_a_broken_compiler_is_reported_not_hidden(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "BUILD_DIR", tmp_path)
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with pytest.raises(OSError, match="failed"):
        launcher._compile(launcher.SOURCE)


# -- the C++ replay (replay.cpp) ---------------------------------------------------------------
# A recipe replayed in C++ must hand the driver exactly what the Python replay hands it for
# the same tensors. Checked with the real launch plans on CPU tensors: the C++ replay
# allocates on the recipe's device, here the CPU, and launches through the stand-in driver.


needs_cxx = pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")), reason="no C++ compiler here"
)
STREAM = 0x7F00_0000_AB00


class PlanKernel:
    """What `direct.loaded` returns for a plan's kernel: a made-up driver handle per kernel."""

    handles: dict[str, int] = {}

    def __init__(self, kernel):
        self.kernel, self.letters = kernel, launcher.kind_letters(kernel.family.args)
        self.function = PlanKernel.handles.setdefault(str(kernel), 0x1000 + 16 * len(PlanKernel.handles))

    def ensure_smem(self, smem):
        pass


@pytest.fixture
def replayers(monkeypatch, private_builds):
    """(C++ module, stand-in driver): the C++ replay and the Python one (through the C
    launcher) both bound to one driver that records every launch."""
    driver = FakeDriver({})
    addresses = (driver.address(driver.plain), driver.address(driver.ex))
    kernels = {}

    def loaded(kernel, index):
        found = kernels.setdefault(str(kernel), PlanKernel(kernel))
        driver.letters[found.function] = found.letters
        return found

    monkeypatch.setattr(direct, "loaded", loaded)
    monkeypatch.setattr(direct, "launcher", lambda: launcher.c_launcher(*addresses, private_builds["launcher"]))
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: STREAM, raising=False)
    from pytorch_custom_ops import cuda_driver

    monkeypatch.setattr(
        cuda_driver, "encode_tiled_tensor_map", lambda *a: repr(a).encode().ljust(128, b".")[:128], raising=True
    )
    module = replay.load(private_builds["replay"], addresses, device=lambda: 0, stream=lambda i: STREAM)
    return module, driver


def _bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


PLANS = {
    "softmax 8x128 fp32": (SOFTMAX, lambda: ([torch.empty(8, 128)], [torch.randn(8, 128)])),
    "softmax 2x300000 (cluster kernel)": (SOFTMAX, lambda: ([torch.empty(2, 300000)], [torch.randn(2, 300000)])),
    "gemm fp32 65x33x17 (SIMT)": (
        GEMM_OPS[(False, False, False)],
        lambda: ([torch.empty(65, 17)], [torch.randn(65, 33), torch.randn(33, 17), torch.zeros(1, 1), torch.ones(2)]),
    ),
    "gemm bf16 256x512x128 NT (tensor maps)": (
        GEMM_OPS[(False, False, True)],
        lambda: (
            [torch.empty(256, 128, dtype=torch.bfloat16)],
            [_bf16(256, 512), _bf16(128, 512), torch.zeros(1, 1, dtype=torch.bfloat16), torch.ones(2)],
        ),
    ),
}


def _recipe(op, outputs, inputs):
    with direct.planning() as scratch:
        launches = op.gpu(outputs, inputs, op.spec.params)
    made = direct.recipe(outputs, inputs, scratch, launches, 0, op.spec.returned)
    assert made is not None
    made.device = torch.device("cpu")  # allocate where these tests run
    return made


def _softmax_book(module, params=None):
    """A book holding the recipe of a softmax 8x128 call, and that call's inputs and recipe."""
    op, make = PLANS["softmax 8x128 fp32"]
    out1, in1 = make()
    recipe = _recipe(op, out1, in1)
    book = module.new_book()
    module.add(book, in1, params, (), recipe)
    return book, in1, recipe


@needs_cxx
@pytest.mark.parametrize("case", PLANS)
def test_the_cpp_replay_launches_what_the_python_replay_launches(replayers, case):
    module, driver = replayers
    op, make = PLANS[case]
    (out1, in1), (_, in2) = make(), make()
    recipe = _recipe(op, out1, in1)
    book = module.new_book()
    assert module.add(book, in1, None, (), recipe) is True and module.size(book) == 1
    outputs = module.call(book, in2, None, ())
    assert [(o.shape, o.dtype) for o in outputs] == [(o.shape, o.dtype) for o in out1]
    by_cpp = list(driver.seen)
    driver.seen.clear()
    recipe.run(outputs, in2)  # the Python replay, same tensors
    assert by_cpp == driver.seen and len(by_cpp) == len(recipe.steps)
    assert all(seen[4] == STREAM for seen in by_cpp)
    pointers = {int.from_bytes(raw, "little") for seen in by_cpp for raw in seen[-1] if len(raw) == 8}
    maps = b"".join(raw for seen in by_cpp for raw in seen[-1] if len(raw) == 128)  # the stand-in's repr
    for t in (outputs[0], in2[0]):  # the new call's addresses, as pointers or inside tensor maps
        assert t.data_ptr() in pointers or str(t.data_ptr()).encode() in maps


@needs_cxx
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_cpp_replay_misses_whatever_the_key_tells_apart(replayers):
    module, driver = replayers
    book, in1, _ = _softmax_book(module)

    class Sub(torch.Tensor):
        pass

    x = torch.randn(8, 129)
    others = {
        "shape": [torch.randn(9, 128)],
        "dtype": [torch.randn(8, 128, dtype=torch.float64)],
        "contiguity": [torch.randn(128, 8).t()],
        "alignment": [x[:, 1:]],  # 4 bytes past a 16-byte boundary
        "a subclass": [torch.randn(8, 128).as_subclass(Sub)],
        "a non-tensor": [3.0],
        "a sparse tensor": [torch.randn(8, 128).to_sparse()],
        "a meta tensor": [torch.empty(8, 128, device="meta")],
        "a nested tensor": [torch.nested.nested_tensor([torch.randn(8, 128)])],
        "one more input": [torch.randn(8, 128), torch.randn(8, 128)],
    }
    for what, inputs in others.items():
        assert module.call(book, inputs, None, ()) is None, what
    assert driver.seen == []
    assert module.call(book, [torch.randn(8, 128)], None, ()) is not None  # the key itself hits, also as a tuple
    assert module.call(book, (torch.randn(8, 128),), None, ()) is not None
    assert len(driver.seen) == 2


@needs_cxx
def test_a_cpp_replay_on_another_current_device_goes_back_to_python(replayers, private_builds):
    module, driver = replayers
    book, in1, _ = _softmax_book(module)
    addresses = (driver.address(driver.plain), driver.address(driver.ex))
    moved = replay.load(private_builds["replay"], addresses, device=lambda: 1, stream=lambda i: STREAM)
    assert moved.call(book, in1, None, ()) is None and driver.seen == []


@needs_cxx
def test_a_failed_cpp_launch_hands_its_recipe_and_tensors_to_python(replayers):
    module, driver = replayers
    book, in1, recipe = _softmax_book(module)
    driver.code = 201  # CUDA_ERROR_INVALID_CONTEXT
    failed = module.call(book, in1, None, ())
    assert isinstance(failed, tuple)
    got_recipe, outputs, scratch, step, code = failed
    assert got_recipe is recipe and step == 0 and code == 201 and scratch == []
    assert outputs[0].shape == (8, 128) and len(driver.seen) == 1


class Spec:
    """A tensor-map argument's spec: counts the addresses it is asked to encode."""

    def __init__(self):
        self.asked = []

    def encode_at(self, address):
        self.asked.append(address)
        return address.to_bytes(8, "little") * 16


class Synthetic:
    """A recipe as replay.cpp reads it, written out by hand: a 0-dim output, a zeroed
    scratch tensor, a pointer, an int32 constant and a tensor map."""

    def __init__(self, spec):
        self.device, self.device_index = torch.device("cpu"), 0
        self.outputs = [(((),), torch.float32), ((3, 5), torch.int64)]
        self.scratch = [((4, 2), torch.int32, True)]
        step = type("Step", (), {})()
        step.function, step.letters, step.grid, step.block, step.smem, step.cluster = 0x2000, b"ptpi", (2, 3), 64, 0, 2
        step.template = (None, None, None, -7)
        step.pointers = ((0, 0), (2, 3))  # output 0, then the scratch tensor (after 1 input)
        step.maps = ((1, 2, spec, {}),)  # a map of the input
        self.steps = [step]


@needs_cxx
def test_a_cpp_replay_allocates_what_the_recipe_says_and_encodes_each_address_once(replayers):
    module, driver = replayers
    spec = Spec()
    driver.letters[0x2000] = b"ptpi"
    x = torch.randn(6)
    book = module.new_book()
    assert module.add(book, [x], None, (), Synthetic(spec)) is True
    first = module.call(book, [x], None, ())
    second = module.call(book, [x], None, ())
    assert [o.shape for o in first] == [(), (3, 5)] and first[1].dtype == torch.int64
    assert spec.asked == [x.data_ptr()]  # the second call reused the encoded map
    (f, grid, block, smem, stream, cluster, raw) = driver.seen[0]
    assert (f, grid, block, cluster) == (0x2000, (2, 3, 1), (64, 1, 1), 2)
    assert int.from_bytes(raw[0], "little") == first[0].data_ptr()
    assert raw[1] == x.data_ptr().to_bytes(8, "little") * 16
    assert int.from_bytes(raw[3], "little", signed=True) == -7
    assert driver.seen[1][-1][0] == second[0].data_ptr().to_bytes(8, "little")


@needs_cxx
def test_a_bad_recipe_is_refused_when_added(replayers):
    module, _ = replayers
    recipe = Synthetic(Spec())
    recipe.steps[0].template = (None, None)  # two values for four arguments
    with pytest.raises(ValueError, match="template"):
        module.add(module.new_book(), [torch.randn(6)], None, (), recipe)
    recipe = Synthetic(Spec())
    recipe.steps[0].pointers = ((0, 9),)  # no tensor 9
    with pytest.raises(ValueError, match="out of range"):
        module.add(module.new_book(), [torch.randn(6)], None, (), recipe)
    recipe = Synthetic(Spec())
    recipe.outputs = [(None, None)]  # a destination the call does not give
    with pytest.raises(ValueError, match="destinations"):
        module.add(module.new_book(), [torch.randn(6)], None, (), recipe)


@needs_cxx
def test_the_same_key_added_again_replaces_its_recipe_and_clear_forgets_all(replayers):
    module, driver = replayers
    book, in1, first = _softmax_book(module)
    second = _recipe(PLANS["softmax 8x128 fp32"][0], [torch.empty(8, 128)], in1)
    module.add(book, in1, None, (), second)
    assert module.size(book) == 1
    driver.code = 201  # a failed launch names the recipe that ran: the second
    assert module.call(book, in1, None, ())[0] is second
    module.clear(book)
    assert module.size(book) == 0 and module.call(book, in1, None, ()) is None


@needs_cxx
def test_parameters_are_part_of_a_cpp_replay_key(replayers):
    module, driver = replayers
    book, in1, _ = _softmax_book(module, (("PIPELINE", "fused"),))
    assert module.call(book, in1, None, ()) is None
    assert module.call(book, in1, (("PIPELINE", "split"),), ()) is None
    assert module.call(book, in1, (("PIPELINE", "fused"),), ()) is not None  # equal, not the same object
    with pytest.raises(TypeError, match="unhashable"):
        module.call(book, in1, {"PIPELINE": "fused"}, ())


@needs_cxx
def test_a_cpp_replay_takes_destinations_in_place_and_keys_on_them(replayers):
    module, driver = replayers
    driver.letters[0x2000] = b"ptpi"
    recipe = Synthetic(Spec())
    recipe.outputs = [((3,), torch.float32), (None, None)]  # output 1: the caller's destination
    recipe.steps[0].pointers = ((0, 1), (2, 3))  # the destination, then the scratch tensor
    x, dest = torch.randn(6), torch.empty(4, dtype=torch.float64)
    book = module.new_book()
    assert module.add(book, [x], None, [dest], recipe) is True
    other = torch.empty(4, dtype=torch.float64)
    outputs = module.call(book, [x], None, [other])
    assert outputs[1] is other and outputs[0].shape == (3,)
    assert int.from_bytes(driver.seen[-1][-1][0], "little") == other.data_ptr()
    assert module.call(book, [x], None, []) is None  # no destination: another key
    assert module.call(book, [x], None, [torch.empty(5, dtype=torch.float64)]) is None


@needs_cc
def test_a_stand_in_driver_bound_to_a_copy_leaves_the_build_unbound(private_builds):
    """What `private_builds` is for: the build loaded from its own file keeps its own
    binding (on this CPU machine: none), whatever a copy was bound to."""
    driver = FakeDriver(b"p")
    both_launchers(driver, private_builds)["c"](1, 1, 32, 0, 0, 0, b"p", (0,))
    assert len(driver.seen) == 1
    own = launcher.load_extension(launcher._compile(launcher.SOURCE))
    if launcher._chosen is None:  # no real launcher in this process: the build was never bound
        with pytest.raises(RuntimeError, match="set_driver was not called"):
            own.launch(1, 1, 32, 0, 0, 0, b"p", (0,))
    assert len(driver.seen) == 1  # the stand-in saw nothing more


def test_a_replay_that_cannot_be_built_says_why_and_python_replays(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(replay, "BUILD_DIR", tmp_path)
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.raises(OSError, match="failed"):
        replay.build()
    monkeypatch.setattr(replay, "_tried", False)
    monkeypatch.setattr(replay, "_module", None)
    monkeypatch.setattr(replay, "_kind", "not loaded yet")
    assert replay.module() is None
    assert replay.replay_kind().startswith("python (the C++ replay could not be built")
    assert "could not be built" in capsys.readouterr().err
    monkeypatch.setenv(replay.ENV_REPLAY, "python")
    monkeypatch.setattr(replay, "_tried", False)
    assert replay.module() is None and replay.replay_kind() == "python (GPU_DAYS_REPLAY=python)"


# -- programs (programs.py, replay_programs.h) ---------------------------------------------------
# A program replays a function's op calls from C++: each step is looked up in its op's
# recipe book by the key a call from Python would have, and launched through the same
# stand-in driver. These build programs from real softmax recipes on CPU tensors.


class BookOp:
    """What `programs.note_call` reads of a MojoOp: its name and its C++ book."""

    def __init__(self, module, book):
        self.module, self._book = module, book
        self.spec = type("Spec", (), {"name": "softmax"})()

    def __call__(self, inputs):
        outputs = self.module.call(self._book, inputs, None, ())
        assert outputs.__class__ is list
        if programs.recording:
            programs.note_call(self, inputs, (), None, outputs)
        return outputs


@pytest.fixture
def recorded(replayers, monkeypatch):
    """(module, driver, op): the private replay as this process's, a softmax 8x128 op."""
    module, driver = replayers
    monkeypatch.setattr(replay, "module", lambda: module)
    monkeypatch.setattr(programs, "ENABLED", True)
    book, _, _ = _softmax_book(module)
    return module, driver, BookOp(module, book)


def _pointers(seen) -> list[int]:
    return [int.from_bytes(raw, "little") for raw in seen[-1] if len(raw) == 8]


@needs_cxx
def test_a_program_replays_its_op_calls_views_and_primitives(recorded):
    module, driver, op = recorded
    pbook = module.new_program_book()
    x = torch.randn(16, 128)
    constants, steps = (
        (),
        (
            (op._book, None, ((0, (8, 128), (128, 1), 8 * 128),), 1),  # softmax of x[8:]
            ("sum_rows", None, (1,), 1),
        ),
    )
    outputs = (1, (1, (1024,), (1,), 0), None, 2)
    assert module.program_add(pbook, [x], ("k",), (constants, steps, outputs)) is True
    assert module.program_call(pbook, [x], ("other",)) is None  # the params are part of the key
    y, flat, nothing, summed = module.program_call(pbook, [x], ("k",))
    assert y.shape == (8, 128) and nothing is None
    assert flat.shape == (1024,) and flat.data_ptr() == y.data_ptr()
    torch.testing.assert_close(summed, y.sum(0), rtol=0, atol=0, equal_nan=True)  # y: never written here
    assert {y.data_ptr(), x[8:].data_ptr()} <= set(_pointers(driver.seen[-1]))
    assert module.program_count(pbook) == 1
    module.clear_programs(pbook)
    assert module.program_count(pbook) == 0 and module.program_call(pbook, [x], ("k",)) is None


@needs_cxx
def test_a_bad_program_is_refused_when_added(recorded):
    module, _, op = recorded
    pbook, x = module.new_program_book(), torch.randn(8, 128)
    bad = {
        "a reference to a tensor not made yet": ((), ((op._book, None, (1,), 1),), ()),
        "unknown step": ((), (("cumsum", None, (0,), 1),), ()),
        "do not fit its kind": ((), (("sum_rows", None, (0, 0), 1),), ()),
        "as many strides as sizes": ((), (), ((0, (8, 128), (1,), 0),)),
        "constants must be tensors": ((3.0,), (), ()),
    }
    for message, program in bad.items():
        with pytest.raises((ValueError, TypeError), match=message):
            module.program_add(pbook, [x], None, program)
    assert module.program_count(pbook) == 0


def _body(op, transform=lambda x: x[8:]):
    def body(x, c):
        (y,) = op([transform(x)])
        summed = y.sum(0)
        programs.note_primitive("sum_rows", (y,), summed)
        return (y, None, summed, c)

    return body


@needs_cxx
def test_a_recorded_function_replays_from_cpp_with_new_tensors(recorded):
    module, driver, op = recorded
    program = programs.Program("test")
    c = programs.keep(torch.randn(3))
    x1, x2 = torch.randn(16, 128), torch.randn(16, 128)
    assert program.call([x1], ("p",)) is None  # nothing stored: the caller records
    got = program.record(_body(op), [x1], ("p",), x1, c)
    assert len(program) == 1 and got[3] is c
    n = len(driver.seen)
    y, nothing, summed, c_again = program.call([x2], ("p",))
    assert len(driver.seen) == n + 1 and x2[8:].data_ptr() in _pointers(driver.seen[-1])
    assert y.data_ptr() in _pointers(driver.seen[-1])
    assert nothing is None and c_again is c  # a kept constant is passed as itself
    torch.testing.assert_close(summed, y.sum(0), rtol=0, atol=0, equal_nan=True)


@needs_cxx
@pytest.mark.parametrize(
    "case",
    ["a torch result as an op input", "a torch result returned", "two inputs the same tensor", "no recipe"],
)
def test_what_a_program_cannot_replay_runs_in_python_from_then_on(recorded, case):
    module, driver, op = recorded
    program = programs.Program("test")
    x, c = torch.randn(16, 128), programs.keep(torch.randn(3))
    tensors, body = [x], _body(op)
    if case == "a torch result as an op input":
        body = _body(op, lambda x: x[8:] * 2)
    elif case == "a torch result returned":
        c = torch.randn(3)  # not kept: made outside the recorded calls
        tensors = [x]
    elif case == "two inputs the same tensor":
        tensors = [x, x]
    else:
        op._book = module.new_book()  # this op's book holds nothing

        def body(x, c):
            outputs = [torch.empty(8, 128)]
            programs.note_call(op, [x[8:]], (), None, outputs)
            return (outputs[0],)

    program.record(body, tensors, ("p",), x, c)
    assert len(program) == 1 and program.call(tensors, ("p",)) is False
    assert program.last_reason


@needs_cxx
def test_a_program_whose_step_misses_or_fails_goes_back_to_python(recorded):
    module, driver, op = recorded
    program = programs.Program("test")
    x, c = torch.randn(16, 128), programs.keep(torch.randn(3))
    program.record(_body(op), [x], ("p",), x, c)
    driver.code = 201  # CUDA_ERROR_INVALID_CONTEXT: the Python function retries and names it
    assert program.call([x], ("p",)) is None
    driver.code = 0
    assert program.call([x], ("p",)).__class__ is list
    module.clear(op._book)  # the op's recipes forgotten (new plans): the step misses
    assert program.call([x], ("p",)) is None


@needs_cxx
def test_a_copy_to_contiguous_is_a_program_step(recorded):
    """A transposed (non-contiguous) input made contiguous before the op call: C++ makes
    the same copy, and the op reads it."""
    module, driver, op = recorded
    program = programs.Program("test")

    def body(x):
        rows = programs.contiguous(x.t())
        return (op([rows])[0], rows)

    x1, x2 = torch.randn(128, 8), torch.randn(128, 8)
    program.record(body, [x1], None, x1)
    y, rows = program.call([x2], None)
    assert rows.is_contiguous() and torch.equal(rows, x2.t())
    assert rows.data_ptr() in _pointers(driver.seen[-1])
    assert programs.contiguous(rows) is rows  # already contiguous: no copy, no step


@needs_cxx
def test_a_replayed_function_called_while_recording_joins_the_outer_program(recorded):
    """A backward that calls a public function (itself replayed): its op calls must join
    the backward's program, or the backward's result would come from nowhere."""
    module, driver, op = recorded
    inner = programs.replayed_forward("inner", lambda rows: op([rows])[0], lambda rows: ([rows], None))
    outer = programs.Program("outer")
    x = torch.randn(16, 128)
    outer.record(lambda x: (inner(x[8:]),), [x], ("p",), x)
    assert len(inner.program) == 0  # the inner function ran itself
    n = len(driver.seen)
    (y,) = outer.call([x], ("p",))
    assert len(driver.seen) == n + 1 and y.data_ptr() in _pointers(driver.seen[-1])


@needs_cxx
def test_a_program_on_another_current_device_runs_in_python_without_recording(recorded, private_builds):
    module, driver, op = recorded
    program = programs.Program("test")
    x, c = torch.randn(16, 128), programs.keep(torch.randn(3))
    program.record(_body(op), [x], ("p",), x, c)
    addresses = (driver.address(driver.plain), driver.address(driver.ex))
    moved = replay.load(private_builds["replay"], addresses, device=lambda: 1, stream=lambda i: STREAM)
    n = len(driver.seen)
    assert moved.program_call(program._book, [x], ("p",)) is False and len(driver.seen) == n


def test_a_backward_with_programs_runs_itself_off_the_gpu_and_in_grad_mode():
    """What `replayed_backward` never replays: CPU tensors, a double backward (grad mode),
    autocast. Each runs the Python backward, and nothing is stored."""
    calls = []

    def backward(ctx, g):
        calls.append(torch.is_grad_enabled())
        return (g * 2,)

    run = programs.replayed_backward("test", backward)
    ctx = type("Ctx", (), {"saved_tensors": (torch.randn(3),), "needs_input_grad": (True,)})()
    with torch.no_grad():
        assert torch.equal(run(ctx, torch.ones(3))[0], torch.full((3,), 2.0))
    with torch.enable_grad():
        run(ctx, torch.ones(3))
    assert calls == [False, True] and len(run.program) == 0


def test_a_forward_with_programs_runs_itself_on_the_cpu(monkeypatch):
    """`replayed_forward` replays CUDA calls only: a CPU call (or a bad argument) goes to
    the function itself, and no replay module is loaded for it."""
    monkeypatch.setattr(replay, "module", lambda: pytest.fail("no replay for a CPU call"))
    run = programs.replayed_forward("test", lambda x, k: x * k, lambda x, k: ([x], k))
    assert torch.equal(run(torch.ones(3), 2.0), torch.full((3,), 2.0))
    with pytest.raises(TypeError):
        run("not a tensor", 2.0)
    assert len(run.program) == 0


# -- C++ autograd nodes (programs.Nodes, replay_nodes.h) ------------------------------------------
# A "softmax" whose node saves its output; its backward is either a program (here the
# softmax recipe again, applied to the gradient: what it computes does not matter, only
# which tensors reach the driver) or the Python backward, called with a NodeContext.


@pytest.fixture
def node_parts(recorded):
    module, driver, op = recorded
    forward = module.new_program_book()
    x0 = torch.randn(8, 128)
    assert module.program_add(forward, [x0], ("fwd",), ((), ((op._book, None, (0,), 1),), (1,)))
    calls = []

    def backward(ctx, g):
        calls.append((ctx.saved_tensors, ctx.needs_input_grad, vars(ctx)))
        return g * 3, None

    spec = (forward, module.new_program_book(), (("dim", -1),), (("o", 0),), (), True, True, (0,), 2)
    return module, driver, op, spec + (programs._make_context, backward), calls


@needs_cxx
def test_a_cpp_node_runs_the_python_backward_when_no_program_replays(node_parts):
    module, driver, op, spec, calls = node_parts
    nbook = module.new_node_book()
    x = torch.randn(8, 128, requires_grad=True)
    assert module.node_call(nbook, [x], ("fwd",)) is None  # no spec yet
    assert module.node_add(nbook, [x], ("fwd",), spec) is True and module.node_known(nbook, [x], ("fwd",))
    y = module.node_call(nbook, [x], ("fwd",))
    assert y.requires_grad and y.grad_fn is not None and len(y.grad_fn.next_functions) >= 1
    assert y.data_ptr() in _pointers(driver.seen[-1])  # the forward's program launched
    g = torch.randn(8, 128)
    y.backward(g)
    ((saved, needs, attrs),) = calls
    assert saved[0] is not None and saved[0].data_ptr() == y.data_ptr()
    assert needs == (True, False) and attrs == {"dim": -1}
    torch.testing.assert_close(x.grad, g * 3)


@needs_cxx
def test_a_cpp_node_replays_its_backward_program(node_parts):
    module, driver, op, spec, calls = node_parts
    nbook = module.new_node_book()
    x = torch.randn(8, 128, requires_grad=True)
    module.node_add(nbook, [x], ("fwd",), spec)
    y = module.node_call(nbook, [x], ("fwd",))
    g = torch.randn(8, 128)
    key = ((("dim", -1),), (True, False), (False, False))  # programs.replayed_backward's params
    assert module.program_add(spec[1], [y.detach(), g], key, ((), ((op._book, None, (1,), 1),), (2, None)))
    n = len(driver.seen)
    y.backward(g)
    assert calls == [] and len(driver.seen) == n + 1
    assert x.grad.shape == (8, 128) and x.grad.data_ptr() in _pointers(driver.seen[-1])  # the program's output
    assert g.data_ptr() in _pointers(driver.seen[-1])


@needs_cxx
def test_a_cpp_node_keeps_autograd_semantics(node_parts):
    """No grad needed: no node. Saved tensors modified in place: torch's error. A key
    stored as 'no node': the Python path."""
    module, driver, op, spec, calls = node_parts
    nbook = module.new_node_book()
    x = torch.randn(8, 128)
    module.node_add(nbook, [x], ("fwd",), spec)
    assert module.node_call(nbook, [x], ("fwd",)).grad_fn is None  # x needs no gradient
    xg = x.clone().requires_grad_()
    y = module.node_call(nbook, [xg], ("fwd",))
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(torch.randn(8, 128))
    module.node_add(nbook, [x], ("fwd",), None)
    assert module.node_call(nbook, [xg], ("fwd",)) is None and module.node_known(nbook, [x], ("fwd",))


def _node_with_a_none_output(module, op, backward):
    """A node whose forward returns (softmax(x), None), as linear without GELU returns no
    `pre`: it saves that None output and the softmax, and marks the None non-differentiable."""
    forward = module.new_program_book()
    steps = ((op._book, None, (0,), 1),)
    assert module.program_add(forward, [torch.randn(8, 128)], ("fwd",), ((), steps, (1, None)))
    saved, non_differentiable = (("o", 0), ("o", 1)), (1,)
    attrs = (("dim", -1),)
    return (forward, module.new_program_book(), attrs, saved, non_differentiable, True, False, (0,), 2) + (
        programs._make_context,
        backward,
    )


@needs_cxx
def test_a_cpp_node_keeps_a_none_output_and_runs_the_forward_once(node_parts):
    """The None stays None, the forward's program launches once (no second, Python forward),
    and the Python backward gets a gradient per output: None for the None, and the saved None."""
    module, driver, op, _spec, _calls = node_parts
    calls = []

    def backward(ctx, g, g_none):
        calls.append((ctx.saved_tensors, g_none))
        return g * 3, None

    nbook, x = module.new_node_book(), torch.randn(8, 128, requires_grad=True)
    module.node_add(nbook, [x], ("fwd",), _node_with_a_none_output(module, op, backward))
    n = len(driver.seen)
    y, nothing = module.node_call(nbook, [x], ("fwd",))
    assert nothing is None and len(driver.seen) == n + 1
    assert y.requires_grad and "ReplayedBackward" in y.grad_fn.name()
    g = torch.randn(8, 128)
    y.backward(g)
    (((saved_y, saved_none), g_none),) = calls
    assert saved_y.data_ptr() == y.data_ptr() and saved_none is None and g_none is None
    torch.testing.assert_close(x.grad, g * 3)


@needs_cxx
def test_a_cpp_node_with_a_none_output_replays_its_backward_program(node_parts):
    """The backward program's key counts the None output's gradient, as the Python path's does."""
    module, driver, op, _spec, calls = node_parts
    spec = _node_with_a_none_output(module, op, lambda ctx, g, g_none: calls.append(g) or (g, None))
    nbook, x = module.new_node_book(), torch.randn(8, 128, requires_grad=True)
    module.node_add(nbook, [x], ("fwd",), spec)
    y, _ = module.node_call(nbook, [x], ("fwd",))
    g = torch.randn(8, 128)
    # (attrs, needs_input_grad, None mask over saved y, saved None, grad of y, grad of None)
    key = ((("dim", -1),), (True, False), (False, True, False, True))
    assert module.program_add(spec[1], [y.detach(), g], key, ((), ((op._book, None, (1,), 1),), (2, None)))
    n = len(driver.seen)
    y.backward(g)
    assert calls == [] and len(driver.seen) == n + 1
    assert x.grad.data_ptr() in _pointers(driver.seen[-1]) and g.data_ptr() in _pointers(driver.seen[-1])


@needs_cxx
def test_a_bad_node_spec_is_refused_or_never_used(node_parts):
    module, driver, op, spec, calls = node_parts
    nbook, x = module.new_node_book(), torch.randn(8, 128, requires_grad=True)
    with pytest.raises(ValueError, match="argument out of range"):
        module.node_add(nbook, [x], ("fwd",), spec[:7] + ((5,),) + spec[8:])
    with pytest.raises(ValueError, match="saved tensor"):
        module.node_add(nbook, [x], ("fwd",), spec[:3] + ((("x", 0),),) + spec[4:])
    module.node_add(nbook, [x], ("fwd",), spec[:3] + ((("o", 3),),) + spec[4:])  # the forward has one output
    assert module.node_call(nbook, [x], ("fwd",)) is None
