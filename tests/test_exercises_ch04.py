"""Chapter 04's checkers: the solution passes, each classic wrong answer gets its own hint, and no
hint prints the expected answer; the simulator they lay orders out with, and the order torch's own
schedules run, recorded without ranks (04b.3's reference)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from mgtutorial.common import models
from mgtutorial.exercises import ExerciseError, ch04
from mgtutorial.exercises.ch04_order import held_at_peak
from mgtutorial.pipeline import bubble, library_order
from mgtutorial.pipeline.bubble import box_order


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


def uncapped(stage, p, m):
    """The lesson's p − s warm-up forwards, not capped at m: wrong when m < p."""
    boxes = [("forward", i) for i in range(p - stage)]
    for i in range(m):
        boxes.append(("backward", i))
        if p - stage + i < m:
            boxes.append(("forward", p - stage + i))
    return boxes


@pytest.mark.parametrize("solution", [one_f_one_b(), textbook], ids=["alternating", "textbook"])
def test_1f1b_order_solution_passes(solution, capsys):
    ch04.one_f_one_b(solution)
    assert capsys.readouterr().out.startswith("✓ 04b.3 the 1F1B order:")


def test_1f1b_order_refuses_the_reference_in_place_of_an_order():
    for copy in (
        lambda s, p, m: bubble.box_order("1f1b", s, p, m),
        lambda s, p, m: library_order.recorded_order("1f1b", s, p, m),
        lambda s, p, m: box_order("1f1b", s, p, m),  # imported by name into the learner's module
    ):
        with pytest.raises(ExerciseError, match=r"\w+\.\w+ is withheld .*: build the order"):
            ch04.one_f_one_b(copy)
    assert bubble.box_order("1f1b", 0, 2, 2) == library_order.recorded_order("1f1b", 0, 2, 2)
    assert box_order is bubble.box_order  # the learner's own name restored too


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
        (uncapped, r"order\(stage=0, p=4, m=2\) must hold .* m < p: how many forwards"),
        (  # right while m ≥ p, GPipe's order when m < p: stage 3 of 4 still alternates at m = 2
            lambda s, p, m: gpipe(s, p, m) if m < p else one_f_one_b()(s, p, m),
            r"p=4, m=2, stage 3: your box 1 \(counting from 0\), \('forward', 1\), is not .*"
            "GPipe's order",
        ),
    ],
    ids=[
        "gpipe",
        "warm-up-1",
        "warm-up+1",
        "short-not-last",
        "no-alternation",
        "missing",
        "...",
        "uncapped-m<p",
        "gpipe-when-m<p",
    ],
)
def test_1f1b_order_wrong_answers_get_their_hint_without_the_answer(answer, hint):
    with pytest.raises(ExerciseError, match=hint) as err:
        ch04.one_f_one_b(answer)
    text = str(err.value)
    assert "[('forward'" not in text and "[('backward'" not in text  # no order printed
    assert "p − s" not in text and "p - s" not in text


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recorded_order_is_what_torchs_loop_runs_and_box_order(schedule):
    for p in range(1, 7):
        for m in range(1, 11):
            for s in range(p):
                got = library_order.recorded_order(schedule, s, p, m)
                assert got == bubble.box_order(schedule, s, p, m), (p, m, s)
    # m < p: 1F1B's warm-up is capped at m, so the first p − m stages run GPipe's order
    p, m = 5, 2
    same = [library_order.recorded_order("1f1b", s, p, m) == gpipe(s, p, m) for s in range(p)]
    assert same == [True, True, True, True, False]


def test_recorded_order_refuses_bad_input_and_torch_refuses_m_below_p():
    with pytest.raises(ValueError, match="schedule='zb'"):
        library_order.recorded_order("zb", 0, 2, 4)
    with pytest.raises(ValueError, match="stage=2, num_stages=2"):
        library_order.recorded_order("1f1b", 2, 2, 4)
    with pytest.raises(ValueError, match=r"Number of microbatches \(1\) must be greater"):
        library_order.Schedule1F1B(_mock_stage(2), 1)  # the library's own check


def _mock_stage(p):
    from unittest import mock

    from torch.distributed.pipelining import PipelineStage

    st = mock.create_autospec(PipelineStage, instance=True)
    st.num_stages, st.stage_index = p, 0
    return st


