"""Day 020, part 8: SMs left free for NCCL. `direct.reserve_sms(n)` makes the persistent
kernels' plans (day 019's GEMMs, day 013's LayerNorm backward) take n SMs fewer; checked on
the CPU, where the plans run on CPU tensors with the H100's 132 SMs standing in."""

import importlib

import pytest
import torch

from pytorch_custom_ops import direct, gemm_gpu, mojo_op

LN = importlib.import_module("pytorch_custom_ops.layer_norm")  # the module (pco.layer_norm is the function)

BF16 = torch.bfloat16


def gemm_grid(m: int, n: int, k: int) -> int:
    a, b = torch.empty(m, k, dtype=BF16), torch.empty(k, n, dtype=BF16)
    out, c = torch.empty(m, n, dtype=BF16), torch.empty(1, 1, dtype=BF16)
    launches = gemm_gpu.gemm_gpu([out], [a, b, c, torch.empty(2)], {"TRANSPOSE_A": False, "TRANSPOSE_B": False})
    assert launches[0].kernel.family is gemm_gpu.PINGPONG_KERNEL  # persistent
    return direct.dim3(launches[0].grid)[0]


def ln_backward_grid(rows: int, cols: int) -> int:
    x = torch.empty(rows, cols)
    w, stat = torch.empty(cols), torch.empty(rows)
    launches = LN.backward_launches(torch.empty_like(x), torch.empty_like(w), torch.empty_like(w), x, x, w, stat, stat)
    return launches[0].grid


def test_persistent_grids_leave_the_reserved_sms():
    """GPT-2's MLP product (16384 x 3072 x 768: 384 tiles of 256 x 128, more than one wave)
    and its LayerNorm backward fill every SM, or every SM but the reserved ones."""
    sms = gemm_gpu.device_sms(None)
    assert gemm_grid(16384, 3072, 768) == sms
    full_ln = ln_backward_grid(16384, 768)
    with direct.reserve_sms(8):
        assert direct.reserved_sms() == 8
        assert gemm_gpu.sm_count(None) == sms - 8
        assert gemm_grid(16384, 3072, 768) == sms - 8
        assert ln_backward_grid(16384, 768) < full_ln
    assert direct.reserved_sms() == 0
    assert gemm_grid(16384, 3072, 768) == sms and ln_backward_grid(16384, 768) == full_ln


def test_reservations_nest_and_undo_on_errors():
    with direct.reserve_sms(4):
        with pytest.raises(RuntimeError, match="inside"):
            with direct.reserve_sms(16):
                assert direct.reserved_sms() == 16
                raise RuntimeError("inside")
        assert direct.reserved_sms() == 4
    assert direct.reserved_sms() == 0
    with direct.reserve_sms(10**6):  # more than the device has: a grid still has one block
        assert direct.usable_sms(132) == 1
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="reserve_sms"):
            with direct.reserve_sms(bad):
                pass


def test_recipes_are_keyed_by_the_reservation():
    """A call replayed from a recipe must not launch a grid planned under another reservation."""
    x = torch.empty(4, 8)
    key = mojo_op._call_key([x], [], {})
    with direct.reserve_sms(8):
        assert mojo_op._call_key([x], [], {}) != key
    assert mojo_op._call_key([x], [], {}) == key
