"""The rank side of exercise 02.2 (notebooks/02_ddp.ipynb): the learner's ``train(cfg, ctx)``,
chapter 01's loop made one rank of DDP, run in each rank's process group; and the one-process
reference it is compared with (:func:`one_process`), which :mod:`mgtutorial.exercises.ch02` uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mgtutorial.common import data, models
from mgtutorial.common.config import Config
from mgtutorial.exercises._common import function_from
from mgtutorial.runtime import env, runlog


@dataclass(kw_only=True)
class RankExerciseConfig(Config):
    """What the learner's ``train(cfg)`` reads: the training of chapter 01 (its ``cfg``), for
    ``epochs`` epochs of the digits."""

    path: str
    """The learner's file, defining ``train(cfg, ctx) -> model``."""
    epochs: int = 2
    """Epochs to train (``set_epoch`` matters from the second one)."""
    batch_size: int = 32
    """Samples per rank per step."""
    lr: float = 0.01
    """SGD's learning rate."""
    momentum: float = 0.9
    """SGD's momentum."""
    backend: env.BackendChoice = "auto"
    """For ``env.distributed(cfg.backend)``: "auto", "gloo" or "nccl"."""


def rank_worker(cfg: RankExerciseConfig) -> dict:
    """Join the process group (``env.distributed(cfg.backend)``), call the learner's
    ``train(cfg, ctx)`` in it; save the parameters of the model it returns (unwrapped, on the CPU)
    to ``params<rank>.pt`` in the run directory. Returns ``{"rank"}``."""
    train = function_from(cfg.path, "train")
    with env.distributed(cfg.backend) as ctx:
        model = train(cfg, ctx)
    state = {k: v.detach().cpu() for k, v in models.unwrap(model).state_dict().items()}
    torch.save(state, runlog.run_dir() / f"params{env.rank()}.pt")
    return {"rank": env.rank()}


def one_process(
    cfg: RankExerciseConfig, ranks: tuple[int, ...] = (0, 1), set_epoch: bool = True
) -> dict:
    """One plain process trained, step by step, on the union of the batches that ranks ``ranks`` of
    a 2-rank job draw (``DistributedSampler(seed=0)``, ``set_epoch(epoch)`` unless ``set_epoch`` is
    False), from ``torch.manual_seed(0)``'s ``ArticleCNN``, with chapter 01's SGD and mean loss.
    ``ranks=(0, 0)`` is two ranks that both claim rank 0. Returns the state dict."""
    train_set, _ = data.load_dataset("digits")
    torch.manual_seed(0)
    model = models.ArticleCNN(in_shape=tuple(train_set[0][0].shape))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    loaders = [data.train_loader(train_set, cfg.batch_size, r, 2) for r in ranks]
    for epoch in range(cfg.epochs):
        for loader in loaders:
            loader.sampler.set_epoch(epoch if set_epoch else 0)
        for batches in zip(*loaders):
            x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return model.state_dict()
