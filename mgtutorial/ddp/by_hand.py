"""DDP by hand, overlapped: each gradient's all-reduce starts from an autograd hook while
``backward()`` goes on, first one all-reduce per parameter, then one per bucket.

Taught in notebooks/03b_ddp_internals.ipynb (section 3); exercise 03b.3 writes
:class:`BucketedDDP`'s two methods. 03a's :class:`~mgtutorial.ddp.collectives.FromScratchDDP`
all-reduces after ``backward()``; here ``Tensor.register_post_accumulate_grad_hook`` (it runs once
autograd has accumulated a parameter's ``.grad``) launches an asynchronous all-reduce at once,
and :meth:`OverlappedDDP.finish_gradient_sync`, called after ``backward()`` and before
``optimizer.step()``, waits for them and divides by the world size. Follows
https://pytorch.org/docs/stable/generated/torch.Tensor.register_post_accumulate_grad_hook.html and
the design of DDP's reducer (https://pytorch.org/docs/stable/notes/ddp.html).

:func:`by_hand_worker` is a small diff of :func:`mgtutorial.ddp.worker`: it reads its rank from
the environment, so :func:`mgtutorial.launch` (the notebook) and ``torchrun`` run it alike.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mgtutorial import ddp
from mgtutorial.runtime import env


class OverlappedDDP(nn.Module):
    """DDP by hand with overlap, one all-reduce per parameter: a thin wrapper around ``module``.

    Rank 0's parameters and buffers are broadcast at construction. Each parameter's hook launches
    an asynchronous SUM all-reduce of its ``.grad`` as soon as autograd has accumulated it; after
    ``backward()`` call :meth:`finish_gradient_sync` (before ``optimizer.step()``).
    ``self.launched`` holds one record per all-reduce of the current step: ``elements``,
    ``launched`` and ``done`` (unix s; ``done`` set when the all-reduce completed).
    """

    def __init__(self, module: nn.Module, ctx: env.DistContext):
        super().__init__()
        self.module, self.world_size = module, ctx.world_size
        self.pending: list = []  # what finish_gradient_sync must wait for, in launch order
        self.launched: list[dict] = []
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        self.register_hooks()

    def register_hooks(self) -> None:
        for p in self.module.parameters():
            p.register_post_accumulate_grad_hook(self.grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def grad_ready(self, p: nn.Parameter) -> None:
        """Autograd calls this once ``p.grad`` holds this step's gradient: launch its all-reduce."""
        launched = time.time()
        work = dist.all_reduce(p.grad, async_op=True)  # returns at once; backward() goes on
        self.pending.append((work, p.grad))
        self.record(work, p.grad.numel(), launched)

    def finish_gradient_sync(self) -> int:
        """Wait for every all-reduce launched in this step, divide by the world size; returns
        how many there were."""
        for work, grad in self.pending:
            work.wait()
            grad.div_(self.world_size)
        n = len(self.pending)
        self.pending.clear()
        return n

    def record(self, work, elements: int, launched: float) -> None:
        """Log an all-reduce's launch (unix s, taken just before the call) and its completion,
        from a callback on its future (which runs at once if it has already completed)."""
        rec = {"elements": elements, "launched": launched}
        self.launched.append(rec)
        work.get_future().then(lambda fut: rec.update(done=time.time()))


class BucketsByHand(OverlappedDDP):
    """:class:`OverlappedDDP` with the parameters grouped into buckets, the way DDP's reducer
    groups them after its first step: in reverse ``model.parameters()`` order (about the order in
    which ``backward()`` produces the gradients), a bucket closing once it holds at least
    ``bucket_cap_mb`` MiB. Every parameter's hook calls :meth:`grad_ready`; what a bucket does
    when its gradients are ready is :class:`BucketedDDP`'s (and exercise 03b.3's).

    Attributes: ``buckets`` (lists of parameters), ``bucket_of`` (parameter → its bucket's index),
    ``ready`` (per bucket, how many of its gradients are ready in this step).
    """

    def __init__(self, module: nn.Module, ctx: env.DistContext, bucket_cap_mb: float = 1.0):
        super().__init__(module, ctx)
        self.buckets: list[list[nn.Parameter]] = [[]]
        cap, size = bucket_cap_mb * 2**20, 0
        for p in reversed(list(module.parameters())):
            if size >= cap:  # the bucket is full: start the next one
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)

    def grad_ready(self, p: nn.Parameter) -> None:
        raise NotImplementedError("a subclass decides what a ready gradient does")


