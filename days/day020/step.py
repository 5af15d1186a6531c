"""One optimizer step of day 020's GPT, four ways: eager, eager with a flat gradient buffer
(averaged in one all-reduce, or in buckets while backward runs), and captured once by a
CUDA graph and replayed.

    grad_sync="ddp"     : DistributedDataParallel (buckets all-reduced while backward runs)
    grad_sync="flat"    : every .grad is a view into one float32 buffer; after backward, one
                          all-reduce of that buffer, divided by the ranks (one rank: plain
                          gradients, which backward hands over without adding into zeros)
    grad_sync="buckets" : the same buffer cut into ~25 MB buckets, last layers first; each
                          bucket is all-reduced on a side stream as soon as backward has
                          written its gradients, so communication overlaps the rest of
                          backward; the step waits for the last bucket before AdamW.
                          Backward hands its gradients over (no zeroed buffer, no add):
                          gpu-days' layers write dW straight into the buckets
    graph=True          : the whole step (forward, backward, the all-reduces, AdamW) is one
                          CUDA graph; a step copies the batch and the learning rate into the
                          graph's input tensors and replays it

Why a flat buffer for the graph: DDP's reducer registers hooks and rebuilds its buckets
after the first iteration, so capturing it needs its own warm-up rules; all-reduces of
fixed slices of one buffer are NCCL kernels in the graph, with nothing to rebuild. Buckets
are launched in one fixed order on every rank (NCCL needs the same order everywhere): a
bucket that is ready waits for the ones before it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pytorch_custom_ops.master_weights import write_grads_into

GRAD_SYNCS = ("ddp", "flat", "buckets")
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size
GRAPH_WARMUP = 3  # eager steps on a side stream before capture: kernels loaded, caches filled


class FlatGrads:
    """Each parameter's .grad as a view into one buffer, so that all-reduces of the buffer
    average them all.

    `bucket_bytes=None`: backward adds into the views in place (a defined .grad is
    accumulated into), so `begin` zeroes the buffer before each backward, and `finish`
    all-reduces the whole buffer after it. Otherwise the buffer is cut into buckets of whole
    parameters, about `bucket_bytes` each, walking the parameters from the last (the first
    gradients backward writes) to the first. `begin` drops the grads instead, so that
    backward hands each new gradient over, and a hook on each parameter moves it into its
    view (8 bytes an element, against 16 for zeroing the buffer and adding into it), makes
    the view its .grad again, counts what is done, and starts a bucket's all-reduce as soon
    as it and every bucket before it are complete. gpu-days' linear layers write their
    float32 weight gradients straight into the views (`master_weights.write_grads_into`),
    which backward then hands over as they are: nothing to move at all.

    On CUDA the all-reduces run on a side stream that waits for the gradients' stream, and
    `finish` makes the current stream wait for it: inside a graph capture this is a fork
    and a join, so the replays overlap the same way."""

    def __init__(self, params: list[torch.Tensor], world: int = 1, bucket_bytes: int | None = None):
        params = [p for p in params if p.requires_grad]  # a frozen one keeps .grad None: AdamW skips it
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"FlatGrads: parameters of one dtype and device only, got {sorted(map(str, kinds))}")
        dtype, device = kinds.pop()
        self.world, self.device = world, device
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        bounds = [0]  # parameter i is buffer[bounds[i] : bounds[i + 1]]
        self.params, self.views = params, []
        for p in params:
            self.views.append(self.buffer[bounds[-1] : bounds[-1] + p.numel()].view_as(p))
            p.grad = self.views[-1]
            bounds.append(bounds[-1] + p.numel())
        self.buckets: list[tuple[int, int]] = []  # (first, end) element ranges, in launch order
        self._size: list[int] = []  # parameters per bucket
        if bucket_bytes is not None:
            sizes = bucket_sizes([p.numel() * p.element_size() for p in params], bucket_bytes)
            hi = len(params)
            for size in sizes:  # the last parameters first
                lo = hi - size
                self.buckets.append((bounds[lo], bounds[hi]))
                for i in range(lo, hi):
                    params[i].register_post_accumulate_grad_hook(self._hook(len(self.buckets) - 1, i))
                hi = lo
            self._size = sizes
            for p, view in zip(params, self.views, strict=True):
                if view.dtype == torch.float32 and view.data_ptr() % 16 == 0:
                    write_grads_into(p, view)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and self.buckets and world > 1 else None
        self._left: list[int] = []
        self._done: list[bool] = []  # per parameter: its gradient is in its view
        self._next = 0
        self.active = False

    def begin(self) -> None:
        """Before a backward: one buffer, zeroed (one kernel; the views stay the .grad); in
        buckets, no .grad at all (backward hands its gradients over, the hooks move them)."""
        if self.buckets:
            for p in self.params:
                p.grad = None
        else:
            self.buffer.zero_()
        self._left = list(self._size)
        self._done = [False] * len(self.params)
        self._next = 0
        self.active = bool(self.buckets)

    def finish(self) -> None:
        """After a backward: every rank holds the mean of every rank's gradients."""
        if not self.buckets:
            if self.world > 1:
                _all_reduce_mean(self.buffer, self.world)
            return
        for i, done in enumerate(self._done):
            if not done:  # no gradient in this backward: zeros, as a zeroed buffer held
                self.views[i].zero_()
                self.params[i].grad = self.views[i]
        self._launch_ready(everything=True)  # parameters that got no gradient still take part
        self.active = False
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s slice of the buffer."""
        return next(v for p, v in zip(self.params, self.views, strict=True) if p is param)

    def _hook(self, bucket: int, i: int):
        def ready(param: torch.Tensor) -> None:
            if not self.active:
                return
            view = self.views[i]
            if param.grad.data_ptr() != view.data_ptr():  # handed over elsewhere: move it in
                view.copy_(param.grad)
                param.grad = view
            if not self._done[i]:  # (a second backward before finish adds into the view)
                self._done[i] = True
                self._left[bucket] -= 1
                self._launch_ready()

        return ready

    def _launch_ready(self, everything: bool = False) -> None:
        while self._next < len(self.buckets) and (everything or self._left[self._next] == 0):
            first, end = self.buckets[self._next]
            self._next += 1
            if self.world == 1:
                continue
            if self.stream is None:
                _all_reduce_mean(self.buffer[first:end], self.world)
                continue
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the gradients are written
            with torch.cuda.stream(self.stream):
                _all_reduce_mean(self.buffer[first:end], self.world)


def bucket_sizes(nbytes: list[int], bucket_bytes: int) -> list[int]:
    """How many parameters each bucket holds, walking `nbytes` from its end: a bucket takes
    parameters while they fit in `bucket_bytes` (a larger parameter is a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    sizes, count, total = [], 0, 0
    for n in reversed(nbytes):
        if count and total + n > bucket_bytes:
            sizes.append(count)
            count, total = 0, 0
        count, total = count + 1, total + n
    if count:
        sizes.append(count)
    return sizes


def _all_reduce_mean(t: torch.Tensor, world: int) -> None:
    if dist.get_backend() == "nccl":  # NCCL divides as it reduces
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
    else:
        dist.all_reduce(t)
        t.div_(world)


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
        if grad_sync not in GRAD_SYNCS:
            raise ValueError(f"grad_sync must be one of {GRAD_SYNCS}, got {grad_sync!r}")
        if graph and world > 1 and grad_sync == "ddp":
            raise ValueError("a captured step averages a flat gradient buffer: use grad_sync='buckets' or 'flat'")
        if graph and not all(p.is_cuda for p in model.parameters()):
            raise ValueError("--graph captures the step with torch.cuda.graph: it needs the model on a CUDA device")
        if graph and batch_shape is None:
            raise ValueError("a captured step needs the shape of its batches (batch_shape)")
        self.model, self.opt, self.amp, self.world = model, opt, amp, world
        self.flat = None
        if grad_sync != "ddp" and world > 1:
            bucket_bytes = BUCKET_BYTES if grad_sync == "buckets" else None
            self.flat = FlatGrads(list(model.parameters()), world, bucket_bytes)
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
            self.flat.begin()
        with self.amp:
            _, loss = self.forward(x, y)
        loss.backward()
        if self.flat is not None:
            self.flat.finish()
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