def test_schedule_1f1b_pipeline_order_is_not_its_loop_in_torch_2_14():
    """Why recorded_order runs the loop: the plan ``pipeline_order`` (what torch's visualiser
    draws) numbers the last stage's forwards from 1, and its warm-up ignores m < p."""
    plan = library_order.Schedule1F1B(_mock_stage(3), 5).pipeline_order
    last = [a.microbatch_index for a in plan[2] if a is not None and a.computation_type == "F"]
    assert last == [1, 2, 3, 4, 5]  # the loop runs forwards 0 … 4
    assert [i for e, i in library_order.recorded_order("1f1b", 2, 3, 5) if e == "forward"] == [
        0,
        1,
        2,
        3,
        4,
    ]


def test_lay_out_is_the_ideal_step_and_refuses_a_deadlock():
    orders = [bubble.box_order("1f1b", s, 4, 8) for s in range(4)]
    evs = bubble.lay_out(orders)
    assert evs == bubble.ideal_events("1f1b", 4, 8)
    assert bubble.bubble_measured(evs) == pytest.approx(bubble.bubble_formula(4, 8))
    assert [held_at_peak(o) for o in orders] == [4, 3, 2, 1]
    with pytest.raises(RuntimeError, match="deadlock"):
        bubble.lay_out([[("forward", 0), ("backward", 0)], [("backward", 0), ("forward", 0)]])


# --- 04a.1: the bubble, derived ------------------------------------------------------------------


def gpipe_step(times, m):
    """The span: every stage once at its own speed, and m − 1 slots of the slowest, both ways."""
    span = 3 * (sum(times) + (m - 1) * max(times))
    return span, 1 - m * 3 * sum(times) / (len(times) * span)


def smallest_m(p, o, target):
    """bubble = 1 − 3m / ((m + p − 1)(3 + 2o) − o), solved for m; None below the floor."""
    coef = 3 - (1 - target) * (3 + 2 * o)
    if coef <= 0:  # the bubble tends to 2o / (3 + 2o) from above: the target is not reached
        return None
    return max(1, math.ceil((1 - target) * ((p - 1) * (3 + 2 * o) - o) / coef - 1e-9))


def by_search(p, o, target):
    """The simulator's answer, searched (up to m = 500), not derived."""
    for m in range(1, 501):
        evs = bubble.lay_out([bubble.box_order("gpipe", s, p, m) for s in range(p)], delay_s=o)
        if bubble.bubble_measured(evs) <= target + 1e-12:
            return m
    return None


def test_bubble_solution_passes(capsys):
    ch04.bubble(gpipe_step, smallest_m)
    assert capsys.readouterr().out.startswith("✓ 04a.1 the bubble, derived:")


def copied_step(times, m):
    """The checker's own reference, copied: the simulator's step."""
    p = len(times)
    evs = bubble.lay_out([bubble.box_order("gpipe", s, p, m) for s in range(p)], scale=times)
    return max(e["end"] for e in evs), bubble.bubble_measured(evs)


def by_model(p, o, target):
    """A search on the course's delay model instead of a derivation."""
    return next(
        (m for m in range(1, 100_000) if bubble.bubble_model(p, m, 1, 2, o) <= target), None
    )


@pytest.mark.parametrize(
    "step, smallest",
    [(copied_step, smallest_m), (gpipe_step, by_search), (gpipe_step, by_model)],
    ids=["step-by-lay-out", "m-by-lay-out", "m-by-bubble-model"],
)
def test_bubble_refuses_the_simulator_in_place_of_a_derivation(step, smallest):
    with pytest.raises(ExerciseError, match=r"bubble\.\w+ is withheld .*: derive"):
        ch04.bubble(step, smallest)
    # and the simulator works again afterwards
    assert bubble.bubble_measured(bubble.ideal_events("gpipe", 2, 2)) == pytest.approx(1 / 3)


def test_bubble_a_capped_search_misses_the_target_just_above_the_floor():
    def capped(p, o, target):  # the derived bubble, searched up to m = 1000 only
        for m in range(1, 1001):
            if 1 - 3 * m / ((m + p - 1) * (3 + 2 * o) - o) <= target:
                return m
        return None

    with pytest.raises(ExerciseError, match=r"target=0\.2505\) returned None, but some m"):
        ch04.bubble(gpipe_step, capped)


