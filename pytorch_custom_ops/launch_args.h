/* What both native launch paths share: the driver's launch types, one argument slot per
 * kernel argument, packing a Python value into its slot, and the launch of packed slots.
 *
 * Included by `launcher.c` (the C launcher: every launch packs its arguments from
 * Python values) and by `replay.cpp` (the C++ replay: constants are packed once, when a
 * recipe is stored, and a replay writes only the addresses). No CUDA header is needed:
 * the driver's entry points are handed in as addresses, and the few types below are
 * written out as the driver API declares them. Python's limited API only, so that the C
 * launcher keeps building against the stable ABI.
 */
#ifndef GPU_DAYS_LAUNCH_ARGS_H
#define GPU_DAYS_LAUNCH_ARGS_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_ARGS 64
#define TENSORMAP_BYTES 128
#define CLUSTER_DIMENSION_ATTRIBUTE 4 /* CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION */
#define LAUNCH_FAILED_IN_PYTHON (-1)  /* not a CUresult: a Python error is set */

#ifdef __cplusplus
#define GPU_DAYS_ALIGN64 alignas(64)
#else
#define GPU_DAYS_ALIGN64 _Alignas(64)
#endif

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

/* One argument slot: wide enough for a tensor map, aligned like one (64 bytes). */
typedef struct {
    GPU_DAYS_ALIGN64 unsigned char bytes[TENSORMAP_BYTES];
} Slot;

/* The driver's entry points, set once per extension module (its `set_driver`). */
static launch_kernel_fn launch_kernel;
static launch_kernel_ex_fn launch_kernel_ex;

static int read_dim3(PyObject *obj, unsigned int out[3], const char *what) {
    if (PyLong_Check(obj)) {
        unsigned long v = PyLong_AsUnsignedLong(obj);
        if (PyErr_Occurred()) goto bad;
        out[0] = (unsigned int)v, out[1] = out[2] = 1;
        if (v > 0xFFFFFFFFul) goto bad;
        return 0;
    }
    {
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
    }
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
    {
        PyObject *type, *val, *tb;
        PyErr_Fetch(&type, &val, &tb);
        PyObject *text = val ? PyObject_Str(val) : NULL;
        PyErr_Format(type ? type : PyExc_TypeError, "kernel argument %zd (kind '%c'): %U", i, kind,
                     text ? text : PyUnicode_FromString("bad value"));
        Py_XDECREF(text);
        Py_XDECREF(type);
        Py_XDECREF(val);
        Py_XDECREF(tb);
    }
    return -1;
}

/* --8<-- [start:launch_slots] */
/* Launch `function` with its packed arguments (`params[i]` points at slot i): the
 * CUresult, or LAUNCH_FAILED_IN_PYTHON with a Python error set. `cluster` > 0: CTAs per
 * cluster along x, through cuLaunchKernelEx. */
static int launch_slots(void *function, const unsigned int grid[3], const unsigned int block[3],
                        unsigned int shared_bytes, void *stream, long cluster, void **params) {
    if (launch_kernel == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "launch: set_driver was not called");
        return LAUNCH_FAILED_IN_PYTHON;
    }
    if (cluster <= 0)
        return launch_kernel(function, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared_bytes, stream,
                             params, NULL);
    if (launch_kernel_ex == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "launch: the driver has no cuLaunchKernelEx (clusters)");
        return LAUNCH_FAILED_IN_PYTHON;
    }
    LaunchAttribute attribute;
    memset(&attribute, 0, sizeof attribute);
    attribute.id = CLUSTER_DIMENSION_ATTRIBUTE;
    attribute.value.cluster.x = (unsigned int)cluster;
    attribute.value.cluster.y = attribute.value.cluster.z = 1;
    LaunchConfig config = {{grid[0], grid[1], grid[2]}, {block[0], block[1], block[2]}, shared_bytes, stream, &attribute,
                           1};
    return launch_kernel_ex(&config, function, params, NULL);
}
/* --8<-- [end:launch_slots] */

#endif
