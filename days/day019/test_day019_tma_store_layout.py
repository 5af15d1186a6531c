"""Day 019, part 10: the index math of the TMA-store epilogue (tma_store.mojo), emulated in
numpy: no GPU needed. The kernel itself runs in the CUDA tests (test_day019_linear.py); this
checks, in CI, the part a wrong constant would break silently on the GPU:

* `write_box_pairs` puts each accumulator pair of a 64 x 64 piece where the TMA unit, reading
  the box with the 128-byte swizzle, expects that element;
* every byte of the box is written exactly once by the warpgroup;
* each warp's 4-byte shared store touches 32 different banks (no conflict).
"""

from __future__ import annotations

import numpy as np

BOX = 64  # STORE_BOX: 64 x 64 bf16, 128 bytes a row
LANES, WARPS = 32, 4


def accumulator_cell(warp: int, lane: int, j: int, e: int) -> tuple[int, int]:
    """(row, col) of accumulator element 4 j + e of a lane, in its warpgroup's 64-row block:
    the m64nN wgmma layout (day 014's wg_store_acc docstring)."""
    g, t = lane // 4, lane % 4
    return 16 * warp + g + 8 * (e // 2), 8 * j + 2 * t + e % 2


def box_pair_address(warp: int, lane: int, half: int, jc: int) -> int:
    """The shared-memory byte offset write_box_pairs stores pair (half, jc) of a lane at."""
    g, t = lane // 4, lane % 4
    return (warp * 16 + g) * 128 + t * 4 + half * 8 * 128 + (jc ^ g) * 16


def tma_swizzle_128b(row: int, col: int, itemsize: int = 2) -> int:
    """Where TMA's CU_TENSOR_MAP_SWIZZLE_128B puts box element (row, col) in shared memory,
    for a 1024-byte-aligned box with 128-byte rows: the 16-byte chunk index (address bits
    4-6) is XORed with the row within its group of 8 (bits 7-9)."""
    linear = row * 128 + col * itemsize
    return linear ^ (((linear >> 7) & 7) << 4)


def write_piece(acc: np.ndarray, h: int) -> tuple[np.ndarray, np.ndarray]:
    """The box as the warpgroup writes piece h (columns 64 h ...) of a 64 x BN accumulator
    block `acc` (float values standing in for the packed pairs), and how often each byte
    was written."""
    box = np.zeros(BOX * BOX)
    writes = np.zeros(BOX * BOX * 2, dtype=int)
    for warp in range(WARPS):
        for lane in range(LANES):
            for half in range(2):
                for jc in range(8):
                    j = 8 * h + jc
                    for e in (2 * half, 2 * half + 1):  # the pair: columns 2t and 2t + 1
                        row, col = accumulator_cell(warp, lane, j, e)
                        addr = box_pair_address(warp, lane, half, jc) + 2 * (e % 2)
                        box[addr // 2] = acc[row, col]
                        writes[addr : addr + 2] += 1
    return box, writes


def test_each_pair_lands_where_tma_reads_it():
    rng = np.random.default_rng(0)
    for bn in (64, 128, 256):
        acc = rng.standard_normal((BOX, bn))
        for h in range(bn // BOX):
            box, writes = write_piece(acc, h)
            assert (writes == 1).all()  # every byte of the box, once
            read = np.array([[box[tma_swizzle_128b(r, c) // 2] for c in range(BOX)] for r in range(BOX)])
            np.testing.assert_array_equal(read, acc[:, BOX * h : BOX * (h + 1)])


def test_every_warp_store_is_free_of_bank_conflicts():
    for warp in range(WARPS):
        for half in range(2):
            for jc in range(8):
                banks = {(box_pair_address(warp, lane, half, jc) // 4) % 32 for lane in range(LANES)}
                assert len(banks) == LANES, (warp, half, jc, sorted(banks))


def test_the_swizzle_model_is_a_permutation_within_each_1024_byte_group():
    """The emulated swizzle keeps each element inside its 8-row group and maps the box onto
    itself one to one: a sanity check of the model the first test relies on."""
    addrs = [tma_swizzle_128b(r, c) for r in range(BOX) for c in range(BOX)]
    assert sorted(addrs) == [2 * i for i in range(BOX * BOX)]
    assert all(tma_swizzle_128b(r, c) // 1024 == r // 8 for r in range(BOX) for c in range(0, BOX, 8))


def test_the_plan_hands_the_kernel_output_maps_of_that_layout():
    """The host side of the same contract: with TMA_STORE the launch carries tensor maps of
    the output (and, with GELU's saved input, of aux) as (N, M, batch) in 64 x 64 boxes,
    128-byte swizzled; without it those two slots repeat A's map, which the kernel ignores."""
    import torch

    from days.day014.test_day014_launch_plan import plan
    from pytorch_custom_ops import cuda_driver
    from pytorch_custom_ops.gemm_gpu import PP_TMA_STORE, gemm_version

    with gemm_version("COOP_TMA_256x128"):
        launch = plan(1000, 1032, 200, torch.bfloat16, batch=3)
    assert launch.kernel.params[PP_TMA_STORE] is True
    out_map, aux_map = launch.args[2:4]
    assert out_map.dims == (1032, 1000, 3) and out_map.byte_strides == (1032 * 2, 1000 * 1032 * 2)
    assert out_map.box == (BOX, BOX, 1) and out_map.swizzle == cuda_driver.CU_TENSOR_MAP_SWIZZLE_128B
    assert out_map.address == launch.args[4] and aux_map == out_map  # dst; no aux: the same map
    with gemm_version("COOP_256x128"):
        launch = plan(1000, 1032, 200, torch.bfloat16, batch=3)
    assert launch.kernel.params[PP_TMA_STORE] is False and launch.args[2] == launch.args[3] == launch.args[0]


def test_gelu_keeps_its_input_through_a_map_of_its_own():
    import torch

    import pytorch_custom_ops as pco
    from pytorch_custom_ops import direct
    from pytorch_custom_ops.linear import linear_gpu

    x, w, b = (torch.empty(*shape, dtype=torch.bfloat16) for shape in ((300, 136), (264, 136), (264,)))
    out, pre = torch.empty(300, 264, dtype=torch.bfloat16), torch.empty(300, 264, dtype=torch.bfloat16)
    params = {"BIAS": True, "GELU": True, "GELU_DERIVATIVE": False}
    with pco.gemm_version("COOP_TMA_128x256"), direct.planning():
        (launch,) = linear_gpu([out, pre], [x, w, b, out, torch.empty(2)], params)
    out_map, aux_map = launch.args[2:4]
    assert (out_map.address, aux_map.address) == (out.data_ptr(), pre.data_ptr())
    assert aux_map.dims == out_map.dims == (264, 300, 1) and aux_map.box == (BOX, BOX, 1)


def test_the_host_and_the_kernel_agree_on_the_boxes():
    """STORE_BOX and STORE_BOXES live in tma_store.mojo; the plan's copies (shared memory,
    the output maps' boxes) must say the same. (A wrong count also fails the kernel's
    SMEM check at build time; a wrong box size would only show on the GPU.)"""
    import re
    from pathlib import Path

    from pytorch_custom_ops import gemm_gpu

    source = (Path(__file__).parent / "tma_store.mojo").read_text()
    declared = {name: int(v) for name, v in re.findall(r"^comptime (STORE_BOX(?:ES)?) = (\d+)", source, re.M)}
    assert (
        declared
        == {"STORE_BOX": gemm_gpu.STORE_BOX, "STORE_BOXES": gemm_gpu.STORE_BOXES}
        == {
            "STORE_BOX": BOX,
            "STORE_BOXES": 2,
        }
    )