def test_the_span_of_unequal_stages_is_what_lay_out_gives():
    for times in ([1, 1, 2], [2, 1, 1], [3, 1, 2], [1, 3, 1, 1], [2, 2], [5]):
        for m in (1, 2, 4, 7):
            p = len(times)
            evs = bubble.lay_out(
                [bubble.box_order("gpipe", s, p, m) for s in range(p)], scale=times
            )
            span, idle = gpipe_step(times, m)
            assert max(e["end"] for e in evs) == span
            assert bubble.bubble_measured(evs) == pytest.approx(idle)


def test_lay_out_with_a_delay_is_the_model_and_box_delays_measures_it():
    for schedule in ("gpipe", "1f1b"):
        for p, m, o in ((2, 1, 0.25), (4, 8, 0.5), (3, 5, 0.1), (4, 2, 0.5)):
            orders = [bubble.box_order(schedule, s, p, m) for s in range(p)]
            evs = bubble.lay_out(orders, delay_s=o)
            assert bubble.box_delays(evs) == pytest.approx([o] * (2 * p * m - 1))
            assert bubble.bubble_measured(evs) == pytest.approx(bubble.bubble_model(p, m, 1, 2, o))
            assert max(e["end"] for e in evs) == pytest.approx(bubble.step_span(p, m, 1, 2, o))


def _step_with(span=None, idle=None):
    def answer(times, m):
        right = gpipe_step(times, m)
        p = len(times)
        return (
            right[0] if span is None else span(times, m, p),
            right[1] if idle is None else idle(times, m, p, right[0]),
        )

    return answer


@pytest.mark.parametrize(
    "step, hint",
    [
        (_step_with(span=lambda t, m, p: (m + p - 1) * 3 * sum(t) / p), "a balanced pipeline's"),
        (_step_with(span=lambda t, m, p: (m + p - 1) * 3 * max(t)), "the slowest stage's"),
        (_step_with(span=lambda t, m, p: 3 * m * sum(t)), "lay the boxes out"),
        (_step_with(idle=lambda t, m, p, span: (p - 1) / (m + p - 1)), "assumes equal stages"),
        (_step_with(idle=lambda t, m, p, span: round(1 - m * sum(t) / span * 3 / p, 2)), "rounded"),
        (_step_with(idle=lambda t, m, p, span: 1 - 3 * m * max(t) / span), "its own boxes only"),
        (lambda t, m: gpipe_step(t, m)[0], "return \\(span in units, bubble"),
    ],
    ids=[
        "balanced-span",
        "slowest-slots",
        "no-fill-drain",
        "formula-bubble",
        "rounded",
        "max-busy",
        "one",
    ],
)
def test_bubble_wrong_step_fails_with_its_hint(step, hint):
    with pytest.raises(ExerciseError, match=hint) as err:
        ch04.bubble(step, smallest_m)
    assert "3 + 2o" not in str(err.value) and "sum(" not in str(err.value)


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lambda p, o, t: smallest_m(p, 0.0, t), "ignores the delay"),
        (lambda p, o, t: math.ceil((p - 1) * (1 - t) / t), "ignores the delay"),  # the starter
        (lambda p, o, t: smallest_m(p, o, t) or 1000, "no m reaches it"),
        (lambda p, o, t: None, "some m reaches"),
        (lambda p, o, t: smallest_m(p, o, t) and smallest_m(p, o, t) + 1, "but so does m="),
        (lambda p, o, t: smallest_m(p, o, t) and smallest_m(p, o, t) - 1, "more micro-batches"),
        (lambda p, o, t: smallest_m(p, o, t) and float(smallest_m(p, o, t)), "whole number"),
        (  # right until the target equals the floor: the bubble only tends to it
            lambda p, o, t: (
                smallest_m(p, o, t) or (10_000 if math.isclose(t, 2 * o / (3 + 2 * o)) else None)
            ),
            "no m reaches it",
        ),
    ],
    ids=[
        "no-delay",
        "starter",
        "none-unreachable",
        "always-none",
        "one-too-many",
        "one-too-few",
        "float",
        "floor-reached",
    ],
)
def test_bubble_wrong_smallest_m_fails_with_its_hint(answer, hint):
    with pytest.raises(ExerciseError, match=hint) as err:
        ch04.bubble(gpipe_step, answer)
    assert "2o / (3 + 2o)" not in str(err.value)


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


# --- 04b.1: a balanced split -------------------------------------------------------------------


