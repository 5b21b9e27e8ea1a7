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


def tour_figure(records: list[dict]):
    """One row per collective, one column per rank, before → after, drawn from the logged
    tensors (the records of :func:`collectives_tour`). Returns a matplotlib ``Figure``."""
    from matplotlib.figure import Figure

    ops = list(dict.fromkeys(r["op"] for r in records if r.get("kind") == "collective"))
    ranks = sorted({r["rank"] for r in records if r.get("kind") == "collective"})
    fig = Figure(figsize=(2.2 + 3.2 * len(ranks), 0.75 * len(ops) + 0.8), layout="constrained")
    axes = fig.subplots(len(ops), len(ranks), squeeze=False)
    by_key = {(r["op"], r["rank"]): r for r in records if r.get("kind") == "collective"}
    for i, op in enumerate(ops):
        for j, rank in enumerate(ranks):
            rec, ax = by_key[(op, rank)], axes[i][j]
            ax.axis("off")
            text = f"{_fmt(rec['before'])}  →  {_fmt(rec['after'])}"
            if "waited_s" in rec:
                text = f"waited {rec['waited_s']:.2f} s"
            ax.text(0.0, 0.5, text, family="monospace", fontsize=9, va="center")
            if j == 0:
                ax.set_title(op, loc="left", fontsize=9, fontweight="bold")
            if i == 0:
                title = f"rank {rank}"
                ax.text(0.0, 1.35, title, transform=ax.transAxes, fontsize=10, color="tab:blue")
    return fig


def _fmt(values: list[float]) -> str:
    return "[" + " ".join(f"{v:g}" for v in values) + "]"


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
    "tour_figure",
]
