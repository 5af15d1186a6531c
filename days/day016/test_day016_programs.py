"""Forwards and backward nodes replayed as programs (day 016, part five; `programs.py`).

The second forward or backward through a gpu-days op with the same shapes runs no op call
from Python: its op calls are replayed from C++ (`replay_programs.h`). These check, on a GPU,
that such a backward gives exactly what the Python backward gives, that nothing of it
goes through Python, and what makes a program be recorded again. Without a GPU they
skip: the C++ side is checked with a stand-in driver in tests/test_launcher.py.
"""

from __future__ import annotations

import pytest
import torch

import pytorch_custom_ops as pco
from benchmark import gpt_block as G
from pytorch_custom_ops import mojo_op, programs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _attention_scores(q, k, mask):
    return pco.gemm_batched(q, k, mask, 0.125, 1.0, False, True)


CASES = {
    "MojoGEMM 3-D input, bias, bf16": (lambda: pco.MojoGEMM(96, 80), (3, 17, 96), torch.bfloat16),
    "MojoGEMM 2-D input, no bias, fp32": (lambda: pco.MojoGEMM(64, 48, bias=False), (37, 64), torch.float32),
    "MojoGEMM many rows (gemv bias grad), bf16": (lambda: pco.MojoGEMM(64, 32), (4100, 64), torch.bfloat16),
    "MojoLayerNorm, bf16": (lambda: pco.MojoLayerNorm(129), (5, 7, 129), torch.bfloat16),
    "MojoSoftmax, fp32": (lambda: pco.MojoSoftmax(dim=-1), (6, 333), torch.float32),
    # day 019's fused linear and day 020's fused MLP (their forward, node and backward)
    "MojoLinear 3-D input, bias, bf16": (lambda: pco.MojoLinear(96, 80), (3, 17, 96), torch.bfloat16),
    "MojoLinear no bias, fp16": (lambda: pco.MojoLinear(64, 48, bias=False), (37, 64), torch.float16),
    "MojoMLP, bf16": (lambda: pco.MojoMLP(64, 256), (5, 7, 64), torch.bfloat16),
}


def _count_op_calls(monkeypatch) -> list[str]:
    """From now on, the name of every op call that goes through Python (MojoOp._call)."""
    calls, real = [], mojo_op.MojoOp._call
    monkeypatch.setattr(mojo_op.MojoOp, "_call", lambda self, *a: calls.append(self.spec.name) or real(self, *a))
    return calls


def _step(module, x, g):
    out = module(x)
    params = [p for p in module.parameters()]
    return torch.autograd.grad(out, [x, *params], g)


@pytest.mark.parametrize("case", CASES)
def test_cuda_a_repeated_backward_runs_from_its_program_and_matches_python(case, monkeypatch):
    make, shape, dtype = CASES[case]
    torch.manual_seed(0)
    module = make().to(device="cuda", dtype=dtype)
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    out_shape = module(x).shape
    g = torch.randn(out_shape, device="cuda", dtype=dtype)
    monkeypatch.setattr(programs, "ENABLED", False)
    python = _step(module, x, g)
    monkeypatch.setattr(programs, "ENABLED", True)
    _step(module, x, g)  # records (or finds the program recorded by an earlier test)
    out = module(x)
    calls = _count_op_calls(monkeypatch)
    replayed = torch.autograd.grad(out, [x, *module.parameters()], g)
    assert calls == [], f"op calls from Python in a replayed backward: {calls}"
    for got, want in zip(replayed, python, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "function, make",
    [
        ("layer_norm", lambda: (pco.MojoLayerNorm(130), (3, 5, 130))),  # its backward calls layer_norm_backward
        ("softmax", lambda: (pco.MojoSoftmax(-1), (4, 77))),  # its backward calls softmax_backward
    ],
)
def test_cuda_a_backward_calling_a_replayed_function_is_one_program(function, make, monkeypatch):
    """The node's backward calls a public function that is replayed itself: recorded
    inside the backward's recording, its op calls belong to the backward's program, and
    a repeated backward is that one program. (`.sum()`'s gradient is expanded: the
    backward's `contiguous` is a step too.)"""
    monkeypatch.setattr(programs, "NODES", False)  # the Python node calls the program through Python
    module, shape = make()
    module = module.cuda()
    program = getattr(pco, function).__globals__[f"_{function}_autograd"].backward_program
    results = []
    real = programs.Program.call
    monkeypatch.setattr(
        programs.Program, "call", lambda self, *a: results.append((self is program, real(self, *a))) or results[-1][1]
    )
    x = torch.randn(shape, device="cuda", requires_grad=True)
    for _ in range(3):
        module(x).sum().backward()
    mine = [found for is_mine, found in results if is_mine]
    assert len(mine) == 3 and mine[-1].__class__ is list, mine


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_cuda_a_repeated_forward_runs_from_its_program_and_matches_python(case, grad, monkeypatch):
    make, shape, dtype = CASES[case]
    torch.manual_seed(1)
    module = make().to(device="cuda", dtype=dtype)
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        monkeypatch.setattr(programs, "ENABLED", False)
        python = module(x)
        monkeypatch.setattr(programs, "ENABLED", True)
        module(x)  # records
        calls = _count_op_calls(monkeypatch)
        replayed = module(x)
    assert calls == [], f"op calls from Python in a replayed forward: {calls}"
    assert replayed.requires_grad == grad and (replayed.grad_fn is None) != grad
    torch.testing.assert_close(replayed, python, rtol=0, atol=0)


