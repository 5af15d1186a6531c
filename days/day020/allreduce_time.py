"""What averaging GPT-2 124M's gradients costs by itself: the all-reduce of the float32
gradient buffer that `--graph` captures, whole and in `step.BUCKET_BYTES` buckets.

    torchrun --nproc_per_node=2 -m days.day020.allreduce_time [--config gpt2] [--repeat 20]

Each rank times the same all-reduces with CUDA events around the whole sequence (median of
--repeat). Bus bandwidth is NCCL's convention for an all-reduce: bytes x 2(n-1)/n / time.
Rank 0 prints one line per way. NVLink SHARP stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

from .model import CONFIGS, GPT
from .step import BUCKET_BYTES, FlatGrads


def step_buckets(config: str, bucket_bytes: int | None) -> tuple[int, list[tuple[int, int]]]:
    """(elements of the flat gradient buffer, the (first, end) ranges it is all-reduced in):
    step.FlatGrads' own layout for the model's parameters, built on the meta device, so
    nothing is allocated. `bucket_bytes=None`: the whole buffer at once."""
    with torch.device("meta"):
        flat = FlatGrads(list(GPT(CONFIGS[config], "torch").parameters()), world=2, bucket_bytes=bucket_bytes)
    return flat.buffer.numel(), flat.buckets or [(0, flat.buffer.numel())]


def time_all_reduces(buffer: torch.Tensor, spans: list[tuple[int, int]], repeat: int) -> float:
    """Median milliseconds for all-reducing every span once, back to back."""
    times = []
    for _ in range(repeat + 3):  # the first calls set up NCCL's channels
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        for first, end in spans:
            dist.all_reduce(buffer[first:end], op=dist.ReduceOp.AVG)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times[3:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="gpt2", choices=sorted(CONFIGS))
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args(argv)
    if "WORLD_SIZE" not in os.environ or not torch.cuda.is_available():
        raise SystemExit(
            "run it under torchrun on CUDA GPUs, e.g. torchrun --nproc_per_node=2 -m days.day020.allreduce_time"
        )
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    numel, _ = step_buckets(args.config, None)
    buffer = torch.randn(numel, device=f"cuda:{local}")
    for name, bucket_bytes in (("whole buffer", None), (f"{BUCKET_BYTES >> 20} MB buckets", BUCKET_BYTES)):
        _, spans = step_buckets(args.config, bucket_bytes)
        ms = time_all_reduces(buffer, spans, args.repeat)
        if dist.get_rank() == 0:
            busbw = buffer.numel() * 4 * 2 * (world - 1) / world / (ms * 1e-3) / 1e9
            print(
                f"{args.config}: {buffer.numel() * 4 / 2**20:.0f} MiB of float32 gradients on {world} GPUs, "
                f"{name} ({len(spans)} all-reduces): {ms:.2f} ms, bus {busbw:.0f} GB/s",
                flush=True,
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
