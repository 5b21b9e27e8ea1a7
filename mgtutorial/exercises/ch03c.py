"""Checker of chapter 03c's exercise (notebooks/03c_ddp_pitfalls.ipynb): uneven inputs with
``Join``, against one process that divides the gradients of the ranks still training by the world
size (without ``Join``, a collective timeout of 3 s on DDP's group ends the job).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mgtutorial import ddp
from mgtutorial.common.compare import max_abs_diff
from mgtutorial.common.config import Config
from mgtutorial.exercises._common import (
    ExerciseError,
    RankFailed,
    function_from,
    passed,
    require,
    run_ranks,
)
from mgtutorial.exercises.ddp_checks import load_params, save_params
from mgtutorial.runtime import env


@dataclass(kw_only=True)
class JoinConfig(Config):
    """The learner's module and the uneven data of :func:`join_worker`."""

    path: str
    """Absolute path of the module defining ``train_uneven(model, optimizer, loss_fn, batches)``."""
    batches: int = 4
    """Batches of rank 0; the last rank has ``extra`` more."""
    extra: int = 2
    """How many more batches the last rank trains."""
    lr: float = 0.1
    """Plain SGD's learning rate."""
    timeout_s: float = 3.0
    """Collective timeout of DDP's process group: a rank alone in an all-reduce fails after this
    long."""
    start_timeout_s: float = 60.0
    """Timeout of starting the ranks (rendezvous, the default group): a rank that starts late is
    no error."""


