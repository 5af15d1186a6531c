"""Train day 020's GPT on the standard library's source, with gpu-days kernels or torch.

    python -m days.day020.train --config small --impl gpu_days --steps 2000 --out build/day020/small
    python -m days.day020.train --out build/day020/small --resume     # continue from the checkpoint

Each run writes into --out: `loss.csv` (step, train loss, validation loss when evaluated,
tokens/s), `checkpoint.pt` (model, optimizer, step: written to a temporary file and renamed,
so a crash never leaves half a checkpoint) and `sample.txt` (text generated at the end).
Batches are a pure function of (seed, step) and nothing else draws random numbers, so a
resumed run computes the same losses as one that never stopped.

Several GPUs (DistributedDataParallel; NCCL on CUDA, gloo on the CPU):

    torchrun --nproc_per_node=2 -m days.day020.train --config small --out build/day020/small-ddp

--batch stays the global batch: each of the W ranks takes its own batch/W rows of the same
(seed, step) batch, DDP averages the gradients, so the run computes the one-process run's
losses (up to the order of float additions). Rank 0 alone writes files and shows progress.

On CUDA, --graph captures the whole step once (forward, backward, the gradient all-reduces
and AdamW) and replays it: no host work per kernel. Its ranks average a flat gradient
buffer, in buckets all-reduced while backward runs (--grad-sync buckets, the default with
--graph) or in one all-reduce after backward (--grad-sync flat; see step.py). Eager runs
can use either as well.
"""

from __future__ import annotations

import argparse
import csv
import gc
import io
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmark.store import write_atomically

from . import data as D
from .model import CONFIGS, GPT, IMPLS
from .step import GRAD_SYNCS, Stepper


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of `lr`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(t, 1.0))))


