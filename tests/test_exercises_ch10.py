"""Chapter 10's checkers both ways on their own (the notebooks' sections run in
tests/test_exercises.py): a right answer passes with one ✓ line, each typical mistake fails with
its hint, and no hint holds the expected answer."""

from __future__ import annotations

import pytest
import torch

from mgtutorial.context_expert import online_softmax
from mgtutorial.context_expert.expert_parallel import split_sizes
from mgtutorial.exercises import ExerciseError, ch10a, ch10b


def test_combine_both_ways(capsys):
    ch10a.combine(online_softmax.merge)
    assert capsys.readouterr().out.startswith("✓ 10a.1 combine: ")

    def average(o1, l1, o2, l2):
        return (o1 + o2) / 2, torch.maximum(l1, l2)

    def no_lse(o1, l1, o2, l2):
        return online_softmax.merge(o1, l1, o2, l2)[0], l1

    for fn, hint in [(average, "lse is wrong"), (no_lse, "lse is wrong")]:
        with pytest.raises(ExerciseError, match=hint):
            ch10a.combine(fn)

    def o_wrong(o1, l1, o2, l2):
        return o1 + o2, torch.logaddexp(l1, l2)

    with pytest.raises(ExerciseError, match="its share of the total"):
        ch10a.combine(o_wrong)

    def overflows(o1, l1, o2, l2):  # right in exact arithmetic, inf in float32
        e1, e2 = torch.exp(l1)[..., None], torch.exp(l2)[..., None]
        return (o1 * e1 + o2 * e2) / (e1 + e2), torch.log(e1 + e2)[..., 0]

    with pytest.raises(ExerciseError, match="overflows float32"):
        ch10a.combine(overflows)


def test_smallest_cp_both_ways(capsys):
    ch10a.smallest_cp({"flash": 4, "materialised": 1024})
    assert capsys.readouterr().out.startswith("✓ 10a.2 smallest cp: ")
    for answer, hint in [
        ({"flash": ..., "materialised": 1}, "still `...`"),
        ({"flash": 2, "materialised": 1024}, "over the 20 GB budget"),
        ({"flash": 8, "materialised": 1024}, "half of it fits too"),
        ({"flash": 4, "materialised": 3}, "power of two"),
    ]:
        with pytest.raises(ExerciseError, match=hint) as err:
            ch10a.smallest_cp(answer)
        assert "=1024" not in str(err.value).replace('"materialised"] = 1024', "")


def test_split_sizes_both_ways(capsys):
    ch10b.splits(split_sizes)
    assert capsys.readouterr().out.startswith("✓ 10b.1 split sizes: ")
    mistakes = [
        (lambda e, k, n, r: torch.bincount(e.flatten(), minlength=n).tolist(), "per destination"),
        (lambda e, k, n, r: torch.bincount(e.flatten() // (n // r), minlength=r).tolist(),
         "dropped"),
        (lambda e, k, n, r: torch.bincount(e[k] % r, minlength=r).tolist(), "consecutive"),
        (lambda e, k, n, r: [1] * r, "count each kept"),
    ]  # fmt: skip
    for fn, hint in mistakes:
        with pytest.raises(ExerciseError, match=hint) as err:
            ch10b.splits(fn)
        assert str(split_sizes(ch10b.EXPERTS, ch10b.KEPT, 4, 2)) not in str(err.value)
