/* Programs: a function's op calls, recorded once by `programs.py`, replayed here in one
 * call (see the block comment below). Included once, by replay.cpp.
 */
#ifndef GPU_DAYS_REPLAY_PROGRAMS_H
#define GPU_DAYS_REPLAY_PROGRAMS_H

#include <ATen/ops/mv.h>
#include <ATen/ops/sum.h>

#include "replay_book.h"

namespace {

// -- programs: a function's op calls, recorded once (programs.py), replayed in one call ----------
//
//   program_add(pbook, inputs, params, program)   program: (constants, steps, outputs), or None:
//                                                 this call cannot be replayed (the Python runs)
//   program_call(pbook, inputs, params) -> list   the outputs (None where the function returned None)
//                                       -> None   no program for this key, or a step missed: the
//                                                 Python function runs (and records again)
//                                       -> False  a call known not to replay, or one on
//                                                 another device than the current one
//
// A program's tensors are numbered: its inputs, its constants, then each step's outputs in
// order. A reference is an index, or (index, sizes, strides, offset): a view of that tensor
// (offset in elements from its storage offset). A step is (book, params, refs, n_outputs):
// one op call replayed from that op's recipe book, by the same key as `call`; or
// (name, None, refs, 1): one of torch's functions below (sum_rows, mv, contiguous).
constexpr const char *kProgramBookName = "gpu_days.program_book";

enum Primitive { kOpCall = 0, kSumRows = 1, kMatVec = 2, kContiguous = 3 };

struct Ref {
    int index = -1;  // -1: None (an output the function did not return)
    bool view = false;
    std::vector<int64_t> sizes, strides;
    int64_t offset = 0;
};

struct ProgramStep {
    Primitive kind = kOpCall;
    PyObject *book = nullptr;    // owned (kOpCall)
    PyObject *params = nullptr;  // owned (kOpCall): None or the op call's parameters
    uint64_t params_hash = 0;
    std::vector<Ref> inputs;
    int n_outputs = 1;
};

struct Program {
    uint64_t hash;
    std::vector<int64_t> key;
    PyObject *params = nullptr;  // owned
    bool replays = false;        // false: known not to replay
    size_t n_inputs = 0;
    std::vector<at::Tensor> constants;
    std::vector<ProgramStep> steps;
    std::vector<Ref> outputs;
};

using ProgramBook = std::vector<std::unique_ptr<Program>>;

// A program's key is its inputs' (a call's key with no destinations).
PyObject *no_destinations() {
    static PyObject *empty = PyTuple_New(0);
    return empty;
}

ProgramBook *program_book_of(PyObject *capsule) {
    return static_cast<ProgramBook *>(PyCapsule_GetPointer(capsule, kProgramBookName));
}

void release(Program &program) {
    Py_CLEAR(program.params);
    for (auto &step : program.steps) {
        Py_CLEAR(step.book);
        Py_CLEAR(step.params);
    }
}

void free_program_book(PyObject *capsule) {
    ProgramBook *book = program_book_of(capsule);
    if (book == nullptr) return;
    for (auto &program : *book) release(*program);
    delete book;
}

PyObject *new_program_book(PyObject *, PyObject *) {
    return PyCapsule_New(new ProgramBook(), kProgramBookName, free_program_book);
}

PyObject *clear_programs(PyObject *, PyObject *capsule) {
    ProgramBook *book = program_book_of(capsule);
    if (book == nullptr) return nullptr;
    for (auto &program : *book) release(*program);
    book->clear();
    Py_RETURN_NONE;
}

PyObject *program_count(PyObject *, PyObject *capsule) {
    ProgramBook *book = program_book_of(capsule);
    return book ? PyLong_FromSize_t(book->size()) : nullptr;
}

bool read_ints(PyObject *obj, std::vector<int64_t> &out) {
    PyObject *seq = PySequence_Tuple(obj);
    if (seq == nullptr) return false;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(seq); i++) out.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i)));
    Py_DECREF(seq);
    return !PyErr_Occurred();
}

