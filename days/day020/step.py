"""One optimizer step of day 020's GPT, three ways: eager, eager with one flat gradient
all-reduce, and captured once by a CUDA graph and replayed.

    grad_sync="ddp"  : DistributedDataParallel (buckets all-reduced while backward runs)
    grad_sync="flat" : every .grad is a view into one float32 buffer; after backward, one
                       all-reduce of that buffer, divided by the ranks (one rank: plain
                       gradients, which backward hands over without adding into zeros)
    graph=True       : the whole step (forward, backward, the flat all-reduce, AdamW) is
                       one CUDA graph; a step copies the batch and the learning rate into
                       the graph's input tensors and replays it

Why a flat buffer for the graph: DDP's reducer registers hooks and rebuilds its buckets
after the first iteration, so capturing it needs its own warm-up rules; one all-reduce
of one buffer is a single NCCL kernel in the graph, with nothing to rebuild. It does not
overlap backward, which costs ~1.5 ms a step for GPT-2 124M on two H200s (500 MB of float32
gradients over NVLink), against ~40 ms of compute per rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

GRAPH_WARMUP = 3  # eager steps on a side stream before capture: kernels loaded, caches filled


class FlatGrads:
    """Each parameter's .grad as a view into one buffer, so that one all-reduce averages
    them all. Backward adds into the views in place (a defined .grad is accumulated into),
    so the optimizer's zero_grad must keep them (set_to_none=False)."""

    def __init__(self, params: list[torch.Tensor]):
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"FlatGrads: parameters of one dtype and device only, got {sorted(map(str, kinds))}")
        dtype, device = kinds.pop()
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        offset = 0
        for p in params:
            p.grad = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def average(self, world: int) -> None:
        """The mean of every rank's gradients, in place on every rank."""
        if world > 1:
            dist.all_reduce(self.buffer)
            self.buffer.div_(world)


class Stepper:
    """`stepper(x, y, lr) -> loss` trains `model` one step on this rank's (x, y)."""

    def __init__(
        self,
        model,
        opt: torch.optim.Optimizer,
        amp,
        world: int,
        grad_sync: str,
        graph: bool = False,
        batch_shape: tuple[int, int] | None = None,
    ):
        """`batch_shape`: (rows, seq) of this rank's batches; a captured step needs it."""
        if grad_sync not in ("ddp", "flat"):
            raise ValueError(f"grad_sync must be 'ddp' or 'flat', got {grad_sync!r}")
        if graph and world > 1 and grad_sync != "flat":
            raise ValueError("a captured step averages gradients with one flat all-reduce: use grad_sync='flat'")
        if graph and not all(p.is_cuda for p in model.parameters()):
            raise ValueError("--graph captures the step with torch.cuda.graph: it needs the model on a CUDA device")
        if graph and batch_shape is None:
            raise ValueError("a captured step needs the shape of its batches (batch_shape)")
        self.model, self.opt, self.amp, self.world = model, opt, amp, world
        self.flat = FlatGrads(list(model.parameters())) if grad_sync == "flat" and world > 1 else None
        if world > 1:
            for p in model.parameters():  # every rank starts from rank 0's parameters, as DDP does
                dist.broadcast(p.data, src=0)
        self.forward = DistributedDataParallel(model) if grad_sync == "ddp" and world > 1 else model
        self.graph = None
        if graph:
            self._capture(batch_shape)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> torch.Tensor:
        if self.graph is None:
            for group in self.opt.param_groups:
                group["lr"] = lr
            return self._step(x, y)
        self.x.copy_(x)
        self.y.copy_(y)
        for group in self.opt.param_groups:
            group["lr"].fill_(lr)  # the tensor the graph reads
        self.graph.replay()
        return self.loss

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.flat is None:
            self.opt.zero_grad(set_to_none=True)
        else:
            self.flat.buffer.zero_()  # one kernel; the views stay the parameters' .grad
        with self.amp:
            _, loss = self.forward(x, y)
        loss.backward()
        if self.flat is not None:
            self.flat.average(self.world)
        self.opt.step()
        return loss

    # --8<-- [start:capture]
    def _capture(self, batch_shape: tuple[int, int]) -> None:
        """Capture one step. The warm-up steps before it really train, so the parameters and
        the optimizer's state are put back afterwards: the first replay is the run's first
        step (or, after --resume, its next one)."""
        restore = training_snapshot(list(self.model.parameters()), self.opt)
        device = next(self.model.parameters()).device
        for group in self.opt.param_groups:  # the graph reads lr from a tensor that each step fills
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        self.x = torch.zeros(batch_shape, dtype=torch.long, device=device)
        self.y = torch.zeros(batch_shape, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(GRAPH_WARMUP):
                self._step(self.x, self.y)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = self._step(self.x, self.y)
        restore()

    # --8<-- [end:capture]


def training_snapshot(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> Callable[[], None]:
    """A function that puts `params` and `opt`'s state back, in place, as they are now.
    State the optimizer creates later (its first step's moments and step count) is zeroed:
    AdamW as if it had never stepped. Warm-up steps before a CUDA graph capture train for
    real; this undoes them without moving any tensor the graph reads."""
    saved_params = [p.detach().clone() for p in params]
    saved_state = {id(t): t.clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)}

    @torch.no_grad()
    def restore() -> None:
        for p, p0 in zip(params, saved_params, strict=True):
            p.copy_(p0)
        for state in opt.state.values():
            for t in state.values():
                if not torch.is_tensor(t):
                    continue
                if id(t) in saved_state:  # resumed: the checkpoint's moments
                    t.copy_(saved_state[id(t)])
                else:  # a fresh AdamW: zero moments, step 0
                    t.zero_()

    return restore
