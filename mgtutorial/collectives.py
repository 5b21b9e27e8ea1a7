"""DDP under the hood: collectives, DDP written from scratch, buckets and hooks, gradient
accumulation, SyncBatchNorm, unused parameters and uneven inputs.

Taught in notebooks/03_ddp_internals.ipynb. Follows
https://pytorch.org/docs/stable/distributed.html (collectives),
https://pytorch.org/docs/stable/notes/ddp.html (buckets, overlap, ``no_sync``),
https://pytorch.org/docs/stable/ddp_comm_hooks.html and
https://pytorch.org/tutorials/advanced/generic_join.html (``Join``).

Every worker here is a small diff of :func:`mgtutorial.ddp.worker`: it reads its rank from the
environment, so :func:`mgtutorial.launch` (the notebook) and ``torchrun`` run it alike.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from . import ddp, env, models, runlog

# ---------------------------------------------------------------------------------------------
# 1. The collectives, on small tensors whose values say where they came from


@dataclass(kw_only=True)
class TourConfig:
    """Configuration of :func:`collectives_tour`."""

    size: int = 4
    """Elements of each rank's tensor (a multiple of the world size, for reduce-scatter)."""
    backend: str = "auto"
    """"auto" | "gloo" | "nccl"."""
    barrier_delay_s: float = 0.5
    """The last rank sleeps this long before the barrier; the others wait for it."""


def _start_tensor(rank: int, size: int, device) -> torch.Tensor:
    # rank r holds [10r, 10r+1, ...]: every value says which rank it came from
    return (torch.arange(size, dtype=torch.float32) + 10 * rank).to(device)


def collectives_tour(cfg: TourConfig) -> list[dict]:
    """Run each collective once and log every rank's tensor before and after it.

    Logs ``kind="collective"`` records: ``op``, ``before``, ``after`` (lists), plus ``waited_s``
    for the barrier. Shapes: each rank starts with a ``(size,)`` tensor; all_gather's result is
    ``(world_size · size,)``; reduce_scatter's ``(size / world_size,)``.

    Raises:
        ValueError: ``size`` not divisible by the world size.
    """
    with env.distributed(cfg.backend) as ctx, runlog.RunLog() as log:
        r, n, dev = ctx.rank, ctx.world_size, ctx.device
        if cfg.size % n:
            raise ValueError(f"size={cfg.size} must be a multiple of the world size {n} for reduce_scatter.")
        records = []

        def record(op: str, before: torch.Tensor, after: torch.Tensor, **extra) -> None:
            records.append(log.write(kind="collective", op=op, before=before.tolist(),
                                     after=after.tolist(), **extra))

        for op, how in (("all_reduce (sum)", dist.ReduceOp.SUM), ("all_reduce (average)", dist.ReduceOp.AVG)):
            t = _start_tensor(r, cfg.size, dev)
            before = t.clone()
            dist.all_reduce(t, op=how)
            record(op, before, t)
        t = _start_tensor(r, cfg.size, dev)
        before = t.clone()
        dist.broadcast(t, src=0)
        record("broadcast (from rank 0)", before, t)
        t = _start_tensor(r, cfg.size, dev)
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t)
        record("all_gather", t, torch.cat(parts))
        t = _start_tensor(r, cfg.size, dev)
        out = torch.empty(cfg.size // n, device=dev)
        dist.reduce_scatter(out, list(t.chunk(n)))
        record("reduce_scatter (sum)", t, out)
        t = _start_tensor(r, cfg.size, dev)
        got = torch.empty_like(t)
        reqs = [dist.isend(t, (r + 1) % n), dist.irecv(got, (r - 1) % n)]
        for req in reqs:
            req.wait()
        record("send/recv (ring: to rank+1)", t, got)
        if r == n - 1:
            time.sleep(cfg.barrier_delay_s)
        t0 = time.time()
        dist.barrier()
        t = _start_tensor(r, cfg.size, dev)
        record("barrier", t, t, waited_s=time.time() - t0)
        return records


def tour_figure(records: list[dict]):
    """One row per collective, one column per rank, before → after, drawn from the logged tensors."""
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
                ax.text(0.0, 1.35, f"rank {rank}", transform=ax.transAxes, fontsize=10, color="tab:blue")
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
        self.module, self.world_size = module, ctx.world_size
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


def scratch_worker(cfg: ddp.DDPConfig) -> dict:
    """:func:`mgtutorial.ddp.worker`'s training, with :class:`FromScratchDDP` instead of DDP.

    Trains ``cfg.max_steps`` steps of epoch 0 and saves the final parameters to ``cfg.checkpoint``
    (rank 0). Returns {"steps", "allreduce_calls_per_step"}.
    """
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx, runlog.RunLog() as log:
        model, train_set, _, optimizer = ddp.build(cfg, ctx, wrap=apply_from_scratch_ddp)
        loader = ddp.rank_loader(train_set, cfg, ctx.rank, ctx.world_size)
        loss_fn, calls, step = nn.CrossEntropyLoss(), 0, 0
        for step, (x, y) in enumerate(loader, start=1):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x.to(ctx.device)), y.to(ctx.device))
            loss.backward()
            calls = model.average_gradients()  # the line DDP does for you, during backward
            optimizer.step()
            ddp.log_step(log, ctx, step=step, epoch=0, loss=loss.item(), samples=step * len(y))
            if step == cfg.max_steps:
                break
        if ctx.is_main and cfg.checkpoint:
            ddp.save_checkpoint(cfg.checkpoint, model.module, optimizer, 1, step)
        return {"steps": step, "allreduce_calls_per_step": calls}