def save_atomic(obj, path: Path) -> None:
    """torch.save through a temporary file and a rename: never half a checkpoint."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_atomically(path, buffer.getvalue())


class Ranks:
    """This process's place in a torchrun job (rank 0 of 1 without torchrun)."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local = int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def start(self, device: str) -> str:
        """Join the job (when there is one); the device this rank computes on."""
        if self.world == 1:
            return device
        if torch.device(device).type == "cuda":
            if torch.cuda.device_count() < self.world:
                raise RuntimeError(f"{self.world} ranks but {torch.cuda.device_count()} GPUs: one GPU per rank")
            torch.cuda.set_device(self.local)
            device = f"cuda:{self.local}"
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        return device

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch."""
        if x.shape[0] % self.world:
            raise ValueError(f"--batch {x.shape[0]} is not a multiple of the {self.world} ranks")
        rows = x.shape[0] // self.world
        return x[self.rank * rows : (self.rank + 1) * rows]

    def mean(self, value: torch.Tensor) -> float:
        """The mean of a scalar over the ranks (each rank's loss is a mean over equal rows)."""
        if self.world > 1:
            value = value.detach().float().clone()
            dist.all_reduce(value)
            value /= self.world
        return value.item()

    def stop(self) -> None:
        """Leave the job: the ranks wait for each other (none closes its connections while
        another still reads), and the process group goes while Python is fully alive."""
        if self.world > 1 and dist.is_initialized():
            gc.collect()  # DDP's reducer sits in reference cycles: free it (and its hooks) now
            dist.barrier()
            dist.destroy_process_group()


@torch.no_grad()
def evaluate(model: GPT, batches: D.Batches, n: int, device, amp, ranks: Ranks) -> float:
    model.eval()
    with amp:
        losses = [ranks.mean(model(*map(ranks.shard, batches.get(i, device)))[1]) for i in range(n)]
    model.train()
    return sum(losses) / len(losses)


def make_optimizer(model: GPT, lr: float, weight_decay: float, device, capturable: bool = False) -> torch.optim.AdamW:
    """AdamW; matrices decay, biases, norms and embeddings' position table do not.
    `capturable`: its step may be captured by a CUDA graph (state and lr on the device)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("wpe")]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and not n.startswith("wpe"))]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    fused = torch.device(device).type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused, capturable=capturable)


def train(args) -> list[dict]:
    """Run (or resume) training; return the rows written to loss.csv by this call."""
    ranks = Ranks()
    try:
        return _train(args, ranks)
    finally:
        ranks.stop()


def _train(args, ranks: Ranks) -> list[dict]:
    out = Path(args.out)
    ckpt_path = out / "checkpoint.pt"
    device = ranks.start(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    state = None
    if args.resume:
        if not ckpt_path.exists():
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        _resume_args(args, state["args"])
    config = CONFIGS[args.config]
    dtype = getattr(torch, args.dtype)
    if args.seq is None:  # tiny's block is 32 tokens, small's 256
        args.seq = min(256, config.block_size)
    if args.seq > config.block_size:
        raise ValueError(f"--seq {args.seq} is longer than the config's block_size {config.block_size}")
    data_dir = Path(args.data)
    if ranks.main and not (data_dir / "train.bin").exists():
        D.build(data_dir, max_bytes=args.max_data_bytes)
    if ranks.world > 1:
        dist.barrier()  # the data exists before any other rank reads it
    train_batches = D.Batches(D.load(data_dir, "train"), args.batch, args.seq, args.seed)
    val_batches = D.Batches(D.load(data_dir, "val"), args.batch, args.seq, args.seed + 1)

    if args.graph and torch.device(device).type != "cuda":
        raise ValueError(f"--graph captures the step with torch.cuda.graph: it needs a CUDA device, not {device}")
    if args.profile_steps < 0:
        raise ValueError(f"--profile-steps must be 0 (no profile) or more, got {args.profile_steps}")
    if args.profile_steps and torch.device(device).type != "cuda":
        raise ValueError(f"--profile-steps reads the CUDA kernels' times: it needs a CUDA device, not {device}")
    grad_sync = args.grad_sync or ("buckets" if args.graph else "ddp")
    # float32 parameters and optimizer; --dtype bfloat16 computes under torch.autocast
    # (mixed precision: gpu-days' ops follow torch's policy, see pytorch_custom_ops.eager).
    # Autocast's weight cache cannot outlive a graph capture: off with --graph.
    model = GPT(config, args.impl).init_weights(args.seed).to(device=device)
    amp = torch.autocast(
        torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32, cache_enabled=not args.graph
    )
    opt = make_optimizer(model, args.lr, args.weight_decay, device, capturable=args.graph)
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    # the gradients are averaged over the ranks (DDP, or a flat buffer's all-reduces: see
    # step.py); `model` stays the plain module (checkpoints, evaluation, sampling)
    if args.batch % ranks.world:
        raise ValueError(f"--batch {args.batch} is not a multiple of the {ranks.world} ranks")
    stepper = Stepper(
        model, opt, amp, ranks.world, grad_sync, graph=args.graph, batch_shape=(args.batch // ranks.world, args.seq)
    )
    rows = []
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "loss.csv"
    fields = ["step", "train_loss", "val_loss", "tokens_per_s", "impl"]
    if ranks.main and (start == 0 or not log_path.exists()):
        with open(log_path, "w", newline="") as f:
            csv.DictWriter(f, fields).writeheader()
    elif ranks.main:  # resumed: rows a stopped run logged after its last checkpoint come again
        with open(log_path, newline="") as f:
            kept = [row for row in csv.DictReader(f) if int(row["step"]) <= start]
        with open(log_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fields)
            writer.writeheader()
            writer.writerows(kept)
    progress = _progress(args.steps, start, args.quiet or not ranks.main)
    tokens_per_step = args.batch * args.seq
    t_last, last_step = time.perf_counter(), start
    stop = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    for step in range(start, stop):
        x, y = map(ranks.shard, train_batches.get(step, device))
        loss = stepper(x, y, lr_at(step, args.steps, args.lr, args.warmup))
        done = step + 1
        evaluated = done % args.eval_every == 0 or done == args.steps
        if done % args.log_every == 0 or evaluated:  # a row at every log and every evaluation
            loss_value = ranks.mean(loss)  # synchronises: the time below is the steps' real time
            now = time.perf_counter()
            row = {
                "step": done,
                "train_loss": loss_value,
                "val_loss": evaluate(model, val_batches, args.eval_batches, device, amp, ranks) if evaluated else "",
                "tokens_per_s": tokens_per_step * (done - last_step) / (now - t_last),
                "impl": args.impl,
            }
            rows.append(row)
            if ranks.main:
                with open(log_path, "a", newline="") as f:
                    csv.DictWriter(f, fields).writerow(row)
            progress(done, row)
            t_last, last_step = time.perf_counter(), done
        if ranks.main and (done % args.checkpoint_every == 0 or done == stop):
            save_atomic(
                {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": done, "args": _saved_args(args)},
                ckpt_path,
            )
    if ranks.main and args.sample_tokens and stop == args.steps:
        prompt = torch.tensor([list(b"def ")], device=device)
        with amp:
            sample = model.generate(prompt, args.sample_tokens, seed=args.seed)
        text = bytes(sample[0].tolist()).decode(errors="replace")
        (out / "sample.txt").write_text(text)
    if args.profile_steps:  # after the run: its losses, checkpoint and sample are already written
        x, y = map(ranks.shard, train_batches.get(stop, device))
        lr = lr_at(stop - 1, args.steps, args.lr, args.warmup)
        profile_steps(lambda: stepper(x, y, lr), args.profile_steps, out / f"profile-rank{ranks.rank}.csv")
    return rows


PROFILE_FIELDS = ["kernel", "calls_per_step", "us_per_step"]


def profile_steps(step, n: int, path: Path) -> None:
    """Time `n` more steps on the host clock (the step's wall time), then profile `n` more:
    one CSV row per kernel with its device time per step, and a "(wall)" row first. Each
    rank writes its own file: comparing a rank of a two-GPU run with a one-GPU run shows
    where a step's time went (NCCL's kernels are among the rows)."""
    from benchmark.timing import kernel_times_us

    step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    rows = [{"kernel": "(wall)", "calls_per_step": 1, "us_per_step": (time.perf_counter() - t) / n * 1e6}]
    calls: dict[str, int] = {}
    kernels = kernel_times_us(step, reps=n, counts=calls)
    rows += [
        {"kernel": name, "calls_per_step": calls[name] / n, "us_per_step": us}
        for name, us in sorted(kernels.items(), key=lambda item: -item[1])
    ]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, PROFILE_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


# what a checkpoint fixes (the run's math) and what it only remembers (the periods)
RUN_ARGS = ("config", "impl", "seed", "batch", "seq", "steps", "lr", "warmup", "weight_decay", "dtype")
PERIOD_ARGS = ("log_every", "eval_every", "eval_batches", "checkpoint_every", "sample_tokens")


def _saved_args(args) -> dict:
    return {k: getattr(args, k) for k in RUN_ARGS + PERIOD_ARGS}


def _resume_args(args, saved: dict) -> None:
    """A resumed run continues the saved one: its settings come from the checkpoint. A
    setting given on the command line that differs from it is refused (a new --steps
    would change the learning-rate schedule, a new --batch the data order); the periods
    follow the checkpoint unless given."""
    defaults = vars(parse_args(["--out", "-"]))
    for key in RUN_ARGS:
        given, kept = getattr(args, key), saved[key]
        if given != defaults[key] and given != kept:
            flag = "--" + key.replace("_", "-")
            raise ValueError(
                f"--resume continues the checkpoint's run: {flag} {given} differs from its {kept} "
                "(use a new --out for a new run)"
            )
        setattr(args, key, kept)
    for key in PERIOD_ARGS:  # checkpoints written before these were saved keep the flags
        if getattr(args, key) == defaults[key] and key in saved:
            setattr(args, key, saved[key])


def _progress(total: int, start: int, quiet: bool):
    """A function(step, row) that shows progress: a rich bar, or nothing when quiet."""
    if quiet:
        return lambda step, row: None
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeRemainingColumn()
    )
    task = bar.add_task("train", total=total, completed=start, info="")
    bar.start()

    def show(step, row):
        val = f" val {row['val_loss']:.3f}" if row["val_loss"] != "" else ""
        bar.update(task, completed=step, info=f"loss {row['train_loss']:.3f}{val} {row['tokens_per_s']:,.0f} tok/s")
        if step == total:
            bar.stop()

    return show


def positive(text: str) -> int:
    """argparse's type for counts and periods (a period of 0 divided by zero mid-run)."""
    n = int(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n


def positive_float(text: str) -> float:
    x = float(text)
    if not (0 < x < math.inf):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return x


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default="small")
    p.add_argument("--impl", choices=IMPLS, default="gpu_days")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data", type=Path, default=Path("build/day020/data"))
    p.add_argument("--max-data-bytes", type=int, default=None, help="cap the corpus when building it")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stop-after", type=positive, default=None, help="stop (with a checkpoint) after this step")
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="CUDA: after the run, time and profile this many more steps; per-rank kernel times "
        "go to --out/profile-rank<r>.csv",
    )
    p.add_argument("--steps", type=positive, default=2000)
    p.add_argument("--batch", type=positive, default=64)
    p.add_argument(
        "--seq", type=positive, default=None, help="tokens a row (default: the config's block_size, at most 256)"
    )
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default=None)
    p.add_argument("--graph", action="store_true", help="CUDA: capture the step once, replay it every step")
    p.add_argument(
        "--grad-sync",
        choices=list(GRAD_SYNCS),
        default=None,
        help="several ranks: DDP (eager's default), a flat gradient buffer all-reduced in buckets while "
        "backward runs (--graph's default), or the same buffer in one all-reduce after backward",
    )
    p.add_argument("--log-every", type=positive, default=10)
    p.add_argument("--eval-every", type=positive, default=200)
    p.add_argument("--eval-batches", type=positive, default=10)
    p.add_argument("--checkpoint-every", type=positive, default=500)
    p.add_argument("--sample-tokens", type=int, default=200)
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device is not None:  # a bad device is the user's error, not a traceback deep in torch
        try:
            kind = torch.device(args.device).type
        except RuntimeError as exc:
            print(f"train: error: --device {args.device}: {exc}", file=sys.stderr)
            return 2
        if kind == "cuda" and not torch.cuda.is_available():
            print(f"train: error: --device {args.device}: this torch has no CUDA device", file=sys.stderr)
            return 2
    try:
        rows = train(args)
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError) as exc:  # the arguments' errors
        print(f"train: error: {exc}", file=sys.stderr)
        return 2
    if rows and Ranks().main:
        last = rows[-1]
        print(f"step {last['step']}: train loss {last['train_loss']:.4f}, val loss {last['val_loss']}")
    return 0


if __name__ == "__main__":
    code = main()
    if Ranks().world > 1:
        # A torchrun rank whose process group is gone (Ranks.stop) skips the interpreter's
        # teardown: there gloo's threads can still free a tensor and need the GIL, which
        # aborts the process ("terminate called without an active exception": once in CI,
        # once in ~70 runs on a loaded 2-core machine). Every file is closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
