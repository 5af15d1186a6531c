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
                          The tied table's bucket holds only the output head's part of
                          its gradient and goes out first; the token lookup's part follows
                          at the end as rows (TokenRows). Options: the persistent kernels
                          of backward leave SMs free for NCCL (reserve_sms), and the
                          buckets sent during backward use at most that many (nccl_ctas)
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from pytorch_custom_ops.direct import reserve_sms
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
    gradients backward writes) to the first. `begin` drops the grads instead, so backward
    hands each new gradient over (no add, no zeroed buffer: 8 bytes moved per element
    instead of 16), and a hook on each parameter copies it into its view, makes the view
    its .grad again, counts what is done and starts a bucket's all-reduce as soon as it and
    every bucket before it are complete. gpu-days' linear layers write their float32 weight
    gradients straight into the views (`master_weights.write_grads_into`): no copy at all.
    On CUDA the all-reduces run on a side stream that waits for the gradients' stream, and
    `finish` makes the current stream wait for it: inside a graph capture this is a fork
    and a join, so the replays overlap the same way."""

    def __init__(
        self,
        params: list[torch.Tensor],
        world: int = 1,
        bucket_bytes: int | None = None,
        overlap_group=None,
        alone: tuple[torch.Tensor, ...] = (),
    ):
        """`overlap_group`: the process group of the buckets sent while backward still runs (all
        but the last; e.g. one whose NCCL kernels take few SMs, `narrow_group`). The last
        bucket goes out when backward is over, with nothing to overlap: on the default group.
        `alone`: parameters that are a bucket of their own (TokenRows' table)."""
        params = [p for p in params if p.requires_grad]  # a frozen one keeps .grad None: AdamW skips it
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"FlatGrads: parameters of one dtype and device only, got {sorted(map(str, kinds))}")
        dtype, device = kinds.pop()
        self.world, self.device, self.overlap_group = world, device, overlap_group
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        bounds = [0]  # parameter i is buffer[bounds[i] : bounds[i + 1]]
        self.params, self.views = params, []
        for p in params:
            self.views.append(self.buffer[bounds[-1] : bounds[-1] + p.numel()].view_as(p))
            p.grad = self.views[-1]
            bounds.append(bounds[-1] + p.numel())
        self._index = {id(p): i for i, p in enumerate(params)}
        self.buckets: list[tuple[int, int]] = []  # (first, end) element ranges, in launch order
        self._size: list[int] = []  # parameters per bucket
        self._bucket_of: dict[int, int] = {}  # id(parameter) -> its bucket
        if bucket_bytes is not None:
            alone_at = {i for i, p in enumerate(params) if any(p is q for q in alone)}
            sizes = bucket_sizes([p.numel() * p.element_size() for p in params], bucket_bytes, alone_at)
            hi = len(params)
            for size in sizes:  # the last parameters first
                lo = hi - size
                self.buckets.append((bounds[lo], bounds[hi]))
                for i in range(lo, hi):
                    params[i].register_post_accumulate_grad_hook(self._hook(len(self.buckets) - 1, i))
                    self._bucket_of[id(params[i])] = len(self.buckets) - 1
                hi = lo
            self._size = sizes
            for p, view in zip(params, self.views, strict=True):
                if view.dtype == torch.float32 and view.data_ptr() % 16 == 0:
                    write_grads_into(p, view)  # gpu-days' layers write dW there: no copy at all
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

    def sent(self, param: torch.Tensor) -> bool:
        """Has `param`'s bucket gone out in this backward?"""
        return self._next > self._bucket_of[id(param)]

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s slice of the buffer."""
        return self.views[self._index[id(param)]]

    def _hook(self, bucket: int, i: int):
        def ready(param: torch.Tensor) -> None:
            if not self.active:
                return
            view = self.views[i]
            if param.grad.data_ptr() != view.data_ptr():  # handed over: move it into the buffer
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
            group = self.overlap_group if self._next < len(self.buckets) else None
            if self.stream is None:
                _all_reduce_mean(self.buffer[first:end], self.world, group)
                continue
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the gradients are written
            with torch.cuda.stream(self.stream):
                _all_reduce_mean(self.buffer[first:end], self.world, group)


class TokenRows:
    """The token lookup's share of the tied table's gradient, sent as rows, not as a table.

    GPT-2's output head and token lookup share one table (wte, 50304 x 768). Its gradient has
    two parts: the head's, a dense product that backward writes first, and the lookup's,
    each token's output gradient added into its row, which exists only at backward's end.
    Through autograd both are summed into one leaf gradient, so the table's bucket (154 MB
    in float32) could only be all-reduced after backward's last kernel, with nothing left
    to hide it behind. Here the lookup hands its gradient to `add` instead: the table's
    .grad holds the head's part alone, whose bucket goes out first (Stepper puts the table
    last in FlatGrads' walk) while the blocks' backward runs. At the end every rank's token
    ids and rows are all-gathered (world x tokens x d floats: fewer than the table's while
    world x tokens < vocab) and each rank adds all of them, / world, into the averaged
    table gradient. The sum is the same as averaging the two parts together."""

    def __init__(self, flat: FlatGrads, weight: torch.Tensor):
        self.flat, self.weight = flat, weight
        # the lookup reads the table detached (an autograd edge to it would hold the table's
        # gradient, and its bucket, back until the lookup's backward at the very end); this
        # empty leaf makes its output require grad, so that its backward runs
        self._anchor = torch.empty(0, device=weight.device, requires_grad=True)

    def lookup(self, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if weight is not self.weight:
            raise ValueError("TokenRows.lookup: a table other than the one its rows are added to")
        return _Lookup.apply(idx, weight.detach(), self._anchor, self)

    def add(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        """In backward: the mean over the ranks of rows[i] is added to row idx[i] of the
        table's gradient, after the table's own bucket has been averaged."""
        flat = self.flat
        if not flat.sent(self.weight):
            raise RuntimeError("TokenRows: the table's bucket has not gone out; its rows would be averaged twice")
        rows = rows.to(flat.buffer.dtype)
        if flat.stream is None:
            return self._gather_and_add(idx, rows)
        flat.stream.wait_stream(torch.cuda.current_stream(flat.device))  # the rows are written
        for t in (idx, rows):  # read on the side stream: their memory waits for it
            t.record_stream(flat.stream)
        with torch.cuda.stream(flat.stream):  # after the table's all-reduce, before finish() joins
            self._gather_and_add(idx, rows)

    def _gather_and_add(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        world = self.flat.world
        every_idx = idx.new_empty(world * idx.numel())
        every_row = rows.new_empty(world * rows.shape[0], rows.shape[1])
        _all_gather(every_idx, idx)
        _all_gather(every_row, rows)
        self.flat.view(self.weight).index_add_(0, every_idx, every_row, alpha=1 / world)


# torch 2.13 renamed all_gather_into_tensor (2.11, the GPU machine's) to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Lookup(torch.autograd.Function):
    """F.embedding of a detached table: the rows' gradient goes to TokenRows.add."""

    @staticmethod
    def forward(ctx, idx, weight, _anchor, rows: TokenRows):
        ctx.save_for_backward(idx)
        ctx.rows = rows
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        ctx.rows.add(idx.reshape(-1).contiguous(), grad.reshape(-1, grad.shape[-1]).contiguous())
        return None, None, None, None


