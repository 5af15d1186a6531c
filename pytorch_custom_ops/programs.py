"""Programs: a function's op calls, recorded once, then replayed from C++ in one call.

A backward node of gpu-days is Python: it unpacks its saved tensors and calls two or three
ops, each through its public checks and then the C++ replay of its recipe. Each op call
costs the launch plus ~5 us of Python on the H100's host, where torch's own backward is
C++ throughout (day 016, part five). A *program* removes the Python between the
launches: the first call of a function with a given key runs in Python while a recorder
notes every op call it makes (which op's recipe book, which tensors, which parameters)
and the torch functions it may use (`note_primitive`); the next call with the same key
is one call into C++ (`replay_programs.h`), which looks each op call up in its op's
recipe book and launches it, exactly as a call from Python would.

    program = Program("GEMM.backward")
    found = program.call(tensors, params)    # a list | None (record now) | False (never replays)
    result = program.record(fn, tensors, params, *args)   # runs fn(*args), keeps what replays

A program returns a list: the function's outputs (a tuple or list), or its one tensor.

The key is `call`'s key for `tensors` (shape, dtype, device, contiguity, alignment of
each) and `params`, a hashable value standing for everything else the function reads
(for a backward: its context's attributes, which inputs need a gradient, which gradients
are None). A function whose result does not follow from its op calls (a torch function
other than the primitives, a tensor made elsewhere) is stored as "does not replay", and
then always runs in Python.

Only pure functions may be recorded (no in-place writes, no side effects): what is not an
op call is not replayed. Two wrappers use programs: `replayed_backward`, for the backward
of the ops whose backward is such a function (`eager.function(..., programs=True)`), and
`replayed_forward`, for their eager implementations (after the public function's
autocast and routing, before its checks: a key seen before passed them).
GPU_DAYS_PROGRAMS=0 turns programs off.

`Nodes` goes one step further for an op called in grad mode: the forward's program and
the autograd node in one C++ call (`replay_nodes.h`), the node's backward a program too.
GPU_DAYS_NODES=0 turns the C++ nodes off (the programs stay).
"""

from __future__ import annotations

import os
import threading

import torch

from . import direct, replay
from .contract import PLAIN_TENSORS

ENABLED = os.environ.get("GPU_DAYS_PROGRAMS", "1") != "0"
MAX_PROGRAMS = 256  # per function: a model has a few dozen distinct calls; more is a sweep

recording = 0  # recorders active in this process: MojoOp's cheap test before `note_call`
_count_lock = threading.Lock()
_local = threading.local()
_kept: dict[int, torch.Tensor] = {}


# -- constants ----------------------------------------------------------------------------------
def keep(t: torch.Tensor) -> torch.Tensor:
    """Mark `t` as a constant kept for the process (an alpha/beta pair, an unread c, a
    vector of ones): a program holds it and passes it again, as the function would."""
    if len(_kept) >= 4096:  # a sweep of shapes: programs hold what they use
        _kept.clear()
    _kept[id(t)] = t
    return t


def _is_kept(t) -> bool:
    return _kept.get(id(t)) is t


# -- recording ----------------------------------------------------------------------------------
class _Unresolved(Exception):
    """What was recorded does not make a program (the reason is the message)."""


class Recorder:
    def __init__(self):
        # (book or primitive name, params, inputs, outputs, the outputs' version counters)
        self.steps: list[tuple] = []
        self.broken: str | None = None


def _recorder() -> Recorder | None:
    return getattr(_local, "recorder", None)


def _inside_a_recording() -> bool:
    """A replayed function called by a function being recorded (a backward calling a
    public function) runs itself, so that its op calls join the outer recording: a
    program of its own would hide them, and the outer function would not replay."""
    return recording > 0 and _recorder() is not None


def note_call(op, inputs, out, params: dict | None, outputs) -> None:
    """MojoOp calls this for each call while some thread records: the call joins this
    thread's program if its op's C++ book holds a recipe for it (the recipe a replay
    will find), else the program cannot replay."""
    rec = _recorder()
    if rec is None or rec.broken:
        return
    items = None if params is None else tuple(params.items())
    module = replay.module()
    if out:
        rec.broken = f"{op.spec.name}: a call with destinations"
    elif op._book is None or module is None or not module.has(op._book, inputs, items, ()):
        rec.broken = f"{op.spec.name}: no recipe in the C++ book for this call"
    else:
        rec.steps.append((op._book, items, list(inputs), list(outputs), [t._version for t in outputs]))