def uneven_batches(
    cfg: JoinConfig, rank: int, world_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches: ``batches`` (+ ``extra`` on the last rank) pairs of ``x (4, 8)``,
    ``y (4, 2)``."""
    g = torch.Generator().manual_seed(100 + rank)
    n = cfg.batches + (cfg.extra if rank == world_size - 1 else 0)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def join_model() -> nn.Module:
    """The seeded ``nn.Linear(8, 2)`` every rank and the reference start from."""
    torch.manual_seed(0)
    return nn.Linear(8, 2)


class _Counted(list):
    """A list that counts the items its loops have taken (``taken``)."""

    taken = 0

    def __iter__(self):
        for item in super().__iter__():
            self.taken += 1
            yield item


def join_worker(cfg: JoinConfig) -> dict:
    """DDP of a linear layer, plain SGD, the learner's ``train_uneven`` on uneven batches; gloo,
    DDP (and so ``Join``) on a group of its own with the ``timeout_s`` timeout. Saves each rank's
    parameters; returns ``{"mean_loss"}``, what ``train_uneven`` returned (its repr if not a
    float). An error names the training step it came from ("[step k of n]")."""
    fn = function_from(cfg.path, "train_uneven")
    with env.distributed("gloo", cfg.start_timeout_s) as ctx:
        group = dist.new_group(timeout=timedelta(seconds=cfg.timeout_s))
        model = ddp.apply_ddp(join_model(), ctx, process_group=group)
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        batches = _Counted(uneven_batches(cfg, ctx.rank, ctx.world_size))
        try:
            mean_loss = fn(model, optimizer, nn.functional.mse_loss, batches)
        except RuntimeError as e:
            raise RuntimeError(f"[step {batches.taken} of {len(batches)}] {e}") from e
        save_params(model.module, ctx.rank)
        return {"mean_loss": mean_loss if isinstance(mean_loss, float) else repr(mean_loss)}


def join_reference(cfg: JoinConfig, world_size: int, losses: list | None = None) -> dict:
    """One process: at each step, the sum of the gradients of the ranks that still have a batch,
    divided by the world size (``Join``'s default, ``divide_by_initial_world_size=True``), one SGD
    step. Returns the final state dict; appends every batch's loss to ``losses`` if given."""
    model = join_model()
    data = [uneven_batches(cfg, r, world_size) for r in range(world_size)]
    for step in range(max(map(len, data))):
        step_losses = [
            nn.functional.mse_loss(model(x), y) for x, y in (d[step] for d in data if step < len(d))
        ]
        grads = [torch.autograd.grad(loss, list(model.parameters())) for loss in step_losses]
        if losses is not None:
            losses += [loss.item() for loss in step_losses]
        with torch.no_grad():
            for p, *gs in zip(model.parameters(), *grads):
                p -= cfg.lr * sum(gs) / world_size
    return model.state_dict()


def join_uneven(path: str = "ex03c_join.py") -> None:
    """03c.1: ``train_uneven(model, optimizer, loss_fn, batches)`` in ``path`` trains every batch
    although the last rank has 2 more, and returns the mean loss over every batch of every rank on
    every rank. Without ``Join`` the ranks fail after the 3 s timeout; with a collective of its own
    in the loop (a per-step all-reduce of the loss), the joined rank waits in ``Join`` for a
    collective the last rank never makes. Compares every rank with :func:`join_reference`."""
    ex = "03c.1 join"
    function_from(path, "train_uneven", ex)
    cfg = JoinConfig(path=str(Path(path).resolve()))
    try:
        result = run_ranks(ex, join_worker, cfg, 2, name="join")
    except RankFailed as e:
        step = re.search(r"\[step (\d+) of (\d+)\] .*time", e.hint, re.I)
        if not step:
            raise
        if e.rank == 0 and step[1] == step[2]:  # rank 0 done, waiting in Join for the last rank
            raise ExerciseError(
                ex,
                f"rank 0 had trained its {step[2]} batches and waited inside Join for the last "
                f"rank's next collective until the {cfg.timeout_s:g} s timeout: the last rank "
                "was in a collective of your own (the loss's all-reduce?), which Join does not "
                "shadow; keep the losses on each rank and all-reduce once, after the Join block",
            ) from None
        if e.rank == 1 and int(step[1]) > cfg.batches:  # the last rank, alone in an extra batch
            raise ExerciseError(
                ex,
                f"rank 1 gave up after the {cfg.timeout_s:g} s timeout in its step "
                f"{step[1]}: the last rank trains {cfg.extra} batches more, and its "
                f"all-reduce had no partner; wrap the loop in `with Join([model]):`",
            ) from None
        raise ExerciseError(
            ex,
            f"rank {e.rank} timed out in step {step[1]} of {step[2]}, where every rank still "
            f"trains: the machine was too busy for the {cfg.timeout_s:g} s timeout; run the "
            f"checker again",
        ) from None
    losses: list[float] = []
    ranks, reference = load_params(result.run_dir, 2), join_reference(cfg, 2, losses)
    different = max_abs_diff(ranks[0], ranks[1]) >= 1e-6
    require(not different, ex, "the ranks finished with different parameters")
    d = max_abs_diff(ranks[0], reference)
    require(
        d < 1e-5,
        ex,
        f"the parameters differ from the reference by {d:.2g}: in the extra steps the last "
        "rank's gradient is divided by the full world size (Join's default)",
    )
    means = [result.values[r]["mean_loss"] for r in range(2)]
    require(
        all(isinstance(m, float) for m in means),
        ex,
        f"train_uneven returned {means[0]!r}: return the mean loss as a Python float (.item())",
    )
    require(
        abs(means[0] - means[1]) < 1e-6,
        ex,
        "the ranks returned different mean losses: each returned the mean of its own batches; "
        "add up the losses and the number of batches on each rank, and all-reduce both once",
    )
    mean = sum(losses) / len(losses)
    require(
        abs(means[0] - mean) < 1e-5 * max(1.0, abs(mean)),
        ex,
        f"the ranks agree on a mean loss, but not the mean over all {len(losses)} batches of "
        f"both ranks: the last rank has {cfg.extra} more batches, so the mean of the ranks' "
        "means weighs its batches less; divide the summed losses by the summed batch counts",
    )
    passed(
        ex,
        f"the last rank trained {cfg.extra} batches more, nobody timed out, every rank equals "
        "one process summing the gradients of the ranks still training ÷ world size, and every "
        f"rank returned the mean loss over all {len(losses)} batches",
    )


__all__ = ["join_uneven"]
