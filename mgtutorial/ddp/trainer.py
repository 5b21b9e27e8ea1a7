"""Data-parallel training with DistributedDataParallel: the Trainer and the chapter-02 worker.

Taught in notebooks/01_single_device.ipynb (one rank) and notebooks/02_ddp.ipynb (two or more).
Follows https://pytorch.org/docs/stable/notes/ddp.html and
https://pytorch.org/tutorials/intermediate/ddp_tutorial.html. The pieces a rank sets up (loader,
DDP wrapper, step record) are in :mod:`mgtutorial.ddp.setup`; the single-process reference DDP
equals is :mod:`mgtutorial.ddp.reference`.

From the shell, one node, 2 ranks (gloo on CPU, NCCL with one GPU per rank)::

    python -m mgtutorial ddp --nproc 2 --epochs 2                   # launches its own ranks
    torchrun --standalone --nproc-per-node 2 -m mgtutorial ddp --epochs 2

Several nodes: the same worker under ``torchrun --nnodes N ...``
(notebooks/05a_torchrun_multinode.ipynb).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mgtutorial.common import checkpoint, config, data, models
from mgtutorial.common.checkpoint import check_checkpoint_path, load_checkpoint, save_checkpoint
from mgtutorial.common.config import at_least, check_timeout, positive
from mgtutorial.common.finite import check_loss
from mgtutorial.ddp.setup import build, log_step, rank_loader
from mgtutorial.runtime import env, runlog


@dataclass(kw_only=True)
class DDPConfig(config.Config):
    """Configuration of :func:`worker` (JSON-serialisable: it crosses the process boundary)."""

    epochs: int = 3
    """Passes over the training set."""
    batch_size: int = 32
    """Samples per rank per step; the effective batch is ``batch_size × world size``."""
    lr: float = 0.01
    """SGD learning rate."""
    momentum: float = 0.9
    """SGD momentum."""
    dataset: data.DatasetName = "auto"
    """The training data ("auto": CIFAR-10 when on disk, else digits; see
    :mod:`mgtutorial.common.data`)."""
    data_root: str | None = None
    """Dataset folder (default: ``$MGTUTORIAL_DATA``, else ``~/.cache/mgtutorial/data``)."""
    download: bool = False
    """Allow downloading CIFAR-10 if it is missing."""
    seed: int = 0
    """Seed for the model's initial weights and the sampler's shuffling (same on every rank)."""
    shuffle: bool = True
    """Shuffle the training set each epoch (DistributedSampler with ``seed + epoch``)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (None: run all epochs)."""
    backend: env.BackendChoice = "auto"
    """Process-group backend ("auto": NCCL with a GPU per local rank, else gloo)."""
    timeout_s: float = 120.0
    """Collective timeout in seconds: a rank waiting longer for its peers raises."""
    checkpoint: str | None = None
    """File to save model + optimizer + progress to (rank 0) after each epoch; None: no
    checkpoints."""
    resume: bool = False
    """Load ``checkpoint`` if it exists and continue exactly where it was taken (mid-epoch too)."""
    evaluate: bool = True
    """Measure test-set accuracy at the end of each epoch."""
    tf32: bool = True
    """Keep torch's TF32 defaults on GPUs (TF32 in cuDNN's convolutions, not in matmuls); turned
    off, every GPU operation computes in full float32. No effect on CPUs."""

    def validate(self, world_size: int) -> None:
        """Called by :func:`mgtutorial.launch` before any process starts.

        Raises:
            ValueError: a value out of range, or not one of its field's choices.
            FileNotFoundError: CIFAR-10 asked for but not on disk.
        """
        super().validate(world_size)
        at_least(
            self, 1, "epochs", "batch_size", *(("max_steps",) if self.max_steps is not None else ())
        )
        positive(self, "lr")
        check_timeout(self)
        at_least(self, 0, "momentum")
        if self.momentum >= 1:
            raise ValueError(
                f"momentum={self.momentum!r}: SGD's momentum must be below 1 (at 1 or more each "
                "step adds more than it forgets, and the weights grow without bound); 0.9 is usual."
            )
        check_checkpoint_path(self.checkpoint, self.resume)
        dataset = data.resolve_dataset(self.dataset, self.data_root)
        data.check_available(dataset, self.data_root, self.download)
        if self.resume:
            checkpoint.check_same_settings(self.checkpoint, self.settings(dataset))

    def settings(self, dataset: str) -> dict:
        """What a checkpoint's progress depends on (recorded beside it, compared on resume):
        the data set (``dataset``: resolved, as "auto" becomes) and the batch size."""
        return {"dataset": dataset, "batch_size": self.batch_size}


class Trainer:
    """Trains a (DDP-wrapped) model; every rank runs the same Trainer on its shard of the data.

    Methods: ``_run_batch`` (one optimizer step), ``_run_epoch`` (calls ``sampler.set_epoch``),
    ``_log_step`` (the per-step record), ``evaluate``, public ``train``; a chapter that changes the
    loop subclasses it and overrides one (chapter 03). ``max_steps`` starts as ``cfg.max_steps``.
    Only rank 0 prints and saves.
    """

    def __init__(self, model, train_set, test_set, optimizer, ctx: env.DistContext, cfg: DDPConfig):
        self.model = model
        self.optimizer = optimizer
        self.ctx = ctx
        self.cfg = cfg
        self.test_set = test_set
        self.loader = rank_loader(train_set, cfg, ctx.rank, ctx.world_size)
        self.loss_fn = nn.CrossEntropyLoss()
        self.log = runlog.RunLog()
        self.max_steps = cfg.max_steps
        # progress: where this run starts (a resumed checkpoint's, below)
        self.first_epoch = 0
        self.step = 0  # optimizer steps done
        self.samples = 0  # samples this rank has trained on
        self.skip = 0  # batches of first_epoch trained before the checkpoint
        self.attempt = env.restart_count()
        if cfg.resume and cfg.checkpoint and Path(cfg.checkpoint).exists():
            state = load_checkpoint(cfg.checkpoint, model, optimizer, ctx.device)
            self.first_epoch = state["epoch"]
            self.step = state["step"]
            # batches per rank at the snapshot's world size; the sampler deals the epoch's order
            # to the ranks in turn, so at another world size the same samples are fewer or more
            # batches (rounded down: a few samples trained twice, none lost; chapter 05b)
            self.skip = state.get("batch", 0) * state.get("world_size", ctx.world_size)
            self.skip //= ctx.world_size
            self.samples = state.get("samples", 0)
            self.log.resume(
                step=self.step, epoch=self.first_epoch, batch=self.skip, attempt=self.attempt
            )
            ctx.print(
                f"resumed from {cfg.checkpoint}: {self.first_epoch} epoch(s) + {self.skip} "
                f"batch(es), step {self.step}"
            )
        self.first_samples = self.samples
        if cfg.checkpoint and ctx.is_main:  # what the checkpoint's progress means, for a resume
            dataset = data.resolve_dataset(cfg.dataset, cfg.data_root)
            checkpoint.save_settings(cfg.checkpoint, cfg.settings(dataset))

    def _save(self, epoch: int, batch: int) -> None:
        if self.ctx.is_main:
            save_checkpoint(
                self.cfg.checkpoint,
                self.model,
                self.optimizer,
                epoch,
                self.step,
                batch,
                self.samples,
            )
            self.log.checkpoint(
                step=self.step, epoch=epoch, batch=batch, path=str(self.cfg.checkpoint)
            )
        if self.ctx.initialized:
            torch.distributed.barrier()  # nobody reads the file before it is complete

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()  # DDP all-reduces (averages) the gradients here
        self.optimizer.step()
        return loss.item()

    def _done(self) -> bool:
        return self.max_steps is not None and self.step >= self.max_steps

    def _log_step(self, epoch: int, loss: float) -> float:
        """Log this step (every rank must call it: ``global_loss`` is an all-reduce); returns it."""
        return log_step(
            self.log, self.ctx, step=self.step, epoch=epoch, loss=loss, samples=self.samples
        )["global_loss"]

    def _run_epoch(self, epoch: int) -> float:
        self.loader.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        self.model.train()
        losses = []
        self.batches_done = 0  # of this epoch, for a snapshot if max_steps cuts it short
        for batch, (x, y) in enumerate(self.loader):
            self.batches_done = batch
            if batch < self.skip:  # resuming mid-epoch: these were trained before the snapshot
                continue
            if self._done():
                break
            self.batches_done = batch + 1
            loss = self._run_batch(x.to(self.ctx.device), y.to(self.ctx.device))
            self.step += 1
            self.samples += len(y)
            logged = self._log_step(epoch, loss)  # the global loss: every rank stops at once
            losses.append(check_loss(logged, step=self.step, cfg=self.cfg))
        self.skip = 0
        return sum(losses) / len(losses) if losses else float("nan")  # the epoch's mean loss

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Test accuracy and mean loss over the *whole* test set, each sample counted once.

        Each rank scores its :func:`~mgtutorial.common.data.eval_shard` with the unwrapped module
        (no DDP collectives), then one all-reduce sums (correct, loss, count) over ranks.
        """
        module = models.unwrap(self.model)
        module.eval()
        shard = data.eval_shard(self.test_set, self.ctx.rank, self.ctx.world_size)
        sums = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
        for x, y in torch.utils.data.DataLoader(shard, batch_size=256):
            x, y = x.to(self.ctx.device), y.to(self.ctx.device)
            logits = module(x)
            sums += torch.stack(
                [
                    (logits.argmax(1) == y).sum().double(),
                    nn.functional.cross_entropy(logits, y, reduction="sum").double(),
                    torch.tensor(float(len(y)), dtype=torch.float64, device=y.device),
                ]
            )
        if self.ctx.initialized:
            torch.distributed.all_reduce(sums)
        correct, loss_sum, count = sums.tolist()
        return correct / count, loss_sum / count

    def train(self) -> dict:
        """Run the epochs (or ``max_steps``); log, evaluate, checkpoint. Returns a summary dict
        whose ``samples_per_s`` is the course's one throughput: samples trained ÷ ``train_time_s``,
        the seconds in the epochs' step loops (evaluation, epoch-end checkpoints excluded); a job's
        is the ranks' sum."""
        acc = None  # the last test accuracy (None without evaluation)
        train_time = 0.0  # seconds in the epochs' step loops
        epoch = self.first_epoch
        total = self.cfg.epochs * len(self.loader)
        self.log.plan(steps=min(total, self.max_steps or total))
        for epoch in range(self.first_epoch, self.cfg.epochs):
            start = time.perf_counter()
            loss = self._run_epoch(epoch)
            train_time += time.perf_counter() - start
            if self.cfg.evaluate:
                acc, test_loss = self.evaluate()
                self.log.eval(step=self.step, epoch=epoch, test_acc=acc, test_loss=test_loss)
            self.ctx.print(
                f"epoch {epoch + 1}/{self.cfg.epochs}: step {self.step}, epoch mean loss "
                f"{loss:.4f}" + (f", test accuracy {acc:.1%}" if acc is not None else "")
            )
            if self.cfg.checkpoint:
                if self.batches_done < len(self.loader):  # max_steps cut the epoch short
                    self._save(epoch, self.batches_done)
                else:
                    self._save(epoch + 1, 0)
            if self._done():
                break
        self.log.close()
        trained = self.samples - self.first_samples  # by this run (a resumed one starts counted)
        return {
            "rank": self.ctx.rank,
            "steps": self.step,
            "epochs_done": epoch + 1,
            "test_acc": acc,
            "samples": self.samples,
            "train_time_s": train_time,
            "samples_per_s": trained / train_time if train_time > 0 else None,
        }


def worker(cfg: DDPConfig) -> dict:
    """Chapter 02's worker: one rank of DDP training of the article's CNN. Returns its summary."""
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        model, train_set, test_set, optimizer = build(cfg, ctx)
        ctx.print(
            f"{ctx.world_size} rank(s), backend {ctx.backend}, device {ctx.device}, "
            f"{len(train_set)} training samples, batch {cfg.batch_size} per rank"
        )
        return Trainer(model, train_set, test_set, optimizer, ctx, cfg).train()
