/* Nodes: an op's autograd node in C++, for a call whose forward and backward replay as
 * programs (replay_programs.h; the Python side is `programs.Nodes`).
 *
 * An op called in grad mode goes through an `autograd.Function`: Python runs its forward
 * (a program), its setup_context and, in the backward, a Python node that calls the
 * backward's program. Recorded once per key, the same call is here one C++ call: the
 * forward's program, then torch's C++ custom-function machinery (`Function<T>::apply`: the
 * node, its edges, the saved tensors, non-differentiable outputs) with a backward that
 * calls the backward's program. What the node saves and marks comes from the recording of
 * the op's own setup_context, so nothing here knows an op.
 *
 *   node_add(nbook, inputs, params, spec)      spec: (forward pbook, backward pbook, attrs,
 *                                              saved, non_differentiable, materialize,
 *                                              single, arg_of_tensor, n_args, make_ctx,
 *                                              backward) or None (this key has no node)
 *   node_call(nbook, inputs, params) -> outputs | None (the Python path: no node, or the
 *                                              forward's program did not replay); an output
 *                                              the forward returned as None stays None
 *   node_known(nbook, inputs, params) -> bool
 *
 * In the backward, anything but the program's own replay (a miss, grad mode on for a
 * double backward, autocast) calls the op's Python backward with a context made by
 * `make_ctx(saved, needs_input_grad, attrs)`, as its Python node would.
 */
#ifndef GPU_DAYS_REPLAY_NODES_H
#define GPU_DAYS_REPLAY_NODES_H

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include "replay_programs.h"

namespace {

constexpr const char *kNodeBookName = "gpu_days.node_book";

struct NodeSpec {
    uint64_t hash;
    std::vector<int64_t> key;
    PyObject *params = nullptr;  // all PyObject fields owned
    bool makes_node = false;     // false: this key has no node (the Python path runs)
    PyObject *forward_pbook = nullptr, *backward_pbook = nullptr;
    PyObject *attrs = nullptr;                // the context's attributes: a tuple of (name, value)
    std::vector<std::pair<char, int>> saved;  // ('i', input k), ('o', output k), ('n', 0): None
    std::vector<int> non_differentiable;      // output indices
    bool materialize = true, single = true;
    std::vector<int> arg_of_tensor;  // the Python argument of each tensor input
    int n_args = 0;
    PyObject *make_ctx = nullptr, *backward = nullptr;

    ~NodeSpec() {  // the last node may go on any thread
        if (!Py_IsInitialized()) return;
        PyGILState_STATE gil = PyGILState_Ensure();
        for (PyObject *o : {params, forward_pbook, backward_pbook, attrs, make_ctx, backward}) Py_XDECREF(o);
        PyGILState_Release(gil);
    }
};

// Nodes hold their spec: a spec replaced in its book lives on while they do, and lets go of
// its Python objects in its destructor (store_keyed's release has nothing to do).
using NodeBook = std::vector<std::shared_ptr<NodeSpec>>;

void release(NodeSpec &) {}

NodeBook *node_book_of(PyObject *capsule) { return static_cast<NodeBook *>(PyCapsule_GetPointer(capsule, kNodeBookName)); }

void free_node_book(PyObject *capsule) { delete node_book_of(capsule); }

PyObject *new_node_book(PyObject *, PyObject *) { return PyCapsule_New(new NodeBook(), kNodeBookName, free_node_book); }

struct SpecHolder : torch::CustomClassHolder {
    std::shared_ptr<NodeSpec> spec;
    explicit SpecHolder(std::shared_ptr<NodeSpec> s) : spec(std::move(s)) {}
};

// Throw the pending Python error where the autograd engine expects a C++ exception.
[[noreturn]] void throw_pending(PyGILState_STATE gil) {
    python_error err;
    err.persist();
    PyGILState_Release(gil);
    throw std::move(err);
}

}  // namespace

