"""Checkers of chapter 01's exercises (notebooks/01_single_device.ipynb): the digits' label counts,
the batch sizes the article's flatten accepts, one training step by hand, and the learning rate."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable

import torch
from torch import nn

from mgtutorial import ddp
from mgtutorial.common import data, models
from mgtutorial.common.compare import max_abs_diff
from mgtutorial.exercises._common import (
    ExerciseError,
    answered,
    attempt,
    passed,
    require,
    run_ranks,
)
from mgtutorial.runtime.runlog import read_run

ARTICLE_FEATURES = 4608  # the article's hard-coded x.view(-1, 4608)


def label_counts(counts: dict, balanced) -> None:
    """01.1: ``counts[label]`` (int) is the number of images of ``label`` (0…9) in the digits
    *training* set; ``balanced`` (bool) says whether every label's count is within 10% of the mean.

    Verified against ``torch.bincount`` of the training labels.
    """
    ex = "01.1 label counts"
    train_labels = data.load_digits()[0].tensors[1]
    truth = torch.bincount(train_labels, minlength=10).tolist()
    require(
        isinstance(counts, dict),
        ex,
        f"counts is a {type(counts).__name__}: give a dict (or Counter) label → count",
    )
    if any(isinstance(key, torch.Tensor) for key in counts):
        raise ExerciseError(
            ex,
            "the keys of counts are tensors (tensor(3) is not the int 3): count int(y) "
            "instead of y, e.g. Counter(int(y) for _, y in train_set)",
        )
    got = [answered(counts.get(label), ex, f"counts[{label}]") for label in range(10)]
    test_size = len(data.load_digits()[1])
    require(
        sum(got) != test_size,
        ex,
        f"your counts add up to {test_size}, the size of the test set: count the training set",
    )
    require(
        sum(got) != len(train_labels) + test_size,
        ex,
        f"your counts add up to {sum(got)}, the whole data set: count the training set only",
    )
    for label in range(10):
        require(
            got[label] == truth[label],
            ex,
            f"counts[{label}] = {got[label]} is not the number of training images with label "
            f"{label}: count the label y of every (x, y) in the training set (not one batch)",
        )
    mean = len(train_labels) / 10
    is_balanced = all(abs(n - mean) <= 0.1 * mean for n in truth)
    require(
        answered(balanced, ex, "balanced") == is_balanced,
        ex,
        f"balanced = {balanced}, but the counts go from {min(truth)} to {max(truth)} around a mean "
        f"of {mean:g}: is every count within 10% of it?",
    )
    passed(
        ex,
        f"{len(train_labels)} training images, {min(truth)} to {max(truth)} per label: "
        + ("balanced (the split is stratified)" if is_balanced else "not balanced"),
    )


def flatten_rows(article_rows: Callable[[int], int | None]) -> None:
    """01.2: ``article_rows(batch_size)`` returns how many rows ``h.view(-1, 4608)`` gives for a
    batch of 32×32 images after the article's convolution and pooling (an int), or ``None`` where
    the view fails. Verified for every batch size 1…99 against the view itself."""
    ex = "01.2 the article's flatten"
    features = nn.MaxPool2d(2)(nn.Conv2d(3, 32, kernel_size=5)(torch.zeros(1, 3, 32, 32))).numel()
    succeeded = {}
    for b in range(1, 100):
        try:
            truth = torch.empty(b, features).view(-1, ARTICLE_FEATURES).shape[0]
        except RuntimeError:
            truth = None
        got = attempt(ex, article_rows, b)
        if got == truth:
            if truth is not None:
                succeeded[b] = truth
            continue
        if truth is None:
            raise ExerciseError(
                ex,
                f"article_rows({b}) returned {got!r}, but view(-1, 4608) fails for a "
                f"batch of {b}: {b} × {features} values are not a whole number of rows "
                f"of 4608. Return None there",
            )
        if got is None:
            raise ExerciseError(
                ex,
                f"article_rows({b}) returned None, but the view succeeds for a batch "
                f"of {b}: {b} × {features} is a multiple of 4608",
            )
        raise ExerciseError(
            ex,
            f"article_rows({b}) returned {got!r}: the view makes rows of 4608 values out "
            f"of {b} × {features} values; count rows, not images",
        )
    passed(
        ex,
        "view(-1, 4608) succeeds below 100 only for batch sizes "
        + ", ".join(f"{b} ({rows} rows)" for b, rows in succeeded.items()),
    )


def _reference_step(model, loss_fn, optimizer, x, y) -> float:
    """The Trainer's own step (``ddp.Trainer._run_batch``), on a plain model."""
    return ddp.Trainer._run_batch(
        SimpleNamespace(model=model, loss_fn=loss_fn, optimizer=optimizer), x, y
    )