def split_balanced(mlp, k, cut_points=None):
    counts = [models.count_parameters(sub) for sub in mlp.subnets]
    n = len(counts)

    def largest(cuts):
        return max(sum(counts[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))

    cuts = min(itertools.combinations(cut_points or range(1, n), k - 1), key=largest)
    return [nn.Sequential(*mlp.subnets[a:b]) for a, b in zip((0, *cuts), (*cuts, n))]


def test_balanced_split_solution_passes(capsys):
    ch04.balanced_split(split_balanced)
    assert capsys.readouterr().out.startswith("✓ 04b.1 balanced split: 8 splits")


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lambda mlp, k: mlp.split(k), "a smaller largest stage exists"),
        # never cuts before the last sub-network: no split at all when k is the sub-network count
        (lambda mlp, k: split_balanced(mlp, k, range(1, len(mlp.subnets) - 1)), "min\\(\\)"),
        (  # at least two stages: wrong only for k = 1
            lambda mlp, k: split_balanced(mlp, max(k, 2)),
            r"ArticleMLP\(\(64, 256, 256, 64, 32, 10\)\), 1\) returned list of 2 items",
        ),
    ],
    ids=["by-number", "no-last-cut", "k=1-gives-two"],
)
def test_balanced_split_wrong_answers_fail(answer, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.balanced_split(answer)


# --- 04b.2: choosing m --------------------------------------------------------------------------


def best_m_solution(p, F, B, o, batch):
    def span(m):
        return (m + p - 1) * ((F + B) / m + 2 * o) - o

    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    m = min(divisors, key=span)
    return (math.sqrt((p - 1) * (F + B) / (2 * o)) if o else math.inf), m, span(m)


def test_choose_m_solution_passes(capsys):
    ch04.choose_m(best_m_solution)
    assert capsys.readouterr().out.startswith("✓ 04b.2 choosing m:")


def test_choose_m_refuses_the_courses_span_in_place_of_one_written():
    def copied(p, F, B, o, batch):
        ds = [d for d in range(1, batch + 1) if batch % d == 0]
        m = min(ds, key=lambda d: bubble.step_span(p, d, F / d, B / d, o))
        real = math.sqrt((p - 1) * (F + B) / (2 * o)) if o else math.inf
        return real, m, bubble.step_span(p, m, F / m, B / m, o)

    with pytest.raises(ExerciseError, match=r"bubble\.step_span is withheld .*critical path"):
        ch04.choose_m(copied)
    assert bubble.step_span(2, 1, 1.0, 2.0) == 6.0  # restored


def _with(index, value):
    """The solution with one of its three answers replaced by ``value(p, F, B, o, batch, out)``."""

    def answer(p, F, B, o, batch):
        out = list(best_m_solution(p, F, B, o, batch))
        out[index] = value(p, F, B, o, batch, out)
        if index == 1:  # a different m, with its own span
            out[2] = (out[1] + p - 1) * ((F + B) / out[1] + 2 * o) - o  # its own span
        return tuple(out)

    return answer


def _nearest(p, F, B, o, batch, out):
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    return batch if o == 0 else min(divisors, key=lambda d: abs(d - out[0]))


@pytest.mark.parametrize(
    "answer, hint",
    [
        (lambda p, F, B, o, batch: best_m_solution(p, F, B, o, batch)[1:], "best real m, m, span"),
        (_with(0, lambda p, F, B, o, batch, out: out[1]), "give math.inf"),  # the divisor, o = 0
        (  # a search's answer for the real m (the best divisor) where o > 0
            _with(0, lambda p, F, B, o, batch, out: out[1] if o else out[0]),
            "closed form",
        ),
        (  # the right m, its span without the delays
            _with(2, lambda p, F, B, o, batch, out: (out[1] + p - 1) * (F + B) / out[1]),
            "delays included",
        ),
        (_with(1, _nearest), "not their distances"),
        (_with(1, lambda p, F, B, o, batch, out: batch), "next to the best real m"),
        (_with(1, lambda p, F, B, o, batch, out: 7), "divisor of the batch"),
    ],
    ids=[
        "two-answers",
        "real-m-for-o-0",
        "real-m-searched",
        "span-without-delays",
        "nearest-divisor",
        "largest-m",
        "not-a-divisor",
    ],
)
def test_choose_m_wrong_answers_fail_with_their_hint(answer, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch04.choose_m(answer)
