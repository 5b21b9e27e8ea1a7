"""Data-parallel training with DistributedDataParallel: the Trainer and the chapter-02 worker.

Taught in notebooks/01_single_device.ipynb (one rank) and notebooks/02_ddp.ipynb (two or more).
Follows https://pytorch.org/docs/stable/notes/ddp.html and
https://pytorch.org/tutorials/intermediate/ddp_tutorial.html.

From the shell, one node, 2 ranks (gloo on CPU, NCCL with one GPU per rank)::

    python -m mgtutorial ddp --nproc 2 --epochs 2                   # launches its own ranks
    torchrun --standalone --nproc-per-node 2 -m mgtutorial ddp --epochs 2

Several nodes: the same worker under ``torchrun --nnodes N ...`` (notebooks/05a_torchrun_multinode.ipynb).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mgtutorial.common import data, models
from mgtutorial.common.checkpoint import check_checkpoint_path, load_checkpoint, save_checkpoint
from mgtutorial.common.config import at_least, positive
from mgtutorial.runtime import env, runlog


@dataclass(kw_only=True)
class DDPConfig:
    """Configuration of :func:`worker` (JSON-serialisable: it crosses the process boundary)."""

    epochs: int = 3
    """Passes over the training set."""
    batch_size: int = 32
    """Samples per rank per step; the effective batch is ``batch_size × world size``."""
    lr: float = 0.01
    """SGD learning rate."""
    momentum: float = 0.9
    """SGD momentum."""
    dataset: str = "auto"
    """"auto" | "digits" | "cifar10" | "synthetic" (see :mod:`mgtutorial.common.data`)."""
    data_root: str | None = None
    """Dataset folder (default ``$MGTUTORIAL_DATA`` or ``~/.cache/mgtutorial/data``)."""
    download: bool = False
    """Allow downloading CIFAR-10 if it is missing."""
    seed: int = 0
    """Seed for the model's initial weights and the sampler's shuffling (same on every rank)."""
    shuffle: bool = True
    """Shuffle the training set each epoch (DistributedSampler with ``seed + epoch``)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (None: run all epochs)."""
    backend: str = "auto"
    """"auto" | "gloo" | "nccl"."""
    timeout_s: float = 120.0
    """Collective timeout in seconds: a rank waiting longer for its peers raises."""
    checkpoint: str | None = None
    """File to save model + optimizer + progress to (rank 0) after each epoch; None: no checkpoints."""
    resume: bool = False
    """Load ``checkpoint`` if it exists and continue exactly where it was taken (mid-epoch too)."""
    evaluate: bool = True
    """Measure test-set accuracy at the end of each epoch."""
    tf32: bool = True
    """True: torch's defaults (TF32 in cuDNN only, not in matmuls); False: full float32 on GPUs; CPU: no effect."""

    def validate(self, world_size: int) -> None:
        """Called by :func:`mgtutorial.launch` before any process starts.

        Raises:
            ValueError: a value out of range. FileNotFoundError: CIFAR-10 asked for but not on disk.
        """
        at_least(
            self, 1, "epochs", "batch_size", *(("max_steps",) if self.max_steps is not None else ())
        )
        positive(self, "lr", "timeout_s")
        at_least(self, 0, "momentum", "seed")
        check_checkpoint_path(self.checkpoint, self.resume)
        data.check_available(
            data.resolve_dataset(self.dataset, self.data_root), self.data_root, self.download
        )


def rank_loader(train_set, cfg: DDPConfig, rank: int, world_size: int, epoch: int = 0):
    """Rank ``rank``'s training loader for ``cfg`` (per-rank batch, seed, shuffle), set to ``epoch``:
    the one place the workers and the single-process reference build it, so they all draw the same
    indices (see :func:`mgtutorial.common.data.train_loader`)."""
    loader = data.train_loader(
        train_set, cfg.batch_size, rank, world_size, seed=cfg.seed, shuffle=cfg.shuffle
    )
    loader.sampler.set_epoch(epoch)
    return loader


def log_step(
    log: runlog.RunLog, ctx: env.DistContext, *, step: int, epoch: int, loss: float, samples: int
) -> dict:
    """Log one training step: this rank's ``loss`` and ``global_loss``, its all-reduced mean.
    Every rank must call it at every step (``global_loss`` is a collective)."""
    return log.train(
        step=step, epoch=epoch, loss=loss, global_loss=env.global_mean(loss, ctx), samples=samples
    )


def apply_ddp(model: nn.Module, ctx: env.DistContext, **ddp_kwargs) -> nn.Module:
    """Move ``model`` to this rank's device, then wrap it in DDP (``device_ids`` only on GPU).

    ``ddp_kwargs`` go to DDP (``bucket_cap_mb``, ``find_unused_parameters``, … — chapter 03).
    Returns the model unchanged when there is no process group (a plain single process).
    """
    model = model.to(ctx.device)
    if not ctx.initialized:
        return model
    return DDP(
        model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None, **ddp_kwargs
    )


