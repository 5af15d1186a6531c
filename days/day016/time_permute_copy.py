"""The GPT block's head split and merge, by torch's copy and by `pco.permute_copy`: kernel
time (CUPTI) and the bandwidth it reaches (bytes read + written), per block shape, bf16.

    PYTHONPATH=$PWD python days/day016/time_permute_copy.py

Each copy is checked bit for bit against torch's before it is timed.
"""

from __future__ import annotations

import torch

import pytorch_custom_ops as pco
from benchmark.gpu_script import need_cuda
from benchmark.timing import kernel_time_ms

SHAPES = ((8, 1024, 768), (32, 128, 1024), (4, 2048, 1024))
HEAD_DIM = 64


def copies(b: int, s: int, d: int):
    """(name, source view, dims) of the block's four copies: split and merge, and in
    backward the same two permutations the other way round."""
    h = d // HEAD_DIM
    qkv = torch.randn(b, s, 3, h, HEAD_DIM, device="cuda").bfloat16()
    o = torch.randn(b, h, s, HEAD_DIM, device="cuda").bfloat16()
    dqkv = torch.randn(3, b, h, s, HEAD_DIM, device="cuda").bfloat16()
    do = torch.randn(b, s, h, HEAD_DIM, device="cuda").bfloat16()
    return (
        ("split", qkv, (2, 0, 3, 1, 4)),
        ("merge", o, (0, 2, 1, 3)),
        ("split backward", dqkv, (1, 3, 0, 2, 4)),
        ("merge backward", do, (0, 2, 1, 3)),
    )


def main() -> None:
    print(f"{torch.cuda.get_device_name()}; bf16; kernel us (GB/s): torch copy | permute_copy")
    for b, s, d in SHAPES:
        total = [0.0, 0.0]
        for name, x, dims in copies(b, s, d):
            assert torch.equal(pco.permute_copy(x, dims), x.permute(dims).contiguous()), name
            moved = 2 * x.numel() * x.element_size()
            times = [
                kernel_time_ms(lambda x=x, dims=dims: x.permute(dims).contiguous(), 50),
                kernel_time_ms(lambda x=x, dims=dims: pco.permute_copy(x, dims), 50),
            ]
            cells = " | ".join(f"{1e3 * ms:7.1f} ({moved / ms / 1e6:5.0f})" for ms in times)
            print(f"{b}x{s}x{d} {name:15s}: {cells}", flush=True)
            total = [t + 1e3 * ms for t, ms in zip(total, times, strict=True)]
        print(f"{b}x{s}x{d} all four     : {total[0]:7.1f} | {total[1]:7.1f} us", flush=True)


if __name__ == "__main__":
    need_cuda(__doc__, __file__)
    main()
