"""Chapter 09's checkers on wrong answers: each mistake gets its own hint (tests/test_exercises.py
covers the solutions and the untouched starters)."""

from __future__ import annotations

import pytest

from mgtutorial.exercises import ch09
from mgtutorial.exercises._common import ExerciseError


def _ratio(ring: bool, share: bool):
    from mgtutorial.perf import costmodel
    from mgtutorial.tensor_parallel import cost

    def ratio(tp_degree, link_bw):
        big = cost.comm_bytes(b=1, s=2048, h=12288, ffn=4 * 12288, tp=tp_degree)
        comm_s = big["tp_forward"] * (2 * (tp_degree - 1) / tp_degree if ring else 1) / link_bw
        compute_s = 2 * big["params"] * 2048 / (tp_degree if share else 1)
        return comm_s / (compute_s / costmodel.H100.peak_flops)

    return ratio


@pytest.mark.parametrize(
    "ring, share, hint",
    [
        (False, True, "a ring all-reduce does not send the tensor once"),
        (True, False, "does each rank compute all the matmuls"),
        (False, False, "two things"),
    ],
)
def test_crossover_hints_name_the_mistake_not_the_factor(ring, share, hint):
    with pytest.raises(ExerciseError, match="^09b.3 crossover: ") as err:
        ch09.crossover(_ratio(ring, share), {"dgx_h100": 16, "one_port": 12})
    assert hint in err.value.hint and "2(n − 1)" not in err.value.hint
    assert "1/tp" not in err.value.hint


def test_crossover_solution_passes(capsys):
    ch09.crossover(_ratio(True, True), {"dgx_h100": 16, "one_port": 12})
    assert "from tp = 16 on DGX H100 nodes and 12 with one port" in capsys.readouterr().out