// A reference to one of the first `known` tensors (None allowed where `none_ok`).
bool read_ref(PyObject *obj, size_t known, bool none_ok, Ref &ref) {
    if (obj == Py_None && none_ok) return true;
    if (PyLong_Check(obj)) {
        ref.index = static_cast<int>(PyLong_AsLong(obj));
    } else if (PyTuple_Check(obj) && PyTuple_GET_SIZE(obj) == 4) {
        ref.view = true;
        ref.index = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(obj, 0)));
        ref.offset = PyLong_AsLongLong(PyTuple_GET_ITEM(obj, 3));
        if (!PyErr_Occurred() && (!read_ints(PyTuple_GET_ITEM(obj, 1), ref.sizes) ||
                                  !read_ints(PyTuple_GET_ITEM(obj, 2), ref.strides)))
            return false;
        if (!PyErr_Occurred() && (ref.sizes.size() != ref.strides.size() || ref.offset < 0)) {
            PyErr_SetString(PyExc_ValueError, "program: a view needs as many strides as sizes, and offset >= 0");
            return false;
        }
    } else {
        PyErr_SetString(PyExc_TypeError, "program: a reference is an index or (index, sizes, strides, offset)");
        return false;
    }
    if (PyErr_Occurred()) return false;
    if (ref.index < 0 || static_cast<size_t>(ref.index) >= known) {
        PyErr_SetString(PyExc_ValueError, "program: a reference to a tensor not made yet");
        return false;
    }
    return true;
}

bool read_program(PyObject *spec, Program &program) {
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 3) {
        PyErr_SetString(PyExc_TypeError, "program: (constants, steps, outputs) expected");
        return false;
    }
    PyObject *constants = PySequence_Tuple(PyTuple_GET_ITEM(spec, 0));
    if (constants == nullptr) return false;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(constants); i++) {
        PyObject *t = PyTuple_GET_ITEM(constants, i);
        if (!THPVariable_Check(t)) {
            Py_DECREF(constants);
            PyErr_SetString(PyExc_TypeError, "program: constants must be tensors");
            return false;
        }
        program.constants.push_back(THPVariable_Unpack(t));
    }
    Py_DECREF(constants);
    size_t known = program.n_inputs + program.constants.size();
    PyObject *steps = PySequence_Tuple(PyTuple_GET_ITEM(spec, 1));
    if (steps == nullptr) return false;
    bool ok = true;
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(steps); i++) {
        PyObject *row = PyTuple_GET_ITEM(steps, i);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 4) {
            PyErr_SetString(PyExc_TypeError, "program: a step is (book or name, params, refs, n_outputs)");
            ok = false;
            break;
        }
        ProgramStep step;
        PyObject *what = PyTuple_GET_ITEM(row, 0);
        if (PyUnicode_Check(what)) {
            step.kind = PyUnicode_CompareWithASCIIString(what, "sum_rows") == 0     ? kSumRows
                        : PyUnicode_CompareWithASCIIString(what, "mv") == 0         ? kMatVec
                        : PyUnicode_CompareWithASCIIString(what, "contiguous") == 0 ? kContiguous
                                                                                    : kOpCall;
            if (step.kind == kOpCall) {
                PyErr_Format(PyExc_ValueError, "program: unknown step %R", what);
                ok = false;
            }
        } else if (book_of(what) != nullptr) {
            Py_INCREF(what);
            Py_INCREF(PyTuple_GET_ITEM(row, 1));
            step.book = what;
            step.params = PyTuple_GET_ITEM(row, 1);
            Py_hash_t h = PyObject_Hash(step.params);
            ok = h != -1;
            step.params_hash = static_cast<uint64_t>(h) * 0x9E3779B97F4A7C15ull;
        } else {
            ok = false;  // book_of set the error
        }
        PyObject *refs = ok ? PySequence_Tuple(PyTuple_GET_ITEM(row, 2)) : nullptr;
        ok = ok && refs != nullptr;
        for (Py_ssize_t j = 0; ok && j < PyTuple_GET_SIZE(refs); j++) {
            step.inputs.emplace_back();
            ok = read_ref(PyTuple_GET_ITEM(refs, j), known, false, step.inputs.back());
        }
        Py_XDECREF(refs);
        if (ok) {
            step.n_outputs = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(row, 3)));
            ok = !PyErr_Occurred();
        }
        size_t arity = step.kind == kMatVec ? 2 : step.kind == kOpCall ? step.inputs.size() : 1;
        if (ok && (step.n_outputs < 0 || (step.kind != kOpCall && step.n_outputs != 1) || step.inputs.size() != arity)) {
            PyErr_SetString(PyExc_ValueError, "program: a step's inputs or outputs do not fit its kind");
            ok = false;
        }
        known += ok ? step.n_outputs : 0;
        program.steps.push_back(std::move(step));
    }
    Py_DECREF(steps);
    PyObject *outputs = ok ? PySequence_Tuple(PyTuple_GET_ITEM(spec, 2)) : nullptr;
    ok = ok && outputs != nullptr;
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(outputs); i++) {
        program.outputs.emplace_back();
        ok = read_ref(PyTuple_GET_ITEM(outputs, i), known, true, program.outputs.back());
    }
    Py_XDECREF(outputs);
    return ok;
}

