"""Checkers of chapter 04's exercises (notebooks/04a_pipeline_gpipe.ipynb: 04a.1, 04a.2;
notebooks/04b_pipeline_schedules.ipynb: 04b.1, 04b.2; 04b.3 in
:mod:`mgtutorial.exercises.ch04_order`): the bubble of an ideal step (with a slow stage too), the
weighting of micro-batch losses when padded rows do not count, a balanced split of the MLP into
stages, and the choice of m for a given stage cost and delay between boxes."""

from __future__ import annotations

import torch
from torch import nn

from mgtutorial.common import models
from mgtutorial.common.compare import max_abs_diff
from mgtutorial.exercises._common import (
    ExerciseError,
    answered,
    attempt,
    close,
    passed,
    require,
)
from mgtutorial.exercises.ch04_choose import choose_m  # noqa: F401  (04b.2)
from mgtutorial.exercises.ch04_order import one_f_one_b  # noqa: F401  (04b.3)
from mgtutorial.exercises.splits import check_split
from mgtutorial.pipeline.bubble import (
    box_order,
    bubble_formula,
    bubble_measured,
    ideal_events,
    lay_out,
)

BUBBLE_CASES = ((4, 8), (8, 16))
"""(p stages, m micro-batches) whose ideal bubble 04a.1 asks for."""
SLOW = (3, 4, [1, 1, 2])
"""04a.1's unbalanced pipeline: p = 3 stages, m = 4 micro-batches, stage 2's boxes twice as long
(a forward 1 unit and a backward 2 on stages 0 and 1, 2 and 4 on stage 2)."""


def bubble(predicted: dict, slow: dict, smallest_m) -> None:
    """04a.1: ``predicted[(p, m)]`` is the ideal GPipe bubble, as a fraction of the step, for p
    stages and m micro-batches, for (4, 8) and (8, 16); ``slow`` is ``{"span": units, "bubble":
    fraction}`` of one ideal GPipe step of :data:`SLOW`, a pipeline the formula does not cover
    (its last stage twice as slow); ``smallest_m`` (an int) is the smallest m whose bubble at
    p = 4 is at most 10 %. Verified against :func:`mgtutorial.pipeline.bubble.bubble_formula`, and
    against ideal GPipe and 1F1B steps laid out box by box
    (:func:`~mgtutorial.pipeline.bubble.lay_out`: each box starts as soon as its input has arrived
    and its stage is free)."""
    ex = "04a.1 bubble formula"
    for p, m in BUBBLE_CASES:
        guess = answered(predicted.get((p, m)), ex, f"predicted[{(p, m)}]")
        truth = bubble_formula(p, m)
        for schedule in ("gpipe", "1f1b"):
            laid_out = bubble_measured(ideal_events(schedule, p, m))
            require(
                close(laid_out, truth),
                ex,
                f"the ideal {schedule} step ({laid_out}) no longer matches the formula ({truth}): "
                "the checker is broken",
            )
        _exact(ex, guess, truth, f"for p={p}, m={m}")
        require(
            close(guess, truth, rel=1e-3, abs_=1e-3),
            ex,
            f"for p={p}, m={m} you predicted {guess!r}, which is not the idle fraction of the "
            "step: "
            + (
                "that is the idle time relative to the compute time; the fraction asked for "
                "divides by the whole step (idle + busy)"
                if close(guess, (p - 1) / m, rel=1e-3)
                else "count the slots a stage idles while the pipeline fills and drains, and the "
                "slots of the whole step"
            ),
        )
    p, m, scale = SLOW
    orders = [box_order("gpipe", s, p, m) for s in range(p)]
    evs = lay_out(orders, scale=scale)
    span = max(e["end"] for e in evs)
    idle = bubble_measured(evs)
    got = answered(slow, ex, "slow")
    require(
        isinstance(got, dict) and {"span", "bubble"} <= set(got),
        ex,
        f"slow = {got!r}: give a dict with keys 'span' (units) and 'bubble' (a fraction)",
    )
    require(
        close(got["span"], span, rel=1e-6),
        ex,
        f"slow['span'] = {got['span']!r} is not the step's span: "
        + (
            "that is the balanced pipeline's; the slow stage sets the pace of the middle of the "
            "step, so lay the boxes out one by one (when can stage 2 start each box?)"
            if close(got["span"], (m + p - 1) * 3, rel=1e-6)
            else "lay the boxes out one by one: a box starts when its input has arrived and its "
            "stage is free"
        ),
    )
    _exact(ex, got["bubble"], idle, "slow['bubble']")
    require(
        close(got["bubble"], idle, rel=1e-3, abs_=1e-3),
        ex,
        f"slow['bubble'] = {got['bubble']!r} is not the idle fraction of that step: "
        + (
            "that is the formula's, which assumes equal stages"
            if close(got["bubble"], bubble_formula(p, m), rel=1e-3)
            else "sum each stage's own busy time (the slow stage's boxes are longer) and divide "
            "by stages × span"
        ),
    )
    m = answered(smallest_m, ex, "smallest_m")
    require(
        isinstance(m, int) and m >= 1,
        ex,
        f"smallest_m = {m!r}: give a whole number of micro-batches",
    )
    require(
        bubble_formula(4, m) <= 0.10,
        ex,
        f"at p=4 and m={m} the bubble is still above 10 %: more micro-batches are needed",
    )
    require(
        m == 1 or bubble_formula(4, m - 1) > 0.10,
        ex,
        f"m={m} keeps the bubble within 10 %, but so does a smaller m: the smallest is asked for",
    )
    passed(
        ex,
        f"{len(BUBBLE_CASES)} predictions equal (p−1)/(m+p−1) and the ideal GPipe and 1F1B steps, "
        f"the slow-stage step lasts {span:g} units with a bubble of {idle:.3f}, and m = {m} is "
        "the smallest with a bubble ≤ 10 % at p = 4",
    )


