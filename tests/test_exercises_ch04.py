"""Exercise 04b.4's checker (the 1F1B order): the solution passes, each classic wrong answer gets
its own hint, and no hint prints the expected order; the simulator it lays orders out with."""

from __future__ import annotations

import pytest

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


def test_bubble_rounded_answer_gets_the_precision_hint_not_the_concept_one():
    rounded = {(4, 8, 1): 0.27, (4, 8, 2): 0.16, (8, 16, 1): 0.30}
    with pytest.raises(ExerciseError, match="close but not exact") as err:
        ch04.bubble(rounded, 4)
    assert "0.2727" not in str(err.value) and "3 / 11" not in str(err.value)
    with pytest.raises(ExerciseError, match="fraction of the whole step"):
        ch04.bubble({(4, 8, 1): 3 / 8, (4, 8, 2): 3 / 19, (8, 16, 1): 7 / 23}, 4)
