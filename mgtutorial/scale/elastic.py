"""A job that survives a lost rank: chapter 02's Trainer plus snapshots every k steps, and a fault
to inject (a rank that raises or SIGKILLs itself) so that a torchrun restart can be watched.

Taught in notebooks/05b_elastic_restarts.ipynb, section 1 (a rank killed mid-run, the restart
from the last snapshot). Resuming is chapter 02's (``DDPConfig.resume``, notebooks/02_ddp.ipynb):
the snapshot holds the progress, so a restarted rank continues mid-epoch where it was taken.
Follows https://pytorch.org/docs/stable/elastic/run.html (``--max-restarts``) and
https://pytorch.org/tutorials/beginner/ddp_series_fault_tolerance.html (snapshots).

One node, 2 ranks, rank 1 killed after step 12 and the job restarted once from the snapshot of
step 10::

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m mgtutorial elastic \\
        --checkpoint runs/elastic.pt --checkpoint-every 5 --resume \\
        --fail-rank 1 --fail-step 12 --fail-how sigkill
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Literal

from mgtutorial.common.config import at_least, check_choices, rank_or_none
from mgtutorial.ddp.trainer import DDPConfig, Trainer, build
from mgtutorial.runtime import env


@dataclass(kw_only=True)
class ElasticConfig(DDPConfig):
    """Configuration of :func:`elastic_worker`: :class:`~mgtutorial.ddp.trainer.DDPConfig` plus
    the snapshot interval and the fault to inject (JSON-serialisable)."""

    checkpoint_every: int = 0
    """Also save a snapshot to ``checkpoint`` every this many steps, mid-epoch (0: only at epoch
    ends, as chapter 02 does)."""
    pause_s: float = 0.0
    """Sleep this long after each step while the job has a single rank: a slow job, so that a node
    started later finds it still running (the membership change of notebooks/05b); once the world
    has grown, the steps run at full speed."""
    fail_rank: int = -1
    """Fault injection for the lessons and tests: this rank fails …"""
    fail_step: int = -1
    """… once it has logged this step, before the next one (−1: never) …"""
    fail_how: Literal["raise", "sigkill"] = "raise"
    """… by raising RuntimeError ("raise") or by SIGKILL-ing itself ("sigkill"); only in a run
    that did not resume from a snapshot, so an elastic restart that resumes gets past it (put
    ``fail_step`` after the first snapshot)."""

    def validate(self, nprocs: int) -> None:
        """Chapter 02's checks, then the snapshot interval and the fault's rank and kind.

        Raises:
            ValueError: a value out of range (``fail_rank`` not a rank of the job, ``fail_how``
                not one of its choices). FileNotFoundError: as :meth:`DDPConfig.validate`.
        """
        super().validate(nprocs)
        check_choices(self)  # fail_how is one of its Literal's values
        at_least(self, 0, "checkpoint_every", "pause_s")
        if self.checkpoint_every and not self.checkpoint:
            raise ValueError(
                f"checkpoint_every={self.checkpoint_every} needs a file to write the snapshots "
                "to: set checkpoint (--checkpoint runs/elastic.pt), or leave checkpoint_every 0."
            )
        if self.fail_step != -1:
            at_least(self, 1, "fail_step", hint=" (or -1: never), a step the rank logs")
        rank_or_none(self, "fail_rank", nprocs)


class ElasticTrainer(Trainer):
    """:class:`~mgtutorial.ddp.trainer.Trainer` whose per-step record is followed by what a
    restartable job adds: a snapshot every ``cfg.checkpoint_every`` steps, and the injected fault.

    A snapshot is chapter 02's checkpoint taken mid-epoch: model, optimizer and progress (epoch,
    step, batches of the epoch done, samples), written by rank 0, then a barrier. The fault strikes
    rank ``cfg.fail_rank`` once it has logged step ``cfg.fail_step`` (after that step's snapshot,
    if one is due), only in a run that did not resume from a snapshot: restarted ranks resume, so
    they get past it whatever their node's restart count (each agent counts its own).
    """

    cfg: ElasticConfig

    def _log_step(self, epoch: int, loss: float) -> float:
        global_loss = super()._log_step(epoch, loss)
        cfg, done = self.cfg, self.batches_done  # batches of this epoch, this step's included
        if cfg.checkpoint and cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
            if done < len(self.loader):  # the epoch's end has its own checkpoint
                self._save(epoch, done)
        if self.ctx.world_size == 1:  # alone: slow, until another node joins
            time.sleep(cfg.pause_s)
        fresh = self.first_samples == 0  # this run did not resume from a snapshot
        if (self.ctx.rank, self.step) == (cfg.fail_rank, cfg.fail_step) and fresh:
            if cfg.fail_how == "sigkill":  # no exception, no clean-up: as the OOM killer does it
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on rank {self.ctx.rank} at step {self.step}")
        return global_loss


def elastic_worker(cfg: ElasticConfig) -> dict:
    """Chapter 05b's worker: one rank of chapter 02's training (:func:`mgtutorial.ddp.worker`)
    with :class:`ElasticTrainer`. Returns the rank's summary (``Trainer.train``)."""
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        model, train_set, test_set, optimizer = build(cfg, ctx)
        ctx.print(
            f"{ctx.world_size} rank(s), backend {ctx.backend}, device {ctx.device}, "
            f"{len(train_set)} training samples, batch {cfg.batch_size} per rank"
        )
        return ElasticTrainer(model, train_set, test_set, optimizer, ctx, cfg).train()