PyObject *program_add(PyObject *, PyObject *const *argv, Py_ssize_t argc) {
    HANDLE_TH_ERRORS
    if (argc != 4) {
        PyErr_SetString(PyExc_TypeError, "program_add(pbook, inputs, params, program or None)");
        return nullptr;
    }
    ProgramBook *book = program_book_of(argv[0]);
    if (book == nullptr) return nullptr;
    auto program = std::make_unique<Program>();
    std::vector<const at::Tensor *> tensors;
    if (!make_key(no_destinations(), argv[1], program->key, tensors)) Py_RETURN_FALSE;
    if (!full_hash(program->key, argv[2], program->hash)) return nullptr;
    program->n_inputs = tensors.size();
    Py_INCREF(argv[2]);
    program->params = argv[2];
    program->replays = argv[3] != Py_None;
    if (program->replays && !read_program(argv[3], *program)) {
        release(*program);
        return nullptr;
    }
    if (!store_keyed(*book, std::move(program))) return nullptr;
    Py_RETURN_TRUE;
    END_HANDLE_TH_ERRORS
}

at::Tensor resolve(const Ref &ref, const std::vector<at::Tensor> &table) {
    const at::Tensor &base = table[ref.index];
    if (!ref.view) return base;
    return base.as_strided(ref.sizes, ref.strides, base.storage_offset() + ref.offset);
}

// The slot of `items` stored under a call's key (its tensors, no destinations) and
// `params`. `keyed` false: the call has no key (a subclass, a non-tensor...: Python's);
// nullptr with `failed` set: a Python error.
template <typename Ptr>
Ptr *find_call(std::vector<Ptr> &items, PyObject *inputs, PyObject *params, std::vector<int64_t> &key,
               std::vector<const at::Tensor *> &tensors, bool &keyed, bool &failed) {
    uint64_t hash;
    failed = false;
    keyed = make_key(no_destinations(), inputs, key, tensors);
    if (!keyed) return nullptr;
    if (!full_hash(key, params, hash)) {
        failed = true;
        return nullptr;
    }
    return find_slot(items, key, hash, params, failed);
}

// True: a program replays this call; False: it is known not to; None: nothing stored.
PyObject *program_known(PyObject *, PyObject *const *argv, Py_ssize_t argc) {
    HANDLE_TH_ERRORS
    if (argc != 3) {
        PyErr_SetString(PyExc_TypeError, "program_known(pbook, inputs, params)");
        return nullptr;
    }
    ProgramBook *book = program_book_of(argv[0]);
    if (book == nullptr) return nullptr;
    std::vector<int64_t> key;
    std::vector<const at::Tensor *> inputs;
    bool keyed, failed;
    auto *slot = find_call(*book, argv[1], argv[2], key, inputs, keyed, failed);
    if (failed) return nullptr;
    if (!keyed) Py_RETURN_FALSE;
    if (slot == nullptr) Py_RETURN_NONE;
    return PyBool_FromLong((*slot)->replays);
    END_HANDLE_TH_ERRORS
}