PRIMITIVES = ("sum_rows", "mv", "contiguous")  # t.sum(0), torch.mv(a, v), t.contiguous(): run in C++


def note_primitive(name: str, inputs, output: torch.Tensor) -> None:
    """A torch function of `PRIMITIVES` that the recorded function called."""
    rec = _recorder()
    if rec is not None and not rec.broken:
        rec.steps.append((name, None, list(inputs), [output], [output._version]))


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """t.contiguous(), noted as a program step when it copies (a gradient that autograd
    expanded, e.g. from `.sum()`, or rows moved to the last dim)."""
    c = t.contiguous()
    if recording and c is not t:
        note_primitive("contiguous", (t,), c)
    return c


# -- from a recording to a program --------------------------------------------------------------
def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _build(rec: Recorder, inputs, result) -> tuple:
    """(constants, steps, outputs) as replay_programs.h reads them; _Unresolved if a
    tensor the function used or returned did not come from its inputs, its op calls, a
    primitive or a kept constant."""
    # symbolic references first ("in", i) / ("const", j) / ("step", k), numbered at the end
    known: list[tuple[tuple, torch.Tensor]] = [(("in", i), t) for i, t in enumerate(inputs)]
    constants: list[torch.Tensor] = []
    n_made = 0

    def ref(t):
        if not isinstance(t, torch.Tensor):
            raise _Unresolved(f"not a tensor: {type(t).__name__}")
        same = [name for name, u in known if u is t]
        if len(same) > 1:
            raise _Unresolved("one tensor is two of the program's tensors")
        if same:
            return same[0]
        if _is_kept(t):
            constants.append(t)
            known.append((("const", len(constants) - 1), t))
            return known[-1][0]
        bases = [(name, u) for name, u in known if _storage(u) == _storage(t) and u.dtype == t.dtype]
        if len(bases) != 1:
            raise _Unresolved("a tensor made outside the recorded calls" if not bases else "an ambiguous view")
        name, base = bases[0]
        offset = t.storage_offset() - base.storage_offset()
        if not base.is_contiguous() or offset < 0:
            raise _Unresolved("a view of a non-contiguous tensor")
        return ("view", name, tuple(t.shape), tuple(t.stride()), offset)

    steps = []
    for what, params, step_inputs, step_outputs, versions in rec.steps:
        if any(t._version != v for t, v in zip(step_outputs, versions, strict=True)):
            # e.g. out.mul_(alpha) after the op: a replay would run the op and skip the edit
            raise _Unresolved(f"{what}: an output was modified in place after the call")
        refs = [ref(t) for t in step_inputs]
        steps.append((what, params, refs, len(step_outputs)))
        for t in step_outputs:
            known.append((("step", n_made), t))
            n_made += 1
    outputs = [None if t is None else ref(t) for t in result]

    first_made = len(inputs) + len(constants)

    def number(r):
        if r is None:
            return None
        if r[0] == "view":
            return (number(r[1]), r[2], r[3], r[4])
        kind, i = r
        return i if kind == "in" else len(inputs) + i if kind == "const" else first_made + i

    return (
        tuple(constants),
        tuple((what, params, tuple(number(r) for r in refs), n) for what, params, refs, n in steps),
        tuple(number(r) for r in outputs),
    )


# -- a function's programs ----------------------------------------------------------------------
class Program:
    """The programs of one function (one C++ program book), keyed by tensors and params."""

    def __init__(self, name: str):
        self.name = name
        self._book = None
        self._call = None
        _PROGRAMS.append(self)

    def call(self, tensors: list, params):
        """The outputs (a list) | None: nothing stored for this key, record it |
        False: this key does not replay, its ops' device is not the current one, or
        programs are off here."""
        if not ENABLED:
            return False
        if self._book is None and not self._open():
            return False
        return self._call(self._book, tensors, params)

    def _open(self) -> bool:
        module = replay.module()
        if module is not None:
            self._book, self._call = module.new_program_book(), module.program_call
        return module is not None

    def record(self, fn, tensors: list, params, *args):
        """fn(*args), recorded; its program (or "does not replay") stored under the key."""
        global recording
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return fn(*args)  # constants made now live in the graph's pool: record another time
        rec = Recorder()
        _local.recorder = rec
        with _count_lock:
            recording += 1
        try:
            result = fn(*args)
        finally:
            with _count_lock:
                recording -= 1
            _local.recorder = None
        self._store(rec, tensors, params, result)
        return result

    def _store(self, rec: Recorder, tensors, params, result) -> None:
        if self._book is None and not self._open():
            return
        module = replay.module()
        if module.program_count(self._book) >= MAX_PROGRAMS:
            return
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        try:
            if rec.broken:
                raise _Unresolved(rec.broken)
            spec = _build(rec, tensors, outputs)
        except _Unresolved as exc:
            spec, self.last_reason = None, str(exc)
        try:
            module.program_add(self._book, tensors, params, spec)
        except TypeError:  # params that do not hash: nothing to store them under
            pass

    def _forget(self) -> None:
        if self._book is not None:
            replay.module().clear_programs(self._book)

    def __len__(self) -> int:
        return 0 if self._book is None else replay.module().program_count(self._book)


