"""The few CUDA driver calls the direct launch path needs, through ctypes on libcuda.so.1.

torch already owns the GPU: it created each device's *primary* context and the streams.
Here we only load compiled kernels into that context (`cuModuleLoadData`), look them up
(`cuModuleGetFunction`); the launch on torch's current stream (`cuLaunchKernel`, or
`cuLaunchKernelEx` for thread-block clusters) is `launcher.py`'s, through the entry points
declared here. No CUDA runtime, and nothing that a CUDA-graph capture would refuse: a
launch is the only stream work.

Every call is checked; a failure raises `CudaDriverError` with the driver's own name for
the error (e.g. CUDA_ERROR_NO_BINARY_FOR_GPU) and what we were doing. Errors that leave the
context unusable ("sticky" errors such as an illegal address) say so: after one of them
every later CUDA call in the process fails too, torch's included, and only a new process
recovers.
"""

from __future__ import annotations

import ctypes
import threading
from functools import cache

CUresult = ctypes.c_int
CUdevice = ctypes.c_int
CUcontext = ctypes.c_void_p
CUmodule = ctypes.c_void_p
CUfunction = ctypes.c_void_p
CUstream = ctypes.c_void_p

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_JIT_ERROR_LOG_BUFFER = 5
CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4

CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_INVALID_HANDLE = 400
# errors after which the context is corrupt (the CUDA docs: "the process must be terminated")
STICKY_ERRORS = {700, 701, 702, 710, 714, 715, 716, 717, 718, 719, 720}


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; `code` is the CUresult."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code

    @property
    def sticky(self) -> bool:
        return self.code in STICKY_ERRORS


class _LaunchAttrValue(ctypes.Union):
    _fields_ = [("clusterDim", ctypes.c_uint * 3), ("pad", ctypes.c_char * 64)]


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttrValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", CUstream),
        ("attrs", ctypes.POINTER(_LaunchAttr)),
        ("numAttrs", ctypes.c_uint),
    ]


_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [CUresult, ctypes.POINTER(ctypes.c_char_p)],
    "cuGetErrorString": [CUresult, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(CUdevice), ctypes.c_int],
    "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, CUdevice],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(CUcontext), CUdevice],
    "cuCtxGetCurrent": [ctypes.POINTER(CUcontext)],
    "cuCtxSetCurrent": [CUcontext],
    "cuModuleLoadDataEx": [
        ctypes.POINTER(CUmodule),
        ctypes.c_void_p,
        ctypes.c_uint,
        ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_void_p),
    ],
    "cuModuleGetFunction": [ctypes.POINTER(CUfunction), CUmodule, ctypes.c_char_p],
    "cuFuncSetAttribute": [CUfunction, ctypes.c_int, ctypes.c_int],
    "cuLaunchKernel": [
        CUfunction,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_uint,
        CUstream,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ],
    "cuLaunchKernelEx": [ctypes.POINTER(_LaunchConfig), CUfunction, ctypes.c_void_p, ctypes.c_void_p],
    "cuOccupancyMaxActiveClusters": [ctypes.POINTER(ctypes.c_int), CUfunction, ctypes.POINTER(_LaunchConfig)],
    "cuTensorMapEncodeTiled": [
        ctypes.c_void_p,  # CUtensorMap* (128 bytes, 64-byte aligned)
        ctypes.c_int,  # data type
        ctypes.c_uint,  # rank
        ctypes.c_void_p,  # global address
        ctypes.POINTER(ctypes.c_uint64),  # global dims
        ctypes.POINTER(ctypes.c_uint64),  # global strides in bytes (rank - 1)
        ctypes.POINTER(ctypes.c_uint32),  # box dims
        ctypes.POINTER(ctypes.c_uint32),  # element strides
        ctypes.c_int,  # interleave
        ctypes.c_int,  # swizzle
        ctypes.c_int,  # L2 promotion
        ctypes.c_int,  # out-of-bounds fill
    ],
}


@cache
def _lib() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaDriverError(f"the CUDA driver library libcuda.so.1 cannot be loaded: {exc}", -1) from exc
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = CUresult
    check(lib.cuInit(0), "cuInit")
    return lib


def error_text(code: int) -> str:
    """'CUDA_ERROR_X: description' for a CUresult."""
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    lib = _lib()
    lib.cuGetErrorName(code, ctypes.byref(name))
    lib.cuGetErrorString(code, ctypes.byref(text))
    label = name.value.decode() if name.value else f"CUresult {code}"
    return f"{label}: {text.value.decode() if text.value else 'unknown error'}"


def check(code: int, what: str) -> None:
    if code != 0:
        message = f"{what} failed with {error_text(code) if code > 0 else code}"
        if code in STICKY_ERRORS:
            message += (
                " (a sticky error: the CUDA context of this process is now unusable, for torch too;"
                " restart the process)"
            )
        raise CudaDriverError(message, code)


# -- contexts ---------------------------------------------------------------------------
_context_lock = threading.Lock()


@cache
def primary_context(device_index: int) -> int:
    """The primary context of a device: the one the CUDA runtime (and so torch) uses."""
    lib = _lib()
    dev = CUdevice()
    check(lib.cuDeviceGet(ctypes.byref(dev), device_index), f"cuDeviceGet({device_index})")
    ctx = CUcontext()
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), f"cuDevicePrimaryCtxRetain({device_index})")
    return ctx.value


