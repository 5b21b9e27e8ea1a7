"""The article's second sample, its "model parallel" MLP: every rank trains the whole model on its
own shuffle of the data and never exchanges a gradient, so the ranks hold N unsynchronised copies,
not one model split over devices.

Taught in notebooks/06b_article_model_parallel.ipynb (its flaws) and first run in
notebooks/04a_pipeline_gpipe.ipynb, before the naive split of :mod:`mgtutorial.pipeline.naive`.
Follows
https://pytorch.org/tutorials/intermediate/model_parallel_tutorial.html (what a split model is)
and https://pytorch.org/docs/stable/notes/ddp.html (what keeps copies equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mgtutorial.common import compare, models
from mgtutorial.common.config import Config
from mgtutorial.pipeline import hand_gpipe
from mgtutorial.pipeline.schedules import PipelineConfig, build_stage, mlp_data
from mgtutorial.runtime import env, runlog


@dataclass(kw_only=True)
class ArticleConfig(Config):
    """Configuration of :func:`article_worker`."""

    steps: int = 5
    """Optimizer steps."""
    batch_size: int = 32
    """Samples per step on each rank."""
    lr: float = 0.05
    """SGD learning rate."""
    seed: int = 0
    """Seed of the initial weights (identical on every rank, so any difference is divergence)."""
    backend: env.BackendChoice = "auto"
    """The process group's backend; "auto": NCCL with a GPU per rank, else gloo."""


def article_batches(cfg: ArticleConfig, rank: int):
    """The article worker's data on ``rank``: its own shuffle of one shared data set; yields
    ``(x, y)`` per step, ``cfg.batch_size`` rows each (the same in a rank and in a single
    process)."""
    ds = mlp_data(cfg.steps * cfg.batch_size, seed=cfg.seed + 1)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(1000 + rank))
    for step in range(cfg.steps):
        idx = order[step * cfg.batch_size : (step + 1) * cfg.batch_size]
        yield ds.tensors[0][idx], ds.tensors[1][idx]


def checksum(model: nn.Module) -> float:
    """Sum of every parameter, in float64 on the CPU: equal on two copies that hold the same
    weights, whichever device each copy is on. Logged per step, so that the ranks' records show
    whether their copies agree."""
    return float(sum(p.detach().cpu().double().sum() for p in model.parameters()))


def article_worker(cfg: ArticleConfig) -> dict:
    """What the article's second sample does: every rank builds the *whole* MLP, trains it on its
    own shuffle of the data and never exchanges a gradient — N unsynchronised copies, not a split
    model.

    Logs ``kind="article_start"`` (parameter count and :func:`checksum` of the starting weights),
    then per step ``kind="article"`` with the same two and the loss, and writes its final parameters
    to ``<run dir>/rank<r>-model.pt``.
    """
    with env.distributed(cfg.backend) as ctx, runlog.RunLog() as log:
        env.seed_everything(cfg.seed)
        model = models.ArticleMLP().to(ctx.device)  # the whole model on every rank
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        n = models.count_parameters(model)
        log.write(kind="article_start", parameters=n, checksum=checksum(model))
        for step, (x, y) in enumerate(article_batches(cfg, ctx.rank), start=1):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
            loss.backward()  # and nothing is exchanged between the ranks
            opt.step()
            sums = checksum(model)
            log.write(kind="article", step=step, loss=loss.item(), parameters=n, checksum=sums)
        torch.save(model.state_dict(), runlog.run_dir() / f"rank{ctx.rank}-model.pt")
        return {"parameters": n}


def split_step_worker(cfg: ArticleConfig) -> dict[str, int]:
    """What real model parallelism exchanges, for comparison with the sample (06b section 2.4):
    one step of the same MLP split into stages, rank = stage (04a's naive split, by hand with one
    micro-batch: :func:`mgtutorial.pipeline.hand_gpipe.step`), while every c10d op is counted.
    Returns this rank's ``{op name: count}`` (on 2 ranks: one ``c10d.send`` and one
    ``c10d.recv_`` each, the activation forward and its gradient back)."""
    with env.distributed(cfg.backend) as ctx:
        env.seed_everything(cfg.seed)
        # only this rank's stage is built (04a's meta-device recipe)
        stage = build_stage(PipelineConfig(), ctx.rank, ctx.world_size).to(ctx.device)
        x, y = next(article_batches(cfg, 0))
        with compare.c10d_counting_mode() as mode:
            hand_gpipe.step(stage, x, y, 1, ctx)
        return mode.counts
