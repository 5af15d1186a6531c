"""Day 019's ladder on a GPU: version 3 (day 014) against version 4, and cuBLAS, in bf16.

    PYTHONPATH=$PWD python days/day019/time_versions.py [--quick]
    PYTHONPATH=$PWD python days/day019/time_versions.py --tokens 16384 --versions AUTO COOP_256x128
    PYTHONPATH=$PWD python days/day019/time_versions.py --tokens 4096 --width 1024
    PYTHONPATH=$PWD python days/day019/time_versions.py --small --versions AUTO TMA_128x128
    PYTHONPATH=$PWD python days/day019/time_versions.py --one-round --versions AUTO PINGPONG_TMA_128x128
    PYTHONPATH=$PWD python days/day019/time_versions.py --in-turn 5 --versions AUTO TMA_128x256
    PYTHONPATH=$PWD python days/day019/time_versions.py --one-round --in-turn 1 --flushed
    PYTHONPATH=$PWD python days/day019/time_versions.py --cluster-split --in-turn 3 --versions AUTO SPLITK_256x128

The issue's squares and GPT-2 small's linear layers at 8192 tokens (forward, dX, dW);
`--tokens` times instead every linear layer of a GPT-2 124M step at that many tokens (the
four layers and the tied head, each forward, dX and dW) and prints what they add up to, or
with `--width` those of one day 016 block of that width (d -> 3d, d -> d, d -> 4d, 4d -> d);
`--small` times the problems of few output tiles that AUTO's FEW_TILES rule is about,
`--one-round` those of about one round of 128 x 128 tiles with a long K (weight gradients),
`--cluster-split` those of fewer tiles than SMs that split-K in a cluster is for (part 28);
`--in-turn R` the same shapes (the squares in the benchmark's three layouts; or the
`--tokens`, `--small` or `--one-round` ones), cuBLAS and every version timed in turn for
R rounds, each round in another order, and the median of the rounds: after the 8192^3
products the card runs at its power limit for a while, and whoever is timed first then
pays for it (part 24). (Part 26's `--all-stages-too` went with the rule it tested, in
part 29.) `--flushed` times each shape once in turn with the benchmark's timer (L2 flushed before
every call, CUDA events) instead of back-to-back kernel time. `--l2-promotion 256` has
the operand tensor maps widen each L2 request to 256 bytes (`gemm_gpu.l2_promotion`), and
`--l2-promotion-too 256` adds AUTO with it to each turn (part 27).
Each version is checked on sampled entries against float64, then timed by kernel time
(CUPTI), as day 014's script does. The stored rows come from
`python -m benchmark --day day019`; this is the quick look while a kernel changes.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import torch

from benchmark.gpu_script import need_cuda
from benchmark.timing import kernel_time_ms, time_cuda
from days.day014.time_versions import GPT2, SQUARES, checked_calls, print_row, time_shape
from pytorch_custom_ops import gemm_gpu

VERSIONS = (
    "TMA_128x128",
    "TMA_128x256",
    "PINGPONG_128x128",
    "PINGPONG_64x256",
    "MULTICAST_128x128",
    "COOP_128x256",
    "COOP_256x128",
    "COOP_TMA_256x128",
    "COOP_TMA_128x256",
    "COOP_MULTICAST_256x128",
    "COOP_256x192",
    "COOP_128x192",
    "PINGPONG_128x64",
    "PINGPONG_TMA_128x128",
    "PINGPONG_TMA_128x64",
    "PINGPONG_64x64",
    "PINGPONG_TMA_64x64",
    "TMA_192x128",
    "COOP_256x64",
    "STREAMK_256x128",
    "SPLITK_256x128",
    "CLUSTER_SPLITK_128x128",
    "AUTO",
)


@dataclass(frozen=True)
class Turns:
    """in_turn's options: `l2_promotion_too` (bytes) adds AUTO with the operand maps' L2
    promotion at that width (`AUTO_L2_256`); `flushed` times end to end from a flushed L2
    (the benchmark's time_cuda) instead of kernel time."""

    flushed: bool = False
    l2_promotion_too: int = 0

    def extra_autos(self) -> dict[str, object]:
        """AUTO's A/B twins: name -> a context manager factory to run AUTO inside."""
        extra = {}
        if self.l2_promotion_too:
            extra[f"AUTO_L2_{self.l2_promotion_too}"] = lambda: gemm_gpu.l2_promotion(self.l2_promotion_too)
        return extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing")
    parser.add_argument("--tokens", type=int, default=None, help="a 124M step's layers at this many tokens")
    parser.add_argument("--small", action="store_true", help="few output tiles (FEW_TILES)")
    parser.add_argument("--one-round", action="store_true", help="about one round of tiles, a long K")
    parser.add_argument("--cluster-split", action="store_true", help="few tiles: split-K in a cluster (part 28)")
    parser.add_argument("--in-turn", type=int, default=0, metavar="R", help="R rounds in turn, medians")
    parser.add_argument("--width", type=int, default=None, help="with --tokens: one day 016 block of this width")
    parser.add_argument("--versions", nargs="+", default=list(VERSIONS), choices=list(gemm_gpu.VERSIONS))
    parser.add_argument("--flushed", action="store_true", help="in turn: end to end from a flushed L2 (time_cuda)")
    parser.add_argument("--l2-promotion", type=int, default=0, help="the operand maps' L2 promotion, bytes")
    parser.add_argument("--l2-promotion-too", type=int, default=0, help="in turn: also AUTO with this promotion")
    args = parser.parse_args()
    need_cuda(None, __file__)
    with gemm_gpu.l2_promotion(args.l2_promotion):
        run(args)


def run(args) -> None:
    turns = Turns(args.flushed, args.l2_promotion_too)
    if args.tokens:
        layers = block_layers(args.width) if args.width else STEP_LAYERS
        step_layers(args.tokens, args.versions, layers, args.in_turn, turns)
        return
    if args.small or args.one_round or args.cluster_split:
        print(f"{torch.cuda.get_device_name()}; bf16; TFLOP/s (% of torch.matmul)")
        for m, n, k, ta, tb in SMALL if args.small else ONE_ROUND if args.one_round else CLUSTER_SPLIT:
            timed(m, n, k, ta, tb, args.versions, args.in_turn, quick=True, turns=turns)
        return
    gpt2 = [s for s in GPT2 if 8192 in s[:3]]
    shapes = SQUARES[1:2] + gpt2[:3] if args.quick else SQUARES[1:] + gpt2
    if args.in_turn:
        squares = [(s, s, s, ta, tb) for s, *_ in SQUARES[1:] for ta, tb in SQUARE_LAYOUTS]
        shapes = squares[:3] + gpt2[:3] if args.quick else squares + gpt2
    print(f"{torch.cuda.get_device_name()}; bf16; TFLOP/s (% of torch.matmul)")
    for m, n, k, ta, tb in shapes:
        timed(m, n, k, ta, tb, args.versions, args.in_turn, args.quick, turns)


SQUARE_LAYOUTS = ((False, True), (False, False), (True, False))  # the benchmark's forward, dX, dW


def timed(
    m: int, n: int, k: int, ta: bool, tb: bool, versions: list[str], rounds: int, quick: bool, turns=Turns()
) -> dict[str, float]:
    """One problem's row, printed and returned (ms): timed once (day 014's time_shape),
    or in turn for `rounds` rounds (`in_turn`, its medians)."""
    if rounds:
        return in_turn(m, n, k, ta, tb, rounds, versions, turns)
    times = time_shape(m, n, k, ta, tb, versions, quick)
    print_row(m, n, k, ta, tb, times)
    return times


def in_turn(
    m: int, n: int, k: int, ta: bool, tb: bool, rounds: int, versions: list[str], turns: Turns
) -> dict[str, float]:
    """Every version checked against float64 once (day 014's checked_calls), then cuBLAS
    and the versions timed once a round, round r starting at the r-th of them (no one
    always runs first or last); prints each round and the medians, and returns the
    medians (ms)."""
    calls = checked_calls(m, n, k, ta, tb, versions)
    for name, inside in turns.extra_autos().items() if "AUTO" in calls else ():

        def twin(auto=calls["AUTO"], inside=inside):
            with inside():
                return auto()

        calls[name] = twin
    names = list(calls)
    if turns.flushed:  # the benchmark's timer: L2 flushed before each call, CUDA events, interleaved
        medians = {name: t.median_ms for name, t in time_cuda(calls).items()}
        print("flushed L2, end to end:", end=" ")
        print_row(m, n, k, ta, tb, medians)
        return medians
    per_round = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        times = {name: kernel_time_ms(calls[name], 10) for name in order}
        per_round.append({name: times[name] for name in names})
        print(f"round {r + 1}:", end=" ")
        print_row(m, n, k, ta, tb, per_round[-1])
    medians = {name: statistics.median(t[name] for t in per_round) for name in names}
    print(f"median of {rounds}:", end=" ")
    print_row(m, n, k, ta, tb, medians)
    return medians


# (m, n, k, ta, tb) with few output tiles: small-output weight gradients, and the linear
# layers of day 016's blocks at 64 to 1024 tokens (forward, dX, dW)
SMALL = (
    (1024, 1024, 4096, True, False),
    (768, 768, 1024, True, False),
    (1024, 1024, 1024, True, False),
    (1024, 768, 768, False, True),
    (1024, 768, 768, False, False),
    (1024, 768, 3072, False, False),
    (1024, 768, 3072, False, True),
    (64, 2304, 768, False, True),
    (64, 768, 768, False, True),
    (64, 768, 3072, False, True),
    (64, 3072, 768, False, True),
    (768, 768, 64, True, False),
    (2304, 768, 64, True, False),
    (512, 768, 768, False, True),
    (1024, 1024, 4096, False, True),
)


# (m, n, k, ta, tb): about one round of 128 x 128 tiles (36 to 132) with a long K, where
# a block has one tile: GPT-2's weight gradients at 8192 and 16384 tokens and others
# (results/nvidia-h100-80gb-hbm3/day019_one_round_tiles.txt)
ONE_ROUND = (
    (3072, 768, 8192, True, False),  # GPT-2's fc dW: 96 tiles of 192 x 128
    (768, 3072, 8192, True, False),  # ... and fc2's
    (2304, 768, 8192, True, False),
    (2304, 768, 16384, True, False),
    (768, 2304, 8192, True, False),
    (768, 2304, 16384, True, False),
    (768, 768, 8192, True, False),
    (768, 768, 16384, True, False),
    (1536, 1024, 8192, True, False),
    (1280, 1280, 8192, True, False),
    (1280, 1280, 16384, True, False),
    (1536, 1024, 16384, True, False),
    (2048, 1024, 4096, True, False),
    (1024, 1536, 4096, False, True),
)


# (m, n, k, ta, tb): fewer 128 x 128 tiles than SMs (16 to 64), K from 1024 up: split-K in
# a cluster against split-K and the FEW_TILES tiles (part 28). GPT-2's attention
# projection dW at 8192 and 16384 tokens, day 016's d = 1024 block's, and smaller K.
CLUSTER_SPLIT = (
    *((768, 768, k, True, False) for k in (8192, 16384, 4096, 2048, 1024)),
    *((1024, 1024, k, True, False) for k in (8192, 4096, 2048, 1024)),
    (1024, 768, 2304, False, False),
    (1024, 768, 3072, False, False),
    (512, 512, 8192, True, False),
    (768, 1024, 16384, True, False),
    (1000, 1000, 1000, False, True),
)


# (d_in, d_out, calls per step): GPT-2 124M's linear layers, 12 blocks, and the tied head
STEP_LAYERS = ((768, 2304, 12), (768, 768, 12), (768, 3072, 12), (3072, 768, 12), (768, 50304, 1))


def block_layers(d: int) -> tuple[tuple[int, int, int], ...]:
    """The linear layers of one day 016 block of width d (benchmark/gpt_block.py)."""
    return ((d, 3 * d, 1), (d, d, 1), (d, 4 * d, 1), (4 * d, d, 1))


def step_layers(tokens: int, versions: list[str], layers=STEP_LAYERS, rounds: int = 0, turns=Turns()) -> None:
    """Every GEMM of `layers` at `tokens` tokens: per shape and pass the % of cuBLAS, and
    the total GEMM time per version (the versions' sum of calls); `rounds`: each shape
    timed in turn (`in_turn`), its medians counted."""
    print(f"{torch.cuda.get_device_name()}; bf16; {tokens} tokens; TFLOP/s (% of torch.matmul)")
    totals: dict[str, float] = {"best version per shape": 0.0}
    for d_in, d_out, calls in layers:
        passes = (
            (tokens, d_out, d_in, False, True),  # forward: x W^T
            (tokens, d_in, d_out, False, False),  # dX = dY W
            (d_out, d_in, tokens, True, False),  # dW = dY^T X
        )
        for m, n, k, ta, tb in passes:
            times = timed(m, n, k, ta, tb, versions, rounds, quick=True, turns=turns)
            for name, ms in times.items():
                totals[name] = totals.get(name, 0.0) + calls * ms
            totals["best version per shape"] += calls * min(ms for name, ms in times.items() if name != "cuBLAS")
    print("step total (ms): " + " | ".join(f"{name} {ms:.2f}" for name, ms in totals.items()))


if __name__ == "__main__":
    main()
