/* The launch itself, in C: pack one kernel's arguments and call cuLaunchKernel(Ex).
 *
 * Day 016 measured the ctypes version of this at a few microseconds of Python per launch
 * (a ctypes struct, an array of pointers into it, an 11-argument foreign call); here it
 * is one call from Python. `launcher.py` compiles this file with the machine's C
 * compiler on first use, as Triton does with its launcher, against Python's stable ABI,
 * and falls back to the ctypes launcher when it cannot.
 *
 * No CUDA header is needed: the driver's entry points are handed in as addresses
 * (`set_driver`, from the ctypes handles of libcuda.so.1). The argument slots, the
 * packing and the launch are in `launch_args.h`, shared with the C++ replay.
 */
#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030B0000
#include "launch_args.h"

static PyObject *set_driver(PyObject *self, PyObject *args) {
    unsigned long long plain, ex;
    if (!PyArg_ParseTuple(args, "KK", &plain, &ex)) return NULL;
    launch_kernel = (launch_kernel_fn)(uintptr_t)plain;
    launch_kernel_ex = (launch_kernel_ex_fn)(uintptr_t)ex;
    Py_RETURN_NONE;
}

/* launch(function, grid, block, shared_bytes, stream, cluster, kinds, args) -> CUresult
 * grid/block: an int or a tuple of 1-3 ints; cluster: CTAs per cluster along x, 0 for
 * none; kinds: bytes, one letter per argument; args: a tuple. */
static PyObject *launch(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    if (argc != 8) {
        PyErr_SetString(PyExc_TypeError, "launch takes 8 arguments");
        return NULL;
    }
    void *function = PyLong_AsVoidPtr(argv[0]);
    unsigned int grid[3], block[3];
    if (PyErr_Occurred() || read_dim3(argv[1], grid, "grid") < 0 || read_dim3(argv[2], block, "block") < 0)
        return NULL;
    unsigned long shared_bytes = PyLong_AsUnsignedLong(argv[3]);
    void *stream = PyLong_AsVoidPtr(argv[4]);
    long cluster = PyLong_AsLong(argv[5]);
    if (PyErr_Occurred()) return NULL;
    char *kinds;
    Py_ssize_t nkinds;
    if (PyBytes_AsStringAndSize(argv[6], &kinds, &nkinds) < 0) return NULL;
    PyObject *values = argv[7];
    if (!PyTuple_Check(values)) {
        PyErr_SetString(PyExc_TypeError, "launch: args must be a tuple");
        return NULL;
    }
    Py_ssize_t n = PyTuple_Size(values);
    if (n != nkinds || n > MAX_ARGS) {
        PyErr_Format(PyExc_ValueError, "launch: %zd arguments for %zd declared kinds (at most %d)", n, nkinds,
                     MAX_ARGS);
        return NULL;
    }
    /* --8<-- [start:pack] */
    Slot slots[MAX_ARGS];
    void *params[MAX_ARGS];
    for (Py_ssize_t i = 0; i < n; i++) {
        if (pack(kinds[i], PyTuple_GetItem(values, i), &slots[i], i) < 0) return NULL;
        params[i] = slots[i].bytes;
    }
    int code = launch_slots(function, grid, block, (unsigned int)shared_bytes, stream, cluster, params);
    if (code == LAUNCH_FAILED_IN_PYTHON) return NULL;
    /* --8<-- [end:pack] */
    return PyLong_FromLong(code);
}

static PyMethodDef methods[] = {
    {"set_driver", set_driver, METH_VARARGS, "set_driver(cuLaunchKernel address, cuLaunchKernelEx address)"},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(function, grid, block, shared_bytes, stream, cluster, kinds, args) -> CUresult"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpu_days_launcher", NULL, -1, methods};

PyMODINIT_FUNC PyInit_gpu_days_launcher(void) { return PyModule_Create(&module); }
