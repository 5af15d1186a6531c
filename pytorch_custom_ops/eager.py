"""Eager calls that skip torch's dispatcher, and autograd without it.

Each op is registered with `torch.library.custom_op`: torch.compile, fake tensors and
`torch.library.opcheck` need that. In eager mode, though, a custom op's Python dispatch
costs tens of microseconds per call (day 016 measured 50-100 us on the H100's host, more
than the launch itself), and so does its autograd wrapper. So every public function asks
`route` where a call goes:

  OP        a tensor subclass (fake, functional...), torch.compile tracing, or a torch.func
            transform (vmap, grad...): the registered op
  AUTOGRAD  a plain tensor that needs a gradient: an `autograd.Function` made by `function`
            from the op's own eager implementation, setup_context and backward (the very
            functions registered with the op, so the two paths cannot disagree)
  EAGER     no gradient needed: the eager implementation, called directly

Backward functions call the public functions, so they route the same way (and a double
backward, with create_graph=True, goes through AUTOGRAD again).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .contract import PLAIN_TENSORS

OP, AUTOGRAD, EAGER = "op", "autograd", "eager"
_transforms_active = torch._C._are_functorch_transforms_active


def route(*tensors) -> str:
    """OP, AUTOGRAD or EAGER for a call with these tensor arguments (None allowed)."""
    if torch.compiler.is_compiling() or _transforms_active():  # vmap's tensors have no storage
        return OP
    grad = False
    for t in tensors:
        if t is None:
            continue
        if type(t) not in PLAIN_TENSORS:  # subclasses, and non-tensors (the op's checks name them)
            return OP
        grad = grad or t.requires_grad
    return AUTOGRAD if grad and torch.is_grad_enabled() else EAGER


def function(
    name: str, forward: Callable, setup_context: Callable, backward: Callable, programs: bool = False
) -> Callable:
    """`apply` of an autograd.Function that runs `forward(*args)` (in no-grad mode, as
    autograd.Function forwards do) and the op's registered `setup_context`/`backward`.
    `programs`: `backward` is a pure function of its context and gradients whose op calls
    may be replayed from C++ (`programs.replayed_backward`); with a replayed `forward`, a
    grad-mode call seen before also makes its autograd node in C++ (`programs.Nodes`).

    The ctx-first form, with setup_context called from forward: a Function that defines
    `setup_context` itself binds every call's arguments with `inspect.signature`, which
    cost ~20 us a call."""

    nodes = None
    if programs:
        from .programs import Nodes, replayed_backward

        backward = replayed_backward(name, backward)
        if hasattr(forward, "split"):  # a replayed forward (programs.replayed_forward)
            nodes = Nodes(forward, setup_context, backward)

    def run(ctx, *args):
        output = forward(*args)
        setup_context(ctx, args, output)
        if nodes is not None:
            nodes.note(args, output)
        return output

    fn = type(name, (torch.autograd.Function,), {"forward": staticmethod(run), "backward": staticmethod(backward)})
    # Function.apply is Python around the C++ apply: it binds arguments when a Function
    # defines setup_context (this one does not), and unwraps functorch tensors left over
    # from finished transforms (a loop over every argument). Outside a transform, calls go
    # to the C++ apply at once; inside one, to Function.apply and its error (torch.func
    # is not supported). A tensor leaked out of a finished vmap is not unwrapped: reading
    # its address then fails with torch's "doesn't have storage" error.
    raw = super(torch.autograd.Function, fn).apply

    def apply(*args):
        if _transforms_active():
            return fn.apply(*args)
        if nodes is not None:
            found = nodes.call(args)  # a call seen before: its node in C++ (programs.Nodes)
            if found is not None:
                return found
        return raw(*args)

    apply.backward_program = getattr(backward, "program", None)  # for tests and tools
    apply.nodes = nodes  # for tools (days/day016/replay_parts.py)
    return apply


def call(tensors: tuple, args: tuple, *, eager: Callable, autograd: Callable, op: Callable, check: Callable):
    """Run a public function's call where `route(*tensors)` sends it. `check(*args)` runs
    before the registered op, so that bad arguments get the op's own message rather than
    torch's schema error (the other two paths check inside the eager implementation)."""
    way = route(*tensors)
    if way is EAGER:
        return eager(*args)
    if way is AUTOGRAD:
        return autograd(*args)
    check(*args)
    return run_op(None, op, *args)


def run_op(name: str | None, op: Callable, *args):
    """`op(*args)`, the registered op. Under torch.func's grad, jvp or jacrev torch refuses
    a torch.library op's autograd with a message about autograd.Function's setup_context
    that names no op: this one names the public function (`name`, else the op's or its
    helper's module's) and says what works."""
    if torch.compiler.is_compiling() or not _transforms_active():  # dynamo need not trace the check
        return op(*args)
    try:
        return op(*args)
    except RuntimeError as e:
        if "setup_context" not in str(e):
            raise
        if name is None:  # an OpOverloadPacket's name is the op's; a helper's, its module's
            name = getattr(op, "__name__", "op")
            name = op.__module__.rsplit(".", 1)[-1] if name.startswith("_") else name
        raise NotImplementedError(
            f"{name}: torch.func's grad, jvp, jacrev and the like are not supported (a torch.library "
            "op's autograd cannot run under them); torch.vmap is, and so is ordinary autograd"
        ) from e


def refuse_double_backward(op: str) -> None:
    """Call first in a backward whose kernels have no derivative of their own. Under
    create_graph=True autograd runs the backward in grad mode: its gradients would then
    carry no graph (the GPU kernels), or one that misses the terms through what the
    forward saved as non-differentiable (the CPU math); either way a double backward
    would be silently wrong, so it stops here with the reason."""
    if torch.is_grad_enabled():
        raise NotImplementedError(
            f"{op}: double backward (create_graph=True) is not supported: its backward runs "
            "kernels that have no derivative of their own"
        )


# -- autocast ---------------------------------------------------------------------------------
def autocast_dtype(t) -> torch.dtype | None:
    """The dtype torch.autocast asks for on `t`'s device, or None when it is off there.

    An eager call skips the dispatcher, where autocast would cast a registered op's
    inputs, so each public function applies torch's CUDA policy itself: matrix products
    (gemm) run in the autocast dtype, normalisations and softmaxes in float32.
    """
    if t.__class__ not in PLAIN_TENSORS:
        return None
    device = "cuda" if t.is_cuda else "cpu" if t.is_cpu else None
    if device is None or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def cast_floats(dtype: torch.dtype, *tensors):
    """`tensors` with every floating-point one of another dtype cast to `dtype` (None stays).
    float64 stays too: torch's autocast casts no float64 tensor (torch.mm stays float64)."""
    return tuple(
        t.to(dtype)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in (dtype, torch.float64)
        else t
        for t in tensors
    )
