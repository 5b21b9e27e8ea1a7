"""Exercise 04b.4's checker (the 1F1B order): the solution passes, each classic wrong answer gets
its own hint, and no hint prints the expected order; the simulator it lays orders out with."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from mgtutorial.exercises import ExerciseError, ch04
from mgtutorial.exercises.ch04_order import held_at_peak
from mgtutorial.pipeline import bubble


def one_f_one_b(warmup_delta=0, alternate=True):
    def order(stage, p, m):
        warm = max(0, min(p - stage + warmup_delta, m))
        boxes = [("forward", i) for i in range(warm)]
        if not alternate:  # the first backward, then every forward, then the other backwards
            rest = [("forward", i) for i in range(warm, m)]
            return boxes + [("backward", 0)] + rest + [("backward", i) for i in range(1, m)]
        for i in range(m):
            boxes.append(("backward", i))
            if warm + i < m:
                boxes.append(("forward", warm + i))
        return boxes

    return order


def textbook(stage, p, m):
    """PipeDream-Flush's own counting: p − s − 1 warm-up forwards, then forward-backward pairs."""
    warm, boxes = min(p - stage - 1, m), []
    boxes += [("forward", i) for i in range(warm)]
    for i in range(m):
        if warm + i < m:
            boxes.append(("forward", warm + i))
        boxes.append(("backward", i))
    return boxes


def gpipe(stage, p, m):
    return [("forward", i) for i in range(m)] + [("backward", i) for i in range(m)]


@pytest.mark.parametrize("solution", [one_f_one_b(), textbook], ids=["alternating", "textbook"])
def test_1f1b_order_solution_passes(solution, capsys):
    ch04.one_f_one_b(solution)
    assert capsys.readouterr().out.startswith("✓ 04b.4 the 1F1B order:")


@pytest.mark.parametrize(
    "answer, hint",
    [
        (gpipe, "that is GPipe's order"),
        (one_f_one_b(-1), "count them again"),
        (one_f_one_b(+1), "hold 3 micro-batches at its peak"),
        (
            lambda s, p, m: one_f_one_b(-1)(s, p, m) if s < p - 1 else one_f_one_b()(s, p, m),
            "warm-up is too short",
        ),
        (one_f_one_b(alternate=False), "alternates one backward and one forward"),
        (lambda s, p, m: [("forward", 0)], "once"),
        (lambda s, p, m: ..., "not written yet"),
    ],
    ids=["gpipe", "warm-up-1", "warm-up+1", "short-not-last", "no-alternation", "missing", "..."],
)
def test_1f1b_order_wrong_answers_get_their_hint_without_the_answer(answer, hint):
    with pytest.raises(ExerciseError, match=hint) as err:
        ch04.one_f_one_b(answer)
    text = str(err.value)
    assert "[('forward'" not in text and "[('backward'" not in text  # no order printed
    assert "p − s" not in text and "p - s" not in text


def test_lay_out_is_the_ideal_step_and_refuses_a_deadlock():
    orders = [bubble.box_order("1f1b", s, 4, 8) for s in range(4)]
    evs = bubble.lay_out(orders)
    assert evs == bubble.ideal_events("1f1b", 4, 8)
    assert bubble.bubble_measured(evs) == pytest.approx(bubble.bubble_formula(4, 8))
    assert [held_at_peak(o) for o in orders] == [4, 3, 2, 1]
    with pytest.raises(RuntimeError, match="deadlock"):
        bubble.lay_out([[("forward", 0), ("backward", 0)], [("backward", 0), ("forward", 0)]])


BUBBLE_RIGHT = {(4, 8): 3 / 11, (8, 16): 7 / 23, (3, 6): 2 / 8}


