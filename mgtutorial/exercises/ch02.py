"""Checkers of chapter 02's exercises (notebooks/02_ddp.ipynb): a failing rank, predicted; a random
augmentation that keeps DDP equal to one process; the last, shorter batch of an epoch on 3 ranks;
and the linear scaling rule."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from mgtutorial import ddp
from mgtutorial.common import data
from mgtutorial.common.compare import float32_tolerance, max_abs_diff
from mgtutorial.exercises import ch02_ranks
from mgtutorial.exercises._common import (
    ExerciseError,
    answered,
    attempt,
    close,
    function_from,
    passed,
    require,
    run_ranks,
)
from mgtutorial.exercises.ch02_failure import failing_rank  # noqa: F401  (02.1)
from mgtutorial.runtime import env

AMPLITUDE = 0.1
"""02.2's noise: Gaussian, of this standard deviation."""


def augmentation(path: str = "ex02_augment.py") -> None:
    """02.2: ``augment(x, index, epoch)`` in ``path`` returns the batch ``x`` (images, ``(B, 3, 32,
    32)``) with Gaussian noise of standard deviation :data:`AMPLITUDE` added, a new draw every
    epoch (``index``: the samples' indices in the data set, ``(B,)``). Checks the noise's size
    and that it changes with the epoch, then runs chapter 02's training with it on 2 ranks
    (:func:`~mgtutorial.exercises.ch02_ranks.augment_worker`: an epoch of the digits, batch 32 per
    rank, every rank seeded 0) and compares each rank's parameters with one process trained on
    the ranks' combined batches, each augmented whole
    (:func:`~mgtutorial.exercises.ch02_ranks.one_process`), within 100 × ``float32_tolerance``
    (an epoch of float32 rounding in another order; a noise that depends on the rank is
    hundreds of times further off)."""
    ex = "02.2 augmentation on several ranks"
    augment = function_from(path, "augment", ex)
    x, _, index = (t[:32] for t in ch02_ranks.indexed_digits().tensors)
    out = attempt(ex, augment, x.clone(), index, 0)
    require(
        isinstance(out, torch.Tensor) and out.shape == x.shape,
        ex,
        f"augment returns {type(out).__name__} {tuple(getattr(out, 'shape', ()))}: return the "
        f"batch, shape {tuple(x.shape)}, with the noise added",
    )
    std = float((out - x).std())
    require(
        abs(std - AMPLITUDE) < 0.1 * AMPLITUDE,
        ex,
        f"the noise added has a standard deviation of {std:.3g}: add Gaussian noise of standard "
        f"deviation {AMPLITUDE}",
    )
    again = attempt(ex, augment, x.clone(), index, 1)
    require(
        not torch.equal(again, out),
        ex,
        "epoch 1 adds the same noise to these samples as epoch 0: a new draw every epoch",
    )
    every, _, indices = ch02_ranks.indexed_digits().tensors  # the whole data set, in chunks

    def drawn(epoch: int) -> set:  # each sample's noise, known by its first values
        noise = [
            attempt(ex, augment, every[k : k + 256].clone(), indices[k : k + 256], epoch)
            - every[k : k + 256]
            for k in range(0, len(indices), 256)
        ]
        return {tuple(row[:8].round(decimals=3).tolist()) for row in torch.cat(noise).flatten(1)}

    require(
        not drawn(0) & drawn(1),
        ex,
        "in epoch 1 a sample gets the very noise some sample got in epoch 0: two (epoch, "
        "index) pairs lead to the same draw",
    )
    cfg = ch02_ranks.AugmentExerciseConfig(path=str(Path(path).resolve()))
    run_dir = run_ranks(
        ex, ch02_ranks.augment_worker, cfg, 2, timeout_s=120, name="ex02_augment"
    ).run_dir
    got = [torch.load(run_dir / f"params{r}.pt", weights_only=True) for r in (0, 1)]
    # float32 sums in another order drift apart over an epoch of momentum SGD (measured on CPU:
    # about 1e-5 with the right noise, 3e-2 with each rank's own stream): 100 × section 4's bound
    tol = 100 * float32_tolerance("cuda" if env.resolve_backend("auto", 2) == "nccl" else "cpu")
    diff = max_abs_diff(got[0], ch02_ranks.one_process(cfg, augment))
    if diff >= tol:
        first = [torch.load(run_dir / f"noise{r}.pt", weights_only=True) for r in (0, 1)]
        why = (
            "both ranks added the same noise to different samples: their random streams start "
            "from the same seed, a bug in training too (the ranks' augmentations are correlated)"
            if torch.allclose(*first, rtol=0, atol=1e-5)  # (x + noise) - x: float rounding
            else "the ranks added different noise, which is right for training, but the noise a "
            "sample gets depends on which rank draws it and on its batch"
        )
        raise ExerciseError(
            ex,
            f"the 2 ranks end {diff:.2g} away from one process trained on their combined "
            f"batches (more than {tol:g}): {why}. One process on the combined batch draws other "
            "numbers. What may the noise of one sample depend on, so that the run is the same on "
            "any number of ranks?",
        )
    passed(
        ex,
        f"noise of standard deviation {AMPLITUDE}, new every epoch; 2 ranks trained an epoch "
        f"with it and equal one process on the combined batches (within {tol:g})",
    )


