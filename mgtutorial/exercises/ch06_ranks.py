"""The rank side of chapter 06's checkers (notebooks/06a_article_ddp.ipynb and
notebooks/06b_article_model_parallel.ipynb): each worker is one of the article's samples, as
:mod:`mgtutorial.article` re-creates it, with the learner's function where the flaw was.

:mod:`mgtutorial.exercises.ch06a` and :mod:`mgtutorial.exercises.ch06b` launch them (06a.2,
06b.1, 06b.3) and read what they logged (``runlog``) or returned. Each loads the learner's
file in the rank with :func:`~mgtutorial.exercises._common.function_from`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mgtutorial.article import ddp_flaws
from mgtutorial.common.compare import c10d_counting_mode
from mgtutorial.common.config import Config
from mgtutorial.common.models import ArticleMLP
from mgtutorial.exercises._common import function_from
from mgtutorial.runtime import env, runlog


def logged(runs_dir: str | Path, name: str, kind: str) -> list[dict]:
    """The ``kind`` records of every run named ``name`` under ``runs_dir`` (a failed run's too:
    what its ranks logged before the failure)."""
    runs = sorted(Path(runs_dir).glob(f"{name}-*"))
    return [r for d in runs for r in runlog.of_kind(runlog.read_run(d), kind)]


# --- 06a.2: the epoch loss, over all ranks -------------------------------------------------------


@dataclass(kw_only=True)
class LossExerciseConfig(Config):
    """Configuration of :func:`loss_worker`."""

    path: str
    """The learner's file, defining ``epoch_loss(losses, ctx) -> float``."""
    seed: int = 0
    """Seed of the model and of each rank's batches."""


def loss_worker(cfg: LossExerciseConfig) -> dict:
    """Call the learner's ``epoch_loss(losses, ctx)`` on this rank's
    :func:`~mgtutorial.article.ddp_flaws.batch_losses`; log and return ``{"losses", "reported"}``
    (``kind="epoch_loss"``)."""
    epoch_loss = function_from(cfg.path, "epoch_loss")
    with env.distributed() as ctx, runlog.RunLog() as log:
        losses = ddp_flaws.batch_losses(ctx.rank, cfg.seed)
        reported = float(epoch_loss(losses, ctx))
        return log.write(kind="epoch_loss", losses=losses, reported=reported)


# --- 06b.1: the sample's copies, made one model -------------------------------------------------


@dataclass(kw_only=True)
class SyncConfig(Config):
    """Configuration of :func:`sync_worker`."""

    path: str
    """The learner's file, defining ``train_step(model, opt, x, y, ctx) -> float``."""
    sizes: list[int] = field(default_factory=lambda: [64, 32, 10])
    """The MLP's widths (``ArticleMLP(sizes)``): small, so that the ranks return their weights."""
    steps: int = 3
    """Steps of the sample's loop."""
    batch_size: int = 8
    """Samples per rank per step."""
    lr: float = 0.05
    """SGD's learning rate."""


def sample_batch(cfg: SyncConfig, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step`` of the sample's loop: its own samples (a generator seeded
    by both), the same in a rank and in the checker's one-process reference."""
    g = torch.Generator().manual_seed(1000 + 100 * rank + step)
    x = torch.randn(cfg.batch_size, cfg.sizes[0], generator=g)
    return x, torch.randint(0, cfg.sizes[-1], (cfg.batch_size,), generator=g)


def sync_worker(cfg: SyncConfig) -> dict:
    """The sample's loop once its group forms (✗ 2.2 fixed): the whole ``ArticleMLP(cfg.sizes)``
    from the same seed on every rank (✗ 2.1), SGD, this rank's own batches
    (:func:`sample_batch`), each step the learner's ``train_step``, counted with
    :func:`~mgtutorial.common.compare.c10d_counting_mode`. Returns ``{"rank", "state"}`` (the
    weights after the steps, as lists) and ``"c10d"`` (op → count, per step)."""
    train_step = function_from(cfg.path, "train_step")
    with env.distributed() as ctx:
        env.seed_everything(0)  # the same initial weights in every process, as the sample's seed
        model = ArticleMLP(sizes=cfg.sizes).to(ctx.device)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        counts: list[dict] = []
        for step in range(cfg.steps):
            x, y = (t.to(ctx.device) for t in sample_batch(cfg, ctx.rank, step))
            with c10d_counting_mode() as mode:
                train_step(model, opt, x, y, ctx)
            counts.append(dict(mode.counts))
        state = {k: v.detach().cpu().tolist() for k, v in model.state_dict().items()}
        return {"rank": ctx.rank, "state": state, "c10d": counts}


# --- 06b.3: the world a process group is told, on two nodes --------------------------------------


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
