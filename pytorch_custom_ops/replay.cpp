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
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

#include "launch_args.h"

namespace {

constexpr const char *kBookName = "gpu_days.recipe_book";
constexpr size_t kMaxEncoded = 256;  // tensor maps kept per argument, as direct.Recipe does

struct Alloc {
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
    bool zeroed;  // scratch: made with zeros
    bool given;   // output: a destination, not allocated
};

struct TensorMapArg {
    int slot, tensor;
    PyObject *spec;  // owned: spec.encode_at(address) -> 128 bytes
    std::unordered_map<uint64_t, std::array<unsigned char, TENSORMAP_BYTES>> encoded;
};

struct Step {
    void *function;
    unsigned int grid[3], block[3], smem;
    long cluster;
    std::unique_ptr<Slot[]> slots;  // constants packed once; addresses written per call
    std::vector<void *> params;
    std::vector<std::pair<int, int>> pointers;  // (slot, tensor index)
    std::vector<TensorMapArg> maps;
};

struct Entry {
    uint64_t hash;
    std::vector<int64_t> key;
    PyObject *params = nullptr;  // owned: None or the call's parameters
    c10::Device device{c10::kCPU};
    long device_index = 0;
    std::vector<Alloc> outputs, scratch;
    std::vector<Step> steps;
    PyObject *recipe = nullptr;  // owned: the Python recipe, for its error path
};

using Book = std::vector<std::unique_ptr<Entry>>;

// set by configure(): which Python types are plain tensors, and torch's current device / stream
PyObject *plain_types;
PyObject *current_device;
PyObject *current_stream;

// Append the key words of a list or tuple of tensors (false: not replayable here, e.g. a
// tensor subclass).
bool add_key(PyObject *seq, std::vector<int64_t> &key, std::vector<const at::Tensor *> &tensors) {
    if (!(PyList_CheckExact(seq) || PyTuple_CheckExact(seq)) || plain_types == nullptr) return false;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    key.push_back(n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PySequence_Fast_GET_ITEM(seq, i);
        bool plain = false;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(plain_types); j++)
            plain = plain || (PyObject *)Py_TYPE(obj) == PyTuple_GET_ITEM(plain_types, j);
        if (!plain) return false;
        const at::Tensor &t = THPVariable_Unpack(obj);
        // what no recipe is made for (the Python path names the problem): no tensor, no
        // storage, a nested or sparse or meta tensor, whose sizes or address would throw
        if (!t.defined() || t.is_nested() || t.layout() != at::kStrided || t.is_meta() || !t.has_storage())
            return false;
        key.push_back(t.dim());
        for (int64_t s : t.sizes()) key.push_back(s);
        key.push_back(static_cast<int64_t>(t.scalar_type()));
        key.push_back(static_cast<int64_t>(t.device().type()));
        key.push_back(t.device().index());
        key.push_back(t.is_contiguous());
        key.push_back(reinterpret_cast<uintptr_t>(t.data_ptr()) & 15);
        tensors.push_back(&t);
    }
    return true;
}

// The key of a call: its destinations, then its inputs. `tensors` gets them in that order.
bool make_key(PyObject *out, PyObject *inputs, std::vector<int64_t> &key, std::vector<const at::Tensor *> &tensors) {
    key.clear();
    tensors.clear();
    return add_key(out, key, tensors) && add_key(inputs, key, tensors);
}

uint64_t hash_key(const std::vector<int64_t> &key) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t v : key) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return h;
}

Book *book_of(PyObject *capsule) { return static_cast<Book *>(PyCapsule_GetPointer(capsule, kBookName)); }

// Drop the Python objects an entry holds (before it is freed).
void release(Entry &entry) {
    Py_XDECREF(entry.recipe);
    Py_XDECREF(entry.params);
    entry.recipe = entry.params = nullptr;
    for (auto &step : entry.steps)
        for (auto &map : step.maps) Py_CLEAR(map.spec);
}

void free_book(PyObject *capsule) {
    Book *book = book_of(capsule);
    if (book == nullptr) return;
    for (auto &entry : *book) release(*entry);
    delete book;
}

// The hash of a call's key and parameters (-1: the parameters cannot be hashed).
bool full_hash(const std::vector<int64_t> &key, PyObject *params, uint64_t &hash) {
    Py_hash_t h = PyObject_Hash(params);
    if (h == -1) return false;
    hash = hash_key(key) ^ (static_cast<uint64_t>(h) * 0x9E3779B97F4A7C15ull);
    return true;
}

