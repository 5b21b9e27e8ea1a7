"""The rank side of exercise 02.2 (notebooks/02_ddp.ipynb): chapter 02's DDP rank with the
learner's random augmentation, ``augment(x, index, epoch)``, applied to every batch; and the
one-process reference it is compared with (:func:`one_process`), which
:mod:`mgtutorial.exercises.ch02` uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from mgtutorial.common import data, models
from mgtutorial.common.config import Config
from mgtutorial.ddp import apply_ddp
from mgtutorial.exercises._common import function_from
from mgtutorial.runtime import env, runlog


@dataclass(kw_only=True)
class AugmentExerciseConfig(Config):
    """The training the learner's augmentation runs in: chapter 02's, for ``epochs`` epochs of
    the digits."""

    path: str
    """The learner's file, defining ``augment(x, index, epoch) -> x``."""
    epochs: int = 1
    """Epochs to train."""
    batch_size: int = 32
    """Samples per rank per step."""
    lr: float = 0.01
    """SGD's learning rate."""
    momentum: float = 0.9
    """SGD's momentum."""
    backend: env.BackendChoice = "auto"
    """For ``env.distributed(cfg.backend)``: "auto", "gloo" or "nccl"."""


def indexed_digits() -> TensorDataset:
    """The digits' training set with each sample's index: ``(x, y, index)``."""
    x, y = data.load_digits()[0].tensors
    return TensorDataset(x, y, torch.arange(len(y)))


def augment_worker(cfg: AugmentExerciseConfig) -> dict:
    """One rank of chapter 02's DDP training (every rank seeded 0, as chapter 02's worker is),
    with the learner's ``augment(x, index, epoch)`` applied to every batch before the forward
    pass, full float32 (no TF32); saves the noise it added to its first batch to ``noise<rank>.pt``
    and the parameters (on the CPU) to ``params<rank>.pt`` in the run directory. Returns
    ``{"rank"}``."""
    augment = function_from(cfg.path, "augment")
    run_dir = runlog.run_dir()
    models.disable_tf32()  # full float32 on GPUs too, as the one-process reference computes
    with env.distributed(cfg.backend) as ctx:
        train_set = indexed_digits()
        torch.manual_seed(0)  # the same initial weights, and the same random stream, on every rank
        model = apply_ddp(models.ArticleCNN(in_shape=tuple(train_set[0][0].shape)), ctx)
        loader = data.train_loader(train_set, cfg.batch_size, ctx.rank, ctx.world_size)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        for epoch in range(cfg.epochs):
            loader.sampler.set_epoch(epoch)
            for x, y, index in loader:
                noisy = augment(x, index, epoch)
                if epoch == 0 and not (run_dir / f"noise{ctx.rank}.pt").exists():
                    torch.save(noisy - x, run_dir / f"noise{ctx.rank}.pt")  # the first batch's
                x = noisy.to(ctx.device)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y.to(ctx.device)).backward()
                opt.step()
    state = {k: v.detach().cpu() for k, v in models.unwrap(model).state_dict().items()}
    torch.save(state, run_dir / f"params{env.rank()}.pt")
    return {"rank": env.rank()}


def one_process(cfg: AugmentExerciseConfig, augment: Callable) -> dict:
    """One plain process trained, step by step, on the union of the batches that the 2 ranks of
    :func:`augment_worker` draw (``DistributedSampler(seed=0)``, ``set_epoch(epoch)``), each
    combined batch passed to ``augment`` whole, from ``torch.manual_seed(0)``'s ``ArticleCNN``,
    with the same SGD and mean loss. Returns the state dict."""
    train_set = indexed_digits()
    torch.manual_seed(0)
    model = models.ArticleCNN(in_shape=tuple(train_set[0][0].shape))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    loaders = [data.train_loader(train_set, cfg.batch_size, r, 2) for r in (0, 1)]
    for epoch in range(cfg.epochs):
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
        for batches in zip(*loaders):
            x, y, index = (torch.cat([b[k] for b in batches]) for k in range(3))
            opt.zero_grad()
            nn.functional.cross_entropy(model(augment(x, index, epoch)), y).backward()
            opt.step()
    return model.state_dict()