# Every Program, emptied at once when launch plans change (the only way a program forgets
# its recordings): a C++ node replays its forward's and its backward's programs straight
# from these books, with no Python in between, so a lazy test at the next Python call would
# come too late. A node made before a PlanSetting switch then misses, and its call goes the
# Python way, which records again under the new plans.
_PROGRAMS: list[Program] = []


def _forget_all() -> None:
    for program in _PROGRAMS:
        program._forget()


direct.on_plans_changed(_forget_all)


_HASHABLE = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _plain_value(v) -> bool:
    """A parameter value that hashes and compares by value (tuples of such values too)."""
    if isinstance(v, tuple):  # torch.Size too
        return all(_plain_value(x) for x in v)
    return isinstance(v, _HASHABLE)


def replayed_backward(name: str, backward):
    """`backward(ctx, *grads)` with its calls replayed as programs where they can be: the
    key is the saved tensors and the gradients, and the params are the context's
    attributes, `needs_input_grad` and which of them are None. A double backward
    (grad mode on), autocast, a CPU call or attributes that are not plain values run
    `backward` itself."""
    program = Program(f"{name}.backward")

    def run(ctx, *grads):
        if torch.is_grad_enabled() or torch.is_autocast_enabled("cuda") or _inside_a_recording():
            return backward(ctx, *grads)
        saved = ctx.saved_tensors
        # saved tensors may be unpacked once only (checkpoint(use_reentrant=False) raises
        # on a second read): from here `backward` reads them from a context of our own
        attrs = tuple(vars(ctx).items())
        ctx = _make_context(saved, ctx.needs_input_grad, attrs)
        given = (*saved, *grads)
        tensors = [t for t in given if t is not None]
        if not tensors or not tensors[0].is_cuda:
            return backward(ctx, *grads)
        params = (attrs, ctx.needs_input_grad, tuple(t is None for t in given))
        try:
            found = program.call(tensors, params)
        except TypeError:  # an attribute that does not hash: this call is Python's
            return backward(ctx, *grads)
        if found.__class__ is list:
            return tuple(found)
        if found is False or not _plain_value(attrs):
            return backward(ctx, *grads)
        return program.record(backward, tensors, params, ctx, *grads)

    run.program = program
    return run


def present(*tensors) -> tuple[list, tuple[bool, ...]]:
    """(the arguments that are not None, which ones are None): a key's tensors and the part
    of its params that tells calls with different arguments left out apart."""
    return [t for t in tensors if t is not None], tuple(t is None for t in tensors)


def split_one(x, dim):
    """The key of a call (x, dim): dim with its type (True == 1, and a check tells them apart)."""
    return [x], (dim, dim.__class__)


def replayed_forward(name: str, fn, split, single: bool = True):
    """`fn(*args)`, an op's eager implementation, replayed as a program where it can be.
    `split(*args)` -> (tensors, params): the tensor arguments (the key) and a hashable
    value for all the others, with their types where the checks read them (a replay skips
    the checks: True must not find the program of 1). `single`: fn returns one tensor
    (else a tuple)."""
    program = Program(name)

    def run(*args):
        if recording and _recorder() is not None:  # _inside_a_recording, on the hot path
            return fn(*args)
        tensors, params = split(*args)
        first = tensors[0]
        if first.__class__ not in PLAIN_TENSORS or not first.is_cuda:  # programs are CUDA's
            return fn(*args)
        try:
            found = program.call(tensors, params)
        except TypeError:  # an argument that does not hash: this call is Python's
            return fn(*args)
        if found.__class__ is list:
            return found[0] if single else tuple(found)
        if found is False:
            return fn(*args)
        return program.record(fn, tensors, params, *args)

    run.program, run.split = program, split
    return run


# -- nodes: the autograd node in C++ (replay_nodes.h) ------------------------------------------
NODES = os.environ.get("GPU_DAYS_NODES", "1") != "0"