def test_bubble_solution_passes_and_the_other_convention_gets_its_hint(capsys):
    ch04.bubble(BUBBLE_RIGHT, 3 / 8, 27)
    assert capsys.readouterr().out.startswith("✓ 04a.1 bubble formula:")
    relative = {k: (p - 1) / m for (p, m), k in zip(BUBBLE_RIGHT, BUBBLE_RIGHT)}
    with pytest.raises(ExerciseError, match="relative to the compute time"):
        ch04.bubble(relative, 3 / 8, 27)
    with pytest.raises(ExerciseError, match="fraction of the whole step"):
        ch04.bubble(BUBBLE_RIGHT, 3 / 11, 27)  # the step's fraction given for the relative one
    with pytest.raises(ExerciseError, match="a smaller m"):
        ch04.bubble(BUBBLE_RIGHT, 3 / 8, 28)


def test_bubble_rounded_answer_gets_the_precision_hint_not_the_concept_one():
    rounded = {(4, 8): 0.27, (8, 16): 0.30, (3, 6): 0.25}
    with pytest.raises(ExerciseError, match="close but not exact") as err:
        ch04.bubble(rounded, 3 / 8, 4)
    assert "0.2727" not in str(err.value) and "3 / 11" not in str(err.value)


# --- 04a.2: loss weighting with padding ---------------------------------------------------------


def _weighted(weight):
    """An accumulate() weighting each micro-batch's mean loss by weight(xi, yi, x, y, m)."""

    def accumulate(model, x, y, m):
        for xi, yi in zip(torch.tensor_split(x, m), torch.tensor_split(y, m)):
            (nn.functional.cross_entropy(model(xi), yi) * weight(xi, yi, x, y, m)).backward()

    return accumulate


def counted_sum(model, x, y, m):
    counted = (y != -100).sum()
    for xi, yi in zip(torch.tensor_split(x, m), torch.tensor_split(y, m)):
        (nn.functional.cross_entropy(model(xi), yi, reduction="sum") / counted).backward()


@pytest.mark.parametrize(
    "solution",
    # each micro-batch's mean weighted by its share of the counted rows: right too (a
    # micro-batch of padding only has a NaN mean, weighted 0, and autograd sends it no gradient)
    [counted_sum, _weighted(lambda xi, yi, x, y, m: (yi != -100).sum() / (y != -100).sum())],
    ids=["counted-sum", "counted-share"],
)
def test_loss_weighting_with_padding_solution_passes(solution, capsys):
    ch04.loss_weighting(solution)
    assert capsys.readouterr().out.startswith("✓ 04a.2 loss weighting with padding:")


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_weighted(lambda xi, yi, x, y, m: len(xi) / len(x)), "share of the rows"),
        # in the first batch the micro-batches are equal: 1/m is their share of the rows
        (_weighted(lambda xi, yi, x, y, m: 1 / m), "share of the rows"),
        (_weighted(lambda xi, yi, x, y, m: 1.0), "one backward of the full batch"),
    ],
    ids=["rows-share", "1/m", "unweighted"],
)
def test_loss_weighting_wrong_answers_fail_with_their_hint(answer, hint):
    with pytest.raises(ExerciseError, match=hint) as err:
        ch04.loss_weighting(answer)
    assert "reduction" not in str(err.value) and "sum" not in str(err.value)


# --- 04b.1: peak activation bytes ---------------------------------------------------------------


def peak_solution(schedule, stage, w, batch, m):
    rows = batch // m
    once = batch * w * 4 if stage == 0 else batch * 8
    per_mb = rows * 2 * w * 4 if stage == 0 else rows * 3 * w * 4 + 4
    held = m if schedule == "gpipe" else min(2 - stage, m)
    return once + held * per_mb


@pytest.fixture
def breakdown_peaks(monkeypatch):
    """The measured peaks of 04b.1's first pipeline replaced by the breakdown's (which
    test_peak_breakdown_is_what_the_meter_measures holds against the measurement): no ranks."""

    def peaks(ex, w, batch, m):
        cases = itertools.product(("gpipe", "1f1b"), (0, 1))
        return {(sch, s): ch04.peak_model(sch, s, w, batch, m) for sch, s in cases}

    monkeypatch.setattr(ch04, "_measured_peaks", peaks)


def test_peak_bytes_solution_passes(breakdown_peaks, capsys):
    ch04.peak_bytes(peak_solution)
    assert capsys.readouterr().out.startswith("✓ 04b.1 peak activation bytes:")