def _exact(ex: str, guess, truth: float, where: str) -> None:
    """Refuse a value within 0.01 of ``truth`` but not within 1e-3: a rounded answer."""
    require(
        close(guess, truth, rel=1e-3, abs_=1e-3) or not close(guess, truth, abs_=0.01),
        ex,
        f"{where} your {guess!r} is close but not exact: give the fraction itself (e.g. as a "
        "quotient, 3 / 7) or at least 3 decimals",
    )


def balanced_split(split_fn) -> None:
    """04b.1: ``split_fn(mlp, k)`` returns ``k`` modules, the consecutive sub-networks of ``mlp``
    (an :class:`~mgtutorial.common.models.ArticleMLP`) with the largest stage's parameter count as
    small as possible.

    Verified on the article's MLP (k = 2, 3), on a 5-block MLP (k = 2, 3, 4), and on one (k = 3)
    where the smallest spread (largest − smallest) is not the smallest largest stage: k stages,
    each with parameters, that share the model's parameters (no copies), whose counts add up to the
    model's, whose forward one after the other equals the unsplit model's, and whose largest stage
    is the smallest possible (:func:`~mgtutorial.exercises.splits.check_split`).
    """
    ex = "04b.1 balanced split"
    for sizes, k in (
        ((1024, 512, 256, 100), 2),
        ((1024, 512, 256, 100), 3),
        ((64, 256, 256, 64, 32, 10), 2),
        ((64, 256, 256, 64, 32, 10), 3),
        ((64, 256, 256, 64, 32, 10), 4),
        ((16, 16, 64, 128, 32, 128), 3),
    ):
        torch.manual_seed(0)
        mlp = models.ArticleMLP(sizes)
        stages = attempt(ex, split_fn, mlp, k)
        check_split(ex, f"split_fn(ArticleMLP({sizes}), {k})", mlp, stages, k)
    passed(ex, "6 splits have the model's parameters, its output and the smallest largest stage")