class _SetupSpy:
    """What an op's setup_context does to its context, noted (`Nodes.note`)."""

    __slots__ = ("to_save", "non_differentiable", "materialize", "dirty", "__dict__")

    def __init__(self):
        self.to_save, self.non_differentiable, self.materialize, self.dirty = (), (), True, False

    def save_for_backward(self, *tensors):
        self.to_save = tensors

    def mark_non_differentiable(self, *tensors):
        self.non_differentiable = tensors

    def set_materialize_grads(self, value: bool):
        self.materialize = bool(value)

    def mark_dirty(self, *tensors):
        self.dirty = True


class NodeContext:
    """The context a C++ node hands the op's Python backward when its program does not
    replay: what an autograd.Function's context offers that backward (vars() gives the
    attributes setup_context set, as for the Function's own context)."""

    __slots__ = ("saved_tensors", "needs_input_grad", "__dict__")


def _make_context(saved: tuple, needs_input_grad: tuple, attrs: tuple) -> NodeContext:
    ctx = NodeContext()
    ctx.saved_tensors, ctx.needs_input_grad = saved, needs_input_grad
    ctx.__dict__.update(attrs)
    return ctx


def _position(t, tensors) -> int | None:
    found = [i for i, u in enumerate(tensors) if u is t]
    return found[0] if len(found) == 1 else None


class Nodes:
    """The C++ autograd nodes of one op (`eager.function(..., programs=True)`): a call in
    grad mode whose forward replays as a program is one C++ call (`node_call`), which
    makes torch's C++ custom-function node; its backward replays the backward's program.
    The first such call of a key runs the autograd.Function and `note` records what its
    setup_context did: saved tensors (each an input or an output), non-differentiable
    outputs, materialized gradients, attributes."""

    def __init__(self, forward, setup_context, backward):
        self.forward, self.setup_context, self.backward = forward, setup_context, backward
        self._book = None
        self._call = None

    def _key(self, args):
        """(tensors, params) of a call that may have a node here, else None."""
        if not (ENABLED and NODES) or (recording and _recorder() is not None):
            return None
        tensors, params = self.forward.split(*args)
        first = tensors[0]
        if first.__class__ not in PLAIN_TENSORS or not first.is_cuda:
            return None
        if self._book is None:
            module = replay.module()
            if module is None:
                return None
            self._book, self._call = module.new_node_book(), module.node_call
        return tensors, params

    def call(self, args):
        """The outputs, with their C++ node; None: the autograd.Function runs."""
        key = self._key(args)
        if key is None:
            return None
        try:
            return self._call(self._book, *key)
        except TypeError:  # a parameter that does not hash
            return None

    def note(self, args, output) -> None:
        """After the autograd.Function ran a call: the node spec of its key, if none yet."""
        key = self._key(args)
        if key is None:
            return
        tensors, params = key
        module = replay.module()
        if self.forward.program._book is None:  # the forward's program book is opened by its first call
            return
        try:
            if module.node_known(self._book, tensors, params):
                return
            replays = module.program_known(self.forward.program._book, tensors, params)
        except TypeError:
            return
        if replays is None:  # the forward's program is recorded by its own first call
            return
        module.node_add(self._book, tensors, params, self._spec(args, tensors, output) if replays else None)

    def _spec(self, args, tensors, output) -> tuple | None:
        spy = _SetupSpy()
        self.setup_context(spy, args, output)
        outputs = output if isinstance(output, tuple) else (output,)
        attrs = tuple(vars(spy).items())
        arg_of_tensor = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        in_order = len(arg_of_tensor) == len(tensors) and all(
            args[i] is t for i, t in zip(arg_of_tensor, tensors, strict=True)
        )
        if spy.dirty or not _plain_value(attrs) or not in_order:
            return None
        saved = []
        for t in spy.to_save:
            i, o = (None, None) if t is None else (_position(t, tensors), _position(t, outputs))
            if t is not None and (i is None) == (o is None):  # neither, or ambiguous
                return None
            saved.append(("n", 0) if t is None else ("i", i) if i is not None else ("o", o))
        non_differentiable = [_position(t, outputs) for t in spy.non_differentiable]
        backward_program = self.backward.program
        if None in non_differentiable or (backward_program._book is None and not backward_program._open()):
            return None
        return (
            self.forward.program._book,
            backward_program._book,
            attrs,
            tuple(saved),
            tuple(non_differentiable),
            spy.materialize,
            not isinstance(output, tuple),
            tuple(arg_of_tensor),
            len(args),
            _make_context,
            self.backward,
        )
