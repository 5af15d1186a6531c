/* The launch itself, in C: pack one kernel's arguments and call cuLaunchKernel(Ex).
 *
 * Day 016 measured the ctypes version of this at a few microseconds of Python per launch
 * (a ctypes struct, an array of pointers into it, an 11-argument foreign call); here it
 * is one call from Python. `launcher.py` compiles this file with the machine's C
 * compiler on first use, as Triton does with its launcher, against Python's stable ABI,
 * and falls back to the ctypes launcher when it cannot.
 *
 * No CUDA header is needed: the driver's entry points are handed in as addresses
 * (`set_driver`, from the ctypes handles of libcuda.so.1), with the few types below
 * written out as the driver API declares them.
 */
#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030B0000
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_ARGS 64
#define TENSORMAP_BYTES 128
#define CLUSTER_DIMENSION_ATTRIBUTE 4 /* CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION */

typedef struct {
    unsigned int id;
    char pad[4];
    union {
        char pad[64];
        struct {
            unsigned int x, y, z;
        } cluster;
    } value;
} LaunchAttribute; /* CUlaunchAttribute */

typedef struct {
    unsigned int grid[3];
    unsigned int block[3];
    unsigned int shared_bytes;
    void *stream;
    LaunchAttribute *attrs;
    unsigned int num_attrs;
} LaunchConfig; /* CUlaunchConfig */

typedef int (*launch_kernel_fn)(void *, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                                unsigned int, unsigned int, void *, void **, void **);
typedef int (*launch_kernel_ex_fn)(const LaunchConfig *, void *, void **, void **);

static launch_kernel_fn launch_kernel;
static launch_kernel_ex_fn launch_kernel_ex;

/* One argument slot: wide enough for a tensor map, aligned like one (64 bytes). */
typedef struct {
    _Alignas(64) unsigned char bytes[TENSORMAP_BYTES];
} Slot;

static PyObject *set_driver(PyObject *self, PyObject *args) {
    unsigned long long plain, ex;
    if (!PyArg_ParseTuple(args, "KK", &plain, &ex)) return NULL;
    launch_kernel = (launch_kernel_fn)(uintptr_t)plain;
    launch_kernel_ex = (launch_kernel_ex_fn)(uintptr_t)ex;
    Py_RETURN_NONE;
}

static int read_dim3(PyObject *obj, unsigned int out[3], const char *what) {
    if (PyLong_Check(obj)) {
        unsigned long v = PyLong_AsUnsignedLong(obj);
        if (PyErr_Occurred()) goto bad;
        out[0] = (unsigned int)v, out[1] = out[2] = 1;
        if (v > 0xFFFFFFFFul) goto bad;
        return 0;
    }
    PyObject *seq = PySequence_Tuple(obj);
    if (seq == NULL) goto bad;
    Py_ssize_t n = PyTuple_Size(seq);
    if (n < 1 || n > 3) {
        Py_DECREF(seq);
        goto bad;
    }
    for (Py_ssize_t i = 0; i < 3; i++) {
        unsigned long v = 1;
        if (i < n) v = PyLong_AsUnsignedLong(PyTuple_GetItem(seq, i));
        if (PyErr_Occurred() || v > 0xFFFFFFFFul) {
            Py_DECREF(seq);
            goto bad;
        }
        out[i] = (unsigned int)v;
    }
    Py_DECREF(seq);
    return 0;
bad:
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "%s must be an int or 1-3 non-negative 32-bit ints", what);
    return -1;
}

/* Write argument i of kind `kind` ('p' pointer, 'q' int64, 'i' int32, 'f' float32,
 * 't' 128-byte tensor map) into its slot. */
static int pack(char kind, PyObject *value, Slot *slot, Py_ssize_t i) {
    switch (kind) {
    case 'p': {
        unsigned long long v = PyLong_AsUnsignedLongLong(value);
        if (PyErr_Occurred()) break;
        memcpy(slot->bytes, &v, sizeof v);
        return 0;
    }
    case 'q': {
        long long v = PyLong_AsLongLong(value);
        if (PyErr_Occurred()) break;
        memcpy(slot->bytes, &v, sizeof v);
        return 0;
    }
    case 'i': {
        long long v = PyLong_AsLongLong(value);
        if (PyErr_Occurred()) break;
        if (v < INT32_MIN || v > INT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "kernel argument %zd: %lld does not fit int32", i, v);
            return -1;
        }
        int32_t w = (int32_t)v;
        memcpy(slot->bytes, &w, sizeof w);
        return 0;
    }
    case 'f': {
        double v = PyFloat_AsDouble(value);
        if (PyErr_Occurred()) break;
        float w = (float)v;
        memcpy(slot->bytes, &w, sizeof w);
        return 0;
    }
    case 't': {
        char *data;
        Py_ssize_t size;
        if (!PyBytes_Check(value) || PyBytes_AsStringAndSize(value, &data, &size) < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "kernel argument %zd: a tensor map must be bytes", i);
            return -1;
        }
        if (size != TENSORMAP_BYTES) {
            PyErr_Format(PyExc_ValueError, "kernel argument %zd: a tensor map is 128 bytes, got %zd", i, size);
            return -1;
        }
        memcpy(slot->bytes, data, TENSORMAP_BYTES);
        return 0;
    }
    default:
        PyErr_Format(PyExc_ValueError, "kernel argument %zd: unknown kind '%c'", i, kind);
        return -1;
    }
    /* a conversion failed: say which argument, keeping the type of the error */
    PyObject *type, *val, *tb;
    PyErr_Fetch(&type, &val, &tb);
    PyObject *text = val ? PyObject_Str(val) : NULL;
    PyErr_Format(type ? type : PyExc_TypeError, "kernel argument %zd (kind '%c'): %U", i, kind,
                 text ? text : PyUnicode_FromString("bad value"));
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(val);
    Py_XDECREF(tb);
    return -1;
}

/* launch(function, grid, block, shared_bytes, stream, cluster, kinds, args) -> CUresult
 * grid/block: an int or a tuple of 1-3 ints; cluster: CTAs per cluster along x, 0 for
 * none; kinds: bytes, one letter per argument; args: a tuple. */
static PyObject *launch(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    if (argc != 8) {
        PyErr_SetString(PyExc_TypeError, "launch takes 8 arguments");
        return NULL;
    }
    if (launch_kernel == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "launch: set_driver was not called");
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
    int code;
    if (cluster <= 0) {
        code = launch_kernel(function, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                             (unsigned int)shared_bytes, stream, params, NULL);
    } else {
        if (launch_kernel_ex == NULL) {
            PyErr_SetString(PyExc_RuntimeError, "launch: the driver has no cuLaunchKernelEx (clusters)");
            return NULL;
        }
        LaunchAttribute attribute;
        memset(&attribute, 0, sizeof attribute);
        attribute.id = CLUSTER_DIMENSION_ATTRIBUTE;
        attribute.value.cluster.x = (unsigned int)cluster;
        attribute.value.cluster.y = attribute.value.cluster.z = 1;
        LaunchConfig config = {{grid[0], grid[1], grid[2]}, {block[0], block[1], block[2]},
                               (unsigned int)shared_bytes, stream, &attribute, 1};
        code = launch_kernel_ex(&config, function, params, NULL);
    }
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
