"""Day 019's ladder on a GPU: version 3 (day 014) against version 4, and cuBLAS, in bf16.

    PYTHONPATH=$PWD python days/day019/time_versions.py [--quick]

The issue's squares and GPT-2 small's linear layers at 8192 tokens (forward, dX, dW);
each version is checked on sampled entries against float64, then timed by kernel time
(CUPTI), as day 014's script does. The stored rows come from
`python -m benchmark --day day019`; this is the quick look while a kernel changes.
"""

from __future__ import annotations

import argparse

import torch

from days.day014.time_versions import GPT2, SQUARES, print_row, time_shape

VERSIONS = (
    "TMA_128x128",
    "TMA_128x256",
    "PINGPONG_128x128",
    "PINGPONG_64x256",
    "MULTICAST_128x128",
    "COOP_128x256",
    "COOP_256x128",
    "COOP_MULTICAST_256x128",
    "COOP_256x192",
    "STREAMK_256x128",
    "SPLITK_256x128",
    "AUTO",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing")
    args = parser.parse_args()
    gpt2 = [s for s in GPT2 if 8192 in s[:3]]
    shapes = SQUARES[1:2] + gpt2[:3] if args.quick else SQUARES[1:] + gpt2
    print(f"{torch.cuda.get_device_name()}; bf16; TFLOP/s (% of torch.matmul)")
    for m, n, k, ta, tb in shapes:
        print_row(m, n, k, ta, tb, time_shape(m, n, k, ta, tb, VERSIONS, args.quick))


if __name__ == "__main__":
    main()