# ---------------------------------------------------------------------------------------------
# 3. Buckets, communication hooks and gradient accumulation with no_sync


@dataclass(kw_only=True)
class HooksConfig(ddp.DDPConfig):
    """:class:`~mgtutorial.ddp.DDPConfig` plus the DDP knobs this section turns."""

    bucket_cap_mb: float = 25.0
    """DDP's bucket size in MiB: gradients are all-reduced in buckets of about this size."""
    accumulation_steps: int = 1
    """Micro-steps per optimizer step; all but the last run under ``no_sync`` (no communication)."""


def counting_allreduce_hook(state, bucket):
    """A DDP communication hook: records the bucket, then does DDP's usual all-reduce (average).

    ``(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]``; left unannotated
    because DDP checks the annotation's *object*, which ``from __future__ import annotations`` turns
    into a string.

    ``state["buckets"]`` collects ``(bucket index, elements, unix time)`` per call.
    """
    state["buckets"].append((bucket.index(), bucket.buffer().numel(), time.time()))
    return default_hooks.allreduce_hook(None, bucket)


def hooks_worker(cfg: HooksConfig) -> dict:
    """DDP with ``bucket_cap_mb`` and a counting comm hook; ``accumulation_steps`` micro-steps per
    optimizer step, all but the last under ``model.no_sync()``.

    Each micro-batch is ``cfg.batch_size`` per rank; its loss is divided by ``accumulation_steps``
    so the accumulated gradient is the mean over all micro-batches. Logs per optimizer step a
    ``kind="sync"`` record: ``allreduce_calls``, ``bucket_sizes`` (elements), ``backward_start``,
    ``backward_end`` and ``bucket_times`` (unix s). Saves the final parameters to ``cfg.checkpoint``.

    Raises:
        ValueError: ``accumulation_steps`` < 1.
    """
    if cfg.accumulation_steps < 1:
        raise ValueError(f"accumulation_steps={cfg.accumulation_steps}: need at least 1.")
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx, runlog.RunLog() as log:
        wrap = functools.partial(ddp.apply_ddp, bucket_cap_mb=cfg.bucket_cap_mb)
        model, train_set, _, optimizer = ddp.build(cfg, ctx, wrap=wrap)
        state = {"buckets": []}
        model.register_comm_hook(state, counting_allreduce_hook)
        loader = ddp.rank_loader(train_set, cfg, ctx.rank, ctx.world_size)
        loss_fn, k, batches = nn.CrossEntropyLoss(), cfg.accumulation_steps, iter(loader)
        for step in range(1, (cfg.max_steps or 1) + 1):
            optimizer.zero_grad(set_to_none=True)
            state["buckets"].clear()
            t0 = time.time()
            for micro in range(k):
                x, y = next(batches)
                last = micro == k - 1
                with (model.no_sync() if not last else contextlib.nullcontext()):
                    (loss_fn(model(x.to(ctx.device)), y.to(ctx.device)) / k).backward()
            t1 = time.time()
            optimizer.step()
            log.write(kind="sync", step=step, allreduce_calls=len(state["buckets"]),
                      bucket_sizes=[b[1] for b in state["buckets"]], bucket_times=[b[2] for b in state["buckets"]],
                      backward_start=t0, backward_end=t1)
        if ctx.is_main and cfg.checkpoint:
            ddp.save_checkpoint(cfg.checkpoint, model, optimizer, 1, step)
        return {"steps": step, "allreduce_calls_last_step": len(state["buckets"])}


# ---------------------------------------------------------------------------------------------
# 4. Parameters the loss never uses; uneven inputs; SyncBatchNorm


class CNNWithUnusedHead(models.ArticleCNN):
    """The article's CNN plus an ``aux_head`` layer that ``forward`` never uses (a common leftover)."""

    def __init__(self, in_shape=(3, 32, 32), num_classes: int = 10):
        super().__init__(in_shape, num_classes)
        self.aux_head = nn.Linear(64, 2)