A = ch04.PEAK_CASES[0]


@pytest.mark.parametrize(
    "answer, hint",
    [
        # right for the first pipeline only: its four numbers hard-coded
        (
            lambda sch, s, w, b, m: (
                peak_solution(sch, s, *A) if (w, b, m) == A else peak_solution(sch, s, *A) + 1000
            ),
            "how it scales",
        ),
        # 1F1B holding m micro-batches, as GPipe does
        (lambda sch, s, w, b, m: peak_solution("gpipe", s, w, b, m), "micro-batches held"),
        # nll_loss's 4-byte total weight forgotten
        (
            lambda sch, s, w, b, m: (
                peak_solution(sch, s, w, b, m) - 4 * (m if sch == "gpipe" else 1) * s
            ),
            "bytes each micro-batch keeps",
        ),
        # the targets held as float32
        (lambda sch, s, w, b, m: peak_solution(sch, s, w, b, m) - 4 * b * s, "held once"),
        (lambda sch, s, w, b, m: ..., "not written yet"),
    ],
    ids=["hard-coded", "1f1b-holds-m", "no-total-weight", "targets-float32", "..."],
)
def test_peak_bytes_wrong_answers_fail_with_their_hint(breakdown_peaks, answer, hint):
    with pytest.raises(ExerciseError, match=hint) as err:
        ch04.peak_bytes(answer)
    keys = [(sch, s, *c) for c in ch04.PEAK_CASES for sch in ("gpipe", "1f1b") for s in (0, 1)]
    given = {answer(*k) for k in keys}  # the learner's own numbers may be quoted
    truths = {ch04.peak_model(*k) for k in keys} - given
    assert not any(str(t) in str(err.value) for t in truths)  # no expected value printed


@pytest.mark.timeout(240)
def test_peak_breakdown_is_what_the_meter_measures(tmp_path, monkeypatch, no_leftovers):
    """peak_model, which 04b.1 checks its second and third pipelines against, equals
    ActivationMeter's measured peaks on all three (one step of GPipe and 1F1B, 2 ranks)."""
    monkeypatch.chdir(tmp_path)  # the checker's runs go to ./runs/exercises
    for w, batch, m in ch04.PEAK_CASES:
        measured = ch04._measured_peaks("test", w, batch, m)
        assert measured == {k: ch04.peak_model(*k, w, batch, m) for k in measured}


# --- 04b.3: choosing m --------------------------------------------------------------------------


def best_m_solution(p, F, B, o, batch):
    def span(m):
        return (m + p - 1) * ((F + B) / m + 2 * o) - o

    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    m = min(divisors, key=span)
    return m, span(m)


def test_choose_m_solution_passes(capsys):
    ch04.choose_m(best_m_solution)
    assert capsys.readouterr().out.startswith("✓ 04b.3 choosing m:")


def _nearest_divisor(p, F, B, o, batch):
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    if o == 0:
        m = batch
    else:
        m = min(divisors, key=lambda d: abs(d - math.sqrt((p - 1) * (F + B) / (2 * o))))
    return m, bubble.step_span(p, m, F / m, B / m, o)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lambda p, F, B, o, batch: best_m_solution(p, F, B, o, batch)[0], "a pair"),
        (  # the right m, its span without the delays
            lambda p, F, B, o, batch: (
                (m := best_m_solution(p, F, B, o, batch)[0]),
                (m + p - 1) * (F + B) / m,
            ),
            "delays included",
        ),
        (_nearest_divisor, "not their distances"),
        (
            lambda p, F, B, o, batch: (batch, bubble.step_span(p, batch, F / batch, B / batch, o)),
            "balance",
        ),
        (lambda p, F, B, o, batch: (7, 1.0), "divisor of the batch"),
    ],
    ids=["m-only", "span-without-delays", "nearest-divisor", "largest-m", "not-a-divisor"],
)
def test_choose_m_wrong_answers_fail_with_their_hint(answer, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.choose_m(answer)
