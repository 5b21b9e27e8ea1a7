"""Checkers of chapter 01's exercises (notebooks/01_single_device.ipynb): the digits' label counts,
the batch sizes the article's flatten accepts, one training step by hand, and the loss of an
untrained network."""

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
)

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


def untrained_loss(predict, classes=(2, 10, 100), samples: int = 256) -> None:
    """01.4: ``predict(num_classes)`` is the mean cross-entropy loss of an untrained network with
    ``num_classes`` outputs, before any step. Builds chapter 01's CNN (seed 0) with each number of
    classes and measures its loss on ``samples`` digits images with random labels; accepts 3 %."""
    ex = "01.4 the untrained loss"
    train_set, _ = data.load_dataset("digits")
    x = torch.stack([train_set[i][0] for i in range(samples)])
    for c in classes:
        guess = attempt(ex, predict, c)
        require(
            isinstance(guess, (int, float)) and math.isfinite(guess),
            ex,
            f"predict({c}) returned {guess!r}: return the loss as a number",
        )
        torch.manual_seed(0)
        model = models.ArticleCNN(tuple(x.shape[1:]), num_classes=c)
        y = torch.randint(0, c, (samples,), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            measured = nn.functional.cross_entropy(model(x), y).item()
        require(
            abs(guess - measured) <= 0.03 * measured,
            ex,
            f"with {c} classes your loss is not what the untrained network scores: its outputs are "
            "small and nearly equal, so it gives every class about the same probability; what is "
            "the cross-entropy (natural logarithm) of that probability?",
        )
    passed(
        ex,
        f"an untrained network scores about ln(classes) for {', '.join(map(str, classes))} "
        "classes: the loss of a uniform guess",
    )
