"""Exercise 06b.1 (the bytes retain_graph=True keeps, for any MLP): the solution passes, the
starter and each classic wrong answer get their own hint, and no hint prints the answer."""

from __future__ import annotations

import pytest
import torch

from mgtutorial.exercises import ExerciseError, ch06b


def _right(sizes, batch_size, dtype):
    size = torch.empty((), dtype=dtype).element_size()
    return batch_size * sum(sizes) * size + batch_size * 8 + size


def test_06b1_solution_passes(capsys):
    ch06b.retained_bytes(_right)
    assert capsys.readouterr().out.startswith("✓ 06b.1 retained bytes: your function gives")


@pytest.mark.parametrize(
    "fn, hint",
    [
        # the starter: section 2.3's numbers, for the article's MLP only
        (lambda s, b, d: b * (1024 + 512 + 256 + 100) * 4 + b * 8 + 4, "redo section 2.3"),
        (lambda s, b, d: b * sum(s) * 4 + b * 8 + 4, "another dtype"),  # float32 always
        (lambda s, b, d: _right(s, b, d) - 4 if d != torch.float64 else 0, "too few"),
        (lambda s, b, d: _right(s, b, d) + b * sum(s[1:-1]) * 4, "too many"),  # ReLU twice
        (lambda s, b, d: _right(s, b, d) if len(s) == 3 else 0, "a deeper MLP"),
        (lambda s, b, d: _right(s, b, d) if d != torch.bfloat16 else 0, "bfloat16"),
        (lambda s, b, d: float(_right(s, b, d)), "a whole number of bytes"),
        (lambda s, b, d: ..., "not written yet"),
    ],
)
def test_06b1_wrong_functions_get_their_hint(fn, hint):
    with pytest.raises(ExerciseError, match="06b.1") as err:
        ch06b.retained_bytes(fn)
    assert hint in err.value.hint
    for sizes, b, dtype in ch06b.CASES:  # no hint gives a measured value (but your own: a float)
        got = ch06b.alive_after_step(True, b, sizes, dtype)
        if f"you return {float(got)!r}" in err.value.hint:
            continue
        assert str(got) not in err.value.hint and f"{got:,}" not in err.value.hint


def test_06b1_cases_are_measured_not_assumed():
    for sizes, b, dtype in ch06b.CASES:
        assert ch06b.alive_after_step(True, b, sizes, dtype) == _right(sizes, b, dtype)
    assert ch06b.alive_after_step(False, 256) == 0
