"""The model, batches, training loop and single-process reference that every part of chapter 07
shares, so that ZeRO by hand, DDP and FSDP2 are compared on the same numbers.

Taught in notebooks/07a_zero_memory.ipynb and notebooks/07b_fsdp2.ipynb. Every part trains the same
tiny :class:`BlockStack` on the same synthetic batches: rank r takes the r-th of N equal slices of
each global batch, so averaged gradients equal the gradients of one process on the whole batch.

The functions take the chapter's configuration, a
:class:`~mgtutorial.sharding.worker.ShardConfig` (they read ``blocks``, ``width``,
``out_features``, ``batch_size``, ``steps``, ``lr`` and ``seed``).
"""

from __future__ import annotations

import torch
from torch import nn

from mgtutorial.common.finite import check_loss
from mgtutorial.runtime import env


class Block(nn.Module):
    """``x + tanh(Linear(x))``: shapes (B, width) → (B, width)."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class BlockStack(nn.Module):
    """``blocks`` :class:`Block` s, then a ``Linear(width, out_features)`` head:
    (B, width) → (B, out_features)."""

    def __init__(self, blocks: int = 2, width: int = 10, out_features: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, out_features)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model(cfg, blocks: int | None = None) -> BlockStack:
    """The seeded model of ``cfg`` (identical on every rank and in the reference); ``blocks``
    overrides ``cfg.blocks``."""
    torch.manual_seed(cfg.seed)
    return BlockStack(cfg.blocks if blocks is None else blocks, cfg.width, cfg.out_features)


def batch(cfg, step: int, rank: int = 0, world_size: int = 1):
    """Rank ``rank``'s slice of global batch ``step``: X (B/N, width), y (B/N, out_features)."""
    g = torch.Generator().manual_seed(1000 * cfg.seed + step)
    x = torch.randn(cfg.batch_size, cfg.width, generator=g)
    y = torch.randn(cfg.batch_size, cfg.out_features, generator=g)
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def train(model, step_fn, cfg, ctx, zero_grad, first: int = 0) -> list[float]:
    """``cfg.steps`` steps of MSE on this rank's slices of batches ``first``, ``first + 1``, …,
    each ``zero_grad()``, forward, backward, ``step_fn()``; returns this rank's losses. Gradients
    stay after the last step (to measure)."""
    losses = []
    for step in range(first, first + cfg.steps):
        zero_grad()
        x, y = (t.to(ctx.device) for t in batch(cfg, step, ctx.rank, ctx.world_size))
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        step_fn()
        losses.append(check_loss(loss.item(), step=step + 1, cfg=cfg))
    return losses


def reference(cfg) -> tuple[BlockStack, list[float]]:
    """One process, AdamW on the whole batch: the model every parallel run must equal, and its
    losses."""
    model = make_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    ctx = env.DistContext.single_process()
    return model, train(model, opt.step, cfg, ctx, opt.zero_grad)