@dataclass(kw_only=True)
class PitfallConfig(ddp.DDPConfig):
    """:class:`~mgtutorial.ddp.DDPConfig` plus the switches that break (and fix) DDP."""

    unused_layer: bool = False
    """Train :class:`CNNWithUnusedHead` (a parameter the loss never reaches)."""
    find_unused_parameters: bool = False
    """DDP's fix for that: search the autograd graph for unused parameters every step."""
    extra_batches_last_rank: int = 0
    """Uneven inputs: the last rank trains this many more batches than the others."""
    use_join: bool = False
    """Wrap the loop in ``Join([model])`` so ranks that run out of data shadow the others' all-reduces."""


def pitfall_worker(cfg: PitfallConfig) -> dict:
    """DDP training with the chosen pitfall switched on (see :class:`PitfallConfig`).

    Every rank trains ``cfg.max_steps`` batches (the last rank ``extra_batches_last_rank`` more);
    only local losses are logged, since a per-step all-reduce of the loss is itself a collective
    that ``Join`` does not cover. Returns {"steps"}.

    Raises (in the ranks, surfacing as WorkerFailed): DDP's "Expected to have finished reduction"
    error for an unused layer without ``find_unused_parameters``; a collective timeout for uneven
    inputs without ``Join``.
    """
    model_cls = CNNWithUnusedHead if cfg.unused_layer else models.ArticleCNN
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx, runlog.RunLog() as log:
        wrap = functools.partial(ddp.apply_ddp, find_unused_parameters=cfg.find_unused_parameters)
        model, train_set, _, optimizer = ddp.build(cfg, ctx, wrap=wrap, model_cls=model_cls)
        loader = ddp.rank_loader(train_set, cfg, ctx.rank, ctx.world_size)
        steps = (cfg.max_steps or 4) + (cfg.extra_batches_last_rank if ctx.rank == ctx.world_size - 1 else 0)
        loss_fn, step = nn.CrossEntropyLoss(), 0
        with Join([model]) if cfg.use_join else contextlib.nullcontext():
            for step, (x, y) in enumerate(loader, start=1):
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(x.to(ctx.device)), y.to(ctx.device))
                loss.backward()
                optimizer.step()
                log.write(kind="train_local", step=step, epoch=0, loss=loss.item())
                if step == steps:
                    break
        log.write(kind="loop_done", step=step)
        return {"steps": step}


def apply_sync_batchnorm(model: nn.Module, ctx: env.DistContext) -> nn.Module:
    """Convert every BatchNorm layer to SyncBatchNorm (batch statistics computed over all ranks).

    Call after the model is on its device and before wrapping it in DDP.

    Raises:
        RuntimeError: the rank's device is not a CUDA GPU — SyncBatchNorm's kernels are GPU-only,
            and we refuse here, before any training, rather than fail at the first forward pass.
    """
    if ctx.device.type != "cuda":
        raise RuntimeError(
            f"SyncBatchNorm needs a CUDA GPU per rank, but this rank runs on {ctx.device}. "
            "On CPU keep plain BatchNorm (statistics per rank) or use GroupNorm/LayerNorm, which "
            "need no synchronisation; on a GPU machine use backend 'auto' or 'nccl'."
        )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model.to(ctx.device))


@dataclass(kw_only=True)
class BatchNormConfig:
    """Configuration of :func:`sync_batchnorm_worker`."""

    backend: str = "auto"
    """"auto" | "gloo" | "nccl"; SyncBatchNorm needs "nccl" (GPUs)."""
    batch_size: int = 8
    """Samples per rank."""
    channels: int = 4
    """Channels of the BatchNorm layer."""


def sync_batchnorm_worker(cfg: BatchNormConfig) -> dict:
    """One forward pass through ``BatchNorm2d`` converted to SyncBatchNorm; returns the running mean.

    Each rank feeds a batch whose mean is its rank, so the synchronised running mean is the mean
    over ranks. Refuses on CPU before any work (see :func:`apply_sync_batchnorm`).
    """
    with env.distributed(cfg.backend) as ctx:
        model = apply_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(cfg.channels, momentum=1.0)), ctx)
        model = DDP(model, device_ids=[ctx.device.index])
        x = torch.randn(cfg.batch_size, cfg.channels, 4, 4, device=ctx.device) * 0.01 + ctx.rank
        model(x)
        return {"running_mean": model.module[0].running_mean.tolist()}


__all__ = [
    "BatchNormConfig", "CNNWithUnusedHead", "FromScratchDDP", "HooksConfig", "PitfallConfig", "TourConfig",
    "apply_from_scratch_ddp", "apply_sync_batchnorm", "collectives_tour", "counting_allreduce_hook",
    "hooks_worker", "pitfall_worker", "scratch_worker", "sync_batchnorm_worker", "tour_figure",
]