// -- reading a Python recipe ------------------------------------------------------------------
bool read_sizes(PyObject *sizes, std::vector<int64_t> &out) {
    // a recipe keeps sizes as torch.empty's positional arguments: (8, 128), or ((),) for 0-dim
    PyObject *seq = PySequence_Tuple(sizes);
    if (seq == nullptr) return false;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i);
        if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 0 && n == 1) break;
        long long v = PyLong_AsLongLong(item);
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return false;
        }
        out.push_back(v);
    }
    Py_DECREF(seq);
    return true;
}

bool read_dtype(PyObject *obj, at::ScalarType &out) {
    if (!THPDtype_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "recipe: a dtype was expected");
        return false;
    }
    out = reinterpret_cast<THPDtype *>(obj)->scalar_type;
    return true;
}

// A list attribute of `obj`, as a new tuple (nullptr with an error set).
PyObject *tuple_attr(PyObject *obj, const char *name) {
    PyObject *value = PyObject_GetAttrString(obj, name);
    if (value == nullptr) return nullptr;
    PyObject *seq = PySequence_Tuple(value);
    Py_DECREF(value);
    return seq;
}

bool read_allocs(PyObject *recipe, const char *name, std::vector<Alloc> &out, bool scratch) {
    PyObject *items = tuple_attr(recipe, name);
    if (items == nullptr) return false;
    bool ok = true;
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(items); i++) {
        PyObject *item = PyTuple_GET_ITEM(items, i);
        Alloc alloc{{}, at::kFloat, false, false};
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != (scratch ? 3 : 2)) {
            PyErr_Format(PyExc_TypeError, "recipe.%s: unexpected entry", name);
            ok = false;
        } else if (PyTuple_GET_ITEM(item, 0) == Py_None && !scratch) {  // a destination the caller gives
            alloc.given = true;
            out.push_back(std::move(alloc));
        } else {
            ok = read_sizes(PyTuple_GET_ITEM(item, 0), alloc.sizes) && read_dtype(PyTuple_GET_ITEM(item, 1), alloc.dtype);
            if (ok && scratch) alloc.zeroed = PyObject_IsTrue(PyTuple_GET_ITEM(item, 2)) == 1;
            out.push_back(std::move(alloc));
        }
    }
    Py_DECREF(items);
    return ok;
}

bool read_pairs(PyObject *step, const char *name, int width, std::vector<PyObject *> &rows) {
    PyObject *items = tuple_attr(step, name);
    if (items == nullptr) return false;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); i++) {
        PyObject *row = PyTuple_GET_ITEM(items, i);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != width) {
            PyErr_Format(PyExc_TypeError, "recipe step.%s: unexpected entry", name);
            Py_DECREF(items);
            return false;
        }
        Py_INCREF(row);
        rows.push_back(row);
    }
    Py_DECREF(items);
    return true;
}

