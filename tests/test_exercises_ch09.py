"""Chapter 09's checkers on wrong answers: each mistake gets its own hint (tests/test_exercises.py
covers the solutions and the untouched starters)."""

from __future__ import annotations

import pytest

from mgtutorial.exercises import ch09
from mgtutorial.exercises._common import ExerciseError

PEAK = 989e12
H_MIN = 4 * 7 * PEAK / (12 * 0.5 * 450e9)  # ratio(8, h, NVLink) = 0.5, solved for h
RIGHT_TP = {"dgx_h100": 8, "pcie": 2}


def _ratio(ring: bool, share: bool):
    """09b.3's closed form, right or without the ring's 2(n − 1)/n or the 1/n share of compute."""

    def ratio(tp, h, link_bw, peak):
        comm_s = 2 * h * 2 * (2 * (tp - 1) / tp if ring else 1) / link_bw  # per token
        compute_s = 2 * 12 * h * h / (tp if share else 1) / peak
        return comm_s / compute_s

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
        ch09.crossover(_ratio(ring, share), RIGHT_TP, H_MIN)
    assert hint in err.value.hint and "2(n − 1)" not in err.value.hint
    assert "1/tp" not in err.value.hint


def test_crossover_solution_passes(capsys):
    ch09.crossover(_ratio(True, True), RIGHT_TP, H_MIN)
    out = capsys.readouterr().out
    assert "up to tp = 8 on DGX H100 nodes and 2 over PCIe" in out
    assert "0.74 at tp = 12, a group that straddles two nodes, and 0.84 at tp = 3" in out


def test_crossover_refuses_the_cost_model_itself():
    from mgtutorial.exercises.ch09_crossover import reference_ratio

    with pytest.raises(ExerciseError, match="calls ch09_crossover.reference_ratio|calls cost"):
        ch09.crossover(lambda n, h, bw, peak: reference_ratio(n, bw, h), RIGHT_TP, H_MIN)


def test_crossover_reference_does_not_depend_on_the_tokens():
    from mgtutorial.exercises.ch09_crossover import reference_ratio

    for n in (2, 8, 16):
        assert reference_ratio(n, 450e9, 4096, s=512) == pytest.approx(
            reference_ratio(n, 450e9, 4096)
        )


