"""The rank side of chapter 06's checkers (notebooks/06a_article_ddp.ipynb and
notebooks/06b_article_model_parallel.ipynb): each worker is one of the article's samples, as
:mod:`mgtutorial.article` re-creates it, with the learner's function where the flaw was.

:mod:`mgtutorial.exercises.ch06a` and :mod:`mgtutorial.exercises.ch06b` launch them (06a.2,
06b.2) and read what they logged (``runlog``) or returned. Each loads the learner's
file in the rank with :func:`~mgtutorial.exercises._common.function_from`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mgtutorial.article import ddp_flaws
from mgtutorial.common.config import Config
from mgtutorial.exercises._common import function_from
from mgtutorial.runtime import env, runlog


def logged(runs_dir: str | Path, name: str, kind: str) -> list[dict]:
    """The ``kind`` records of every run named ``name`` under ``runs_dir`` (a failed run's too:
    what its ranks logged before the failure)."""
    runs = sorted(Path(runs_dir).glob(f"{name}-*"))
    return [r for d in runs for r in runlog.of_kind(runlog.read_run(d), kind)]


# --- 06a.2: the epoch loss, over all ranks -------------------------------------------------------


def sized_batch_losses(
    rank: int, seed: int = 0, batch_size: int = 4
) -> tuple[list[float], list[int]]:
    """Rank ``rank``'s epoch as a loader without ``drop_last`` gives it: ``4 + 2 * rank`` batches
    (unequal on purpose), the last one shorter (``1 + 2 * rank`` samples), each batch's loss the
    mean cross-entropy over its samples of a fixed ``Linear(8, 3)`` on random data. Returns
    ``(losses, sizes)``, the same numbers in a rank and in a single process (exercise 06a.2;
    :func:`~mgtutorial.article.ddp_flaws.batch_losses`, section 1.7's, has equal batches)."""
    env.seed_everything(seed)
    model = nn.Linear(8, 3)
    g = torch.Generator().manual_seed(seed + 101 + rank)
    n = 4 + 2 * rank
    sizes = [batch_size] * (n - 1) + [1 + 2 * rank]
    with torch.no_grad():
        losses = [
            nn.functional.cross_entropy(
                model(torch.randn(b, 8, generator=g)), torch.randint(0, 3, (b,), generator=g)
            ).item()
            for b in sizes
        ]
    return losses, sizes


@dataclass(kw_only=True)
class LossExerciseConfig(Config):
    """Configuration of :func:`loss_worker`."""

    path: str
    """The learner's file, defining ``epoch_loss(losses, sizes, ctx) -> float``."""
    seed: int = 0
    """Seed of the model and of each rank's batches."""
    keep: list[int] | None = None
    """How many of its last batches each rank keeps (None: all of them, 4 and 6)."""


def loss_worker(cfg: LossExerciseConfig) -> dict:
    """Call the learner's ``epoch_loss(losses, sizes, ctx)`` on this rank's
    :func:`sized_batch_losses` (its last ``keep[rank]`` batches,
    the shorter last one included); log and return ``{"losses", "sizes", "reported"}``
    (``kind="epoch_loss"``)."""
    epoch_loss = function_from(cfg.path, "epoch_loss")
    with env.distributed() as ctx, runlog.RunLog() as log:
        losses, sizes = sized_batch_losses(ctx.rank, cfg.seed)
        if cfg.keep:
            losses, sizes = losses[-cfg.keep[ctx.rank] :], sizes[-cfg.keep[ctx.rank] :]
        reported = float(epoch_loss(list(losses), list(sizes), ctx))
        return log.write(kind="epoch_loss", losses=losses, sizes=sizes, reported=reported)


# --- 06b.2: the world a process group is told, on two nodes --------------------------------------


@dataclass(kw_only=True)
class WorldConfig(Config):
    """Configuration of :func:`world_worker`."""

    path: str
    """The learner's file, defining ``join(part) -> {"world_size", "rank", "stage"}``."""
    subnets: int = 3
    """Processes per simulated node, one per sub-network: rank r plays part r % subnets of node
    r // subnets."""
    timeout_s: float = 3.0
    """How long the process group waits for ranks that never join."""


def world_worker(cfg: WorldConfig) -> dict:
    """Join a gloo group with the world size and rank the learner's ``join(part)`` gives this
    process on its simulated node (``part``: the sub-network it was started for, as the sample's
    ``mp.Process(args=(i, …))``); logs ``kind="world_claim"`` before joining and returns the claim
    with the group's ``group_rank``/``group_world_size`` once a barrier has passed
    (:func:`~mgtutorial.article.ddp_flaws.join_claimed`)."""
    node, part = divmod(env.rank(), cfg.subnets)
    # as on a node of its own
    os.environ.update(LOCAL_RANK=str(part), LOCAL_WORLD_SIZE=str(cfg.subnets))
    claim = dict(function_from(cfg.path, "join")(part))
    fields = {k: claim.get(k) for k in ("world_size", "rank", "stage")}
    runlog.RunLog().write(kind="world_claim", node=node, part=part, **fields)
    group = ddp_flaws.join_claimed(int(claim["rank"]), int(claim["world_size"]), cfg.timeout_s)
    return {**claim, "group_rank": group["rank"], "group_world_size": group["world_size"]}
