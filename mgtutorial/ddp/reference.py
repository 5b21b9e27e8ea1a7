"""The single-process reference DDP must equal: one plain process trained on the combined batch.

Chapter 02's central claim (notebooks/02_ddp.ipynb, section 4): k steps on n ranks of b samples
each give the parameters of one process taking k steps on batches of n·b samples, the union of
what the ranks saw, because the gradient of the combined batch's mean loss is the average of the
ranks' gradients, which DDP's all-reduce computes. Every later chapter that trains the CNN in
parallel compares with it (03a, 03b, 05b, 09), and so do the tests.
"""

from __future__ import annotations

import torch
from torch import nn

from mgtutorial.ddp.setup import build, rank_loader
from mgtutorial.ddp.trainer import DDPConfig
from mgtutorial.runtime import env


def combined_batch_reference(cfg: DDPConfig, world_size: int) -> nn.Module:
    """One plain process trained, step by step, on the union of what ``world_size`` DDP ranks see
    (their DistributedSamplers' indices): one batch of ``batch_size × world_size``. With equal
    per-rank batches its mean loss has the average of the ranks' gradients, what DDP's all-reduce
    computes. Runs the steps the ranks take, ``cfg.max_steps`` (required, else ValueError) or
    fewer when ``cfg.epochs`` ends first, all in epoch 0 (ValueError when the ranks would go on
    into epoch 1); returns the model (CPU)."""
    if cfg.max_steps is None:
        raise ValueError("combined_batch_reference needs cfg.max_steps.")
    ctx = env.DistContext.single_process()
    model, train_set, _, optimizer = build(cfg, ctx)
    loaders = [rank_loader(train_set, cfg, r, world_size) for r in range(world_size)]
    loss_fn = nn.CrossEntropyLoss()
    per_epoch = min(len(loader) for loader in loaders)
    if min(cfg.max_steps, cfg.epochs * per_epoch) > per_epoch:
        raise ValueError(
            f"combined_batch_reference: epoch 0 has {per_epoch} steps of {cfg.batch_size} per "
            f"rank on {world_size} rank(s), and the ranks go on into epoch 1 before "
            f"max_steps={cfg.max_steps}; lower batch_size or max_steps"
        )
    for step, batches in enumerate(zip(*loaders)):
        if step >= cfg.max_steps:
            break
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
    return model