bool read_step(PyObject *py_step, Step &step, size_t n_tensors) {
    PyObject *function = PyObject_GetAttrString(py_step, "function");
    PyObject *grid = PyObject_GetAttrString(py_step, "grid");
    PyObject *block = PyObject_GetAttrString(py_step, "block");
    PyObject *smem = PyObject_GetAttrString(py_step, "smem");
    PyObject *cluster = PyObject_GetAttrString(py_step, "cluster");
    PyObject *letters = PyObject_GetAttrString(py_step, "letters");
    PyObject *tmpl = tuple_attr(py_step, "template");
    std::vector<PyObject *> pointers, maps;
    bool ok = function && grid && block && smem && cluster && letters && tmpl;
    char *kinds = nullptr;
    Py_ssize_t n = 0;
    if (ok) {
        step.function = PyLong_AsVoidPtr(function);
        step.smem = static_cast<unsigned int>(PyLong_AsUnsignedLong(smem));
        step.cluster = PyLong_AsLong(cluster);
        ok = !PyErr_Occurred() && read_dim3(grid, step.grid, "grid") == 0 && read_dim3(block, step.block, "block") == 0;
    }
    ok = ok && PyBytes_AsStringAndSize(letters, &kinds, &n) == 0;
    if (ok && (n != PyTuple_GET_SIZE(tmpl) || n > MAX_ARGS)) {
        PyErr_SetString(PyExc_ValueError, "recipe step: the template does not match the kernel's arguments");
        ok = false;
    }
    if (ok) {
        step.slots.reset(new Slot[n > 0 ? n : 1]);
        std::memset(step.slots.get(), 0, sizeof(Slot) * (n > 0 ? n : 1));
        for (Py_ssize_t i = 0; ok && i < n; i++) {
            step.params.push_back(step.slots[i].bytes);
            PyObject *value = PyTuple_GET_ITEM(tmpl, i);
            if (value != Py_None) ok = pack(kinds[i], value, &step.slots[i], i) == 0;  // None: filled per call
        }
    }
    ok = ok && read_pairs(py_step, "pointers", 2, pointers) && read_pairs(py_step, "maps", 4, maps);
    for (PyObject *row : pointers) {
        long slot = PyLong_AsLong(PyTuple_GET_ITEM(row, 0)), tensor = PyLong_AsLong(PyTuple_GET_ITEM(row, 1));
        if (ok && (slot < 0 || slot >= n || kinds[slot] != 'p' || tensor < 0 || (size_t)tensor >= n_tensors)) {
            PyErr_SetString(PyExc_ValueError, "recipe step: an address slot out of range");
            ok = false;
        }
        step.pointers.emplace_back(static_cast<int>(slot), static_cast<int>(tensor));
        Py_DECREF(row);
    }
    for (PyObject *row : maps) {
        long slot = PyLong_AsLong(PyTuple_GET_ITEM(row, 0)), tensor = PyLong_AsLong(PyTuple_GET_ITEM(row, 1));
        if (ok && (slot < 0 || slot >= n || kinds[slot] != 't' || tensor < 0 || (size_t)tensor >= n_tensors)) {
            PyErr_SetString(PyExc_ValueError, "recipe step: a tensor-map slot out of range");
            ok = false;
        }
        PyObject *spec = PyTuple_GET_ITEM(row, 2);
        Py_INCREF(spec);
        step.maps.push_back(TensorMapArg{static_cast<int>(slot), static_cast<int>(tensor), spec, {}});
        Py_DECREF(row);
    }
    ok = ok && !PyErr_Occurred();
    Py_XDECREF(function), Py_XDECREF(grid), Py_XDECREF(block), Py_XDECREF(smem);
    Py_XDECREF(cluster), Py_XDECREF(letters), Py_XDECREF(tmpl);
    return ok;
}

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
    for (auto &old : *book) {  // the same key again (after plans_changed): the new recipe wins
        int same = old->hash == entry->hash && old->key == entry->key
                       ? PyObject_RichCompareBool(old->params, entry->params, Py_EQ)
                       : 0;
        if (same < 0) {
            release(*entry);
            return nullptr;
        }
        if (same) {
            std::swap(old, entry);
            release(*entry);
            Py_RETURN_TRUE;
        }
    }
    book->push_back(std::move(entry));
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