class BucketedDDP(BucketsByHand):
    """DDP by hand, overlapped and bucketed: when the last gradient of a bucket is ready, its
    gradients are flattened into one buffer whose all-reduce is launched at once;
    :meth:`finish_gradient_sync` waits for each, divides and copies the pieces back."""

    def grad_ready(self, p: nn.Parameter) -> None:
        b = self.bucket_of[p]
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b]):  # the bucket's last gradient: launch it
            grads = [q.grad for q in self.buckets[b]]
            flat = torch.cat([g.flatten() for g in grads])
            launched = time.time()
            work = dist.all_reduce(flat, async_op=True)
            self.pending.append((work, flat, grads))
            self.record(work, flat.numel(), launched)

    def finish_gradient_sync(self) -> int:
        for work, flat, grads in self.pending:
            work.wait()
            flat.div_(self.world_size)
            for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))
        n = len(self.pending)
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
        return n


@dataclass(kw_only=True)
class ByHandConfig(ddp.DDPConfig):
    """:class:`~mgtutorial.ddp.DDPConfig` plus the bucket size of the DDP by hand."""

    bucket_cap_mb: float | None = None
    """None: :class:`OverlappedDDP` (an all-reduce per parameter); else :class:`BucketedDDP`
    with buckets of at least this many MiB."""


def wrap_by_hand(model: nn.Module, ctx: env.DistContext, bucket_cap_mb: float | None = None):
    """Move ``model`` to this rank's device and wrap it in :class:`OverlappedDDP`, or in
    :class:`BucketedDDP` when ``bucket_cap_mb`` is given."""
    model = model.to(ctx.device)
    if bucket_cap_mb is None:
        return OverlappedDDP(model, ctx)
    return BucketedDDP(model, ctx, bucket_cap_mb)


class ByHandTrainer(ddp.Trainer):
    """:class:`~mgtutorial.ddp.Trainer` for DDP by hand: ``finish_gradient_sync`` between
    ``backward()`` and ``optimizer.step()``. Logs the ``kind="sync"`` record of
    :class:`~mgtutorial.ddp.overlap.AccumulationTrainer` per step (``allreduce_calls``,
    ``bucket_sizes``, ``bucket_launched``, ``bucket_done``, ``backward_start``,
    ``backward_end``) plus ``sync_end``, when ``finish_gradient_sync`` returned: what DDP's
    ``backward()`` includes, its wait for the last all-reduces."""

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.launched = []
        loss = self.loss_fn(self.model(x), y)
        t0 = time.time()
        loss.backward()  # the hooks launch the all-reduces while backward() goes on
        t1 = time.time()
        calls = self.model.finish_gradient_sync()  # wait for them all, before the step
        t2 = time.time()
        self.optimizer.step()
        b = self.model.launched
        self.log.write(
            kind="sync",
            step=self.step + 1,
            allreduce_calls=calls,
            bucket_sizes=[s["elements"] for s in b],
            bucket_launched=[s["launched"] for s in b],
            bucket_done=[s.get("done") for s in b],
            backward_start=t0,
            backward_end=t1,
            sync_end=t2,
        )
        return loss.item()


def by_hand_worker(cfg: ByHandConfig) -> dict:
    """:func:`mgtutorial.ddp.worker` with :class:`OverlappedDDP` or :class:`BucketedDDP`
    instead of DDP, trained by :class:`ByHandTrainer`. Returns the Trainer's summary."""
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        wrap = functools.partial(wrap_by_hand, bucket_cap_mb=cfg.bucket_cap_mb)
        model, train_set, test_set, optimizer = ddp.build(cfg, ctx, wrap=wrap)
        return ByHandTrainer(model, train_set, test_set, optimizer, ctx, cfg).train()
