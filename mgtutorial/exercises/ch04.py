"""Checkers of chapter 04's exercises (notebooks/04a_pipeline_gpipe.ipynb: 04a.1, 04a.2;
notebooks/04b_pipeline_schedules.ipynb: 04b.1, 04b.2; 04b.3 in :mod:`.ch04_order`): the span and
bubble of a step with unequal stages and the m a target bubble needs with a delay per box, both
against the chapter's simulator, the weighting of micro-batch losses when padded rows do not count,
a balanced split of the MLP into stages, and the choice of m for a stage cost and delay per box."""

from __future__ import annotations

import math

import torch
from torch import nn

from mgtutorial.common import models
from mgtutorial.common.compare import max_abs_diff
from mgtutorial.exercises._common import (
    ExerciseError,
    attempt,
    close,
    passed,
    require,
    withheld,
)
from mgtutorial.exercises.ch04_choose import choose_m  # noqa: F401  (04b.2)
from mgtutorial.exercises.ch04_order import one_f_one_b  # noqa: F401  (04b.3)
from mgtutorial.exercises.splits import check_split
from mgtutorial.pipeline import bubble as bubble_module
from mgtutorial.pipeline.bubble import (
    box_order,
    bubble_formula,
    bubble_measured,
    bubble_model,
    lay_out,
)

STAGE_CASES = (([1, 1, 2], 4), ([2, 1, 1], 4), ([1, 3, 1, 1], 6), ([1, 1, 1, 1], 8), ([1, 2, 3], 1))
"""04a.1's unequal stages: (each stage's forward in units, its backward twice that; m)."""
DELAY_CASES = (
    (2, 0.1, 0.10),
    (3, 0.05, 0.15),
    (4, 0.25, 0.18),
    (8, 0.5, 0.30),
    (4, 0.5, 0.2505),  # just above the floor: m = 4310, beyond a short search
    (4, 0.5, 0.25),
    (4, 1.0, 0.30),
)
"""04a.1's delays: (p, o units before every box but the step's first, target bubble); in the last
two no m reaches the target (in the first of them the bubble only tends to it)."""
WITHHELD = ("lay_out", "ideal_events", "box_order", "bubble_model", "step_span", "step_costs")
"""What ``bubble`` withholds while 04a.1's functions run: the simulator and the delay model."""


def _gpipe(times, m: int, delay: float = 0.0) -> list[dict]:
    """An ideal GPipe step laid out by :func:`lay_out`: stage s's boxes ``times[s]`` × (1, 2)."""
    p = len(times)
    orders = [box_order("gpipe", s, p, m) for s in range(p)]
    return lay_out(orders, scale=list(times), delay_s=delay)


def _smallest(p: int, o: float, target: float) -> int | None:
    """The checker's own closed form: bubble(m) ≤ target ⇔ m·(3 − (1 − T)(3 + 2o)) ≥
    (1 − T)((p − 1)(3 + 2o) − o) (:func:`~mgtutorial.pipeline.bubble.bubble_model`, f = 1, b = 2);
    None when the coefficient of m is not positive: the floor 2o / (3 + 2o) is not below T."""
    coef = 3 - (1 - target) * (3 + 2 * o)
    if coef <= 0:
        return None
    return max(1, math.ceil((1 - target) * ((p - 1) * (3 + 2 * o) - o) / coef - 1e-12))