def last_batch(predicted: dict, nprocs: int = 3, batch_size: int = 100) -> None:
    """02.3: predictions for DDP on ``nprocs`` ranks with ``batch_size`` per rank over the whole
    first epoch of the digits: ``"samples_per_rank"``, ``"steps"`` (batches per rank),
    ``"last_batch"`` (samples in each rank's last batch), and ``"equal"`` (bool: DDP's parameters
    equal one process trained on the combined batches, largest difference < 1e-5; < 1e-4 with GPU
    ranks).

    Launches ``ddp.worker`` for that epoch (full float32: ``tf32=False``) and trains the reference
    here with ``ddp.combined_batch_reference``.
    """
    ex = "02.3 the last, shorter batch"
    keys = ("samples_per_rank", "steps", "last_batch", "equal")
    guess = {k: answered(predicted.get(k), ex, f"predicted[{k!r}]") for k in keys}
    train_set = data.load_digits()[0]
    loaders = [data.train_loader(train_set, batch_size, r, nprocs) for r in range(nprocs)]
    per_rank, steps = len(loaders[0].sampler), len(loaders[0])
    last = {len(list(loader)[-1][1]) for loader in loaders}
    require(
        guess["samples_per_rank"] == per_rank,
        ex,
        f'predicted["samples_per_rank"] = {guess["samples_per_rank"]}: the sampler pads '
        f"{len(train_set)} samples up to a multiple of {nprocs} ranks, then deals them out",
    )
    require(
        guess["steps"] == steps,
        ex,
        f'predicted["steps"] = {guess["steps"]}: how many batches of {batch_size} does one '
        "rank's share make, when the loader keeps a last, shorter one (drop_last=False)?",
    )
    require(
        {guess["last_batch"]} == last,
        ex,
        f'predicted["last_batch"] = {guess["last_batch"]}: the last batch holds what the '
        "full batches leave of one rank's share",
    )
    checkpoint = Path("runs/exercises/ex02_last_batch.pt").resolve()
    cfg = ddp.DDPConfig(
        dataset="digits",
        epochs=1,
        batch_size=batch_size,
        max_steps=steps,
        evaluate=False,
        tf32=False,
        checkpoint=str(checkpoint),
    )
    run_ranks(ex, ddp.worker, cfg, nprocs, name="ex02_last_batch")
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    diff = max_abs_diff(ddp.combined_batch_reference(cfg, nprocs).state_dict(), state)
    gpus = env.resolve_backend("auto", nprocs) == "nccl"
    equal = diff < float32_tolerance("cuda" if gpus else "cpu")  # chapter 02's tolerance
    require(
        guess["equal"] == equal,
        ex,
        f'predicted["equal"] = {guess["equal"]}: not what the run and the reference show. At the '
        "last step, does every rank's batch have the same size, and what does DDP average?",
    )
    passed(
        ex,
        f"{per_rank} samples per rank, {steps} steps, the last of {last.pop()} on every rank: "
        + ("DDP still equals one process on the combined batches" if equal else "DDP differs"),
    )


def _reference_lr(
    step: int, base_lr: float, base_batch: int, batch_size: int, world_size: int, warmup_steps: int
) -> float:
    target = base_lr * batch_size * world_size / base_batch
    return target if step >= warmup_steps else base_lr + (target - base_lr) * step / warmup_steps


def _shown(kw: dict) -> str:
    return "lr_at(step, " + ", ".join(f"{k}={v}" for k, v in kw.items()) + ")"


CASES = (  # (base_lr, base_batch, batch_size, world_size, warmup_steps)
    (0.01, 16, 16, 2, 10),
    (0.01, 16, 32, 4, 20),
    (0.1, 256, 32, 8, 100),
    (0.1, 256, 64, 8, 0),
)


def linear_scaling(lr_at: Callable) -> None:
    """02.4: ``lr_at(step, *, base_lr, base_batch, batch_size, world_size, warmup_steps) ->
    float`` is the learning rate at optimizer ``step`` (0, 1, …) under the linear scaling rule with
    a linear warm-up from ``base_lr``. Compared with the rule on a few configurations and steps."""
    ex = "02.4 linear scaling rule"
    cases = [
        dict(zip(("base_lr", "base_batch", "batch_size", "world_size", "warmup_steps"), c))
        for c in CASES
    ]
    for kw in cases:  # first the rate after warm-up, then the warm-up itself
        base_lr, base_batch, warmup = kw["base_lr"], kw["base_batch"], kw["warmup_steps"]
        where = _shown(kw)
        target = _reference_lr(warmup, **kw)
        effective = kw["batch_size"] * kw["world_size"]
        got = attempt(ex, lr_at, warmup + 1, **kw)
        require(
            not close(got, base_lr * kw["world_size"]) or close(target, got),
            ex,
            f"after warm-up {where} is {got:g}: you scaled by the number of ranks only; the "
            f"effective batch is batch_size × world_size = {effective}, "
            f"{effective / base_batch:g}× base_batch",
        )
        require(
            close(got, target),
            ex,
            f"after warm-up {where} is {got:g}: multiply base_lr by the factor the batch grew, "
            f"(batch_size × world_size) / base_batch = {effective}/{base_batch}",
        )
    for kw in cases:  # the whole line, not only the points above: every step, and a late one
        warmup, where = kw["warmup_steps"], _shown(kw)
        for step in [*range(warmup + 4), 10 * warmup + 1000]:
            got = attempt(ex, lr_at, step, **kw)
            require(
                close(got, _reference_lr(step, **kw)),
                ex,
                f"{where} at step {step} is {got:g}, off the rule: a straight line from base_lr "
                "at step 0 (the warm-up's start) to the scaled rate at step warmup_steps, and the "
                "scaled rate from there on",
            )
    example = _reference_lr(10, *CASES[0])
    passed(
        ex,
        f"lr_at follows the rule on {len(CASES)} configurations, e.g. 2 ranks of 16 against a "
        f"base batch of 16: 0.01 rising to {example:g}",
    )
