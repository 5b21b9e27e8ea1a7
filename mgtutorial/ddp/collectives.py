"""DDP under the hood, part 1: the collectives, and DDP written from scratch (broadcast once,
all-reduce every gradient). What the real DDP adds is in :mod:`mgtutorial.ddp.overlap` (buckets,
hooks) and :mod:`mgtutorial.ddp.internals` (pitfalls).

Taught in notebooks/03a_collectives.ipynb. Follows
https://pytorch.org/docs/stable/distributed.html (collectives) and
https://pytorch.org/docs/stable/notes/ddp.html (what DDP does for you).

Every worker here is a small diff of :func:`mgtutorial.ddp.worker`: it reads its rank from the
environment, so :func:`mgtutorial.launch` (the notebook) and ``torchrun`` run it alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mgtutorial import ddp
from mgtutorial.common.config import Config
from mgtutorial.runtime import env, runlog

# ---------------------------------------------------------------------------------------------
# 1. The collectives, on small tensors whose values say where they came from


@dataclass(kw_only=True)
class TourConfig(Config):
    """Configuration of :func:`collectives_tour` and :func:`async_allreduce`."""

    size: int = 4
    """Elements of each rank's tensor (a multiple of the world size, for reduce-scatter)."""
    backend: env.BackendChoice = "auto"
    """Process-group backend ("auto": NCCL with a GPU per local rank, else gloo)."""
    barrier_delay_s: float = 0.5
    """The last rank sleeps this long before the barrier; the others wait for it."""


def start_tensor(rank: int, size: int, device) -> torch.Tensor:
    """Rank ``rank``'s ``(size,)`` float32 tensor ``[10r, 10r + 1, …]`` on ``device``: every value
    says which rank it came from."""
    return (torch.arange(size, dtype=torch.float32) + 10 * rank).to(device)


