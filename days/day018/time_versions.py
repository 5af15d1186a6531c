"""Day 018's forward on a GPU: the Mojo kernel against day 017's Triton kernel and SDPA's
flash and cuDNN backends, bf16, TFLOP/s by kernel time (CUPTI, benchmark.timing).

    PYTHONPATH=$PWD python days/day018/time_versions.py [--quick]

Shapes as in the benchmark (batch x seq = 16384, heads x head_dim = 2048). Each impl is
first checked against SDPA's math in float32 on one (batch, head) slice. `mojo_v1`,
`mojo_v2`, ... are the ladder's rungs (pytorch_custom_ops.attention_gpu.attention_version). The
stored rows come from `python -m benchmark --day day018`; this is the quick look while a
kernel changes.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import pytorch_custom_ops as pco
from benchmark.cases.day017 import IMPLS_FOR_TIMING, MODEL_DIM, flops, shapes_for
from benchmark.gpu_script import need_cuda
from benchmark.timing import kernel_time_ms, kernel_times_us
from pytorch_custom_ops.attention_gpu import (
    BWD_CHOICES,
    DEFAULT_BWD_VERSION,
    DEFAULT_FWD_TILE,
    DEFAULT_VERSION,
    TILE_NAMES,
    VERSIONS,
    attention_bwd_version,
    attention_fwd_tile,
    attention_version,
)
from pytorch_custom_ops.gemm_gpu import l2_promotion


def _mojo(version, tile=DEFAULT_FWD_TILE):
    def run(q, k, v, causal):
        with attention_version(version), attention_fwd_tile(tile):
            return pco.attention(q, k, v, causal=causal)

    return run


IMPLS = {f"mojo_v{v}": _mojo(v) for v in VERSIONS} | IMPLS_FOR_TIMING


def tile_impls(tiles: list[str], versions: list[int], control: bool = False) -> dict:
    """A column per forward version and K/V tile (`mojo_v3_192_split`), then the rivals.
    control: the first column once more at the end (`..._again`): the very same kernel,
    so the two columns differ by the measurement's noise alone."""
    impls = {f"mojo_v{v}_{t}": _mojo(v, t) for t in tiles for v in versions}
    if control:
        impls[f"mojo_v{versions[0]}_{tiles[0]}_again"] = _mojo(versions[0], tiles[0])
    return impls | IMPLS_FOR_TIMING


def timed_in_turns(steps: dict, rounds: int) -> dict[str, list[float]]:
    """Kernel time (ms) of each step, `rounds` times, the steps taking turns within a
    round, so that a drift of the clocks over the run reaches every column alike."""
    out: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            out[name].append(kernel_time_ms(step, reps=20 if rounds == 1 else 10))
    return out


def shapes(d: int, lengths) -> list[tuple[int, int, int, int]]:
    """The benchmark's shapes, or with --lengths batch 16 at each length (to see what a
    length that leaves a block part-full costs)."""
    return [(16, MODEL_DIM // d, n, d) for n in lengths] if lengths else shapes_for(d)


def wanted(seq: int, quick: bool, seqs) -> bool:
    """Whether to time this length: --quick keeps 1024 and 8192, --seqs the ones named."""
    return not (quick and seq not in (1024, 8192) or seqs and seq not in seqs)


def causal_flags(masks) -> list[bool]:
    """--masks as the `causal` flags to time, in the table's order."""
    return [m == "causal" for m in ("none", "causal") if m in masks]


def check(fn, q, k, v, causal) -> float:
    out = fn(q, k, v, causal)[:1, :1].float()
    ref = F.scaled_dot_product_attention(q[:1, :1].float(), k[:1, :1].float(), v[:1, :1].float(), is_causal=causal)
    return (out - ref).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="seq 1024 and 8192 only")
    parser.add_argument("--backward", action="store_true", help="forward + backward (3.5x the forward's FLOPs)")
    parser.add_argument(
        "--bwd-versions",
        type=lambda v: v if v == "auto" else int(v),
        nargs="+",
        choices=BWD_CHOICES,
        default=[DEFAULT_BWD_VERSION],
        help="with --backward: the Mojo backward's versions, each its own column (`mojo_b<N>`)",
    )
    parser.add_argument(
        "--kernels", action="store_true", help="with --backward: each column's kernels and their times, every shape"
    )
    parser.add_argument(
        "--fwd-tiles",
        nargs="+",
        choices=list(TILE_NAMES),
        default=None,
        help="forward only: each version on each K/V tile (auto or attention_gpu.FWD_TILES), a column each",
    )
    parser.add_argument("--versions", type=int, nargs="+", choices=VERSIONS, default=list(VERSIONS))
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every column this many times, taking turns; print the median and the range",
    )
    parser.add_argument("--control", action="store_true", help="with --fwd-tiles: the first column again, last")
    parser.add_argument("--head-dims", type=int, nargs="+", choices=(128, 64), default=[128, 64])
    parser.add_argument("--seqs", type=int, nargs="+", default=None, help="only these sequence lengths")
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=None, help="batch 16 at these lengths, not the benchmark's shapes"
    )
    parser.add_argument(
        "--masks", nargs="+", choices=("none", "causal"), default=["none", "causal"], help="only these masks"
    )
    parser.add_argument("--l2-promotion", type=int, default=0, help="the operand maps' L2 promotion, bytes")
    args = parser.parse_args()
    need_cuda(None, __file__)
    with l2_promotion(args.l2_promotion):  # gemm_gpu's A/B switch (day 019, part 26)
        time_all(args)