def bucket_sizes(nbytes: list[int], bucket_bytes: int, alone: set[int] = frozenset()) -> list[int]:
    """How many parameters each bucket holds, walking `nbytes` from its end: a bucket takes
    parameters while they fit in `bucket_bytes` (a larger parameter is a bucket of its own,
    as is each one whose index is in `alone`)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    sizes, count, total = [], 0, 0
    for i in reversed(range(len(nbytes))):
        if count and (total + nbytes[i] > bucket_bytes or i in alone or i + 1 in alone):
            sizes.append(count)
            count, total = 0, 0
        count, total = count + 1, total + nbytes[i]
    if count:
        sizes.append(count)
    return sizes


def _all_reduce_mean(t: torch.Tensor, world: int, group=None) -> None:
    if dist.get_backend(group) == "nccl":  # NCCL divides as it reduces
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
    else:
        dist.all_reduce(t, group=group)
        t.div_(world)


def narrow_group(max_ctas: int):
    """A process group of every rank whose NCCL kernels use at most `max_ctas` blocks (one
    SM each): an all-reduce that runs beside backward's persistent GEMMs then fits in the
    SMs they leave free (`--reserve-sms`). NCCL only: other backends take no SMs."""
    if dist.get_backend() != "nccl":
        raise ValueError(f"--nccl-ctas limits NCCL's kernels; this job's backend is {dist.get_backend()}")
    if not isinstance(max_ctas, int) or max_ctas < 1:
        raise ValueError(f"--nccl-ctas must be a positive int, got {max_ctas!r}")
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = max_ctas
    return dist.new_group(backend="nccl", pg_options=options)


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
        reserve_sms: int = 0,
        nccl_ctas: int | None = None,
        token_rows: bool = True,
    ):
        """`batch_shape`: (rows, seq) of this rank's batches; a captured step needs it.
        With buckets on several ranks: `reserve_sms`, SMs the persistent kernels leave free
        during backward (`direct.reserve_sms`), and `nccl_ctas`, the most blocks the NCCL
        kernels of the buckets sent during backward may take (`narrow_group`), and
        `token_rows`, whether the tied table's lookup sends rows (TokenRows; where that is
        less data than the table)."""
        if grad_sync not in GRAD_SYNCS:
            raise ValueError(f"grad_sync must be one of {GRAD_SYNCS}, got {grad_sync!r}")
        if (reserve_sms or nccl_ctas) and not (grad_sync == "buckets" and world > 1):
            raise ValueError(
                "reserve_sms and nccl_ctas make room for buckets sent during backward: "
                "they need grad_sync='buckets' and several ranks"
            )
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
            group = None if nccl_ctas is None else narrow_group(nccl_ctas)
            params = list(model.parameters())
            table = _tied_table(model) if token_rows and bucket_bytes and batch_shape else None
            if table is not None and world * batch_shape[0] * batch_shape[1] < table.shape[0]:
                params = [p for p in params if p is not table] + [table]  # its bucket goes out first
                self.flat = FlatGrads(params, world, bucket_bytes, group, alone=(table,))
                model.token_rows = TokenRows(self.flat, table)
            else:
                self.flat = FlatGrads(params, world, bucket_bytes, group)
        self.reserve_sms = reserve_sms
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
        with reserve_sms(self.reserve_sms):
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


def _tied_table(model) -> torch.Tensor | None:
    """The token table of a model whose lookup can hand its gradient over (day 020's GPT)."""
    wte = getattr(model, "wte", None)
    if hasattr(model, "token_rows") and wte is not None and wte.weight.requires_grad:
        return wte.weight
    return None


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
