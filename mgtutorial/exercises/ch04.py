"""Checkers of chapter 04's exercises (notebooks/04a_pipeline_gpipe.ipynb: 04a.1, 04a.2;
notebooks/04b_pipeline_schedules.ipynb: 04b.1, 04b.2, 04b.3; 04b.4 in
:mod:`mgtutorial.exercises.ch04_order`): the bubble formula, the
peak activation bytes of each stage under GPipe and 1F1B, a balanced split of the MLP into
stages, the weighting of micro-batch losses when padded rows do not count, and the choice of m
for a given stage cost and delay between boxes."""

from __future__ import annotations

import itertools

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
    run_ranks,
)
from mgtutorial.exercises.ch04_order import one_f_one_b  # noqa: F401  (04b.4)
from mgtutorial.exercises.splits import check_split
from mgtutorial.pipeline import schedules
from mgtutorial.pipeline.bubble import bubble_formula, bubble_measured, ideal_events, step_span

BUBBLE_CASES = ((4, 8), (8, 16), (3, 6))
"""(p stages, m micro-batches) whose ideal bubble 04a.1 asks for."""


def bubble(predicted: dict, relative, smallest_m) -> None:
    """04a.1: ``predicted[(p, m)]`` is the ideal GPipe bubble, as a fraction of the step, for p
    stages and m micro-batches, for (4, 8), (8, 16) and (3, 6); ``relative`` is the same idle time
    at p = 4, m = 8 relative to the compute time instead (Megatron-LM's convention, 04a section
    4); ``smallest_m`` (an int) is the smallest m whose bubble (fraction of the step) at p = 4 is
    at most 10 %. Verified against :func:`mgtutorial.pipeline.bubble.bubble_formula` and against
    ideal GPipe and 1F1B steps whose boxes have no cost between them
    (:func:`~mgtutorial.pipeline.bubble.ideal_events`)."""
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
    rel = answered(relative, ex, "relative")
    truth = bubble_formula(4, 8) / (1 - bubble_formula(4, 8))
    _exact(ex, rel, truth, "relative (p=4, m=8)")
    require(
        close(rel, truth, rel=1e-3, abs_=1e-3),
        ex,
        f"relative = {rel!r} is not the idle time over the compute time at p=4, m=8"
        + (
            ": that is the fraction of the whole step; divide the same idle time by the busy "
            "time instead"
            if close(rel, bubble_formula(4, 8), rel=1e-3)
            else ": how many slots does a stage idle, and how many does it compute?"
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
        f"the idle time is {truth:.3f} of the compute time at p = 4, m = 8, and m = {m} is the "
        "smallest with a bubble ≤ 10 % at p = 4",
    )


def _exact(ex: str, guess, truth: float, where: str) -> None:
    """Refuse a value within 0.01 of ``truth`` but not within 1e-3: a rounded answer."""
    require(
        close(guess, truth, rel=1e-3, abs_=1e-3) or not close(guess, truth, abs_=0.01),
        ex,
        f"{where} your {guess!r} is close but not exact: give the fraction itself (e.g. as a "
        "quotient, 3 / 7) or at least 3 decimals",
    )


PEAK_CASES = ((128, 64, 8), (96, 48, 6), (64, 60, 5))
"""(width w, batch, m) of the 2-stage pipelines ``sizes=[w] * 5`` 04b.1's function is checked
on: the first measured, the others from the chapter's breakdown (:func:`peak_model`)."""


def _stage_bytes(w: int, batch: int, m: int, stage: int) -> tuple[int, int]:
    """(bytes held once per step, bytes per micro-batch held) of ``stage`` of a 2-stage pipeline of
    ``sizes=[w] * 5``: stage 0 keeps the input batch and two ReLU outputs per micro-batch; stage 1
    the int64 targets and, per micro-batch, its input, one ReLU output, the log-softmax output and
    ``nll_loss``'s 4-byte total weight (04b section 3)."""
    rows = batch // m
    if stage == 0:
        return batch * w * 4, rows * 2 * w * 4
    return batch * 8, rows * 3 * w * 4 + 4


def peak_model(schedule: str, stage: int, w: int, batch: int, m: int) -> int:
    """The peak activation bytes of ``stage`` (0 or 1) of 2 under ``schedule`` ("gpipe" or
    "1f1b") by 04b section 3's breakdown: held once, plus per micro-batch times the micro-batches
    held at the peak (m under GPipe, min(p − s, m) under 1F1B). tests/test_exercises_ch04.py holds
    it against ``ActivationMeter``'s measurement."""
    fixed, per_mb = _stage_bytes(w, batch, m, stage)
    held = m if schedule == "gpipe" else min(2 - stage, m)
    return fixed + held * per_mb


def _measured_peaks(ex: str, w: int, batch: int, m: int) -> dict:
    """{(schedule, stage): peak activation bytes} of one step of each schedule on 2 ranks."""
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        cfg = schedules.PipelineConfig(
            schedule=schedule,
            n_microbatches=m,
            batch_size=batch,
            steps=1,
            sizes=[w] * 5,
            save_params=False,
        )
        run = run_ranks(ex, schedules.worker, cfg, 2, name=f"peak-{schedule}", threads_per_rank=1)
        for s, value in sorted(run.values.items()):
            peaks[schedule, s] = value["peak_activation_bytes"]
    return peaks


def peak_bytes(peak) -> None:
    """04b.1: ``peak(schedule, stage, w, batch, m)`` (an int) is the peak activation bytes of stage
    0 or 1 of a 2-stage pipeline of ``sizes=[w] * 5`` under schedule "gpipe" or "1f1b", a batch of
    ``batch`` rows in ``m`` micro-batches (float32 activations, int64 targets).

    Checked on three pipelines (:data:`PEAK_CASES`): the first run on 2 ranks (one step of each
    schedule, each stage's peak as ``ActivationMeter`` measures it), the others against the
    chapter's breakdown (:func:`peak_model`). A wrong value is explained by the part of 04b
    section 3's breakdown it misses (held once, per micro-batch, micro-batches held), never by the
    number.
    """
    ex = "04b.1 peak activation bytes"
    for case, (w, batch, m) in enumerate(PEAK_CASES):
        truth = (
            _measured_peaks(ex, w, batch, m)
            if case == 0
            else {
                (sch, s): peak_model(sch, s, w, batch, m)
                for sch, s in itertools.product(("gpipe", "1f1b"), (0, 1))
            }
        )
        guesses = {}
        for sch, s in itertools.product(("gpipe", "1f1b"), (0, 1)):
            guesses[sch, s] = attempt(ex, peak, sch, s, w, batch, m)
            require(
                isinstance(guesses[sch, s], int),
                ex,
                f"peak({sch!r}, {s}, w={w}, batch={batch}, m={m}) returned "
                f"{guesses[sch, s]!r}: give a number of bytes (an int)",
            )
        for s in (0, 1):
            fixed, per_mb = _stage_bytes(w, batch, m, s)
            require(
                case > 0 or truth["gpipe", s] == peak_model("gpipe", s, w, batch, m),
                ex,
                f"stage {s} measured {truth['gpipe', s]} bytes, not the breakdown's: the "
                "chapter's model or ActivationMeter changed; rerun section 3",
            )
            for sch in ("gpipe", "1f1b"):
                guess = guesses[sch, s]
                if guess == truth[sch, s]:
                    continue
                # GPipe and 1F1B hold the same bytes once and differ only in micro-batches held
                if guesses["gpipe", s] - guesses["1f1b", s] == truth["gpipe", s] - truth["1f1b", s]:
                    part = "the bytes held once, which both schedules hold"
                elif (guess - fixed) % per_mb == 0:
                    part = "the number of micro-batches held at the peak"
                else:
                    part = "the bytes each micro-batch keeps (every tensor saved, its dtype)"
                raise ExerciseError(
                    ex,
                    f"peak({sch!r}, {s}, w={w}, batch={batch}, m={m}) = {guess!r} is not the "
                    f"peak{' measured' if case == 0 else ''}; check {part} against 04b's "
                    "breakdown for width 1024, and how it scales with w, batch and m",
                )
    passed(
        ex,
        f"{len(PEAK_CASES)} pipelines (the first measured on 2 ranks): every stage's peak under "
        "GPipe and 1F1B, to the byte",
    )


def balanced_split(split_fn) -> None:
    """04b.2: ``split_fn(mlp, k)`` returns ``k`` modules, the consecutive sub-networks of ``mlp``
    (an :class:`~mgtutorial.common.models.ArticleMLP`) with the largest stage's parameter count as
    small as possible.

    Verified on the article's MLP (k = 2, 3), on a 5-block MLP (k = 2, 3, 4), and on one (k = 3)
    where the smallest spread (largest − smallest) is not the smallest largest stage: k stages,
    each with parameters, that share the model's parameters (no copies), whose counts add up to the
    model's, whose forward one after the other equals the unsplit model's, and whose largest stage
    is the smallest possible (:func:`~mgtutorial.exercises.splits.check_split`).
    """
    ex = "04b.2 balanced split"
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


CHOOSE_CASES = (  # (p, F, B, o, batch): one stage's whole-batch forward, backward; delay per box
    (2, 0.240, 0.480, 0.0, 64),
    (2, 0.240, 0.480, 0.002, 64),
    (4, 0.100, 0.200, 0.005, 48),
    (2, 0.020, 0.040, 0.003, 512),
    (2, 0.0832, 0.1664, 0.002, 60),  # the best real m, 7.9, is nearer 6 but 10 is better
)


def choose_m(best_m) -> None:
    """04b.3: ``best_m(p, F, B, o, batch)`` returns ``(m, span)``: the micro-batch count m (a
    divisor of ``batch``, as the library needs) whose step is shortest, and that step's span in
    seconds, for a stage whose whole-batch forward and backward take F and B seconds (so F/m and
    B/m per box) and a delay of o seconds before each box on the critical path (the decomposition
    of 04z: :func:`~mgtutorial.pipeline.bubble.step_span`). Verified against every divisor: the
    span must be m's own, and no divisor's shorter."""
    ex = "04b.3 choosing m"
    for p, f, b, o, batch in CHOOSE_CASES:
        call = f"best_m(p={p}, F={f}, B={b}, o={o}, batch={batch})"
        out = attempt(ex, best_m, p, f, b, o, batch)
        require(
            isinstance(out, tuple) and len(out) == 2,
            ex,
            f"{call} returned {out!r}: return a pair (m, span in seconds)",
        )
        m, predicted = out
        require(
            isinstance(m, int) and m >= 1 and batch % m == 0,
            ex,
            f"{call} returned m = {m!r}: give a divisor of the batch (an int)",
        )
        span = {d: step_span(p, d, f / d, b / d, o) for d in range(1, batch + 1) if batch % d == 0}
        require(
            close(predicted, span[m], rel=1e-6),
            ex,
            f"{call}: the span you give for m={m}, {predicted!r}, is not that step's: count the "
            "slots of the critical path and what each costs, delays included",
        )
        best = min(span.values())
        if span[m] <= best * (1 + 1e-9):
            continue
        below = max(d for d in span if d * d <= (p - 1) * (f + b) / (2 * o)) if o else batch
        above = min((d for d in span if d > below), default=below)
        why = (
            "with o = 0 the step only shrinks as m grows"
            if o == 0
            else "of the two divisors around the best real m, yours has the longer step: compare "
            "their spans, not their distances to it"
            if m in (below, above)
            else "the delays grow with m while the fill and drain shrink: where do the two balance?"
        )
        raise ExerciseError(
            ex,
            f"for p={p}, F={f} s, B={b} s, o={o} s, batch {batch}, another divisor of the batch "
            f"gives a shorter step than m={m}: {why}",
        )
    passed(
        ex,
        f"{len(CHOOSE_CASES)} cases: each m gives the shortest step of all the divisors, and its "
        "span is that step's",
    )