def training_step(train_step: Callable, steps: int = 3) -> None:
    """01.3: ``train_step(model, loss_fn, optimizer, X, y) -> float`` does one optimizer step on the
    batch ``X`` (B, 3, 32, 32), ``y`` (B,) and returns its loss as a Python float.

    ``steps`` steps on digits batches of 16, from the same initial weights, are compared after each
    step with the Trainer's own step (``ddp.Trainer._run_batch``).
    """
    ex = "01.3 one training step"
    train_set, _ = data.load_digits()
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    batches = [batch for batch, _ in zip(loader, range(steps))]

    def fresh():
        torch.manual_seed(0)
        model = models.ArticleCNN((3, 32, 32))
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    (mine, my_opt), (ref, ref_opt) = fresh(), fresh()
    start = {k: v.clone() for k, v in mine.state_dict().items()}
    loss_fn = nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(batches, start=1):
        loss = attempt(ex, train_step, mine, loss_fn, my_opt, x, y)
        ref_loss = _reference_step(ref, loss_fn, ref_opt, x, y)
        require(
            isinstance(loss, float),
            ex,
            f"train_step returned a {type(loss).__name__}: return "
            f"loss.item(), a Python float (a tensor keeps its graph alive)",
        )
        require(
            math.isclose(loss, ref_loss, rel_tol=1e-5),
            ex,
            f"step {step}'s loss is {loss:.4f}, the Trainer's is {ref_loss:.4f}: return the loss "
            "of this batch, computed before the weights change",
        )
        if max_abs_diff(mine.state_dict(), ref.state_dict()) <= 1e-6:
            continue
        require(
            max_abs_diff(mine.state_dict(), start) > 0,
            ex,
            "the weights did not change: call optimizer.step() "
            "after loss.backward(), or is zero_grad() between "
            "backward() and step() clearing the gradients?",
        )
        require(
            step > 1,
            ex,
            "after the first step your weights differ from the Trainer's: the order is "
            "zero_grad, forward, loss, backward, step",
        )
        raise ExerciseError(
            ex,
            f"the first step matches the Trainer's, step {step} does not: the gradients "
            "add up in .grad across steps. Call optimizer.zero_grad() every step",
        )
    passed(ex, f"{steps} steps of train_step give the Trainer's weights and losses")


def learning_rates(order: list, lrs=(0.001, 0.01, 0.05), max_steps: int = 45) -> None:
    """01.4: ``order`` lists the learning rates ``lrs`` from the lowest mean training loss over the
    first ``max_steps`` steps to the highest.

    Trains one rank of ``ddp.worker`` per learning rate on the digits (chapter 01's cfg otherwise:
    batch 16, SGD with momentum 0.9, the same seed) and reads each run's logged losses.
    """
    ex = "01.4 learning rate"
    guess = [answered(v, ex, f"order[{i}]") for i, v in enumerate(order)]
    require(
        sorted(guess) == sorted(lrs),
        ex,
        f"order is {guess}: list each of {', '.join(map(str, lrs))} once",
    )
    mean_loss = {}
    for lr in lrs:
        cfg = ddp.DDPConfig(
            dataset="digits", epochs=1, batch_size=16, lr=lr, max_steps=max_steps, evaluate=False
        )
        run_dir = run_ranks(ex, ddp.worker, cfg, 1, name=f"ex01_lr{lr:g}").run_dir
        losses = [rec["global_loss"] for rec in read_run(run_dir) if rec["kind"] == "train"]
        require(
            len(losses) == max_steps,
            ex,
            f"the run at lr={lr} logged {len(losses)} steps, not {max_steps}",
        )
        mean_loss[lr] = sum(losses) / len(losses)
    truth = sorted(lrs, key=mean_loss.get)
    chance = math.log(10)  # cross-entropy of a uniform guess over 10 labels
    for i, (g, t) in enumerate(zip(guess, truth)):
        place = "lowest" if i == 0 else "highest" if i == len(lrs) - 1 else "middle"
        require(
            g == t,
            ex,
            f"order[{i}] is {g}, but lr={t} gave the {place} mean loss. Too "
            "small a step moves slowly; too large a step overshoots, and a loss above "
            f"ln 10 ≈ {chance:.2f} is worse than a uniform guess over the 10 labels",
        )
    passed(
        ex,
        f"over {max_steps} steps lr={truth[0]} trained best, then lr={truth[1]}, then "
        f"lr={truth[2]}",
    )
