"""The two launchers (C and ctypes) hand the driver the same launch, byte for byte.

No GPU here: each launcher is bound to a stand-in for cuLaunchKernel / cuLaunchKernelEx
(a ctypes callback with the driver's signature) that decodes what it was given.
"""

from __future__ import annotations

import ctypes
import shutil

import pytest

from pytorch_custom_ops import cuda_driver as cu
from pytorch_custom_ops import launcher

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
    """Records each launch as (function, grid, block, smem, stream, cluster, arg bytes)."""

    def __init__(self, letters: bytes, code: int = 0):
        self.letters, self.code, self.seen = letters.decode(), code, []
        self.plain = LAUNCH(self._plain)
        self.ex = LAUNCH_EX(self._ex)

    def _args(self, params):
        return [ctypes.string_at(params[i], SIZES[k]) for i, k in enumerate(self.letters)]

    def _plain(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.seen.append((f, (gx, gy, gz), (bx, by, bz), smem, stream or 0, 0, self._args(params)))
        return self.code

    def _ex(self, config, f, params, extra):
        c = config.contents
        attr = c.attrs.contents
        assert c.numAttrs == 1 and attr.id == cu.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        cluster = tuple(attr.value.clusterDim)
        assert cluster[1:] == (1, 1)
        grid, block = (c.gridDimX, c.gridDimY, c.gridDimZ), (c.blockDimX, c.blockDimY, c.blockDimZ)
        self.seen.append((f, grid, block, c.sharedMemBytes, c.hStream or 0, cluster[0], self._args(params)))
        return self.code

    def address(self, fn) -> int:
        return ctypes.cast(fn, ctypes.c_void_p).value


def both_launchers(driver: FakeDriver):
    c = launcher.c_launcher(driver.address(driver.plain), driver.address(driver.ex))
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
def test_c_and_ctypes_launchers_pass_the_driver_the_same_launch(grid, block, smem, stream, cluster):
    driver = FakeDriver(LETTERS)
    for launch in both_launchers(driver).values():
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
def test_the_driver_result_comes_back():
    driver = FakeDriver(b"p", code=700)
    for launch in both_launchers(driver).values():
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
def test_the_c_launcher_names_a_bad_argument(letters, args, error, message):
    driver = FakeDriver(letters)
    launch = both_launchers(driver)["c"]
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
