/* The replay of a call seen before, in C++: key, outputs, addresses, launch.
 *
 * A recipe (`direct.Recipe`) is the launches of one call with each address argument
 * replaced by the index of the tensor it came from. Replaying it in Python costs a key
 * (five tensor attributes per tensor), one torch.empty per output and a loop over the
 * launches: 8-15 us per call on the H100's host, where the launch itself is ~3.5 (day 016,
 * part four). Here a recipe book (one per op) does the same in one call from Python:
 *
 *   call(book, inputs, params, out) -> list of outputs   a recipe for this key ran
 *                                   -> None              no recipe: Python plans, adds one
 *                                   -> (recipe, outputs, scratch, step, code)
 *                                                        a launch returned `code`: the Python
 *                                                        recipe goes on from `step` (its error path)
 *   add(book, inputs, params, out, recipe)               store the Python recipe under this key
 *
 * The key is what `mojo_op._call_key` reads: the number of destinations (`out`, the
 * outputs the caller gives), the shape, dtype, device, contiguity and 16-byte alignment
 * of each destination and input, and `params` (None, or a hashable value standing for
 * the call's parameters, compared by ==). The caller checks that destinations overlap no
 * input, as the Python replay does. Constant
 * arguments are packed once, when a recipe is added; a replay writes only addresses and
 * tensor maps (re-encoded per address by the recipe's Python spec, cached here).
 *
 * Built by `replay.py` against the local torch, on first use; the GIL is held throughout,
 * so the books need no lock.
 */
#include "replay_book.h"
#include "replay_nodes.h"
#include "replay_programs.h"

namespace {

// -- the module's functions -------------------------------------------------------------------
PyObject *configure(PyObject *, PyObject *args) {
    unsigned long long plain, ex;
    PyObject *types, *device, *stream;
    if (!PyArg_ParseTuple(args, "KKO!OO", &plain, &ex, &PyTuple_Type, &types, &device, &stream)) return nullptr;
    launch_kernel = (launch_kernel_fn)(uintptr_t)plain;
    launch_kernel_ex = (launch_kernel_ex_fn)(uintptr_t)ex;
    Py_INCREF(types), Py_INCREF(device), Py_INCREF(stream);
    Py_XSETREF(plain_types, types);
    Py_XSETREF(current_device, device);
    Py_XSETREF(current_stream, stream);
    Py_RETURN_NONE;
}

PyObject *new_book(PyObject *, PyObject *) { return PyCapsule_New(new Book(), kBookName, free_book); }

PyObject *book_size(PyObject *, PyObject *capsule) {
    Book *book = book_of(capsule);
    return book ? PyLong_FromSize_t(book->size()) : nullptr;
}

PyObject *add(PyObject *, PyObject *const *argv, Py_ssize_t argc) {
    HANDLE_TH_ERRORS
    if (argc != 5) {
        PyErr_SetString(PyExc_TypeError, "add(book, inputs, params, out, recipe)");
        return nullptr;
    }
    Book *book = book_of(argv[0]);
    if (book == nullptr) return nullptr;
    std::vector<int64_t> key;
    std::vector<const at::Tensor *> tensors;
    if (!make_key(argv[3], argv[1], key, tensors)) Py_RETURN_FALSE;  // such calls stay on the Python path
    auto entry = std::make_unique<Entry>();
    entry->key = key;
    if (!full_hash(key, argv[2], entry->hash)) return nullptr;
    PyObject *recipe = argv[4];
    const size_t n_given = static_cast<size_t>(PySequence_Fast_GET_SIZE(argv[3]));
    PyObject *device = PyObject_GetAttrString(recipe, "device");
    PyObject *index = PyObject_GetAttrString(recipe, "device_index");
    bool ok = device && index && THPDevice_Check(device);
    if (ok) {
        entry->device = reinterpret_cast<THPDevice *>(device)->device;
        entry->device_index = PyLong_AsLong(index);
        ok = !PyErr_Occurred();
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_TypeError, "recipe.device: a torch.device was expected");
    }
    Py_XDECREF(device), Py_XDECREF(index);
    ok = ok && read_allocs(recipe, "outputs", entry->outputs, false) && read_allocs(recipe, "scratch", entry->scratch, true);
    size_t n_given_outputs = 0;
    for (const Alloc &a : entry->outputs) n_given_outputs += a.given;
    if (ok && n_given_outputs != n_given) {
        PyErr_SetString(PyExc_ValueError, "recipe: its destinations do not match the call's");
        ok = false;
    }
    PyObject *steps = ok ? tuple_attr(recipe, "steps") : nullptr;
    // tensor indices: outputs (destinations among them), inputs, scratch
    size_t n_tensors = entry->outputs.size() + (tensors.size() - n_given) + entry->scratch.size();
    if (steps != nullptr) {
        entry->steps.resize(PyTuple_GET_SIZE(steps));
        for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(steps); i++)
            ok = read_step(PyTuple_GET_ITEM(steps, i), entry->steps[i], n_tensors);
        Py_DECREF(steps);
    }
    if (!ok || steps == nullptr) {
        release(*entry);
        return nullptr;
    }
    Py_INCREF(recipe);
    Py_INCREF(argv[2]);
    entry->recipe = recipe;
    entry->params = argv[2];
    if (!store_keyed(*book, std::move(entry))) return nullptr;
    Py_RETURN_TRUE;
    END_HANDLE_TH_ERRORS
}

