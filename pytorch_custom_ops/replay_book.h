/* The recipe book of the C++ replay (`replay.cpp`): what a recipe is in C++, the key of a
 * call, reading a Python recipe (`direct.Recipe`) into one, and running it.
 *
 * Included once, by replay.cpp (and through it by replay_programs.h): a header so that
 * the replay, its programs and its module functions each read on their own.
 */
#ifndef GPU_DAYS_REPLAY_BOOK_H
#define GPU_DAYS_REPLAY_BOOK_H

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

bool is_plain(PyObject *obj) {
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(plain_types); j++)
        if ((PyObject *)Py_TYPE(obj) == PyTuple_GET_ITEM(plain_types, j)) return true;
    return false;
}

// Append the key words of one tensor (false: no recipe is made for it: no tensor, no
// storage, a nested or sparse or meta tensor, whose sizes or address would throw; the
// Python path names the problem).
bool key_tensor(const at::Tensor &t, std::vector<int64_t> &key) {
    if (!t.defined() || t.is_nested() || t.layout() != at::kStrided || t.is_meta() || !t.has_storage()) return false;
    key.push_back(t.dim());
    for (int64_t s : t.sizes()) key.push_back(s);
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(static_cast<int64_t>(t.device().type()));
    key.push_back(t.device().index());
    key.push_back(t.is_contiguous());
    key.push_back(reinterpret_cast<uintptr_t>(t.data_ptr()) & 15);
    return true;
}

// Append the key words of a list or tuple of tensors (false: not replayable here, e.g. a
// tensor subclass).
bool add_key(PyObject *seq, std::vector<int64_t> &key, std::vector<const at::Tensor *> &tensors) {
    if (!(PyList_CheckExact(seq) || PyTuple_CheckExact(seq)) || plain_types == nullptr) return false;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    key.push_back(n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PySequence_Fast_GET_ITEM(seq, i);
        if (!is_plain(obj)) return false;
        const at::Tensor &t = THPVariable_Unpack(obj);
        if (!key_tensor(t, key)) return false;
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

// Books hold entries (recipes), programs and node specs, each under a key, its hash and
// its parameters. The slot of `items` holding this key and these parameters: nullptr when
// there is none, or when comparing the parameters raised (then `failed` is set).
template <typename Ptr>
Ptr *find_slot(std::vector<Ptr> &items, const std::vector<int64_t> &key, uint64_t hash, PyObject *params,
               bool &failed) {
    failed = false;
    for (auto &e : items) {
        if (e->hash != hash || e->key != key) continue;
        int same = e->params == params ? 1 : PyObject_RichCompareBool(e->params, params, Py_EQ);
        if (same < 0) {
            failed = true;
            return nullptr;
        }
        if (same) return &e;
    }
    return nullptr;
}

// Store `item`; one already stored under the same key and parameters is replaced (the
// same key added again, after new plans or a new recording: the new one wins) and
// released. False with a Python error set when comparing the parameters raised.
template <typename Ptr>
bool store_keyed(std::vector<Ptr> &items, Ptr item) {
    bool failed;
    Ptr *slot = find_slot(items, item->key, item->hash, item->params, failed);
    if (failed) {
        release(*item);
        return false;
    }
    if (slot == nullptr) {
        items.push_back(std::move(item));
        return true;
    }
    std::swap(*slot, item);
    release(*item);
    return true;
}

Entry *find_entry(Book &book, const std::vector<int64_t> &key, uint64_t hash, PyObject *params, bool &failed) {
    auto *slot = find_slot(book, key, hash, params, failed);
    return slot == nullptr ? nullptr : slot->get();
}

// torch's current device, and its current raw stream (false with an error set).
bool current_device_index(long &index) {
    PyObject *device = PyObject_CallNoArgs(current_device);
    if (device == nullptr) return false;
    index = PyLong_AsLong(device);
    Py_DECREF(device);
    return !PyErr_Occurred();
}

bool current_stream_of(long device_index, void *&stream) {
    PyObject *index = PyLong_FromLong(device_index);
    PyObject *raw_stream = index ? PyObject_CallOneArg(current_stream, index) : nullptr;
    Py_XDECREF(index);
    if (raw_stream == nullptr) return false;
    stream = PyLong_AsVoidPtr(raw_stream);
    Py_DECREF(raw_stream);
    return !PyErr_Occurred();
}

// Run a recipe on `tensors` (the destinations given, then the inputs). `made` gets its
// outputs (destinations among them), then its scratch. 0, a driver error code (the launch
// of step `failed_step` failed), or LAUNCH_FAILED_IN_PYTHON (a Python error is set).
int run_entry(Entry &entry, const std::vector<const at::Tensor *> &tensors, size_t n_given, void *stream,
              std::vector<at::Tensor> &made, size_t &failed_step) {
    // outputs (new ones, and the destinations given), then scratch; the recipe's tensor
    // indices count outputs, then inputs, then scratch
    made.clear();
    made.reserve(entry.outputs.size() + entry.scratch.size());
    size_t given = 0;
    for (const Alloc &a : entry.outputs) {
        if (a.given)
            made.push_back(*tensors[given++]);
        else
            made.push_back(at::empty(a.sizes, at::TensorOptions().dtype(a.dtype).device(entry.device)));
    }
    for (const Alloc &a : entry.scratch) {
        auto options = at::TensorOptions().dtype(a.dtype).device(entry.device);
        made.push_back(a.zeroed ? at::zeros(a.sizes, options) : at::empty(a.sizes, options));
    }
    const size_t n_out = entry.outputs.size(), n_in = tensors.size() - n_given;
    auto address = [&](int i) -> uint64_t {
        const at::Tensor &t = i < (int)n_out               ? made[i]
                              : i < (int)(n_out + n_in) ? *tensors[n_given + i - n_out]
                                                        : made[i - n_in];
        return reinterpret_cast<uintptr_t>(t.data_ptr());
    };
    for (size_t s = 0; s < entry.steps.size(); s++) {
        Step &step = entry.steps[s];
        for (auto [slot, i] : step.pointers) {
            uint64_t a = address(i);
            std::memcpy(step.slots[slot].bytes, &a, sizeof a);
        }
        for (TensorMapArg &map : step.maps) {
            uint64_t a = address(map.tensor);
            auto found = map.encoded.find(a);
            if (found == map.encoded.end()) {  // a new address: the recipe's spec encodes it
                PyObject *raw = PyObject_CallMethod(map.spec, "encode_at", "K", (unsigned long long)a);
                if (raw == nullptr) return LAUNCH_FAILED_IN_PYTHON;
                if (!PyBytes_Check(raw) || PyBytes_GET_SIZE(raw) != TENSORMAP_BYTES) {
                    Py_DECREF(raw);
                    PyErr_SetString(PyExc_ValueError, "encode_at must return 128 bytes");
                    return LAUNCH_FAILED_IN_PYTHON;
                }
                if (map.encoded.size() >= kMaxEncoded) map.encoded.clear();
                found = map.encoded.emplace(a, std::array<unsigned char, TENSORMAP_BYTES>{}).first;
                std::memcpy(found->second.data(), PyBytes_AS_STRING(raw), TENSORMAP_BYTES);
                Py_DECREF(raw);
            }
            std::memcpy(step.slots[map.slot].bytes, found->second.data(), TENSORMAP_BYTES);
        }
        int code = launch_slots(step.function, step.grid, step.block, step.smem, stream, step.cluster, step.params.data());
        if (code != 0) {
            failed_step = s;
            return code;
        }
    }
    return 0;
}

}  // namespace

#endif  // GPU_DAYS_REPLAY_BOOK_H
