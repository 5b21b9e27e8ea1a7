"""DDP's knobs and pitfalls: buckets and communication hooks, gradient accumulation with
``no_sync``, parameters the loss never uses, uneven inputs (``Join``), SyncBatchNorm.

Taught in notebooks/03_ddp_internals.ipynb. Follows
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
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from . import ddp, env, models, runlog

# ---------------------------------------------------------------------------------------------
# 1. Buckets, communication hooks and gradient accumulation with no_sync


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
# 2. Parameters the loss never uses; uneven inputs; SyncBatchNorm


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
    "BatchNormConfig", "CNNWithUnusedHead", "HooksConfig", "PitfallConfig", "apply_sync_batchnorm",
    "counting_allreduce_hook", "hooks_worker", "pitfall_worker", "sync_batchnorm_worker",
]