// In a named namespace: the node's name is its type's, what profiles and grad_fn.name()
// show: torch::autograd::CppNode<gpu_days::ReplayedBackward>.
namespace gpu_days {

struct ReplayedBackward : public torch::autograd::Function<ReplayedBackward> {
    // the outputs were computed by the forward's program before `apply` (it runs this in
    // no-grad mode, as autograd.Function forwards do): here only what setup_context did
    // `outputs` holds every output, undefined where the forward returned None (linear's
    // absent `pre`): torch's Function<T> cannot wrap an undefined output, so the node's
    // outputs are the defined ones, and `nones` (kept in the context) says where the others
    // were; the backward puts undefined gradients back in those places.
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext *ctx,
                                                  const std::shared_ptr<NodeSpec> &spec, at::TensorList inputs,
                                                  const torch::autograd::variable_list *outputs,
                                                  const std::vector<int64_t> *nones) {
        torch::autograd::variable_list to_save, non_differentiable, defined;
        for (auto [kind, k] : spec->saved)
            to_save.push_back(kind == 'i' ? inputs[k] : kind == 'o' ? (*outputs)[k] : at::Tensor());
        ctx->save_for_backward(std::move(to_save));
        for (int k : spec->non_differentiable)
            if ((*outputs)[k].defined()) non_differentiable.push_back((*outputs)[k]);
        if (!non_differentiable.empty()) ctx->mark_non_differentiable(non_differentiable);
        ctx->set_materialize_grads(spec->materialize);
        ctx->saved_data["spec"] = at::IValue::make_capsule(c10::make_intrusive<SpecHolder>(spec));
        if (nones->empty()) return *outputs;
        ctx->saved_data["nones"] = *nones;
        for (const at::Tensor &t : *outputs)
            if (t.defined()) defined.push_back(t);
        return defined;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads);
};

}  // namespace gpu_days

namespace {

PyObject *wrap_or_none(const at::Tensor &t) { return t.defined() ? THPVariable_Wrap(t) : Py_NewRef(Py_None); }

}  // namespace

namespace gpu_days {

torch::autograd::variable_list ReplayedBackward::backward(torch::autograd::AutogradContext *ctx,
                                                   torch::autograd::variable_list grads) {
    auto holder = ctx->saved_data["spec"].toCapsule();
    std::shared_ptr<NodeSpec> spec = static_cast<SpecHolder *>(holder.get())->spec;
    torch::autograd::variable_list saved = ctx->get_saved_variables();
    if (auto found_nones = ctx->saved_data.find("nones"); found_nones != ctx->saved_data.end()) {
        // a gradient per output, as the Python backward takes them: undefined for the Nones
        std::vector<int64_t> nones = found_nones->second.toIntVector();
        torch::autograd::variable_list all(grads.size() + nones.size());
        size_t next = 0, j = 0;
        for (size_t i = 0; i < all.size(); i++) {
            if (next < nones.size() && nones[next] == static_cast<int64_t>(i))
                next++;
            else
                all[i] = std::move(grads[j++]);
        }
        grads = std::move(all);
    }
    const size_t n_tensors = spec->arg_of_tensor.size();
    torch::autograd::variable_list result(n_tensors + 3);  // the spec, outputs and nones arguments get none
    PyGILState_STATE gil = PyGILState_Ensure();
    // the key of the backward's program, as programs.replayed_backward makes it
    std::vector<bool> needed(spec->n_args, false);
    for (size_t i = 0; i < n_tensors; i++) needed[spec->arg_of_tensor[i]] = ctx->needs_input_grad(i);
    PyObject *needs = PyTuple_New(spec->n_args);
    for (int a = 0; a < spec->n_args; a++) PyTuple_SET_ITEM(needs, a, PyBool_FromLong(needed[a]));
    const size_t n_given = saved.size() + grads.size();
    PyObject *none_mask = PyTuple_New(static_cast<Py_ssize_t>(n_given));
    PyObject *tensors = PyList_New(0);
    for (size_t i = 0; i < n_given; i++) {
        const at::Tensor &t = i < saved.size() ? saved[i] : grads[i - saved.size()];
        PyTuple_SET_ITEM(none_mask, static_cast<Py_ssize_t>(i), PyBool_FromLong(!t.defined()));
        if (t.defined()) {
            PyObject *w = THPVariable_Wrap(t);
            PyList_Append(tensors, w);
            Py_XDECREF(w);
        }
    }
    PyObject *params = Py_BuildValue("(OOO)", spec->attrs, needs, none_mask);
    PyObject *found = nullptr;
    bool replay = !torch::autograd::GradMode::is_enabled() && !at::autocast::is_autocast_enabled(at::kCUDA);
    if (replay && params != nullptr) {
        PyObject *argv[3] = {spec->backward_pbook, tensors, params};
        found = program_call(nullptr, argv, 3);
        if (found == nullptr) {
            Py_DECREF(needs), Py_DECREF(none_mask), Py_DECREF(tensors), Py_DECREF(params);
            throw_pending(gil);
        }
    }
    if (found == nullptr || !PyList_Check(found)) {
        // the op's Python backward, with a context like its Python node's
        Py_XDECREF(found);
        PyObject *saved_list = PyTuple_New(static_cast<Py_ssize_t>(saved.size()));
        for (size_t i = 0; i < saved.size(); i++) PyTuple_SET_ITEM(saved_list, i, wrap_or_none(saved[i]));
        PyObject *py_ctx = PyObject_CallFunctionObjArgs(spec->make_ctx, saved_list, needs, spec->attrs, nullptr);
        Py_DECREF(saved_list);
        PyObject *call_args = py_ctx ? PyTuple_New(static_cast<Py_ssize_t>(grads.size() + 1)) : nullptr;
        if (call_args != nullptr) {
            PyTuple_SET_ITEM(call_args, 0, py_ctx);
            for (size_t i = 0; i < grads.size(); i++) PyTuple_SET_ITEM(call_args, i + 1, wrap_or_none(grads[i]));
            found = PyObject_Call(spec->backward, call_args, nullptr);
            Py_DECREF(call_args);
        }
    }
    Py_XDECREF(needs), Py_XDECREF(none_mask), Py_XDECREF(tensors), Py_XDECREF(params);
    if (found == nullptr) throw_pending(gil);
    PyObject *seq = PySequence_Fast(found, "a backward must return a sequence");
    Py_DECREF(found);
    if (seq == nullptr) throw_pending(gil);
    if (PySequence_Fast_GET_SIZE(seq) != spec->n_args) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_RuntimeError, "gpu-days node: the backward returned %zd gradients for %d arguments",
                     PySequence_Fast_GET_SIZE(seq), spec->n_args);
        throw_pending(gil);
    }
    for (size_t i = 0; i < n_tensors; i++) {
        PyObject *g = PySequence_Fast_GET_ITEM(seq, spec->arg_of_tensor[i]);
        if (g != Py_None) result[i + 1] = THPVariable_Unpack(g);
    }
    Py_DECREF(seq);
    PyGILState_Release(gil);
    return result;
}

}  // namespace gpu_days