def make_current(device_index: int) -> None:
    """Make the device's primary context current on this thread (a thread that never
    touched CUDA through torch has none)."""
    check(_lib().cuCtxSetCurrent(primary_context(device_index)), "cuCtxSetCurrent")


def device_attribute(device_index: int, attribute: int) -> int:
    lib = _lib()
    dev = CUdevice()
    check(lib.cuDeviceGet(ctypes.byref(dev), device_index), f"cuDeviceGet({device_index})")
    value = ctypes.c_int()
    check(lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, dev), "cuDeviceGetAttribute")
    return value.value


# -- modules ----------------------------------------------------------------------------
def load_module(image: bytes, device_index: int, what: str) -> int:
    """Load a cubin or PTX image into the device's primary context; return the CUmodule.

    PTX is compiled by the driver here (JIT, cached on disk by the driver); its error log
    is part of the exception.
    """
    lib = _lib()
    with _context_lock:
        previous = CUcontext()
        check(lib.cuCtxGetCurrent(ctypes.byref(previous)), "cuCtxGetCurrent")
        make_current(device_index)
        try:
            log = ctypes.create_string_buffer(8192)
            options = (ctypes.c_int * 2)(CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
            values = (ctypes.c_void_p * 2)(ctypes.addressof(log), len(log))
            data = ctypes.create_string_buffer(image if image.endswith(b"\0") else image + b"\0")
            module = CUmodule()
            code = lib.cuModuleLoadDataEx(ctypes.byref(module), data, 2, options, values)
            if code != 0:
                detail = log.value.decode(errors="replace").strip()
                raise CudaDriverError(
                    f"loading {what} failed with {error_text(code)}" + (f"\n{detail}" if detail else ""), code
                )
            return module.value
        finally:
            if previous.value:
                lib.cuCtxSetCurrent(previous)


def get_function(module: int, entry: str, what: str) -> int:
    fn = CUfunction()
    check(_lib().cuModuleGetFunction(ctypes.byref(fn), module, entry.encode()), f"cuModuleGetFunction({what})")
    return fn.value


def set_max_dynamic_shared_memory(function: int, nbytes: int, what: str) -> None:
    check(
        _lib().cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
        f"cuFuncSetAttribute(max dynamic shared memory = {nbytes} B) for {what}",
    )


# -- tensor maps (TMA descriptors) --------------------------------------------------------
CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6
CU_TENSOR_MAP_DATA_TYPE_FLOAT32 = 7
CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9
CU_TENSOR_MAP_SWIZZLE_128B = 3
# CUtensorMapL2promotion: none, or each L2 request widened to 64, 128 or 256 bytes
CU_TENSOR_MAP_L2_PROMOTION = {0: 0, 64: 1, 128: 2, 256: 3}
CU_TENSOR_MAP_L2_PROMOTION_NONE = CU_TENSOR_MAP_L2_PROMOTION[0]
CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0


def max_active_clusters(function: int, cluster: int, block: int, smem: int, what: str) -> int:
    """How many clusters of `cluster` CTAs (along x) of `function`, `block` threads and
    `smem` bytes of dynamic shared memory each, fit on the device at once: a cluster sits
    inside one GPC, so fewer than SMs / cluster may (the function's dynamic shared memory
    limit must already allow `smem`)."""
    attr = _LaunchAttr()
    attr.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim[0], attr.value.clusterDim[1], attr.value.clusterDim[2] = cluster, 1, 1
    config = _LaunchConfig(cluster, 1, 1, block, 1, 1, smem, None, ctypes.pointer(attr), 1)
    count = ctypes.c_int()
    check(
        _lib().cuOccupancyMaxActiveClusters(ctypes.byref(count), function, ctypes.byref(config)),
        f"cuOccupancyMaxActiveClusters(cluster {cluster}, block {block}, {smem} B shared) for {what}",
    )
    return count.value


def encode_tiled_tensor_map(
    data_type: int,
    address: int,
    dims,
    byte_strides,
    box,
    swizzle: int,
    what: str,
    l2_promotion: int = CU_TENSOR_MAP_L2_PROMOTION_NONE,
) -> bytes:
    """A CUtensorMap (128 bytes) for a tiled TMA view; `dims`/`box` innermost first,
    `byte_strides` for every dim but the innermost; `l2_promotion` one of
    CU_TENSOR_MAP_L2_PROMOTION's values."""
    rank = len(dims)
    storage = ctypes.create_string_buffer(128 + 64)  # the driver wants 64-byte alignment
    aligned = (ctypes.addressof(storage) + 63) & ~63
    code = _lib().cuTensorMapEncodeTiled(
        aligned,
        data_type,
        rank,
        address,
        (ctypes.c_uint64 * rank)(*dims),
        (ctypes.c_uint64 * max(rank - 1, 1))(*byte_strides),
        (ctypes.c_uint32 * rank)(*box),
        (ctypes.c_uint32 * rank)(*([1] * rank)),
        0,
        swizzle,
        l2_promotion,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    check(
        code,
        f"cuTensorMapEncodeTiled ({what}: dims {tuple(dims)}, byte strides {tuple(byte_strides)}, box {tuple(box)}, "
        f"L2 promotion {l2_promotion}, "
        f"address {address:#x}, {address % 16} bytes past a 16-byte boundary)",
    )
    return ctypes.string_at(aligned, 128)