IGNORE = -100
"""The label of a row that does not count (``cross_entropy``'s default ``ignore_index``)."""

WEIGHTING_CASES = (  # (batch, m, rows whose label is IGNORE)
    (32, 4, tuple(range(6))),  # 6 padded rows, all in micro-batch 0
    (33, 4, (3, 10, 11, 12, 20)),  # unequal micro-batches (9, 8, 8, 8) and padding
    (32, 4, tuple(range(8, 16))),  # micro-batch 1 is padding only: its own mean is NaN
)


def _grads_weighted(model, x, y, m, weight) -> list[torch.Tensor]:
    """The gradients of sum over micro-batches i of weight(i, xi, yi) × their mean loss."""
    params = list(model.parameters())
    total = [torch.zeros_like(w) for w in params]
    for i, (xi, yi) in enumerate(zip(torch.tensor_split(x, m), torch.tensor_split(y, m))):
        loss = nn.functional.cross_entropy(model(xi), yi) * weight(i, xi, yi)
        for acc, gi in zip(total, torch.autograd.grad(loss, params)):
            acc += gi
    return total


def loss_weighting(accumulate) -> None:
    """04a.2: ``accumulate(model, x, y, m)`` cuts ``(x, y)`` into ``m`` micro-batches
    (``torch.tensor_split``), runs forward and backward on each, and leaves in ``.grad`` the
    gradient of the full batch's ``cross_entropy(model(x), y)``, whose mean runs over the rows
    that count: rows labelled -100 (padding) are ignored.

    Verified against one full-batch backward in three cases (batch, m, padded rows): 32 in 4 with
    the 6 padded rows in micro-batch 0; 33 in 4 (9, 8, 8, 8) with 5 spread out; 32 in 4 with
    micro-batch 1 all padding (its own mean is 0 / 0, a NaN loss; autograd sends it no gradient).
    A wrong gradient is compared with the two weightings of section 3a's reasoning (1/m, and each
    micro-batch's share of the rows) to say which it is, without giving the right one.
    """
    ex = "04a.2 loss weighting with padding"
    for batch, m, padded in WEIGHTING_CASES:
        g = torch.Generator().manual_seed(batch + m + len(padded))
        x, y = torch.randn(batch, 16, generator=g), torch.randint(0, 10, (batch,), generator=g)
        y[list(padded)] = IGNORE
        torch.manual_seed(0)
        model = models.ArticleMLP((16, 32, 10))
        params = list(model.parameters())
        want = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), params)
        model.zero_grad(set_to_none=True)
        attempt(ex, accumulate, model, x, y, m)
        got = [p.grad for p in model.parameters()]
        where = f"batch {batch} in m={m} micro-batches, rows {list(padded)} padded"
        require(
            all(gr is not None for gr in got),
            ex,
            f"{where}: some parameters have no .grad: call backward() on each micro-batch's loss",
        )
        if all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want)):
            continue
        share = _grads_weighted(model, x, y, m, lambda i, xi, yi: len(xi) / len(x))
        equal = _grads_weighted(model, x, y, m, lambda i, xi, yi: 1 / m)
        if all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, share)):
            hint = (
                "you weighted each micro-batch by its share of the rows, as section 3a does; "
                "here the full batch's mean does not divide by its rows: by what then, and what "
                "does each micro-batch's own mean divide by?"
            )
        elif all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, equal)):
            hint = "you weighted every micro-batch by 1/m; which rows does the full mean count?"
        else:
            hint = (
                "compare with one backward of the full batch's mean loss; do not zero .grad "
                "between micro-batches"
            )
        raise ExerciseError(
            ex,
            f"{where}: the gradient differs from the full batch's by up to "
            f"{max_abs_diff(got, want):.1e}: {hint}",
        )
    passed(
        ex,
        f"{len(WEIGHTING_CASES)} padded batches (one with a micro-batch of padding only) give "
        "the full batch's gradient",
    )