namespace {

bool read_node_spec(PyObject *spec, NodeSpec &node) {
    PyObject *forward_pbook, *backward_pbook, *attrs, *saved, *nondiff, *arg_of_tensor, *make_ctx, *backward;
    int materialize, single, n_args;
    if (!PyArg_ParseTuple(spec, "OOO!OOppOiOO", &forward_pbook, &backward_pbook, &PyTuple_Type, &attrs, &saved, &nondiff,
                          &materialize, &single, &arg_of_tensor, &n_args, &make_ctx, &backward))
        return false;
    if (program_book_of(forward_pbook) == nullptr || program_book_of(backward_pbook) == nullptr) return false;
    std::vector<int64_t> ints;
    PyObject *rows = PySequence_Tuple(saved);
    if (rows == nullptr) return false;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(rows); i++) {
        const char *kind;
        int k;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(rows, i), "si", &kind, &k) || std::strchr("ion", kind[0]) == nullptr) {
            Py_DECREF(rows);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "node: a saved tensor is ('i'|'o'|'n', index)");
            return false;
        }
        node.saved.emplace_back(kind[0], k);
    }
    Py_DECREF(rows);
    if (!read_ints(nondiff, ints)) return false;
    node.non_differentiable.assign(ints.begin(), ints.end());
    ints.clear();
    if (!read_ints(arg_of_tensor, ints)) return false;
    node.arg_of_tensor.assign(ints.begin(), ints.end());
    for (int a : node.arg_of_tensor)
        if (a < 0 || a >= n_args) {
            PyErr_SetString(PyExc_ValueError, "node: a tensor's argument out of range");
            return false;
        }
    if (!PyCallable_Check(make_ctx) || !PyCallable_Check(backward)) {
        PyErr_SetString(PyExc_TypeError, "node: make_ctx and backward must be callable");
        return false;
    }
    node.materialize = materialize, node.single = single, node.n_args = n_args;
    for (PyObject *o : {forward_pbook, backward_pbook, attrs, make_ctx, backward}) Py_INCREF(o);
    node.forward_pbook = forward_pbook, node.backward_pbook = backward_pbook, node.attrs = attrs;
    node.make_ctx = make_ctx, node.backward = backward;
    node.makes_node = true;
    return true;
}

