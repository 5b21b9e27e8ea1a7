"""Model parallelism without a pipeline: the article's "model parallel" sample (N unsynchronised
copies) and the naive split of one model over two devices in one process.

Taught in notebooks/04_model_parallel.ipynb (the naive split) and
notebooks/06b_article_model_parallel.ipynb (the article's copies). Follows
https://pytorch.org/tutorials/intermediate/model_parallel_tutorial.html (the naive split).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mgtutorial.common import models
from mgtutorial.pipeline.schedules import PipelineConfig, batches, mlp_data
from mgtutorial.pipeline.timeline import Timeline
from mgtutorial.runtime import env, runlog


@dataclass(kw_only=True)
class ArticleConfig:
    """Configuration of :func:`article_worker`."""

    steps: int = 5
    """Optimizer steps."""
    batch_size: int = 32
    """Samples per step on each rank."""
    lr: float = 0.05
    """SGD learning rate."""
    seed: int = 0
    """Seed of the initial weights (identical on every rank, so any difference is divergence)."""
    backend: str = "auto"
    """"auto" | "gloo" | "nccl"."""


def article_batches(cfg: ArticleConfig, rank: int):
    """The article worker's data on ``rank``: its own shuffle of one shared data set; yields ``(x, y)``
    per step, ``cfg.batch_size`` rows each (the same in a rank and in a single process)."""
    ds = mlp_data(cfg.steps * cfg.batch_size, seed=cfg.seed + 1)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(1000 + rank))
    for step in range(cfg.steps):
        idx = order[step * cfg.batch_size : (step + 1) * cfg.batch_size]
        yield ds.tensors[0][idx], ds.tensors[1][idx]


def checksum(model: nn.Module) -> float:
    """Sum of every parameter, in float64 on the CPU: equal on two copies that hold the same weights,
    whichever device each copy is on."""
    return float(sum(p.detach().cpu().double().sum() for p in model.parameters()))


def article_worker(cfg: ArticleConfig) -> dict:
    """What the article's second sample does: every rank builds the *whole* MLP, trains it on its own
    shuffle of the data and never exchanges a gradient — N unsynchronised copies, not a split model.

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
            log.write(
                kind="article", step=step, loss=loss.item(), parameters=n, checksum=checksum(model)
            )
        torch.save(model.state_dict(), runlog.run_dir() / f"rank{ctx.rank}-model.pt")
        return {"parameters": n}


def combined_batch_reference(cfg: ArticleConfig, nprocs: int = 2) -> dict:
    """The state dict of one model trained in this process on the ``nprocs`` ranks' batches of each
    step at once: what synchronised copies (mean gradient, equal batch sizes) must end with."""
    env.seed_everything(cfg.seed)
    model = models.ArticleMLP()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for step in zip(*(article_batches(cfg, r) for r in range(nprocs))):
        opt.zero_grad()
        x, y = (torch.cat(t) for t in zip(*step))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def naive_devices() -> list[torch.device]:
    """cuda:0 and cuda:1 with two GPUs, else the CPU twice (the same code either way)."""
    if env.gpu_count() >= 2:
        return [torch.device("cuda", 0), torch.device("cuda", 1)]
    return [torch.device("cpu")] * 2


class NaiveModelParallel(nn.Module):
    """The MLP cut in two, stage i on ``devices[i]``; ``forward`` moves activations between them.

    Only one device computes at a time: stage 1 waits for stage 0's output, and in backward
    stage 0 waits for stage 1's gradients. Shapes: ``(B, 1024)`` → ``(B, 100)`` on ``devices[-1]``.
    """

    def __init__(self, mlp: models.ArticleMLP, devices: list[torch.device]):
        super().__init__()
        self.devices = devices
        self.stages = nn.ModuleList(st.to(d) for st, d in zip(mlp.split(len(devices)), devices))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, device in zip(self.stages, self.devices):
            x = stage(x.to(device))
        return x


def train_naive(
    cfg: PipelineConfig, devices: list[torch.device] | None = None
) -> tuple[nn.Module, list[dict]]:
    """Train :class:`NaiveModelParallel` in this process on :func:`batches`; returns (model, events).

    Events are the same records :class:`Timeline` logs (forward/backward per stage), in memory.
    """
    env.seed_everything(cfg.seed)
    model = NaiveModelParallel(models.ArticleMLP(tuple(cfg.sizes)), devices or naive_devices())
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)

    memory = runlog.MemoryLog()
    timelines = [Timeline(st, i, memory) for i, st in enumerate(model.stages)]
    for step, (x, y) in enumerate(batches(cfg), start=1):
        for t in timelines:
            t.new_step(step)
        opt.zero_grad()
        out = model(x.to(model.devices[0]))
        nn.functional.cross_entropy(out, y.to(out.device)).backward()  # targets to the last device
        opt.step()
    return model, memory.records
