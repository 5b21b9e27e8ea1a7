"""SyncBatchNorm: batch statistics over the samples of every rank, by hand and the library's.

Taught in notebooks/03c_ddp_pitfalls.ipynb (section 2). Follows
https://pytorch.org/docs/stable/generated/torch.nn.SyncBatchNorm.html.

torch's ``nn.SyncBatchNorm`` has CUDA kernels only. Its worker, :func:`sync_batchnorm_worker`,
therefore takes the conversion from its config: ``sync_layer="torch"`` converts with
``nn.SyncBatchNorm.convert_sync_batchnorm`` (a GPU per rank: the notebook's GPU cell and
``make gpu-check``'s item ``sync_batchnorm``), ``sync_layer="by_hand"`` with
:func:`convert_by_hand`, whose :class:`SyncBatchNormByHand` computes the same forward pass from
:func:`synced_batch_stats` on any backend (the CPU test). Everything else in the worker is the
same code on both paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from mgtutorial.common.config import Config
from mgtutorial.runtime import env

SyncLayer = Literal["torch", "by_hand"]
"""Which SyncBatchNorm a model is converted to: torch's (CUDA only) or
:class:`SyncBatchNormByHand` (any backend)."""


@dataclass(kw_only=True)
class BatchNormConfig(Config):
    """Configuration of :func:`batchnorm_by_hand_worker` and :func:`sync_batchnorm_worker`."""

    backend: env.BackendChoice = "auto"
    """Process-group backend; torch's SyncBatchNorm needs "nccl" (a CUDA GPU per rank)."""
    batch_size: int = 8
    """Samples on rank 0; rank r has ``batch_size + r`` (uneven, so the counts matter)."""
    channels: int = 4
    """Channels of the BatchNorm layer."""
    sync_layer: SyncLayer = "torch"
    """What :func:`sync_batchnorm_worker` converts BatchNorm to: "torch" (``nn.SyncBatchNorm``,
    GPUs only) or "by_hand" (:class:`SyncBatchNormByHand`, any backend)."""


def batchnorm_inputs(cfg: BatchNormConfig, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input, ``(batch_size + rank, channels, 4, 4)``, seeded by rank, mean ≈
    rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(cfg.batch_size + rank, cfg.channels, 4, 4, generator=g) * (1 + rank) + rank


def synced_batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SyncBatchNorm's forward statistics by hand: each rank's per-channel mean, biased variance
    and count of ``x`` ``(N_r, C, H, W)`` are all-gathered and combined. Returns (mean ``(C,)``,
    variance ``(C,)``, count) of the batch of all ranks together."""
    c, dims = x.shape[1], [0, 2, 3]
    count = torch.tensor([x.numel() / c], device=x.device)
    mine = torch.cat([x.mean(dims), x.var(dims, unbiased=False), count])
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    mean, var, n = torch.stack(parts).split([c, c, 1], dim=1)  # (world, C), (world, C), (world, 1)
    total = n.sum()
    g_mean = (n * mean).sum(0) / total
    g_var = (n * (var + (mean - g_mean) ** 2)).sum(0) / total  # within-rank + between-rank variance
    return g_mean, g_var, total


def batchnorm_by_hand_worker(cfg: BatchNormConfig) -> dict:
    """Normalise :func:`batchnorm_inputs` with :func:`synced_batch_stats` (eps 1e-5, no affine).

    Returns ``out`` (this rank's normalised batch, nested lists), ``mean``, ``var`` (biased),
    ``count``.
    """
    with env.distributed(cfg.backend) as ctx:
        x = batchnorm_inputs(cfg, ctx.rank).to(ctx.device)
        mean, var, n = synced_batch_stats(x)
        out = (x - mean[None, :, None, None]) / torch.sqrt(var[None, :, None, None] + 1e-5)
        return {"out": out.tolist(), "mean": mean.tolist(), "var": var.tolist(), "count": n.item()}


class SyncBatchNormByHand(nn.BatchNorm2d):
    """``nn.SyncBatchNorm``'s forward pass in training, from :func:`synced_batch_stats` (one
    all-gather), on any device and backend: ``(N_r, C, H, W)`` in, the same shape out, normalised
    with the statistics of all ranks' batches together; the running statistics (the variance
    unbiased, as BatchNorm keeps it) move by ``momentum`` towards them. In eval mode, or without
    a process group, it is plain ``BatchNorm2d``.

    Forward only: the statistics are gathered outside autograd (torch's layer all-reduces two
    sums in its backward), so where a gradient would be needed it raises RuntimeError.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not dist.is_initialized():
            return super().forward(x)
        needs_grad = x.requires_grad or any(p.requires_grad for p in self.parameters())
        if torch.is_grad_enabled() and needs_grad:
            raise RuntimeError(
                "SyncBatchNormByHand computes the forward pass only; for training use "
                "nn.SyncBatchNorm on GPUs, or run this under torch.no_grad()."
            )
        mean, var, n = synced_batch_stats(x)
        if self.track_running_stats:
            self.num_batches_tracked += 1
            m = self.momentum if self.momentum is not None else 1 / self.num_batches_tracked.item()
            self.running_mean.lerp_(mean, m)
            self.running_var.lerp_(var * n / (n - 1), m)
        out = (x - mean[None, :, None, None]) / torch.sqrt(var[None, :, None, None] + self.eps)
        if self.affine:
            out = out * self.weight[None, :, None, None] + self.bias[None, :, None, None]
        return out