PyObject *node_add(PyObject *, PyObject *const *argv, Py_ssize_t argc) {
    HANDLE_TH_ERRORS
    if (argc != 4) {
        PyErr_SetString(PyExc_TypeError, "node_add(nbook, inputs, params, spec or None)");
        return nullptr;
    }
    NodeBook *book = node_book_of(argv[0]);
    if (book == nullptr) return nullptr;
    auto spec = std::make_shared<NodeSpec>();
    std::vector<const at::Tensor *> tensors;
    if (!make_key(no_destinations(), argv[1], spec->key, tensors)) Py_RETURN_FALSE;
    if (!full_hash(spec->key, argv[2], spec->hash)) return nullptr;
    spec->params = Py_NewRef(argv[2]);
    if (argv[3] != Py_None && !read_node_spec(argv[3], *spec)) return nullptr;
    if (!store_keyed(*book, std::move(spec))) return nullptr;
    Py_RETURN_TRUE;
    END_HANDLE_TH_ERRORS
}

PyObject *node_known(PyObject *, PyObject *const *argv, Py_ssize_t argc) {
    HANDLE_TH_ERRORS
    if (argc != 3) {
        PyErr_SetString(PyExc_TypeError, "node_known(nbook, inputs, params)");
        return nullptr;
    }
    NodeBook *book = node_book_of(argv[0]);
    if (book == nullptr) return nullptr;
    bool keyed, failed;
    std::vector<int64_t> key;
    std::vector<const at::Tensor *> tensors;
    auto *slot = find_call(*book, argv[1], argv[2], key, tensors, keyed, failed);
    if (failed) return nullptr;
    return PyBool_FromLong(slot != nullptr);
    END_HANDLE_TH_ERRORS
}

PyObject *node_call(PyObject *, PyObject *const *argv, Py_ssize_t argc) {
    HANDLE_TH_ERRORS
    if (argc != 3) {
        PyErr_SetString(PyExc_TypeError, "node_call(nbook, inputs, params)");
        return nullptr;
    }
    NodeBook *book = node_book_of(argv[0]);
    if (book == nullptr) return nullptr;
    bool keyed, failed;
    thread_local std::vector<int64_t> key;
    thread_local std::vector<const at::Tensor *> tensors;
    auto *slot = find_call(*book, argv[1], argv[2], key, tensors, keyed, failed);
    if (failed) return nullptr;
    if (slot == nullptr || !(*slot)->makes_node) Py_RETURN_NONE;
    std::shared_ptr<NodeSpec> spec = *slot;  // the node holds it: a later node_add may replace it in the book
    std::vector<at::Tensor> inputs;
    for (const at::Tensor *t : tensors) inputs.push_back(*t);
    PyObject *program_argv[3] = {spec->forward_pbook, argv[1], argv[2]};
    PyObject *outputs_list;
    {
        at::AutoGradMode no_grad(false);  // as an autograd.Function's forward runs
        outputs_list = program_call(nullptr, program_argv, 3);
    }
    if (outputs_list == nullptr) return nullptr;
    if (!PyList_Check(outputs_list)) {  // the forward's program did not replay: the Python path
        Py_DECREF(outputs_list);
        Py_RETURN_NONE;
    }
    torch::autograd::variable_list outputs;
    std::vector<int64_t> nones;  // outputs the forward returned as None (a program's only non-tensor)
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outputs_list); i++) {
        PyObject *o = PyList_GET_ITEM(outputs_list, i);
        if (o == Py_None) {
            nones.push_back(i);
            outputs.emplace_back();
            continue;
        }
        if (!THPVariable_Check(o)) {
            Py_DECREF(outputs_list);
            Py_RETURN_NONE;
        }
        outputs.push_back(THPVariable_Unpack(o));
    }
    Py_DECREF(outputs_list);
    for (auto [kind, k] : spec->saved)  // what the spec names must exist (else: the Python path)
        if ((kind == 'i' && k >= static_cast<int>(inputs.size())) || (kind == 'o' && k >= static_cast<int>(outputs.size())))
            Py_RETURN_NONE;
    for (int k : spec->non_differentiable)
        if (k < 0 || k >= static_cast<int>(outputs.size())) Py_RETURN_NONE;
    torch::autograd::variable_list wrapped =
        gpu_days::ReplayedBackward::apply(spec, at::TensorList(inputs), &outputs, &nones);
    if (spec->single) return nones.empty() ? THPVariable_Wrap(wrapped[0]) : Py_NewRef(Py_None);
    PyObject *tuple = PyTuple_New(static_cast<Py_ssize_t>(outputs.size()));
    for (size_t i = 0, j = 0; i < outputs.size(); i++)  // the Nones back in their places
        PyTuple_SET_ITEM(tuple, i, outputs[i].defined() ? THPVariable_Wrap(wrapped[j++]) : Py_NewRef(Py_None));
    return tuple;
    END_HANDLE_TH_ERRORS
}

}  // namespace

#endif  // GPU_DAYS_REPLAY_NODES_H
