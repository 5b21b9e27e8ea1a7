"""DDP's knobs and pitfalls: buckets and communication hooks, gradient accumulation with
``no_sync``, parameters the loss never uses, uneven inputs (``Join``), SyncBatchNorm.

Taught in notebooks/03b_ddp_internals.ipynb. Follows
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
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join

from mgtutorial import ddp
from mgtutorial.common import models

# ---------------------------------------------------------------------------------------------
from mgtutorial.runtime import env

# 1. Buckets, communication hooks and gradient accumulation with no_sync


@dataclass(kw_only=True)
class HooksConfig(ddp.DDPConfig):
    """:class:`~mgtutorial.ddp.DDPConfig` plus the DDP knobs this section turns."""

    bucket_cap_mb: float | None = None
    """DDP's bucket size in MiB (None: DDP's default, 25 MiB, the first bucket capped at
    ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` = 1 MiB)."""
    find_unused_parameters: bool = False
    """Passed to DDP; with it (and no ``static_graph``) DDP never rebuilds its buckets."""
    static_graph: bool = False
    """Passed to DDP: the graph is the same every step (buckets rebuilt once, before step 3)."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step; all but the last run under ``no_sync`` (no communication)."""

    def validate(self, world_size: int) -> None:
        """:meth:`DDPConfig.validate` plus ``accumulation_steps`` ≥ 1. Raises ValueError."""
        super().validate(world_size)
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={self.accumulation_steps}: need at least 1.")


def counting_allreduce_hook(state, bucket):
    """A DDP communication hook: records the bucket, then does DDP's usual all-reduce (average),
    and records when the all-reduce's future completes.

    ``(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]``; left unannotated
    because DDP checks the annotation's *object*, which ``from __future__ import annotations`` turns
    into a string.

    ``state["buckets"]`` collects one dict per call: ``index``, ``elements``, ``launched`` and
    ``done`` (unix s; ``done`` is set by the future's callback: on gloo when the data has been
    exchanged, on NCCL when the all-reduce is queued on its CUDA stream).
    """
    rec = {"index": bucket.index(), "elements": bucket.buffer().numel(), "launched": time.time()}
    state["buckets"].append(rec)

    def done(fut):
        rec["done"] = time.time()
        return fut.value()

    return default_hooks.allreduce_hook(None, bucket).then(done)


class AccumulationTrainer(ddp.Trainer):
    """:class:`~mgtutorial.ddp.Trainer` whose step accumulates gradients over ``accumulation_steps``
    micro-batches of ``cfg.batch_size`` (its loader deals ``batch_size × accumulation_steps``
    samples per step), all but the last under ``model.no_sync()``; each micro-batch's loss is
    divided by their number, so the gradient is the mean over all of them. ``max_steps`` counts
    optimizer steps, as everywhere. Logs a ``kind="sync"`` record per step: ``allreduce_calls``,
    ``bucket_sizes`` (elements), ``bucket_launched`` and ``bucket_done`` (unix s, per bucket),
    ``backward_start`` and ``backward_end`` (unix s, around the last micro-batch's ``backward()``).
    """

    def __init__(
        self, model, train_set, test_set, optimizer, ctx: env.DistContext, cfg: HooksConfig
    ):
        super().__init__(model, train_set, test_set, optimizer, ctx, cfg)
        big = dataclasses.replace(cfg, batch_size=cfg.batch_size * cfg.accumulation_steps)
        self.loader = ddp.rank_loader(train_set, big, ctx.rank, ctx.world_size)
        self.buckets = {"buckets": []}
        model.register_comm_hook(self.buckets, counting_allreduce_hook)

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        self.buckets["buckets"].clear()
        k, total = self.cfg.accumulation_steps, 0.0
        for micro, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):
            with self.model.no_sync() if micro < k - 1 else contextlib.nullcontext():
                loss = self.loss_fn(self.model(xm), ym) / k
                t0 = time.time()
                loss.backward()  # DDP all-reduces only in the last micro-batch's backward
                t1 = time.time()
            total += loss.item()
        self.optimizer.step()
        b = self.buckets["buckets"]
        self.log.write(
            kind="sync",
            step=self.step + 1,
            allreduce_calls=len(b),
            bucket_sizes=[s["elements"] for s in b],
            bucket_launched=[s["launched"] for s in b],
            bucket_done=[s.get("done") for s in b],
            backward_start=t0,
            backward_end=t1,
        )
        return total


def hooks_worker(cfg: HooksConfig) -> dict:
    """DDP with ``bucket_cap_mb`` and :func:`counting_allreduce_hook`, trained by
    :class:`AccumulationTrainer`. Returns the Trainer's summary.

    Raises:
        ValueError: ``accumulation_steps`` < 1 (``cfg.validate``, called before any rank starts).
    """
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        wrap = functools.partial(
            ddp.apply_ddp,
            bucket_cap_mb=cfg.bucket_cap_mb,
            static_graph=cfg.static_graph,
            find_unused_parameters=cfg.find_unused_parameters,
        )
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
    divide_by_initial_world_size: bool = True
    """Passed to DDP's join hook: divide the gradients by the initial world size (True) or by the
    number of ranks still training (False)."""


class PitfallTrainer(ddp.Trainer):
    """:class:`~mgtutorial.ddp.Trainer` for :class:`PitfallConfig`: the last rank trains
    ``extra_batches_last_rank`` more steps; the epoch runs inside ``Join([model])`` if
    ``use_join``. Logs only local losses (``kind="train_local"``): the all-reduced loss of every
    step is itself a collective that ``Join`` does not cover. Logs ``kind="loop_done"`` after the loop.
    With ``use_join`` it also logs ``kind="grad_scale"`` per step: ``ratio`` = ‖DDP's gradient‖ /
    ‖this rank's own gradient‖ (computed with ``torch.autograd.grad``, which DDP does not reduce).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.ctx.rank == self.ctx.world_size - 1:
            self.max_steps = (self.max_steps or 4) + self.cfg.extra_batches_last_rank

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if not self.cfg.use_join:
            return super()._run_batch(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        params = list(self.model.parameters())
        own = torch.autograd.grad(
            loss, params, retain_graph=True
        )  # this rank's gradient, not reduced
        loss.backward()  # DDP's all-reduce (a joined rank contributes zeros)
        ratio = (
            torch.cat([p.grad.flatten() for p in params]).norm()
            / torch.cat([g.flatten() for g in own]).norm()
        )
        self.log.write(kind="grad_scale", step=self.step + 1, ratio=ratio.item())
        self.optimizer.step()
        return loss.item()

    def _log_step(self, epoch: int, loss: float) -> float:
        return self.log.write(kind="train_local", step=self.step, epoch=epoch, loss=loss)["loss"]

    def _run_epoch(self, epoch: int) -> float:
        join = Join(
            [self.model], divide_by_initial_world_size=self.cfg.divide_by_initial_world_size
        )
        with join if self.cfg.use_join else contextlib.nullcontext():
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
        return {
            "steps": PitfallTrainer(model, train_set, test_set, optimizer, ctx, cfg).train()[
                "steps"
            ]
        }


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
    """Configuration of :func:`batchnorm_by_hand_worker` and :func:`sync_batchnorm_worker`."""

    backend: str = "auto"
    """"auto" | "gloo" | "nccl"; the library's SyncBatchNorm needs "nccl" (GPUs)."""
    batch_size: int = 8
    """Samples on rank 0; rank r has ``batch_size + r`` (uneven, so the counts matter)."""
    channels: int = 4
    """Channels of the BatchNorm layer."""


def batchnorm_inputs(cfg: BatchNormConfig, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input, ``(batch_size + rank, channels, 4, 4)``, seeded by rank, mean ≈ rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(cfg.batch_size + rank, cfg.channels, 4, 4, generator=g) * (1 + rank) + rank


def synced_batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SyncBatchNorm's forward statistics by hand: each rank's per-channel mean, biased variance and
    count of ``x`` ``(N_r, C, H, W)`` are all-gathered and combined. Returns (mean ``(C,)``, variance
    ``(C,)``, count) of the batch of all ranks together."""
    c, dims = x.shape[1], [0, 2, 3]
    mine = torch.cat([x.mean(dims), x.var(dims, unbiased=False), torch.tensor([x.numel() / c])])
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    mean, var, n = torch.stack(parts).split([c, c, 1], dim=1)  # (world, C), (world, C), (world, 1)
    total = n.sum()
    g_mean = (n * mean).sum(0) / total
    g_var = (n * (var + (mean - g_mean) ** 2)).sum(0) / total  # within-rank + between-rank variance
    return g_mean, g_var, total


def batchnorm_by_hand_worker(cfg: BatchNormConfig) -> dict:
    """Normalise :func:`batchnorm_inputs` with :func:`synced_batch_stats` (eps 1e-5, no affine).

    Returns ``out`` (this rank's normalised batch, nested lists), ``mean``, ``var`` (biased), ``count``.
    """
    with env.distributed(cfg.backend) as ctx:
        x = batchnorm_inputs(cfg, ctx.rank).to(ctx.device)
        mean, var, n = synced_batch_stats(x)
        out = (x - mean[None, :, None, None]) / torch.sqrt(var[None, :, None, None] + 1e-5)
        return {"out": out.tolist(), "mean": mean.tolist(), "var": var.tolist(), "count": n.item()}


def sync_batchnorm_worker(cfg: BatchNormConfig) -> dict:
    """The library's version: ``BatchNorm2d(affine=False)`` converted to SyncBatchNorm, one forward
    pass of :func:`batchnorm_inputs`. Returns ``out`` and ``running_mean``, ``running_var``
    (momentum 1: the batch's own statistics). Refuses on CPU before any work
    (see :func:`apply_sync_batchnorm`).
    """
    with env.distributed(cfg.backend) as ctx:
        bn = nn.BatchNorm2d(cfg.channels, momentum=1.0, affine=False)
        # not wrapped in DDP: this model has no parameter (affine=False), which DDP refuses
        model = apply_sync_batchnorm(nn.Sequential(bn), ctx)
        out = model(batchnorm_inputs(cfg, ctx.rank).to(ctx.device))
        layer = model.module[0]
        return {
            "out": out.tolist(),
            "running_mean": layer.running_mean.tolist(),
            "running_var": layer.running_var.tolist(),
        }


__all__ = [
    "AccumulationTrainer",
    "BatchNormConfig",
    "batchnorm_by_hand_worker",
    "batchnorm_inputs",
    "synced_batch_stats",
    "CNNWithUnusedHead",
    "HooksConfig",
    "PitfallConfig",
    "PitfallTrainer",
    "apply_sync_batchnorm",
    "counting_allreduce_hook",
    "hooks_worker",
    "pitfall_worker",
    "sync_batchnorm_worker",
]
