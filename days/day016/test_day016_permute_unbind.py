"""Day 016, part ten: `pco.permute_unbind` (x.permute(dims).contiguous().unbind(0)) and its
one-pass gradient, against torch's composition, which is exact: copies and sums of one
term each must match bit for bit.

CPU: the forward through MAX, the composition's backward, gradcheck and a double backward;
the gather's launch plan, emulated index by index. CUDA: the gather kernel (16-byte and
scalar paths, two and three pieces, other ranks), one launch per backward, CUDA graphs,
torch.compile.
"""

import importlib

import pytest
import torch

import pytorch_custom_ops as pco

PC = importlib.import_module("pytorch_custom_ops.permute_copy")
PU = importlib.import_module("pytorch_custom_ops.permute_unbind")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (shape, dims): the heads' split, odd sizes, other ranks; the first dim after the
# permutation (the pieces) has 1, 2, 3 or (composition only) 5 entries
CASES = [
    ((2, 7, 3, 4, 64), (2, 0, 3, 1, 4)),  # (b, s, 3, h, hd) -> q, k, v: (b, h, s, hd)
    ((3, 5, 2, 6, 9), (2, 1, 0, 3, 4)),  # odd last dim: the scalar path
    ((5, 2, 17), (1, 0, 2)),  # rank 3: leading dims of 1 in the kernel's rank 5
    ((3, 40), (0, 1)),
    ((2, 5, 8), (1, 0, 2)),  # 5 pieces: the composition's backward
]


def rand(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) + 0.5).to(dtype).to(device)


def check_case(shape, dims, dtype, device):
    x = rand(shape, dtype, device).requires_grad_()
    pieces = pco.permute_unbind(x, dims)
    want_x = x.detach().clone().requires_grad_()
    want = want_x.permute(dims).contiguous().unbind(0)
    assert len(pieces) == len(want)
    for p, w in zip(pieces, want, strict=True):
        assert p.shape == w.shape and p.dtype == dtype and torch.equal(p, w)
    grads = [rand(w.shape, dtype, device, seed=i + 1) for i, w in enumerate(want)]
    (gx,) = torch.autograd.grad(pieces, x, grads)
    (gw,) = torch.autograd.grad(want, want_x, grads)
    assert gx.shape == x.shape and torch.equal(gx, gw)


@pytest.mark.parametrize("shape,dims", CASES)
def test_cpu_matches_the_composition_bit_for_bit(shape, dims):
    check_case(shape, dims, torch.float32, "cpu")


def test_cpu_gradcheck_and_double_backward():
    x = rand((2, 3, 3, 2, 4), torch.float64, "cpu").requires_grad_()
    f = lambda t: pco.permute_unbind(t, (2, 0, 3, 1, 4))  # noqa: E731
    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


@pytest.mark.parametrize(
    "x,dims,error,match",
    [
        (torch.ones(2, 3, 4), (0, 2, 1), ValueError, "permute_unbind: the last dim must stay last"),
        (torch.ones(2, 3), (0, 0), ValueError, "permute_unbind: dims .* is not a permutation"),
        (torch.ones(2, 3, dtype=torch.int32), (0, 1), TypeError, "permute_unbind"),
    ],
)
def test_bad_arguments_raise_clear_errors(x, dims, error, match):
    with pytest.raises(error, match=match):
        pco.permute_unbind(x, dims)


# -- the gather's launch plan, emulated (no GPU) -------------------------------------------------
def emulate(launch, tensors: dict[int, torch.Tensor]) -> None:
    """Run permute_copy_kernel's index math (days/day016/permute_copy.mojo) on CPU tensors
    named by their addresses in the launch's arguments."""
    dst = tensors[launch.args[0]]
    srcs = [tensors[a].reshape(-1) for a in launch.args[1:4]]
    n0, n1, n2, n3, d, s0, s1, s2, s3, pick = launch.args[4:]
    assert dst.shape == (n0, n1, n2, n3, d) and dst.is_contiguous()
    flat = dst.view(-1)
    at = 0
    for i0 in range(n0):
        for i1 in range(n1):
            for i2 in range(n2):
                for i3 in range(n3):
                    which = min((i0, i1, i2, i3)[pick], 2)
                    base = i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3
                    flat[at : at + d] = srcs[which][base : base + d]
                    at += d