def build(cfg: DDPConfig, ctx: env.DistContext, wrap=apply_ddp, model_cls=models.ArticleCNN):
    """Seeded model, datasets and optimizer for ``cfg`` → (model, train_set, test_set, optimizer).

    ``wrap(model, ctx)`` moves and wraps the model (default :func:`apply_ddp`); ``model_cls(in_shape=...)``
    builds it (default the article's CNN).
    """
    env.seed_everything(cfg.seed)
    if not cfg.tf32:
        models.disable_tf32()
    train_set, test_set = data.load_dataset(cfg.dataset, cfg.data_root, cfg.download, seed=cfg.seed)
    in_shape = tuple(train_set[0][0].shape)
    model = wrap(model_cls(in_shape=in_shape), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    return model, train_set, test_set, optimizer


class Trainer:
    """Trains a (DDP-wrapped) model; every rank runs the same Trainer on its shard of the data.

    Methods: ``_run_batch`` (one optimizer step), ``_run_epoch`` (calls ``sampler.set_epoch``),
    ``_log_step`` (the per-step record), ``evaluate``, public ``train``; a chapter that changes the
    loop subclasses it and overrides one (chapter 03). ``max_steps`` starts as ``cfg.max_steps``.
    Only rank 0 prints and saves.
    """

    def __init__(self, model, train_set, test_set, optimizer, ctx: env.DistContext, cfg: DDPConfig):
        self.model, self.optimizer, self.ctx, self.cfg, self.test_set = (
            model,
            optimizer,
            ctx,
            cfg,
            test_set,
        )
        self.loader = rank_loader(train_set, cfg, ctx.rank, ctx.world_size)
        self.loss_fn = nn.CrossEntropyLoss()
        self.log = runlog.RunLog()
        self.first_epoch, self.step, self.samples, self.skip, self.max_steps = (
            0,
            0,
            0,
            0,
            cfg.max_steps,
        )
        self.attempt = env.restart_count()
        if cfg.resume and cfg.checkpoint and Path(cfg.checkpoint).exists():
            state = load_checkpoint(cfg.checkpoint, model, optimizer, ctx.device)
            self.first_epoch, self.step, self.skip = (
                state["epoch"],
                state["step"],
                state.get("batch", 0),
            )
            self.samples = state.get("samples", 0)
            self.log.resume(
                step=self.step, epoch=self.first_epoch, batch=self.skip, attempt=self.attempt
            )
            ctx.print(
                f"resumed from {cfg.checkpoint}: {self.first_epoch} epoch(s) + {self.skip} batch(es), "
                f"step {self.step}"
            )
        self.first_samples = self.samples

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
            losses.append(self._log_step(epoch, loss))
        self.skip = 0
        return sum(losses) / len(losses) if losses else float("nan")  # the epoch's mean loss

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Test accuracy and mean loss over the *whole* test set, each sample counted once.

        Each rank scores its :func:`~mgtutorial.common.data.eval_shard` with the unwrapped module (no DDP
        collectives), then one all-reduce sums (correct, loss, count) over ranks.
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
        """Run the epochs (or ``max_steps``); log, evaluate, checkpoint. Returns a summary dict whose
        ``samples_per_s`` is the course's one throughput: samples trained ÷ ``train_time_s``, the seconds
        in the epochs' step loops (evaluation, epoch-end checkpoints excluded); a job's is the ranks' sum."""
        acc, train_time, epoch = None, 0.0, self.first_epoch
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
        trained = (
            self.samples - self.first_samples
        )  # by this attempt (a resumed run starts counted)
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


def combined_batch_reference(cfg: DDPConfig, world_size: int) -> nn.Module:
    """One plain process trained, step by step, on the union of what ``world_size`` DDP ranks see
    (their DistributedSamplers' indices): one batch of ``batch_size × world_size``. With equal per-rank
    batches its mean loss has the average of the ranks' gradients, what DDP's all-reduce computes.
    Runs ``cfg.max_steps`` steps (required, else ValueError) of epoch 0; returns the model (CPU)."""
    if cfg.max_steps is None:
        raise ValueError("combined_batch_reference needs cfg.max_steps.")
    ctx = env.DistContext.single_process()
    model, train_set, _, optimizer = build(cfg, ctx)
    loaders = [rank_loader(train_set, cfg, r, world_size) for r in range(world_size)]
    loss_fn = nn.CrossEntropyLoss()
    for step, batches in enumerate(zip(*loaders)):
        if step >= cfg.max_steps:
            break
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
    return model


def max_param_diff(model: nn.Module, state_dict: dict) -> float:
    """Largest absolute difference between ``model``'s parameters and those in ``state_dict``."""
    own = model.state_dict()
    return max((own[k].float() - v.float().cpu()).abs().max().item() for k, v in state_dict.items())