PyObject *program_call(PyObject *, PyObject *const *argv, Py_ssize_t argc) {
    HANDLE_TH_ERRORS
    if (argc != 3) {
        PyErr_SetString(PyExc_TypeError, "program_call(pbook, inputs, params)");
        return nullptr;
    }
    ProgramBook *book = program_book_of(argv[0]);
    if (book == nullptr) return nullptr;
    thread_local std::vector<int64_t> key;
    thread_local std::vector<const at::Tensor *> inputs;
    bool keyed, failed;
    auto *slot = find_call(*book, argv[1], argv[2], key, inputs, keyed, failed);
    if (failed) return nullptr;
    if (!keyed) Py_RETURN_FALSE;  // no key: Python's
    if (slot == nullptr) Py_RETURN_NONE;
    Program *program = slot->get();
    if (!program->replays) Py_RETURN_FALSE;

    std::vector<at::Tensor> table;
    table.reserve(program->n_inputs + program->constants.size() + 2 * program->steps.size());
    for (const at::Tensor *t : inputs) table.push_back(*t);
    for (const at::Tensor &t : program->constants) table.push_back(t);
    long device = -1;
    void *stream = nullptr;
    std::vector<at::Tensor> step_inputs, made;
    std::vector<const at::Tensor *> pointers;
    std::vector<int64_t> step_key;
    // --8<-- [start:program_steps]
    for (const ProgramStep &step : program->steps) {
        step_inputs.clear();
        for (const Ref &ref : step.inputs) step_inputs.push_back(resolve(ref, table));
        if (step.kind == kSumRows) {
            table.push_back(at::sum(step_inputs[0], {0}));
            continue;
        }
        if (step.kind == kMatVec) {
            table.push_back(at::mv(step_inputs[0], step_inputs[1]));
            continue;
        }
        if (step.kind == kContiguous) {
            table.push_back(step_inputs[0].contiguous());
            continue;
        }
        // an op call: its recipe, found by the key `call` would compute (no destinations)
        step_key.clear();
        pointers.clear();
        step_key.push_back(0);
        step_key.push_back(static_cast<int64_t>(step_inputs.size()));
        for (const at::Tensor &t : step_inputs) {
            if (!key_tensor(t, step_key)) Py_RETURN_NONE;
            pointers.push_back(&t);
        }
        Entry *entry = find_entry(*book_of(step.book), step_key, hash_key(step_key) ^ step.params_hash, step.params, failed);
        if (failed) return nullptr;
        if (entry == nullptr) Py_RETURN_NONE;  // e.g. the op's recipes were forgotten (new plans)
        // another current device: the function runs in Python, which switches to the
        // tensors' device (nothing to record again: False)
        if (device < 0) {
            if (!current_device_index(device)) return nullptr;
            if (device != entry->device_index) Py_RETURN_FALSE;
            if (!current_stream_of(device, stream)) return nullptr;
        } else if (device != entry->device_index) {
            Py_RETURN_FALSE;
        }
        size_t failed_step = 0;
        int code = run_entry(*entry, pointers, 0, stream, made, failed_step);
        if (code == LAUNCH_FAILED_IN_PYTHON) return nullptr;
        // a failed launch: the function runs in Python, whose op calls retry or name the
        // kernel (what ran so far wrote only tensors made here)
        if (code != 0 || made.size() < static_cast<size_t>(step.n_outputs)) Py_RETURN_NONE;
        for (int i = 0; i < step.n_outputs; i++) table.push_back(std::move(made[i]));
    }
    // --8<-- [end:program_steps]
    PyObject *list = PyList_New(static_cast<Py_ssize_t>(program->outputs.size()));
    if (list == nullptr) return nullptr;
    for (size_t i = 0; i < program->outputs.size(); i++) {
        const Ref &ref = program->outputs[i];
        PyObject *item = ref.index < 0 ? Py_NewRef(Py_None) : THPVariable_Wrap(resolve(ref, table));
        if (item == nullptr) {
            Py_DECREF(list);
            return nullptr;
        }
        PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
    }
    return list;
    END_HANDLE_TH_ERRORS
}

}  // namespace

#endif  // GPU_DAYS_REPLAY_PROGRAMS_H