PyObject *wrap_all(std::vector<at::Tensor> &tensors, size_t first, size_t count) {
    PyObject *list = PyList_New(static_cast<Py_ssize_t>(count));
    if (list == nullptr) return nullptr;
    for (size_t i = 0; i < count; i++) {
        PyObject *t = THPVariable_Wrap(std::move(tensors[first + i]));
        if (t == nullptr) {
            Py_DECREF(list);
            return nullptr;
        }
        PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), t);
    }
    return list;
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
    if (!make_key(argv[3], argv[1], key, tensors)) Py_RETURN_NONE;
    if (!full_hash(key, argv[2], hash)) return nullptr;
    Entry *entry = nullptr;
    for (auto &e : *book) {
        if (e->hash != hash || e->key != key) continue;
        int same = e->params == argv[2] ? 1 : PyObject_RichCompareBool(e->params, argv[2], Py_EQ);
        if (same < 0) return nullptr;
        if (same) {
            entry = e.get();
            break;
        }
    }
    if (entry == nullptr) Py_RETURN_NONE;

    // torch's current device must be the recipe's (else the Python path switches to it)
    PyObject *device = PyObject_CallNoArgs(current_device);
    if (device == nullptr) return nullptr;
    long current = PyLong_AsLong(device);
    Py_DECREF(device);
    if (current != entry->device_index) Py_RETURN_NONE;
    PyObject *index = PyLong_FromLong(entry->device_index);
    PyObject *raw_stream = index ? PyObject_CallOneArg(current_stream, index) : nullptr;
    Py_XDECREF(index);
    if (raw_stream == nullptr) return nullptr;
    void *stream = PyLong_AsVoidPtr(raw_stream);
    Py_DECREF(raw_stream);
    if (PyErr_Occurred()) return nullptr;

    // outputs (new ones, and the destinations given), then scratch; the recipe's tensor
    // indices count outputs, then inputs, then scratch
    const size_t n_given = static_cast<size_t>(PySequence_Fast_GET_SIZE(argv[3]));
    std::vector<at::Tensor> made;
    made.reserve(entry->outputs.size() + entry->scratch.size());
    size_t given = 0;
    for (const Alloc &a : entry->outputs) {
        if (a.given)
            made.push_back(*tensors[given++]);
        else
            made.push_back(at::empty(a.sizes, at::TensorOptions().dtype(a.dtype).device(entry->device)));
    }
    for (const Alloc &a : entry->scratch) {
        auto options = at::TensorOptions().dtype(a.dtype).device(entry->device);
        made.push_back(a.zeroed ? at::zeros(a.sizes, options) : at::empty(a.sizes, options));
    }
    const size_t n_out = entry->outputs.size(), n_in = tensors.size() - n_given;
    auto address = [&](int i) -> uint64_t {
        const at::Tensor &t = i < (int)n_out               ? made[i]
                              : i < (int)(n_out + n_in) ? *tensors[n_given + i - n_out]
                                                        : made[i - n_in];
        return reinterpret_cast<uintptr_t>(t.data_ptr());
    };
    for (size_t s = 0; s < entry->steps.size(); s++) {
        Step &step = entry->steps[s];
        for (auto [slot, i] : step.pointers) {
            uint64_t a = address(i);
            std::memcpy(step.slots[slot].bytes, &a, sizeof a);
        }
        for (TensorMapArg &map : step.maps) {
            uint64_t a = address(map.tensor);
            auto found = map.encoded.find(a);
            if (found == map.encoded.end()) {  // a new address: the recipe's spec encodes it
                PyObject *raw = PyObject_CallMethod(map.spec, "encode_at", "K", (unsigned long long)a);
                if (raw == nullptr) return nullptr;
                if (!PyBytes_Check(raw) || PyBytes_GET_SIZE(raw) != TENSORMAP_BYTES) {
                    Py_DECREF(raw);
                    PyErr_SetString(PyExc_ValueError, "encode_at must return 128 bytes");
                    return nullptr;
                }
                if (map.encoded.size() >= kMaxEncoded) map.encoded.clear();
                found = map.encoded.emplace(a, std::array<unsigned char, TENSORMAP_BYTES>{}).first;
                std::memcpy(found->second.data(), PyBytes_AS_STRING(raw), TENSORMAP_BYTES);
                Py_DECREF(raw);
            }
            std::memcpy(step.slots[map.slot].bytes, found->second.data(), TENSORMAP_BYTES);
        }
        int code = launch_slots(step.function, step.grid, step.block, step.smem, stream, step.cluster, step.params.data());
        if (code == LAUNCH_FAILED_IN_PYTHON) return nullptr;
        if (code != 0) {  // the Python recipe takes over from this step (retry, or an error naming the kernel)
            PyObject *outputs = wrap_all(made, 0, n_out);
            PyObject *scratch = outputs ? wrap_all(made, n_out, made.size() - n_out) : nullptr;
            if (scratch == nullptr) {
                Py_XDECREF(outputs);
                return nullptr;
            }
            return Py_BuildValue("(ONNni)", entry->recipe, outputs, scratch, (Py_ssize_t)s, code);
        }
    }
    return wrap_all(made, 0, n_out);
    END_HANDLE_TH_ERRORS
}
// --8<-- [end:call]

PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(cuLaunchKernel, cuLaunchKernelEx, plain tensor types, current_device(), current_stream(index))"},
    {"new_book", new_book, METH_NOARGS, "new_book() -> an empty recipe book"},
    {"size", book_size, METH_O, "size(book) -> recipes stored"},
    {"add", (PyCFunction)(void (*)(void))add, METH_FASTCALL, "add(book, inputs, params, out, recipe) -> stored"},
    {"clear", clear, METH_O, "clear(book)"},
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL,
     "call(book, inputs, params, out) -> outputs | None | (recipe, outputs, scratch, step, code)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpu_days_replay", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_gpu_days_replay(void) { return PyModule_Create(&module); }