def bubble(gpipe_step, smallest_m) -> None:
    """04a.1: ``gpipe_step(times, m)`` returns ``(span, bubble)`` of one ideal GPipe step (no cost
    between boxes) whose stage s's forward lasts ``times[s]`` units and its backward twice that,
    with m micro-batches: the span in units and the idle fraction of the step. ``smallest_m(p, o,
    target)`` returns the smallest m whose GPipe bubble is at most ``target``, every forward 1
    unit and backward 2 (the micro-batch keeps its size as m grows) and every box but the step's
    first starting ``o`` units late; None when no m reaches it.

    Verified against ideal steps laid out box by box by the chapter's simulator
    (:func:`~mgtutorial.pipeline.bubble.lay_out`, with ``scale`` and ``delay_s``): the span and
    bubble of :data:`STAGE_CASES` (equal stages among them, where the formula holds, and m = 1),
    and for :data:`DELAY_CASES` the bubble at the learner's m and at m − 1."""
    ex = "04a.1 the bubble, derived"
    for times, m in STAGE_CASES:
        evs, p = _gpipe(times, m), len(times)
        span, idle = max(e["end"] for e in evs), bubble_measured(evs)
        if len(set(times)) == 1:
            require(close(idle, bubble_formula(p, m)), ex, "lay_out no longer gives the formula")
        call = f"gpipe_step({times}, m={m})"
        with withheld(
            ex, bubble_module, WITHHELD, "derive the span from the stages' times", gpipe_step
        ):
            out = attempt(ex, gpipe_step, list(times), m)
        require(
            isinstance(out, tuple) and len(out) == 2,
            ex,
            f"{call} returned {out!r}: return (span in units, bubble as a fraction)",
        )
        got_span, got_idle = out
        balanced = (m + p - 1) * 3 * sum(times) / p
        require(
            close(got_span, span, rel=1e-6),
            ex,
            f"{call}: the span {got_span!r} is not the step's: "
            + (
                "that is a balanced pipeline's with the same total work; which stage sets the "
                "pace while the pipeline is full?"
                if close(got_span, balanced, rel=1e-6)
                else "you made every slot as long as the slowest stage's; the fill and the "
                "drain cross each stage once, at its own speed"
                if close(got_span, (m + p - 1) * 3 * max(times), rel=1e-6)
                else "lay the boxes out with bubble.lay_out(..., scale=times) and follow the last "
                "micro-batch's forward and the first one's way back"
            ),
        )
        require(
            close(got_idle, idle, rel=1e-6, abs_=1e-9),
            ex,
            f"{call}: the bubble {got_idle!r} is not the idle fraction of that step: "
            + (
                "close but not exact: give the fraction itself, not a rounded value"
                if close(got_idle, idle, abs_=0.01)
                else "that is the formula's, which assumes equal stages"
                if close(got_idle, bubble_formula(p, m), rel=1e-6)
                else "each stage is busy for its own boxes only: sum them over the stages and "
                "divide by stages × span"
            ),
        )
    for p, o, target in DELAY_CASES:
        call, want = f"smallest_m(p={p}, o={o}, target={target})", _smallest(p, o, target)
        why = "derive the bubble with the delay, and solve it for m"
        with withheld(ex, bubble_module, WITHHELD, why, smallest_m):
            got = attempt(ex, smallest_m, p, o, target)
        if want is not None:
            ok = _bubble_at(p, want, o) <= target + 1e-9 < _bubble_at(p, want - 1, o)
            require(ok, ex, f"{call}: lay_out and the closed form disagree: the checker is broken")
        if got is None:
            require(
                want is None,
                ex,
                f"{call} returned None, but some m reaches a bubble ≤ {target}: what does the "
                "bubble tend to as m grows, and is the target above it?",
            )
            continue
        require(
            isinstance(got, int) and got >= 1,
            ex,
            f"{call} returned {got!r}: give a whole number of micro-batches, or None",
        )
        idle = _bubble_at(p, got, o)
        if idle > target + 1e-9:
            why = (
                "and no m reaches it: as m grows, what does the bubble tend to when every box "
                "pays o? (return None)"
                if want is None
                else "that m ignores the delay: every box starts o late, which the formula does "
                "not see"
                if o and abs(got - _smallest(p, 0.0, target)) <= 1  # the formula's m, ± rounding
                else "more micro-batches are needed"
            )
            raise ExerciseError(
                ex,
                f"{call}: at m={got} the bubble laid out with bubble.lay_out(..., delay_s={o}) "
                f"is {idle:.4f}, still above {target}: {why}",
            )
        require(
            _bubble_at(p, got - 1, o) > target,
            ex,
            f"{call}: m={got} keeps the bubble within {target}, but so does m={got - 1}: the "
            "smallest is asked for",
        )
    passed(
        ex,
        f"{len(STAGE_CASES)} steps with unequal stages have the span and bubble the simulator "
        f"lays out, and {len(DELAY_CASES)} delays give the smallest m (or none) for their target",
    )


def _bubble_at(p: int, m: int, o: float) -> float:
    """The laid-out bubble of :func:`_gpipe` with equal stages; 1 for m = 0 (no work). Past
    m = 5000 (a learner's very large m), :func:`bubble_model`, which equals it (tested)."""
    if m > 5000:
        return bubble_model(p, m, 1.0, 2.0, o)
    return bubble_measured(_gpipe([1] * p, m, o)) if m >= 1 else 1.0


def balanced_split(split_fn) -> None:
    """04b.1: ``split_fn(mlp, k)`` returns ``k`` modules, the consecutive sub-networks of ``mlp``
    (an :class:`~mgtutorial.common.models.ArticleMLP`) with the largest stage's parameter count as
    small as possible.

    Verified on the article's MLP (k = 2, 3), on a 5-block MLP (k = 1 … 5), and on one (k = 3)
    where the smallest spread (largest − smallest) is not the smallest largest stage: k stages,
    each with parameters, that share the model's parameters (no copies), whose counts add up to the
    model's, whose forward one after the other equals the unsplit model's, and whose largest stage
    is the smallest possible (:func:`~mgtutorial.exercises.splits.check_split`).
    """
    ex = "04b.1 balanced split"
    for sizes, k in SPLIT_CASES:
        torch.manual_seed(0)
        mlp = models.ArticleMLP(sizes)
        stages = attempt(ex, split_fn, mlp, k)
        check_split(ex, f"split_fn(ArticleMLP({sizes}), {k})", mlp, stages, k)
    passed(
        ex,
        f"{len(SPLIT_CASES)} splits (one stage, and one sub-network per stage, among them) have "
        "the model's parameters, its output and the smallest largest stage",
    )


SPLIT_CASES = (
    ((1024, 512, 256, 100), 2),
    ((1024, 512, 256, 100), 3),
    ((64, 256, 256, 64, 32, 10), 2),
    ((64, 256, 256, 64, 32, 10), 3),
    ((64, 256, 256, 64, 32, 10), 4),
    ((16, 16, 64, 128, 32, 128), 3),
    ((64, 256, 256, 64, 32, 10), 5),  # as many stages as sub-networks: one each
    ((64, 256, 256, 64, 32, 10), 1),  # one stage: the whole model
)
"""04b.1's (layer widths, k stages)."""


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
