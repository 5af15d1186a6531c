"""Day 016, part seven: `pco.permute_copy` (x.permute(dims).contiguous() with the last dim
kept last), against torch's own copy, which is exact: a copy must match bit for bit.

CPU: the Mojo op through MAX (strict mode). CUDA: the direct launch, its 16-byte and
scalar paths, grids past 65535 rows, CUDA graphs and side streams; the launch plan's
choices are also checked on the CPU.
"""

import importlib

import pytest
import torch

import pytorch_custom_ops as pco

PC = importlib.import_module("pytorch_custom_ops.permute_copy")
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# (shape, dims): the attention's head split and merge, odd sizes, every rank
CASES = [
    ((2, 7, 3, 4, 64), (2, 0, 3, 1, 4)),  # (b, s, 3, h, hd) -> (3, b, h, s, hd)
    ((2, 4, 7, 64), (0, 2, 1, 3)),  # (b, h, s, hd) -> (b, s, h, hd)
    ((3, 5, 2, 6, 9), (3, 1, 0, 2, 4)),  # odd last dim: the scalar path
    ((5, 3, 17), (1, 0, 2)),
    ((4, 33), (0, 1)),
    ((11,), (0,)),
    ((2, 3, 4, 5, 8), (-2, -3, -4, -5, -1)),  # negative dims, as torch takes them
]


def rand(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) + 0.5).to(dtype).to(device)


def check_case(shape, dims, dtype, device):
    x = rand(shape, dtype, device)
    y = pco.permute_copy(x, dims)
    want = x.permute(dims).contiguous()
    assert y.shape == want.shape and y.dtype == dtype and y.is_contiguous()
    assert torch.equal(y, want)
    assert y.data_ptr() != x.data_ptr()  # always a new tensor