PyObject *clear(PyObject *, PyObject *capsule) {
    Book *book = book_of(capsule);
    if (book == nullptr) return nullptr;
    for (auto &entry : *book) release(*entry);
    book->clear();
    Py_RETURN_NONE;
}

// --8<-- [start:call]
PyObject *call(PyObject *, PyObject *const *argv, Py_ssize_t argc) {
    HANDLE_TH_ERRORS
    if (argc != 4) {
        PyErr_SetString(PyExc_TypeError, "call(book, inputs, params, out)");
        return nullptr;
    }
    Book *book = book_of(argv[0]);
    if (book == nullptr) return nullptr;
    thread_local std::vector<int64_t> key;
    thread_local std::vector<const at::Tensor *> tensors;  // destinations, then inputs
    uint64_t hash;
    bool failed;
    if (!make_key(argv[3], argv[1], key, tensors)) Py_RETURN_NONE;
    if (!full_hash(key, argv[2], hash)) return nullptr;
    Entry *entry = find_entry(*book, key, hash, argv[2], failed);
    if (failed) return nullptr;
    if (entry == nullptr) Py_RETURN_NONE;

    // torch's current device must be the recipe's (else the Python path switches to it)
    long current;
    void *stream;
    if (!current_device_index(current)) return nullptr;
    if (current != entry->device_index) Py_RETURN_NONE;
    if (!current_stream_of(entry->device_index, stream)) return nullptr;

    const size_t n_given = static_cast<size_t>(PySequence_Fast_GET_SIZE(argv[3]));
    std::vector<at::Tensor> made;
    size_t step = 0;
    int code = run_entry(*entry, tensors, n_given, stream, made, step);
    if (code == LAUNCH_FAILED_IN_PYTHON) return nullptr;
    const size_t n_out = entry->outputs.size();
    if (code != 0) {  // the Python recipe takes over from this step (retry, or an error naming the kernel)
        PyObject *outputs = wrap_all(made, 0, n_out);
        PyObject *scratch = outputs ? wrap_all(made, n_out, made.size() - n_out) : nullptr;
        if (scratch == nullptr) {
            Py_XDECREF(outputs);
            return nullptr;
        }
        return Py_BuildValue("(ONNni)", entry->recipe, outputs, scratch, (Py_ssize_t)step, code);
    }
    return wrap_all(made, 0, n_out);
    END_HANDLE_TH_ERRORS
}
// --8<-- [end:call]

// Whether `book` holds a recipe for this call (what a program may replay; nothing runs).
PyObject *has(PyObject *, PyObject *const *argv, Py_ssize_t argc) {
    HANDLE_TH_ERRORS
    if (argc != 4) {
        PyErr_SetString(PyExc_TypeError, "has(book, inputs, params, out)");
        return nullptr;
    }
    Book *book = book_of(argv[0]);
    if (book == nullptr) return nullptr;
    std::vector<int64_t> key;
    std::vector<const at::Tensor *> tensors;
    uint64_t hash;
    bool failed;
    if (!make_key(argv[3], argv[1], key, tensors)) Py_RETURN_FALSE;
    if (!full_hash(key, argv[2], hash)) return nullptr;
    Entry *entry = find_entry(*book, key, hash, argv[2], failed);
    if (failed) return nullptr;
    return PyBool_FromLong(entry != nullptr);
    END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(cuLaunchKernel, cuLaunchKernelEx, plain tensor types, current_device(), current_stream(index))"},
    {"new_book", new_book, METH_NOARGS, "new_book() -> an empty recipe book"},
    {"size", book_size, METH_O, "size(book) -> recipes stored"},
    {"add", (PyCFunction)(void (*)(void))add, METH_FASTCALL, "add(book, inputs, params, out, recipe) -> stored"},
    {"clear", clear, METH_O, "clear(book)"},
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL,
     "call(book, inputs, params, out) -> outputs | None | (recipe, outputs, scratch, step, code)"},
    {"has", (PyCFunction)(void (*)(void))has, METH_FASTCALL, "has(book, inputs, params, out) -> a recipe is stored"},
    {"new_program_book", new_program_book, METH_NOARGS, "new_program_book() -> an empty program book"},
    {"program_count", program_count, METH_O, "program_count(pbook) -> programs stored"},
    {"clear_programs", clear_programs, METH_O, "clear_programs(pbook)"},
    {"program_add", (PyCFunction)(void (*)(void))program_add, METH_FASTCALL,
     "program_add(pbook, inputs, params, (constants, steps, outputs) or None) -> stored"},
    {"program_known", (PyCFunction)(void (*)(void))program_known, METH_FASTCALL,
     "program_known(pbook, inputs, params) -> True (replays) | False | None (not stored)"},
    {"new_node_book", new_node_book, METH_NOARGS, "new_node_book() -> an empty node book"},
    {"node_add", (PyCFunction)(void (*)(void))node_add, METH_FASTCALL, "node_add(nbook, inputs, params, spec or None)"},
    {"node_known", (PyCFunction)(void (*)(void))node_known, METH_FASTCALL, "node_known(nbook, inputs, params)"},
    {"node_call", (PyCFunction)(void (*)(void))node_call, METH_FASTCALL,
     "node_call(nbook, inputs, params) -> outputs (with their C++ autograd node) | None"},
    {"program_call", (PyCFunction)(void (*)(void))program_call, METH_FASTCALL,
     "program_call(pbook, inputs, params) -> outputs | None (no program, or a step missed) | False"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpu_days_replay", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_gpu_days_replay(void) { return PyModule_Create(&module); }