@pytest.mark.parametrize("shape,dims", [c for c in CASES if c[0][c[1][0]] <= 3])
def test_the_gather_plan_writes_each_element_from_its_piece(shape, dims):
    norm = tuple(p % len(shape) for p in dims)
    lead = PC.RANK - len(shape)
    y = rand(shape, torch.float32, "cpu").permute(norm).contiguous()
    pieces = [rand(y.shape[1:], torch.float32, "cpu", seed=i + 5) for i in range(y.shape[0])]
    op = PU.gather_kernel(PC._padded(norm), lead, len(pieces))
    views = [p.view((1,) * lead + tuple(p.shape)) for p in pieces]
    out = torch.full((1,) * lead + shape, float("nan"))
    (launch,) = PC._gather_gpu([out], views, op.spec.params)
    emulate(launch, {t.data_ptr(): t for t in (out, *views)})
    want = torch.stack(pieces).permute(PC._inverse(norm)).contiguous()
    assert torch.equal(out.view(shape), want)


# -- CUDA ------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("shape,dims", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_the_composition_bit_for_bit(shape, dims, dtype):
    check_case(shape, dims, dtype, "cuda")


@needs_cuda
def test_cuda_the_backward_is_one_launch(launched):
    x = rand((2, 33, 3, 4, 64), torch.bfloat16, "cuda").requires_grad_()
    q, k, v = pco.permute_unbind(x, (2, 0, 3, 1, 4))
    ((q * 2).sum() + (k * v).sum()).backward()
    copies = [key for key in launched if "permute_copy" in key]
    assert copies == ["day016.permute_copy_kernel.bfloat16.8"] * 2, launched  # forward, backward
    want = torch.stack([torch.full_like(q, 2), v, k]).permute(1, 3, 0, 2, 4)
    assert torch.equal(x.grad, want)


@needs_cuda
def test_cuda_non_contiguous_gradients_are_gathered_right():
    x = rand((2, 9, 3, 4, 64), torch.float16, "cuda").requires_grad_()
    pieces = pco.permute_unbind(x, (2, 0, 3, 1, 4))
    grads = [rand(p.shape[:-2] + p.shape[-1:] + p.shape[-2:-1], torch.float16, "cuda", seed=i).transpose(-1, -2)
             for i, p in enumerate(pieces)]  # fmt: skip
    (gx,) = torch.autograd.grad(pieces, x, grads)
    assert torch.equal(gx, torch.stack(grads).permute(1, 3, 0, 2, 4))


@needs_cuda
def test_cuda_graph_replays_forward_and_backward():
    x = rand((2, 16, 3, 4, 64), torch.bfloat16, "cuda").requires_grad_()
    g = rand((3, 2, 4, 16, 64), torch.bfloat16, "cuda", seed=7)

    def step():
        pieces = pco.permute_unbind(x, (2, 0, 3, 1, 4))
        return torch.autograd.grad(pieces, x, g.unbind(0))[0]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: kernels loaded outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gx = step()
    g.copy_(rand(g.shape, torch.bfloat16, "cuda", seed=8))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gx, g.permute(1, 3, 0, 2, 4))


@needs_cuda
def test_cuda_compiles_fullgraph_with_grads():
    x = rand((2, 8, 3, 2, 64), torch.float32, "cuda").requires_grad_()

    def f(t):
        q, k, v = pco.permute_unbind(t, (2, 0, 3, 1, 4))
        return q * 2 + k * v

    y = torch.compile(f, fullgraph=True)(x)
    (gx,) = torch.autograd.grad(y.sum(), x)
    q, k, v = x.detach().permute(2, 0, 3, 1, 4)
    assert torch.equal(y, q * 2 + k * v)
    assert torch.equal(gx, torch.stack([torch.full_like(q, 2), v, k]).permute(1, 3, 0, 2, 4))