@pytest.mark.parametrize(
    "answer, h_min, hint",
    [
        ({"dgx_h100": 12, "pcie": 2}, H_MIN, "ratio = 0.738 > 0.5"),
        ({"dgx_h100": 4, "pcie": 2}, H_MIN, "a larger divisor of 96 still has ratio ≤ 0.5"),
        ({"dgx_h100": 10, "pcie": 2}, H_MIN, "does not divide the 96 heads"),
        ({"dgx_h100": 8, "pcie": 8}, H_MIN, "ratio = 2.93 > 0.5"),  # NVLink's answer on PCIe
        (RIGHT_TP, H_MIN / 2, "solve your closed form for h"),
        (RIGHT_TP, 12288, "solve your closed form for h"),
    ],
)
def test_crossover_hints_for_the_degree_and_the_width(answer, h_min, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch09.crossover(_ratio(True, True), answer, h_min)


def _exposed(kind: str):
    """09b.1's function: right, one worker whatever asked, no queue, α once, or the library's."""

    def exposed(bwd_s, bucket_bytes, ready, alpha, beta, workers):
        if kind == "library":
            from mgtutorial.perf import costmodel

            t = costmodel.ddp_step_time(0.0, bwd_s, 0.0, bucket_bytes, alpha, beta, ready=ready)
            return t["exposed"]
        free = [0.0] * {
            "right": workers,
            "one worker": 1,
            "no queue": 99,
            "alpha once": workers,
            "no contention": 1 if workers == 1 else 99,
        }[kind]
        for i, (nbytes, fraction) in enumerate(zip(bucket_bytes, ready)):
            w = free.index(min(free))
            a = alpha if kind != "alpha once" or i == 0 else 0.0
            free[w] = max(free[w], bwd_s * fraction) + a + beta * nbytes
        return max(0.0, max(free) - bwd_s)

    return exposed


@pytest.mark.parametrize(
    "kind, hint",
    [
        ("one worker", "that is the answer for one worker"),
        ("no queue", "waits until the previous one is done"),
        ("alpha once", "α is paid once per bucket"),
        ("library", "calls costmodel.ddp_step_time"),
    ],
)
def test_exposed_fails_each_mistake_with_its_hint(kind, hint):
    with pytest.raises(ExerciseError, match="^09b.1 exposed all-reduce: ") as err:
        ch09.exposed(_exposed(kind))
    assert hint in err.value.hint


def test_exposed_right_answer_passes_and_matches_the_cost_model(capsys):
    from mgtutorial.perf import costmodel

    ch09.exposed(_exposed("right"))
    assert capsys.readouterr().out.startswith("✓ 09b.1 exposed all-reduce:")
    s = ch09.STEP
    for sizes, ready in ch09.CASES.values():  # one worker: the reference is the model's rule
        model = costmodel.ddp_step_time(
            0.0, s["bwd_s"], 0.0, sizes, s["alpha"], s["beta"], ready=ready
        )
        one = ch09.exposed_reference(s["bwd_s"], sizes, ready, s["alpha"], s["beta"])
        assert one == pytest.approx(model["exposed"], rel=1e-12)


def _timer(mistake: str):
    """09a.2's timer: right, or with one mistake ("per call": ``timing.time_op``'s pattern)."""
    from mgtutorial.exercises.ch09_timing import per_call_time

    if mistake == "per call":
        return per_call_time

    def time_it(op, *, warmup, repeats, clock, synchronize):
        for _ in range(0 if mistake == "no warm-up" else warmup):
            op()
        if mistake != "no sync after warm-up":
            synchronize()
        t0 = clock()
        for _ in range(repeats):
            op()
        if mistake != "no final sync":
            synchronize()
        return (clock() - t0) / repeats

    return time_it


RIGHT_PREDICTION = {"sloppy": 70.2e-6, "per call": 65e-6}


@pytest.mark.parametrize(
    "mistake, hint",
    [
        ("no final sync", "the clock stopped before the queued kernels were done"),
        ("no sync after warm-up", "the warm-up's kernels were still queued"),
        ("per call", "each timed call pays its launch and a synchronize's round trip"),
        ("no warm-up", "the first calls are slow"),
    ],
)
def test_timing_fails_each_wrong_timer_with_its_hint(mistake, hint):
    with pytest.raises(ExerciseError, match="^09a.2 timing: ") as err:
        ch09.timing(_timer(mistake), RIGHT_PREDICTION)
    assert hint in err.value.hint


@pytest.mark.parametrize(
    "prediction, hint",
    [
        ({"sloppy": 40e-6, "per call": 65e-6}, "that is the kernel's own time"),
        ({"sloppy": 70.2, "per call": 65e-6}, "answer in seconds"),
        ({"sloppy": 70.2e-6, "per call": 40e-6}, "that is the kernel's own time"),
        (
            {"sloppy": 70.2e-6, "per call": 45e-6},
            "what does the host wait for between the two clock",
        ),
        ({"sloppy": 70.2e-6}, "still `None`"),
    ],
)
def test_timing_fails_a_wrong_prediction(prediction, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch09.timing(_timer("right"), prediction)


def test_timing_right_answers_pass(capsys):
    ch09.timing(_timer("right"), RIGHT_PREDICTION)
    out = capsys.readouterr().out
    assert out.startswith("✓ 09a.2 timing: the sloppy timer reports 70.2 µs") and "65.0 µs" in out


def test_the_given_timers_on_the_simulated_gpu():
    """The device's rules, by hand: the sloppy timer carries the warm-up's queued kernels."""
    from mgtutorial.exercises import ch09_timing as t

    g = t.GPU
    sloppy = (
        g["launch_s"] + 3 * g["warmup_s"] + 50 * g["kernel_s"] + g["sync_s"] - 3 * g["launch_s"]
    ) / 50
    assert t.run_timer(t.sloppy_time)[0] == pytest.approx(sloppy, rel=1e-12)
    assert t.run_timer(t.per_call_time)[0] == pytest.approx(
        g["launch_s"] + g["kernel_s"] + g["sync_s"]
    )


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


def test_timing_refuses_a_timer_that_subtracts_the_simulated_constants():
    from mgtutorial.exercises.ch09_timing import GPU, per_call_time

    def subtracts(op, **kw):
        return per_call_time(op, **kw) - GPU["launch_s"] - GPU["sync_s"]

    with pytest.raises(ExerciseError, match="250 µs"):
        ch09.timing(subtracts, RIGHT_PREDICTION)


def test_exposed_refuses_the_checkers_own_reference_and_a_model_without_contention():
    with pytest.raises(ExerciseError, match="calls ch09.exposed_reference"):
        ch09.exposed(lambda *a: ch09.exposed_reference(*a))
    with pytest.raises(ExerciseError, match="both workers busy"):
        ch09.exposed(_exposed("no contention"))