def _python_then_replayed(step, grad: bool, monkeypatch):
    """(step() with programs off, step() a third time with them on), checking that the
    third call ran no op call from Python and equals the first exactly."""
    with torch.set_grad_enabled(grad):
        monkeypatch.setattr(programs, "ENABLED", False)
        python = step()
        monkeypatch.setattr(programs, "ENABLED", True)
        step()  # records
        calls = _count_op_calls(monkeypatch)
        replayed = step()
    assert calls == [], f"op calls from Python in a replayed call: {calls}"
    for got, want in zip(replayed, python, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    return python, replayed


# day 020's fused add + LayerNorm: (x's dtype, delta's dtype or None, out_dtype)
ADD_LN_CASES = {
    "bf16, delta": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "bf16, no delta": (torch.bfloat16, None, torch.bfloat16),
    "fp32 stream, bf16 delta and y": (torch.float32, torch.bfloat16, torch.bfloat16),
    "fp32 stream, no delta, bf16 y": (torch.float32, None, torch.bfloat16),
}


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("case", ADD_LN_CASES)
def test_cuda_add_layer_norm_replays_forward_and_backward(case, grad, monkeypatch):
    """`add_layer_norm` (day 020) as a program: a repeated call runs no op call from
    Python, without autograd (no statistics) and with it (the C++ node), and so does a
    repeated backward; both give exactly what the Python path gives."""
    dtype, delta_dtype, out_dtype = ADD_LN_CASES[case]
    torch.manual_seed(3)
    ln = pco.MojoAddLayerNorm(130).to(device="cuda", dtype=dtype)
    x = torch.randn(3, 5, 130, device="cuda", dtype=dtype, requires_grad=grad)
    delta = None if delta_dtype is None else torch.randn(3, 5, 130, device="cuda", dtype=delta_dtype)
    leaves = [x, *ln.parameters()] + ([] if delta is None else [delta.requires_grad_(grad)])
    gs, gy = torch.randn_like(x), torch.randn(3, 5, 130, device="cuda", dtype=out_dtype)

    def step():
        s, y = ln(x, delta, out_dtype)
        if not grad:
            return s, y
        return (s, y, *torch.autograd.grad((s, y), leaves, (gs, gy)))

    _, replayed = _python_then_replayed(step, grad, monkeypatch)
    if delta is None:
        assert replayed[0] is x  # s is x itself


@pytest.mark.parametrize("grad", [False, True])
def test_cuda_permute_unbind_replays_forward_and_backward(grad, monkeypatch):
    """The attention's head split (day 016, part ten) as a program: the forward's copy and
    the backward's gather run no op call from Python when repeated."""
    torch.manual_seed(4)
    x = torch.randn(2, 9, 3, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    gs = [torch.randn(2, 4, 9, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]

    def step():
        q, k, v = pco.permute_unbind(x, (2, 0, 3, 1, 4))
        return (q, k, v, *torch.autograd.grad((q, k, v), [x], gs)) if grad else (q, k, v)

    _python_then_replayed(step, grad, monkeypatch)


FUSED_MODULES = {  # a module, its input shape and its other arguments
    "MojoLinear, bias": (lambda: pco.MojoLinear(96, 80), (3, 17, 96), ()),
    "MojoAddLayerNorm, no delta": (lambda: pco.MojoAddLayerNorm(96), (3, 17, 96), (None,)),
    "MojoMLP": (lambda: pco.MojoMLP(96, 256), (3, 17, 96), ()),
}


@pytest.mark.parametrize("case", FUSED_MODULES)
def test_cuda_a_grad_mode_call_launches_its_kernels_once(case, monkeypatch):
    """A repeated call in grad mode launches what the Python path launches, no more: a C++
    node that ran the forward's program and then fell back to Python ran it twice (day 016,
    part sixteen)."""
    make, shape, extra = FUSED_MODULES[case]
    module = make().to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def kernels() -> int:
        for _ in range(3):  # recorded, then replayed
            module(x, *extra)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            module(x, *extra)
            torch.cuda.synchronize()
        return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)

    monkeypatch.setattr(programs, "ENABLED", False)
    python = kernels()
    monkeypatch.setattr(programs, "ENABLED", True)
    assert kernels() == python > 0
    # and the call is a C++ node, though its forward returns a None (linear's `pre`
    # without GELU, add_layer_norm's sum without delta): node_call keeps the None
    names = _node_names(module(x, *extra))
    assert any("ReplayedBackward" in n for n in names), names


def _node_names(y, depth: int = 3) -> list[str]:
    """The names of the autograd nodes of y (or of each tensor of a tuple: add_layer_norm
    gives (x, y) without delta), `depth` edges deep (past a view of the output)."""
    names, level = [], [t.grad_fn for t in (y if isinstance(y, tuple) else (y,))]
    for _ in range(depth):
        level = [f for f in level if f is not None]
        names += [f.name() for f in level]
        level = [g for f in level for g, _ in f.next_functions]
    return names


def _ln_backward_args():
    x = torch.randn(4, 9, 130, device="cuda")
    _, mean, rstd = torch.ops.gpu_days.layer_norm(x, [130], torch.randn(130, device="cuda"), None, 1e-5)
    return torch.randn_like(x), x, (130,), torch.randn(130, device="cuda"), mean, rstd


def _cuda(*shape):
    return torch.randn(*shape, device="cuda")


# name: (function, its arguments, whether a repeated call replays)
FUNCTIONS = {
    "softmax_backward": (pco.softmax_backward, lambda: (_cuda(7, 300), _cuda(7, 300), -1), True),
    "log_softmax_backward": (pco.log_softmax_backward, lambda: (_cuda(7, 300), _cuda(7, 300), -1), True),
    "layer_norm_backward": (pco.layer_norm_backward, _ln_backward_args, True),
    "online_softmax": (pco.online_softmax, lambda: (_cuda(5, 3, 77), -1), True),
    # no autograd: y alone (layer_norm_y_kernel), from a 2-D x and from a view of a 3-D one
    "layer_norm, y alone": (pco.layer_norm, lambda: (_cuda(6, 130), (130,), _cuda(130), _cuda(130)), True),
    "layer_norm, y alone, 3-D": (pco.layer_norm, lambda: (_cuda(2, 3, 130), (130,), _cuda(130), _cuda(130)), True),
    "long_softmax": (pco.long_softmax, lambda: (_cuda(2, 5000),), True),
    "gemm, transposed b, alpha": (pco.gemm, lambda: (_cuda(33, 40), _cuda(50, 40), None, 0.5, 0.0, False, True), True),
    # the rows of a dim other than the last are a copy: a `contiguous` step of the program
    "online_softmax over dim 1": (pco.online_softmax, lambda: (_cuda(5, 3, 77), 1), True),
    # not replayed: without a weight, LayerNorm's ones are made per call (torch.full, a
    # torch op), and one tensor passed twice is ambiguous for a recording (a shape no
    # other case records)
    "layer_norm without weight or bias": (pco.layer_norm, lambda: (_cuda(6, 130), (130,)), False),
    "softmax_backward, one tensor twice": (pco.softmax_backward, lambda: (_cuda(7, 301),) * 2 + (-1,), False),
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_cuda_a_repeated_public_call_runs_from_its_program(name, monkeypatch):
    fn, make, replays = FUNCTIONS[name]
    torch.manual_seed(2)
    args = make()
    monkeypatch.setattr(programs, "ENABLED", False)
    python = fn(*args)
    monkeypatch.setattr(programs, "ENABLED", True)
    fn(*args)  # records
    calls = _count_op_calls(monkeypatch)
    replayed = fn(*args)
    assert (calls == []) == replays, f"op calls from Python in the third call: {calls}"
    torch.testing.assert_close(replayed, python, rtol=0, atol=0)


def test_cuda_a_gemm_batched_backward_with_a_broadcast_mask_replays(monkeypatch):
    """The attention scores of the model benchmark: q and k are views of one tensor, the
    mask a (1, s, s) c that needs no gradient."""
    torch.manual_seed(0)
    qk = torch.randn(2, 12, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = G.causal_mask(64, torch.bfloat16, "cuda")
    g = torch.randn(12, 64, 64, device="cuda", dtype=torch.bfloat16)
    grads = []
    for i in range(3):
        q, k = qk.unbind(0)
        out = _attention_scores(q, k, mask)
        calls = _count_op_calls(monkeypatch) if i == 2 else []
        grads.append(torch.autograd.grad(out, [qk], g)[0])
        assert calls == []
    torch.testing.assert_close(grads[2], grads[0], rtol=0, atol=0)
    q, k = qk.detach().double().unbind(0)
    torch.testing.assert_close(grads[2][0].double(), g.double() @ k * 0.125, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grads[2][1].double(), g.double().mT @ q * 0.125, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_a_gpt_block_train_step_is_the_same_with_and_without_programs(dtype, monkeypatch):
    x = G.make_input((2, 64, 128), dtype, "cuda")
    mask = G.causal_mask(64, dtype, "cuda")
    block = G.make_block(128, G.GPU_DAYS, dtype, "cuda")
    params = list(block.parameters())
    xg = x.detach().clone().requires_grad_()
    monkeypatch.setattr(programs, "ENABLED", False)
    python = G.train_step(block, xg, mask, params)
    monkeypatch.setattr(programs, "ENABLED", True)
    for _ in range(3):  # record, then replay twice
        replayed = G.train_step(block, xg, mask, params)
    for got, want in zip(replayed, python, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_cuda_new_launch_plans_make_the_programs_record_again():
    """A GEMM version forced by `gemm_version` changes the plans (direct.plans_changed):
    the programs of every backward are forgotten with the recipes, and the next
    backward runs the new version's kernels."""
    torch.manual_seed(0)
    lin = pco.MojoGEMM(256, 128).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    first = [_step(lin, x, g) for _ in range(2)][-1]
    with pco.gemm_version("TMA_128x256"):
        forced = _step(lin, x, g)
    again = _step(lin, x, g)
    want = g.double() @ lin.weight.detach().double()
    for grads in (first, forced, again):
        torch.testing.assert_close(grads[0].double(), want, rtol=2e-2, atol=2e-1)


def test_cuda_a_replay_never_skips_a_check_that_would_fail():
    """A program skips the public checks: only calls equal to one that passed them may
    find it. True == 1 == 1.0 in Python, so each scalar's type is part of the key."""
    a, b = _cuda(16, 32), _cuda(32, 8)
    for _ in range(2):  # recorded, then replayed
        pco.gemm(a, b, None, 1.0, 0.0, False, False)
        pco.softmax(a, -1)
    with pytest.raises(TypeError, match="alpha must be a real number"):
        pco.gemm(a, b, None, True, 0.0, False, False)
    with pytest.raises(TypeError, match="transpose_a must be a bool"):
        pco.gemm(a, b, None, 1.0, 0.0, 0, False)
    with pytest.raises((TypeError, ValueError), match="dim"):
        pco.softmax(a, -1.0)


@pytest.mark.parametrize("nodes", [True, False])
def test_cuda_a_repeated_call_in_grad_mode_makes_a_cpp_node(nodes, monkeypatch):
    """With programs.NODES on, the third call of a key in grad mode is one C++ call: its
    node is torch's C++ custom-function node (whose backward replays the backward's
    program). Off, it is the autograd.Function's Python node. Both give the same grads,
    also in a double backward (the C++ node runs the Python backward in grad mode)."""
    monkeypatch.setattr(programs, "NODES", nodes)
    torch.manual_seed(3)
    lin = pco.MojoGEMM(40, 24).to(device="cuda", dtype=torch.float64)
    x = torch.randn(9, 40, device="cuda", dtype=torch.float64, requires_grad=True)
    for _ in range(3):
        y = lin(x)
    assert ("ReplayedBackward" in y.grad_fn.name()) == nodes, y.grad_fn.name()
    g = torch.randn_like(y, requires_grad=True)
    (gx,) = torch.autograd.grad(y, [x], g, create_graph=True)
    torch.testing.assert_close(gx, g @ lin.weight, rtol=1e-12, atol=1e-12)
    (ggw,) = torch.autograd.grad(gx.sum(), [lin.weight])  # through the backward's own graph
    torch.testing.assert_close(ggw, g.sum(0, keepdim=True).T.expand(24, 40), rtol=1e-12, atol=1e-12)