def time_all(args) -> None:
    if args.backward:
        return time_backward(
            args.quick,
            args.bwd_versions,
            args.kernels,
            args.rounds,
            args.head_dims,
            args.seqs,
            args.masks,
            args.lengths,
        )
    impls = tile_impls(args.fwd_tiles, args.versions, args.control) if args.fwd_tiles else IMPLS
    what = "(max |err| vs fp32)" if args.rounds == 1 else f"median of {args.rounds} interleaved rounds [min-max]"
    print(f"{torch.cuda.get_device_name()}; bf16 forward; TFLOP/s by kernel time {what}")
    print(f"{'d':>4} {'causal':>6} {'seq':>6} " + " ".join(f"{n:>18}" for n in impls))
    for d in args.head_dims:
        for causal in causal_flags(args.masks):
            for shape in shapes(d, args.lengths):
                if not wanted(shape[2], args.quick, args.seqs):
                    continue
                q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                errs = {name: check(fn, q, k, v, causal) for name, fn in impls.items()}
                steps = {n: (lambda fn=fn, q=q, k=k, v=v, c=causal: fn(q, k, v, c)) for n, fn in impls.items()}
                work = flops(shape, causal, False)
                times = timed_in_turns(steps, args.rounds)
                rates = {name: [work / ms / 1e9 for ms in t] for name, t in times.items()}
                if args.rounds == 1:
                    cells = [f"{rates[n][0]:8.1f} ({errs[n]:.0e})" for n in impls]
                else:
                    cells = [f"{statistics.median(r):6.1f} [{min(r):.0f}-{max(r):.0f}]" for r in rates.values()]
                    cells.append(f"max |err| {max(errs.values()):.0e}")
                print(f"{d:>4} {causal!s:>6} {shape[2]:>6} " + " ".join(f"{c:>18}" for c in cells))


def print_kernels(name: str, step) -> None:
    """One line per kernel `step` launches, longest first: device µs per call and the
    kernel's name, cut to its head and tail (Mojo's names carry every parameter)."""
    times = sorted(kernel_times_us(step).items(), key=lambda kv: -kv[1])
    print(f"     {name}: {sum(t for _, t in times):8.1f} us in all")
    for kernel, t in times[:6]:
        short = kernel if len(kernel) <= 60 else f"{kernel[:36]}..{kernel[-22:]}"
        print(f"        {t:8.1f} us  {short}")


def time_backward(
    quick: bool,
    versions: list[int],
    kernels: bool,
    rounds: int = 1,
    head_dims=(128, 64),
    seqs=None,
    masks=("none", "causal"),
    lengths=None,
) -> None:
    """Forward + backward; the Mojo columns share the default forward, one column per
    backward version (the version is read when the backward runs, so the context covers
    the autograd call). rounds > 1: every column timed that many times in turns, the
    median printed."""
    mojo = _mojo(DEFAULT_VERSION)
    impls = {f"mojo_b{v}": (mojo, v) for v in versions} | {n: (fn, None) for n, fn in IMPLS_FOR_TIMING.items()}
    print(f"{torch.cuda.get_device_name()}; bf16 forward + backward; TFLOP/s by kernel time (max |dq err| vs fp32)")
    print(f"{'d':>4} {'causal':>6} {'seq':>6} " + " ".join(f"{n:>18}" for n in impls))
    for d in head_dims:
        for causal in causal_flags(masks):
            for shape in shapes(d, lengths):
                if not wanted(shape[2], quick, seqs):
                    continue
                q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                ref = F.scaled_dot_product_attention(
                    q[:1, :1].float(), k[:1, :1].float(), v[:1, :1].float(), is_causal=causal
                )
                (want,) = torch.autograd.grad(ref, q, do[:1, :1].float())
                errs, steps = {}, {}
                for name, (fn, version) in impls.items():

                    def step(fn=fn, version=version, q=q, k=k, v=v, do=do, c=causal):
                        if version is None:
                            return torch.autograd.grad(fn(q, k, v, c), (q, k, v), do)
                        with attention_bwd_version(version):
                            return torch.autograd.grad(fn(q, k, v, c), (q, k, v), do)

                    errs[name] = (step()[0][:1, :1].float() - want[0, 0]).abs().max().item()
                    steps[name] = step
                times = timed_in_turns(steps, rounds)
                work = flops(shape, causal, True)
                cells = [f"{work / statistics.median(t) / 1e9:8.1f} ({errs[n]:.0e})" for n, t in times.items()]
                print(f"{d:>4} {causal!s:>6} {shape[2]:>6} " + " ".join(f"{c:>18}" for c in cells))
                if kernels:
                    for name, step in steps.items():
                        print_kernels(name, step)


if __name__ == "__main__":
    main()
