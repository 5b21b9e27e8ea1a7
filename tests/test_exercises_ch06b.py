"""Exercise 06b.1's checker (the sample, reviewed): the solution passes, the starter and each
classic wrong answer get their own hint, and no hint prints a measured value."""

from __future__ import annotations

import pytest

from mgtutorial.common.models import ArticleMLP, count_parameters
from mgtutorial.exercises import ExerciseError, ch06b

ONE = count_parameters(ArticleMLP(sizes=ch06b.SIZES))
RIGHT = {"parameters": 2 * ONE, "sent": 0, "collectives": 0, "copies_equal": False}


def test_the_measurement_is_the_samples():
    assert ch06b.sample_measured() == RIGHT
    # one model, one process: nothing to compare, and half the parameters
    assert ch06b.sample_measured(sizes=(2048, 10))["parameters"] == 2048 * 10 + 10


def test_the_solution_passes(capsys):
    ch06b.sample_reviewed(dict(RIGHT))
    assert capsys.readouterr().out.startswith("✓ 06b.1 the sample, reviewed:")


@pytest.mark.parametrize(
    "change, hint",
    [
        ({"parameters": ...}, "is still `...`"),
        ({"parameters": ONE}, "one model's parameters"),
        ({"parameters": 524544}, "one sub-network's parameters"),
        ({"parameters": 3 * ONE}, "it is not what the processes hold"),
        ({"parameters": float(2 * ONE)}, "a whole number"),
        ({"sent": 1}, "find the line of the sample's loop that would send"),
        ({"sent": 2}, "find the line of the sample's loop that would send"),
        ({"collectives": 4}, "which line of the sample's loop calls a collective"),
        ({"copies_equal": True}, "what would make their steps equal"),
        ({"copies_equal": 0}, "True or False"),
    ],
)
def test_each_classic_wrong_answer_gets_its_hint(change, hint):
    with pytest.raises(ExerciseError, match="06b.1") as err:
        ch06b.sample_reviewed(RIGHT | change)
    assert hint in err.value.hint
    for value in (str(2 * ONE), f"{2 * ONE:,}", str(ONE), f"{ONE:,}"):
        assert value not in err.value.hint or value in repr(change)


def test_not_a_dict_is_refused():
    with pytest.raises(ExerciseError, match="not a dict"):
        ch06b.sample_reviewed([2 * ONE, 0, 0, False])
