"""Setting up one DDP rank: its loader, its wrapped model and optimizer, and its step record.

These are the package's lines for what chapter 02 adds to chapter 01's loop
(notebooks/02_ddp.ipynb, "What changed"): :func:`rank_loader` (a ``DistributedSampler`` per
rank), :func:`apply_ddp` (the model on the rank's device first, then DDP), :func:`build` (a seeded
model, the data and the optimizer) and :func:`log_step` (this rank's loss and the all-reduced
global loss). :class:`mgtutorial.ddp.trainer.Trainer` and the workers of every later chapter call
them. Follows https://pytorch.org/tutorials/intermediate/ddp_tutorial.html.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mgtutorial.common import data, models
from mgtutorial.runtime import env, runlog


def rank_loader(train_set, cfg, rank: int, world_size: int, epoch: int = 0):
    """Rank ``rank``'s training loader for ``cfg`` (a :class:`~mgtutorial.ddp.trainer.DDPConfig`:
    per-rank batch, seed, shuffle), set to ``epoch``: the one place the workers and the
    single-process reference build it, so they all draw the same indices (see
    :func:`mgtutorial.common.data.train_loader`)."""
    loader = data.train_loader(
        train_set, cfg.batch_size, rank, world_size, seed=cfg.seed, shuffle=cfg.shuffle
    )
    loader.sampler.set_epoch(epoch)
    return loader


def log_step(
    log: runlog.RunLog, ctx: env.DistContext, *, step: int, epoch: int, loss: float, samples: int
) -> dict:
    """Log one training step: this rank's ``loss`` and ``global_loss``, its all-reduced mean.
    Every rank must call it at every step (``global_loss`` is a collective)."""
    return log.train(
        step=step, epoch=epoch, loss=loss, global_loss=env.global_mean(loss, ctx), samples=samples
    )


def apply_ddp(model: nn.Module, ctx: env.DistContext, **ddp_kwargs) -> nn.Module:
    """Move ``model`` to this rank's device, then wrap it in DDP (``device_ids`` only on GPU).

    ``ddp_kwargs`` go to DDP (``bucket_cap_mb``, ``find_unused_parameters``, … — chapter 03).
    Returns the model unchanged when there is no process group (a plain single process).
    """
    model = model.to(ctx.device)
    if not ctx.initialized:
        return model
    return DDP(
        model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None, **ddp_kwargs
    )


def build(cfg, ctx: env.DistContext, wrap=apply_ddp, model_cls=models.ArticleCNN):
    """Seeded model, datasets and optimizer for ``cfg`` (a
    :class:`~mgtutorial.ddp.trainer.DDPConfig`) → (model, train_set, test_set, optimizer).

    ``wrap(model, ctx)`` moves and wraps the model (default :func:`apply_ddp`);
    ``model_cls(in_shape=...)`` builds it (default the article's CNN).
    """
    env.seed_everything(cfg.seed)
    if not cfg.tf32:
        models.disable_tf32()
    train_set, test_set = data.load_dataset(cfg.dataset, cfg.data_root, cfg.download, seed=cfg.seed)
    in_shape = tuple(train_set[0][0].shape)
    model = wrap(model_cls(in_shape=in_shape), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    return model, train_set, test_set, optimizer
