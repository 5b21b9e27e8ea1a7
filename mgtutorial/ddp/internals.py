"""DDP's pitfalls: parameters the loss never uses (``find_unused_parameters``) and uneven inputs
(a collective timeout, then ``Join``).

Taught in notebooks/03c_ddp_pitfalls.ipynb (sections 1 and 3). Follows
https://pytorch.org/docs/stable/notes/ddp.html and
https://pytorch.org/tutorials/advanced/generic_join.html (``Join``). Buckets, hooks and
accumulation are in :mod:`mgtutorial.ddp.overlap`, SyncBatchNorm in :mod:`mgtutorial.ddp.batchnorm`.

:func:`pitfall_worker` is a small diff of :func:`mgtutorial.ddp.worker`: it reads its rank from the
environment, so :func:`mgtutorial.launch` (the notebook) and ``torchrun`` run it alike.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms.join import Join

from mgtutorial import ddp
from mgtutorial.common import models
from mgtutorial.common.compare import counting_mode
from mgtutorial.runtime import env


class CNNWithUnusedHead(models.ArticleCNN):
    """The article's CNN plus an ``aux_head`` layer that ``forward`` never uses (a common
    leftover)."""

    def __init__(self, in_shape=(3, 32, 32), num_classes: int = 10):
        super().__init__(in_shape, num_classes)
        self.aux_head = nn.Linear(64, 2)


@dataclass(kw_only=True)
class PitfallConfig(ddp.DDPConfig):
    """:class:`~mgtutorial.ddp.DDPConfig` plus the switches that break (and fix) DDP."""

    unused_layer: bool = False
    """Train :class:`CNNWithUnusedHead` (a parameter the loss never reaches)."""
    find_unused_parameters: bool = False
    """DDP's fix for that: search the autograd graph for unused parameters every step."""
    extra_batches_last_rank: int = 0
    """Uneven inputs: the last rank trains this many more batches than the others."""
    use_join: bool = False
    """Wrap the loop in ``Join([model])`` so ranks that run out of data shadow the others'
    all-reduces."""
    divide_by_initial_world_size: bool = True
    """Passed to DDP's join hook: divide the gradients by the initial world size (True) or by the
    number of ranks still training (False)."""


class PitfallTrainer(ddp.Trainer):
    """:class:`~mgtutorial.ddp.Trainer` for :class:`PitfallConfig`: the last rank trains
    ``extra_batches_last_rank`` more steps; the epoch runs inside ``Join([model])`` if
    ``use_join``. Logs only local losses (``kind="train_local"``, with ``collectives``: the
    step's ``{name: calls}`` counted by ``CommDebugMode``): the all-reduced loss of every step is
    itself a collective that ``Join`` does not cover. Logs ``kind="loop_done"`` after the
    loop. With ``use_join`` it also logs ``kind="grad_scale"`` per step: ``ratio`` = ‖DDP's
    gradient‖ / ‖this rank's own gradient‖ (computed with ``torch.autograd.grad``, which DDP does
    not reduce).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.ctx.rank == self.ctx.world_size - 1:
            self.max_steps = (self.max_steps or 4) + self.cfg.extra_batches_last_rank

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with counting_mode() as mode:  # every collective of the forward and backward passes
            if not self.cfg.use_join:
                loss = super()._run_batch(x, y)
            else:
                loss = self._run_joined_batch(x, y)
        self.collectives = mode.counts()
        return loss

    def _run_joined_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        params = list(self.model.parameters())
        # this rank's own gradient: torch.autograd.grad does not go through DDP's reduction
        own = torch.autograd.grad(loss, params, retain_graph=True)
        loss.backward()  # DDP's all-reduce (a joined rank contributes zeros)
        ratio = (
            torch.cat([p.grad.flatten() for p in params]).norm()
            / torch.cat([g.flatten() for g in own]).norm()
        )
        self.log.write(kind="grad_scale", step=self.step + 1, ratio=ratio.item())
        self.optimizer.step()
        return loss.item()

    def _log_step(self, epoch: int, loss: float) -> float:
        return self.log.write(
            kind="train_local", step=self.step, epoch=epoch, loss=loss, collectives=self.collectives
        )["loss"]

    def _run_epoch(self, epoch: int) -> float:
        join = Join(
            [self.model], divide_by_initial_world_size=self.cfg.divide_by_initial_world_size
        )
        with join if self.cfg.use_join else contextlib.nullcontext():
            loss = super()._run_epoch(epoch)
        self.log.write(kind="loop_done", step=self.step)
        return loss


def pitfall_worker(cfg: PitfallConfig) -> dict:
    """DDP training with the chosen pitfall switched on (see :class:`PitfallConfig`), trained by
    :class:`PitfallTrainer`. Returns {"steps"}.

    Raises (in the ranks, surfacing as WorkerFailed): DDP's "Expected to have finished reduction"
    error for an unused layer without ``find_unused_parameters``; a collective timeout for uneven
    inputs without ``Join``.
    """
    model_cls = CNNWithUnusedHead if cfg.unused_layer else models.ArticleCNN
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        wrap = functools.partial(ddp.apply_ddp, find_unused_parameters=cfg.find_unused_parameters)
        model, train_set, test_set, optimizer = ddp.build(cfg, ctx, wrap=wrap, model_cls=model_cls)
        trainer = PitfallTrainer(model, train_set, test_set, optimizer, ctx, cfg)
        return {"steps": trainer.train()["steps"]}
