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
import dataclasses
import functools
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from . import ddp, env, models

# ---------------------------------------------------------------------------------------------
# 1. Buckets, communication hooks and gradient accumulation with no_sync


@dataclass(kw_only=True)
class HooksConfig(ddp.DDPConfig):
    """:class:`~mgtutorial.ddp.DDPConfig` plus the DDP knobs this section turns."""

    bucket_cap_mb: float = 25.0
    """DDP's bucket size in MiB: gradients are all-reduced in buckets of about this size."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step; all but the last run under ``no_sync`` (no communication)."""

    def validate(self, world_size: int) -> None:
        """:meth:`DDPConfig.validate` plus ``accumulation_steps`` ≥ 1. Raises ValueError."""
        super().validate(world_size)
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={self.accumulation_steps}: need at least 1.")


def counting_allreduce_hook(state, bucket):
    """A DDP communication hook: records the bucket, then does DDP's usual all-reduce (average).

    ``(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]``; left unannotated
    because DDP checks the annotation's *object*, which ``from __future__ import annotations`` turns
    into a string.

    ``state["buckets"]`` collects ``(bucket index, elements, unix time)`` per call.
    """
    state["buckets"].append((bucket.index(), bucket.buffer().numel(), time.time()))
    return default_hooks.allreduce_hook(None, bucket)


class AccumulationTrainer(ddp.Trainer):
    """:class:`~mgtutorial.ddp.Trainer` whose step accumulates gradients over ``accumulation_steps``
    micro-batches of ``cfg.batch_size`` (its loader deals ``batch_size × accumulation_steps``
    samples per step), all but the last under ``model.no_sync()``; each micro-batch's loss is
    divided by their number, so the gradient is the mean over all of them. ``max_steps`` counts
    optimizer steps, as everywhere. Logs a ``kind="sync"`` record per step: ``allreduce_calls``,
    ``bucket_sizes`` (elements), ``bucket_times``, ``backward_start`` and ``backward_end`` (unix s).
    """

    def __init__(self, model, train_set, test_set, optimizer, ctx: env.DistContext, cfg: HooksConfig):
        super().__init__(model, train_set, test_set, optimizer, ctx, cfg)
        big = dataclasses.replace(cfg, batch_size=cfg.batch_size * cfg.accumulation_steps)
        self.loader = ddp.rank_loader(train_set, big, ctx.rank, ctx.world_size)
        self.buckets = {"buckets": []}
        model.register_comm_hook(self.buckets, counting_allreduce_hook)

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        self.buckets["buckets"].clear()
        k, total, t0 = self.cfg.accumulation_steps, 0.0, time.time()
        for micro, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):
            with self.model.no_sync() if micro < k - 1 else contextlib.nullcontext():
                loss = self.loss_fn(self.model(xm), ym) / k
                loss.backward()  # DDP all-reduces only in the last micro-batch's backward
            total += loss.item()
        t1 = time.time()
        self.optimizer.step()
        b = self.buckets["buckets"]
        self.log.write(kind="sync", step=self.step + 1, allreduce_calls=len(b), bucket_sizes=[s[1] for s in b],
                       bucket_times=[s[2] for s in b], backward_start=t0, backward_end=t1)
        return total


def hooks_worker(cfg: HooksConfig) -> dict:
    """DDP with ``bucket_cap_mb`` and :func:`counting_allreduce_hook`, trained by
    :class:`AccumulationTrainer`. Returns the Trainer's summary.

    Raises:
        ValueError: ``accumulation_steps`` < 1 (``cfg.validate``, called before any rank starts).
    """
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        wrap = functools.partial(ddp.apply_ddp, bucket_cap_mb=cfg.bucket_cap_mb)
        model, train_set, test_set, optimizer = ddp.build(cfg, ctx, wrap=wrap)
        return AccumulationTrainer(model, train_set, test_set, optimizer, ctx, cfg).train()


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


class PitfallTrainer(ddp.Trainer):
    """:class:`~mgtutorial.ddp.Trainer` for :class:`PitfallConfig`: the last rank trains
    ``extra_batches_last_rank`` more steps; the epoch runs inside ``Join([model])`` if
    ``use_join``. Logs only local losses (``kind="train_local"``): the all-reduced loss of every
    step is itself a collective that ``Join`` does not cover. Logs ``kind="loop_done"`` after the loop.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.ctx.rank == self.ctx.world_size - 1:
            self.max_steps = (self.max_steps or 4) + self.cfg.extra_batches_last_rank

    def _log_step(self, epoch: int, loss: float) -> float:
        return self.log.write(kind="train_local", step=self.step, epoch=epoch, loss=loss)["loss"]

    def _run_epoch(self, epoch: int) -> float:
        with Join([self.model]) if self.cfg.use_join else contextlib.nullcontext():
            loss = super()._run_epoch(epoch)
        self.log.write(kind="loop_done", step=self.step)
        return loss


def pitfall_worker(cfg: PitfallConfig) -> dict:
    """DDP training with the chosen pitfall switched on (see :class:`PitfallConfig`), trained by
    :class:`PitfallTrainer`. Returns {"steps"}.

    Raises (in the ranks, surfacing as WorkerFailed): DDP's "Expected to have finished reduction"
    error for an unused layer without ``find_unused_parameters``; a collective timeout for uneven
    inputs without ``Join``.
    """
    model_cls = CNNWithUnusedHead if cfg.unused_layer else models.ArticleCNN
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        wrap = functools.partial(ddp.apply_ddp, find_unused_parameters=cfg.find_unused_parameters)
        model, train_set, test_set, optimizer = ddp.build(cfg, ctx, wrap=wrap, model_cls=model_cls)
        return {"steps": PitfallTrainer(model, train_set, test_set, optimizer, ctx, cfg).train()["steps"]}


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
    "AccumulationTrainer", "BatchNormConfig", "CNNWithUnusedHead", "HooksConfig", "PitfallConfig", "PitfallTrainer", "apply_sync_batchnorm",
    "counting_allreduce_hook", "hooks_worker", "pitfall_worker", "sync_batchnorm_worker",
]