def convert_by_hand(module: nn.Module) -> nn.Module:
    """``nn.SyncBatchNorm.convert_sync_batchnorm`` with :class:`SyncBatchNormByHand`: every
    ``BatchNorm2d`` in ``module`` (``module`` itself included) is replaced by one with the same
    settings, parameters and running statistics. Returns the converted module."""
    if isinstance(module, nn.BatchNorm2d) and not isinstance(module, SyncBatchNormByHand):
        layer = SyncBatchNormByHand(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
        )
        layer.load_state_dict(module.state_dict())
        return layer.train(module.training)
    for name, child in module.named_children():
        module.add_module(name, convert_by_hand(child))
    return module


CONVERSIONS = {"torch": nn.SyncBatchNorm.convert_sync_batchnorm, "by_hand": convert_by_hand}
"""``sync_layer`` → the function that converts a model's BatchNorm layers."""


def apply_sync_batchnorm(
    model: nn.Module, ctx: env.DistContext, sync_layer: SyncLayer = "torch"
) -> nn.Module:
    """Move ``model`` to this rank's device and convert every BatchNorm layer to SyncBatchNorm
    (batch statistics computed over all ranks): torch's, or with ``sync_layer="by_hand"``
    :class:`SyncBatchNormByHand`. Call it before wrapping the model in DDP.

    Raises:
        RuntimeError: torch's layer on a rank whose device is not a CUDA GPU — SyncBatchNorm's
            kernels are GPU-only, and we refuse here, before any training, rather than fail at
            the first forward pass.
    """
    if sync_layer == "torch" and ctx.device.type != "cuda":
        raise RuntimeError(
            f"SyncBatchNorm needs a CUDA GPU per rank, but this rank runs on {ctx.device}. "
            "On CPU keep plain BatchNorm (statistics per rank) or use GroupNorm/LayerNorm, which "
            "need no synchronisation; on a GPU machine use backend 'auto' or 'nccl'."
        )
    return CONVERSIONS[sync_layer](model.to(ctx.device)).to(ctx.device)


def sync_batchnorm_worker(cfg: BatchNormConfig) -> dict:
    """``BatchNorm2d(affine=False)`` converted by :func:`apply_sync_batchnorm` (torch's
    SyncBatchNorm, or ``cfg.sync_layer="by_hand"``), one forward pass of
    :func:`batchnorm_inputs`. Returns ``out`` (nested lists) and ``running_mean``,
    ``running_var`` ``(channels,)`` (momentum 1: the batch's own statistics, the variance
    unbiased). With torch's layer it refuses on CPU before any work.
    """
    with env.distributed(cfg.backend) as ctx:
        bn = nn.BatchNorm2d(cfg.channels, momentum=1.0, affine=False)
        # not wrapped in DDP: this model has no parameter (affine=False), which DDP refuses
        model = apply_sync_batchnorm(nn.Sequential(bn), ctx, cfg.sync_layer)
        out = model(batchnorm_inputs(cfg, ctx.rank).to(ctx.device))
        layer = model[0]  # the converted layer: the conversion replaced `bn`
        return {
            "out": out.tolist(),
            "running_mean": layer.running_mean.tolist(),
            "running_var": layer.running_var.tolist(),
        }
