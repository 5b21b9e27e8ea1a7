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
        ch09.crossover(_ratio(ring, share), {"dgx_h100": 8, "pcie": 2})
    assert hint in err.value.hint and "2(n − 1)" not in err.value.hint
    assert "1/tp" not in err.value.hint


def test_crossover_solution_passes(capsys):
    ch09.crossover(_ratio(True, True), {"dgx_h100": 8, "pcie": 2})
    out = capsys.readouterr().out
    assert "up to tp = 8 on DGX H100 nodes and 2 over PCIe" in out
    assert "the ratio is 0.74 (tp = 12, a group that straddles two nodes) and 0.84 (tp = 3)" in out


@pytest.mark.parametrize(
    "answer, hint",
    [
        ({"dgx_h100": 12, "pcie": 2}, "ratio = 0.738 > 0.5"),
        ({"dgx_h100": 4, "pcie": 2}, "a larger divisor of 96 still has ratio ≤ 0.5"),
        ({"dgx_h100": 10, "pcie": 2}, "does not divide the 96 heads"),
        ({"dgx_h100": 8, "pcie": 8}, "ratio = 2.93 > 0.5"),  # NVLink's answer on PCIe
    ],
)
def test_crossover_hints_for_the_degree(answer, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch09.crossover(_ratio(True, True), answer)


RUN = ([1618216], [2600, 256, 1605632, 9600, 128])  # steps 1 and 2 of the 2-rank run (bytes)
CAP = 104  # bucket_cap_mb=0.0001 in bytes


@pytest.fixture
def ddp_run(monkeypatch):
    """09b.2's real run replaced by the buckets it reports (a real run: the notebook's cell)."""
    from mgtutorial.exercises import ch09_buckets

    monkeypatch.setattr(ch09_buckets, "_ddp_buckets", lambda: ([RUN[0][0]], RUN[1]))


@pytest.mark.parametrize(
    "predicted, hint",
    [
        (RUN[1][::-1], "right buckets in reverse order: DDP fills buckets in the order backward"),
        ([256, 2600, 1605632, 9600, 128], "the right buckets in the wrong order"),
        ([9600, 128, 1605632, 256, 2560, 40], "in forward order"),
        (RUN[0], "one bucket is DDP's first step"),
    ],
)
def test_buckets_checks_the_order(ddp_run, predicted, hint):
    with pytest.raises(ExerciseError, match="^09b.2 buckets: ") as err:
        ch09.buckets(CAP, predicted)
    assert hint in err.value.hint


def test_buckets_says_as_predicted_only_for_the_runs_order(ddp_run, capsys):
    ch09.buckets(CAP, RUN[1])
    assert "[2600, 256, 1605632, 9600, 128] bytes, as predicted" in capsys.readouterr().out
    ch09.buckets(CAP, [2600, 256, 1605632, 128, 9600])  # conv1's bias before its weight
    out = capsys.readouterr().out
    assert "as predicted" not in out and "weight and bias the other way round" in out


def _ring(all_gather: str):
    """09a.1's ring all-reduce: the starter's reduce-scatter, then an all-gather that is right
    ("right"), missing ("none"), sent to the left ("left") or run twice ("twice")."""

    def ring_all_reduce(chunks, send):
        n = len(chunks)
        for k in range(n - 1):
            arrived = [send(r, (r + 1) % n, chunks[r][(r - k) % n]) for r in range(n)]
            for r in range(n):
                chunks[r][(r - 1 - k) % n] = chunks[r][(r - 1 - k) % n] + arrived[(r - 1) % n]
        rounds = {"right": 1, "left": 1, "twice": 2, "none": 0}[all_gather]
        for k in range(rounds * (n - 1)):
            dst = [(r - 1) % n if all_gather == "left" else (r + 1) % n for r in range(n)]
            arrived = [send(r, dst[r], chunks[r][(r + 1 - k) % n]) for r in range(n)]
            for r in range(n):
                chunks[r][(r - k) % n] = arrived[(r - 1) % n]
        return chunks

    return ring_all_reduce


@pytest.mark.parametrize(
    "all_gather, hint",
    [
        ("none", "is not the sum over the ranks"),
        ("left", "right-hand neighbour"),
        ("twice", "how many rounds"),
    ],
)
def test_ring_fails_a_wrong_all_gather_with_its_hint(all_gather, hint):
    with pytest.raises(ExerciseError, match="^09a.1 ring: ") as err:
        ch09.ring(_ring(all_gather))
    assert hint in err.value.hint and "2(n−1)/n" not in err.value.hint


def test_ring_solution_passes_and_reports_its_own_factor(capsys):
    ch09.ring(_ring("right"))
    out = capsys.readouterr().out
    assert "✓ 09a.1 ring:" in out and "1.00·S at n = 2" in out and "1.75·S at n = 8" in out