def collectives_tour(cfg: TourConfig) -> list[dict]:
    """Run each collective once and log every rank's tensor before and after it.

    Logs ``kind="collective"`` records: ``op``, ``before``, ``after`` (lists), plus ``entered``
    (unix s) and ``waited_s`` for the barrier. Shapes: each rank starts with a ``(size,)`` tensor;
    all_gather's result is ``(world_size · size,)``; reduce_scatter's ``(size / world_size,)``.

    Raises:
        ValueError: ``size`` not divisible by the world size.
    """
    with env.distributed(cfg.backend) as ctx, runlog.RunLog() as log:
        r, n, dev = ctx.rank, ctx.world_size, ctx.device
        if cfg.size % n:
            raise ValueError(
                f"size={cfg.size} must be a multiple of the world size {n} for reduce_scatter."
            )
        records = []

        def record(op: str, before: torch.Tensor, after: torch.Tensor, **extra) -> None:
            records.append(
                log.write(
                    kind="collective", op=op, before=before.tolist(), after=after.tolist(), **extra
                )
            )

        for op, how in (
            ("all_reduce (sum)", dist.ReduceOp.SUM),
            ("all_reduce (average)", dist.ReduceOp.AVG),
        ):
            t = start_tensor(r, cfg.size, dev)
            before = t.clone()
            dist.all_reduce(t, op=how)
            record(op, before, t)
        t = start_tensor(r, cfg.size, dev)
        before = t.clone()
        dist.broadcast(t, src=0)
        record("broadcast (from rank 0)", before, t)
        t = start_tensor(r, cfg.size, dev)
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t)
        record("all_gather", t, torch.cat(parts))
        t = start_tensor(r, cfg.size, dev)
        out = torch.empty(cfg.size // n, device=dev)
        dist.reduce_scatter(out, list(t.chunk(n)))
        record("reduce_scatter (sum)", t, out)
        t = start_tensor(r, cfg.size, dev)
        got = torch.empty_like(t)
        reqs = [dist.isend(t, (r + 1) % n), dist.irecv(got, (r - 1) % n)]
        for req in reqs:
            req.wait()
        record("send/recv (ring: to rank+1)", t, got)
        if r == n - 1:
            time.sleep(cfg.barrier_delay_s)
        t0 = time.time()
        dist.barrier()
        t = start_tensor(r, cfg.size, dev)
        record("barrier", t, t, entered=t0, waited_s=time.time() - t0)
        return records


def async_allreduce(cfg: TourConfig) -> dict:
    """One all-reduce with ``async_op=True`` while the last rank arrives ``barrier_delay_s`` late.

    Returns this rank's ``called``, ``returned`` (the call) and ``done`` (``work.wait()`` returned),
    unix s; ``completed_after_call`` (``work.is_completed()`` right after the call) and ``result``
    (the ``(size,)`` sum, a list). On gloo ``async_op=False`` would block in the call; on NCCL every
    collective returns at once like this one, queued on a CUDA stream.
    """
    with env.distributed(cfg.backend) as ctx:
        t = start_tensor(ctx.rank, cfg.size, ctx.device)
        if ctx.rank == ctx.world_size - 1:
            time.sleep(cfg.barrier_delay_s)
        called = time.time()
        work = dist.all_reduce(t, async_op=True)  # returns a Work handle at once
        returned, completed = time.time(), work.is_completed()
        work.wait()  # now t holds the sum
        return {
            "called": called,
            "returned": returned,
            "completed_after_call": completed,
            "done": time.time(),
            "result": t.tolist(),
        }


def _sources(op: str, rank: int, i: int, n: int, size: int) -> list[int]:
    """The ranks whose data element ``i`` of ``rank``'s result comes from, after ``op``."""
    if op.startswith(("all_reduce", "reduce_scatter")):
        return list(range(n))
    if op.startswith("broadcast"):
        return [0]
    if op == "all_gather":
        return [i // size]
    return [(rank - 1) % n]  # send/recv around the ring


def _senders(op: str, rank: int, n: int) -> list[int]:
    """The ranks that send data to ``rank`` in ``op``."""
    if op.startswith("broadcast"):
        return [0]
    if op.startswith("send/recv"):
        return [(rank - 1) % n]
    return list(range(n))


def movement_figure(records: list[dict]):
    """Who sends what to whom: one panel per collective of :func:`collectives_tour`'s records
    (the barrier left out), each rank's tensor before (left) and after (right) as a row of cells
    coloured by the rank the data came from (striped where ranks' values were summed), with an
    arrow from every rank that sends to every rank that receives. Returns a matplotlib
    ``Figure``."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    recs = [r for r in records if r.get("kind") == "collective" and r["op"] != "barrier"]
    ops = list(dict.fromkeys(r["op"] for r in recs))
    by_key = {(r["op"], r["rank"]): r for r in recs}
    n = len({r["rank"] for r in recs})
    size = len(recs[0]["before"])
    fig = Figure(figsize=(10, 1.15 * n * len(ops) / 2 + 0.6), layout="constrained")
    axes = fig.subplots(len(ops) // 2 + len(ops) % 2, 2, squeeze=False).flatten()
    gap = 2.5  # between the tensors before and after, in cells

    def row(ax, x0, y, values, sources):
        for i, (v, src) in enumerate(zip(values, sources)):
            for k, s in enumerate(src):  # one stripe per contributing rank
                w = 1 / len(src)
                ax.add_patch(
                    Rectangle((x0 + i + k * w, y - 0.35), w, 0.7, color=f"C{s}", alpha=0.5)
                )
            ax.add_patch(Rectangle((x0 + i, y - 0.35), 1, 0.7, fill=False, lw=0.6))
            ax.text(x0 + i + 0.5, y, f"{v:g}", ha="center", va="center", fontsize=7)

    for ax, op in zip(axes, ops):
        width = max(len(by_key[op, r]["after"]) for r in range(n))
        right = size + gap
        for r in range(n):
            y = n - 1 - r
            rec = by_key[op, r]
            row(ax, 0, y, rec["before"], [[r]] * size)
            after = rec["after"]
            row(ax, right, y, after, [_sources(op, r, i, n, size) for i in range(len(after))])
            ax.text(-0.3, y, f"rank {r}", ha="right", va="center", fontsize=8)
            for s in _senders(op, r, n):
                ax.annotate(
                    "",
                    xy=(right - 0.1, y),
                    xytext=(size + 0.1, n - 1 - s),
                    arrowprops={"arrowstyle": "->", "color": f"C{s}", "lw": 1},
                )
        ax.set_xlim(-1.6, right + width + 0.2)
        ax.set_ylim(-0.6, n - 0.4)
        ax.set_title(f"{op}: before → after", fontsize=9, loc="left")
        ax.axis("off")
    for ax in axes[len(ops) :]:
        ax.axis("off")
    return fig


# ---------------------------------------------------------------------------------------------
# 2. DDP from scratch: broadcast once, all-reduce gradients every step


class FromScratchDDP(nn.Module):
    """What DDP does, by hand, without buckets or overlap: a thin wrapper around ``module``.

    At construction, rank 0's parameters and buffers are broadcast so every rank starts equal.
    After ``loss.backward()``, call :meth:`average_gradients`: one all-reduce (SUM) per parameter,
    then ÷ world size. ``forward`` only calls the wrapped module.
    """

    def __init__(self, module: nn.Module, ctx: env.DistContext):
        super().__init__()
        self.module = module
        self.world_size = ctx.world_size
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def average_gradients(self) -> int:
        """All-reduce every gradient and divide by the world size; returns the number of calls."""
        calls = 0
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= self.world_size
                calls += 1
        return calls


def apply_from_scratch_ddp(model: nn.Module, ctx: env.DistContext) -> nn.Module:
    """Move ``model`` to this rank's device and wrap it in :class:`FromScratchDDP`."""
    return FromScratchDDP(model.to(ctx.device), ctx)


class ScratchTrainer(ddp.Trainer):
    """:class:`~mgtutorial.ddp.Trainer` for a :class:`FromScratchDDP` model: the step all-reduces
    the gradients itself, between ``backward`` and ``optimizer.step``."""

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.calls = self.model.average_gradients()  # the line DDP does for you, during backward
        self.optimizer.step()
        return loss.item()


def scratch_worker(cfg: ddp.DDPConfig) -> dict:
    """:func:`mgtutorial.ddp.worker` with :class:`FromScratchDDP` instead of DDP, trained by
    :class:`ScratchTrainer`. Returns the Trainer's summary plus ``allreduce_calls_per_step``."""
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        model, train_set, test_set, optimizer = ddp.build(cfg, ctx, wrap=apply_from_scratch_ddp)
        trainer = ScratchTrainer(model, train_set, test_set, optimizer, ctx, cfg)
        return {**trainer.train(), "allreduce_calls_per_step": trainer.calls}


__all__ = [
    "FromScratchDDP",
    "ScratchTrainer",
    "TourConfig",
    "apply_from_scratch_ddp",
    "async_allreduce",
    "collectives_tour",
    "scratch_worker",
    "movement_figure",
]