# On the CPU each (permutation, dtype) compiles a MAX graph (seconds each): every case in
# float32 and every dtype on the head split there; CUDA runs the whole matrix.
@pytest.mark.parametrize("shape,dims", CASES)
def test_matches_torch_bit_for_bit(device, shape, dims):
    check_case(shape, dims, torch.float32, device)


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
def test_every_dtype(device, dtype):
    check_case(*CASES[0], dtype, device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_every_case_and_dtype(dtype):
    for shape, dims in CASES:
        check_case(shape, dims, dtype, "cuda")


def test_non_contiguous_input_is_copied_first(device):
    base = rand((6, 5, 4, 16), torch.float32, device)
    x = base.transpose(0, 1)  # (5, 6, 4, 16), not contiguous
    assert torch.equal(pco.permute_copy(x, (2, 0, 1, 3)), x.permute(2, 0, 1, 3).contiguous())


def test_empty_tensor(device):
    x = torch.empty((2, 0, 3, 8), device=device)
    assert pco.permute_copy(x, (0, 2, 1, 3)).shape == (2, 3, 0, 8)


def test_gradient_is_the_inverse_permutation(device):
    x = rand((2, 5, 3, 2, 6), torch.float64, device).requires_grad_()
    dims = (2, 0, 3, 1, 4)
    y = pco.permute_copy(x, dims)
    g = rand(y.shape, torch.float64, device, seed=1)
    (gx,) = torch.autograd.grad(y, x, g)
    assert torch.equal(gx, g.permute(1, 3, 0, 2, 4))
    assert gx.is_contiguous()  # in x's own layout: a view before the copy costs no copy back
    assert torch.autograd.gradcheck(lambda t: pco.permute_copy(t, dims), (x,))


def test_the_heads_of_a_block_round_trip(device):
    """Split a QKV projection into heads, merge o back: the same as torch's reshapes."""
    b, s, h, hd = 2, 9, 3, 64
    qkv = rand((b, s, 3 * h * hd), torch.bfloat16, device)
    q, k, v = pco.permute_copy(qkv.view(b, s, 3, h, hd), (2, 0, 3, 1, 4)).view(3, b * h, s, hd).unbind(0)
    tq, tk, tv = qkv.view(b, s, 3, h, hd).permute(2, 0, 3, 1, 4).reshape(3, b * h, s, hd).unbind(0)
    assert torch.equal(q, tq) and torch.equal(k, tk) and torch.equal(v, tv)
    merged = pco.permute_copy(v.view(b, h, s, hd), (0, 2, 1, 3)).view(b, s, h * hd)
    assert torch.equal(merged, qkv.view(b, s, 3, h * hd)[:, :, 2])


@pytest.mark.parametrize(
    "x,dims,error,match",
    [
        (torch.ones(2, 3, 4), (0, 2, 1), ValueError, "last dim must stay last"),
        (torch.ones(2, 3, 4), (0, 0, 2), ValueError, "not a permutation"),
        (torch.ones(2, 3, 4), (0, 1), ValueError, "has 2 entries"),
        (torch.ones(2, 3, 4), (0, 3, 2), IndexError, "out of range"),
        (torch.ones(2, 3, 4), (0, 1.0, 2), TypeError, "sequence of ints"),
        (torch.ones(2, 3, 4), "012", TypeError, "sequence of ints"),
        (torch.ones(2, 3, 4, dtype=torch.int32), (1, 0, 2), TypeError, "dtype"),
        (torch.ones(1, 1, 1, 1, 1, 2), (1, 0, 2, 3, 4, 5), ValueError, "rank 1 to 5"),
        (torch.ones(()), (), ValueError, "rank 1 to 5"),
        ([1.0, 2.0], (0,), TypeError, "torch.Tensor"),
    ],
)
def test_bad_arguments_raise_clear_errors(x, dims, error, match):
    with pytest.raises(error, match=match):
        pco.permute_copy(x, dims)


def test_dims_as_torch_takes_them():
    """range and numpy ints, as Tensor.permute takes them (bool stays refused above)."""
    np = pytest.importorskip("numpy")
    x = torch.randn(2, 3, 4, 8)
    assert torch.equal(pco.permute_copy(x, range(4)), x)
    want = x.permute(1, 0, 2, 3).contiguous()
    assert torch.equal(pco.permute_copy(x, (np.int64(1), 0, np.int32(2), 3)), want)
    assert torch.equal(torch.stack(pco.permute_unbind(x, [np.int64(1), 0, 2, 3])), want)


def test_registered_op_passes_opcheck():
    x = rand((2, 3, 4, 8), torch.float32, "cpu").requires_grad_()
    torch.library.opcheck(torch.ops.gpu_days.permute_copy, (x, [1, 0, 2, 3]))


# -- the launch plan (runs on the CPU: no driver call) -----------------------------------------
def _plan(x5: torch.Tensor, perm):
    out = torch.empty([x5.shape[p] for p in perm] + [x5.shape[4]], dtype=x5.dtype)
    params = {f"P{i}": p for i, p in enumerate(perm)}
    (launch,) = PC._permute_copy_gpu([out], [x5], params)
    return launch, out


def test_plan_uses_16_byte_vectors_where_rows_and_strides_allow():
    launch, out = _plan(torch.empty(2, 128, 3, 16, 64, dtype=torch.bfloat16), (2, 0, 3, 1))
    assert launch.kernel.params == (torch.bfloat16, 8)
    assert launch.grid == (16, 2, 3)  # (w, b): a run of 16 heads x 128 x 64 elements, 16 chunks
    assert launch.args[1] == launch.args[2] == launch.args[3]  # one source, passed for all three
    assert launch.args[4:] == (3, 2, 16, 128, 64, 64 * 16, 128 * 3 * 16 * 64, 64, 3 * 16 * 64, 0)
    launch, _ = _plan(torch.empty(1, 2048, 3, 16, 64, dtype=torch.bfloat16), (2, 0, 3, 1))
    assert launch.grid == (16 * 16, 1, 3)  # 16 heads x 16384 vectors a (w, b): 256 chunks
    launch, _ = _plan(torch.empty(1, 8, 12, 1024, 64, dtype=torch.bfloat16), (0, 1, 3, 2))
    assert launch.grid == (96, 8, 1)  # the merge: a run per batch entry, 1024 x 12 x 8 vectors
    launch, _ = _plan(torch.empty(2, 5, 3, 4, 9, dtype=torch.bfloat16), (2, 0, 3, 1))
    assert launch.kernel.params == (torch.bfloat16, 1)  # 9-wide rows: element by element


def test_plan_caps_the_grid_and_the_kernel_loops_over_the_rest():
    launch, _ = _plan(torch.empty(1, 70000, 1, 1, 8), (0, 1, 2, 3))
    assert launch.grid == (1, 65535, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_vector_and_scalar_paths(launched):
    x = rand((2, 33, 3, 4, 64), torch.bfloat16, "cuda")
    assert torch.equal(pco.permute_copy(x, (2, 0, 3, 1, 4)), x.permute(2, 0, 3, 1, 4).contiguous())
    flat = rand((2 * 33 * 3 * 4 * 64 + 1,), torch.bfloat16, "cuda")
    odd = flat[1:].view(2, 33, 3, 4, 64)  # contiguous, 2 bytes past a 16-byte boundary
    assert torch.equal(pco.permute_copy(odd, (2, 0, 3, 1, 4)), odd.permute(2, 0, 3, 1, 4).contiguous())
    vws = [key for key in launched if "permute_copy" in key]
    assert vws == ["day016.permute_copy_kernel.bfloat16.8", "day016.permute_copy_kernel.bfloat16.1"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_grid_past_65535_rows():
    x = rand((3, 70001, 2, 8), torch.float32, "cuda")
    assert torch.equal(pco.permute_copy(x, (1, 0, 2, 3)), x.permute(1, 0, 2, 3).contiguous())
    y = rand((70001, 2, 3, 8), torch.float16, "cuda")
    assert torch.equal(pco.permute_copy(y, (2, 0, 1, 3)), y.permute(2, 0, 1, 3).contiguous())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_and_side_stream():
    x = rand((2, 16, 3, 4, 64), torch.bfloat16, "cuda")
    dims = (2, 0, 3, 1, 4)
    pco.permute_copy(x, dims)  # warm: loads the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = pco.permute_copy(x, dims)
    x.copy_(rand(x.shape, torch.bfloat16, "cuda", seed=3))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x.permute(dims).contiguous())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        z = pco.permute_copy(x, dims)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(z, x.permute(dims).contiguous())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiles_fullgraph_with_grads():
    x = rand((2, 8, 3, 2, 64), torch.float32, "cuda").requires_grad_()
    f = torch.compile(lambda t: pco.permute_copy(t, (2, 0, 3, 1, 4)).sum(0) * 2, fullgraph=True)
    y = f(x)
    (gx,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(y, x.permute(2, 0, 3, 1, 4).sum(0) * 2)
    assert torch.equal(gx, torch.full_like(x, 2.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_repeated_grad_mode_call_makes_a_cpp_node():
    """The third call of a key in grad mode is one C++ call whose node replays the
    backward's program (programs.py): the context holds only plain values (a tuple)."""
    x = rand((2, 6, 3, 2, 64), torch.bfloat16, "cuda").requires_grad_()
    dims = (2, 0, 3, 1, 4)
    for _ in range(3):
        y = pco.permute_copy(x, dims)
    assert "ReplayedBackward" in y.grad_fn.name(), y.grad_fn.name()
    g = rand(y.shape, torch.bfloat16, "cuda", seed=2)
    for _ in range(3):  # the backward's program is recorded, then replayed
        (gx,) = torch.autograd.grad(pco.permute_copy(x, dims), x, g)
        assert torch.equal(gx, g.permute(1, 3, 0, 2, 4))
