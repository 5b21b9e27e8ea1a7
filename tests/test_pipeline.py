"""Chapter 04: every pipeline schedule equals the unsplit model; timelines; bubbles; memory;
failures."""

from __future__ import annotations

import itertools
import os
import threading
import typing

import pytest
import torch

from mgtutorial import launch
from mgtutorial.article import model_parallel_flaws
from mgtutorial.common import models
from mgtutorial.common.compare import max_abs_diff
from mgtutorial.pipeline import (
    activations,
    bubble,
    hand_gpipe,
    handoff,
    naive,
    schedules,
    simulated,
    timeline,
)
from mgtutorial.runtime import runlog
from mgtutorial.runtime.run import WorkerFailed


def _run(cfg, runs, n=2):
    run = launch(schedules.worker, cfg, n, runs_dir=runs)
    return run, run.wait(timeout=90)


def _assert_equals_unsplit(run, res, cfg, n=2):
    ref, ref_losses = schedules.unsplit_reference(cfg)
    got = schedules.gather_params(run.run_dir, cfg, n)
    torch.testing.assert_close(got, ref.state_dict(), rtol=1e-5, atol=1e-6)
    assert res.values[n - 1]["losses"] == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.timeout(180)
def test_hand_gpipe_equals_library_gpipe_and_1f1b_equals_unsplit(runs, no_leftovers):
    params = {}
    for schedule in ("hand-gpipe", "gpipe", "1f1b"):
        cfg = schedules.PipelineConfig(schedule=schedule, n_microbatches=4, batch_size=32, steps=3)
        run, res = _run(cfg, runs)
        _assert_equals_unsplit(run, res, cfg)
        params[schedule] = schedules.gather_params(run.run_dir, cfg, 2)
    torch.testing.assert_close(params["hand-gpipe"], params["gpipe"])
    # the check can fail: one step fewer is a different model
    ref_short, _ = schedules.unsplit_reference(schedules.PipelineConfig(steps=2, batch_size=32))
    assert max_abs_diff(ref_short.state_dict(), params["gpipe"]) > 1e-4


@pytest.mark.timeout(120)
def test_interleaved_two_stages_per_rank_equals_unsplit(runs, no_leftovers):
    m = 3  # torch 2.14's ScheduleInterleaved1F1B does not need m divisible by the ranks
    cfg = schedules.PipelineConfig(
        schedule="interleaved",
        n_microbatches=m,
        batch_size=33,
        steps=2,
        sizes=[1024, 512, 256, 128, 100],
        input_grad=True,
    )
    run, res = _run(cfg, runs)
    _assert_equals_unsplit(run, res, cfg)
    evs = timeline.events(runlog.read_run(run.run_dir), step=2)
    assert {(e["stage"], e["rank"]) for e in evs} == {(s, s % 2) for s in range(4)}
    for s in range(4):
        for kind in ("forward", "backward"):
            assert sorted(
                e["microbatch"] for e in evs if e["stage"] == s and e["event"] == kind
            ) == list(range(m))
    by = {(e["event"], e["stage"], e["microbatch"]): e for e in evs}
    for s in range(1, 4):
        for i in range(m):
            assert by[("forward", s, i)]["start"] >= by[("forward", s - 1, i)]["end"]
    assert 0 < bubble.bubble_measured(evs, by="rank") < 1
    # each rank built and holds only its two stages
    stages = schedules.initial_mlp(cfg).split(4)
    for r in range(2):
        mine = [t for s in (r, r + 2) for t in stages[s].parameters()]
        assert res.values[r]["parameter_bytes"] == sum(t.numel() * 4 for t in mine)


@pytest.mark.timeout(120)
def test_indivisible_batch_hand_written_weights_by_share(runs, no_leftovers):
    cfg = schedules.PipelineConfig(schedule="hand-gpipe", n_microbatches=3, batch_size=32, steps=3)
    assert hand_gpipe.microbatch_sizes(32, 3) == [11, 11, 10]
    run, res = _run(cfg, runs)
    _assert_equals_unsplit(run, res, cfg)


def test_interleaved_microbatch_rule_is_torchs():
    """The course refuses exactly the m that torch's ScheduleInterleaved1F1B refuses, built on
    torch's own mock stages (``_schedule_visualizer.get_schedule_ops``, no process group)."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    def accepts(check, *args):
        try:
            check(*args)
        except ValueError:
            return False
        return True

    for p in (2, 3, 4):
        for m in range(1, 17):
            torch_ok = accepts(get_schedule_ops, ScheduleInterleaved1F1B, p, m, 2)
            assert torch_ok == accepts(schedules.check_interleaved_microbatches, m, p), (p, m)
    assert accepts(schedules.check_interleaved_microbatches, 10, 4)  # 2 rounds of 5
    assert not accepts(schedules.check_interleaved_microbatches, 5, 2)  # 2 rounds: 5 % 2


def test_indivisible_batch_library_refused_before_any_process(runs):
    for schedule in ("gpipe", "1f1b"):
        with pytest.raises(ValueError, match="batch_size=32 is not divisible by n_microbatches=3"):
            launch(
                schedules.worker,
                schedules.PipelineConfig(schedule=schedule, n_microbatches=3, batch_size=32),
                2,
                runs_dir=runs,
            )
    with pytest.raises(
        ValueError, match=r"interleaved runs n_microbatches=5 in max\(1, m // ranks\) = 2"
    ):
        launch(
            schedules.worker,
            schedules.PipelineConfig(schedule="interleaved", n_microbatches=5, batch_size=60),
            2,
            runs_dir=runs,
        )
    with pytest.raises(ValueError, match="1F1B needs n_microbatches ≥ stages: 1 < 2"):
        launch(
            schedules.worker,
            schedules.PipelineConfig(schedule="1f1b", n_microbatches=1),
            2,
            runs_dir=runs,
        )
    assert not list(runs.iterdir())


def _expected_order(schedule: str, stage: int, p: int, m: int) -> list[tuple[str, int]]:
    if schedule != "1f1b":
        return [("forward", i) for i in range(m)] + [("backward", i) for i in range(m)]
    warmup = min(p - stage, m)
    order = [("forward", i) for i in range(warmup)]
    f, b = warmup, 0
    while b < m:
        order.append(("backward", b))
        b += 1
        if f < m:
            order.append(("forward", f))
            f += 1
    return order


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["hand-gpipe", "gpipe", "1f1b"])
def test_timeline_events_well_formed(schedule, runs, no_leftovers):
    m, p = 4, 2
    cfg = schedules.PipelineConfig(
        schedule=schedule, n_microbatches=m, batch_size=32, steps=2, save_params=False
    )
    run, res = _run(cfg, runs)
    recs = runlog.read_run(run.run_dir)
    for step in (1, 2):
        evs = timeline.events(recs, step)
        for s in range(p):
            mine = [e for e in evs if e["stage"] == s]
            assert [(e["event"], e["microbatch"]) for e in mine] == _expected_order(
                schedule, s, p, m
            )
            assert all(e["start"] <= e["end"] for e in mine)
        by = {(e["event"], e["stage"], e["microbatch"]): e for e in evs}
        for i in range(m):  # data dependencies hold in the real timestamps
            assert by[("forward", 1, i)]["start"] >= by[("forward", 0, i)]["end"]
            assert by[("backward", 0, i)]["start"] >= by[("backward", 1, i)]["end"] - 1e-3
        assert 0 < bubble.bubble_measured(evs) < 1
    for v in res.values.values():  # one CPU time and one run-queue wait per step, main thread
        assert len(v["step_times_s"]) == len(v["step_cpu_s"]) == len(v["step_wait_s"]) == cfg.steps
        assert all(c > 0 for c in v["step_cpu_s"])
        assert all(w is None or w >= 0 for w in v["step_wait_s"])


@pytest.mark.timeout(120)
def test_1f1b_holds_fewer_activations_than_gpipe(runs, no_leftovers):
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        cfg = schedules.PipelineConfig(
            schedule=schedule, n_microbatches=8, batch_size=64, steps=1, save_params=False
        )
        _, res = _run(cfg, runs)
        peaks[schedule] = (
            res.values[0]["peak_activation_bytes"],
            res.values[1]["peak_activation_bytes"],
        )
    # stage 0 (1024→512→ReLU→256→ReLU) keeps the input batch (one storage: the micro-batches are
    # views of it) and, per micro-batch until its backward, each ReLU's output (which the next
    # Linear also saves: one storage). GPipe holds all 8 micro-batches at once, 1F1B at most
    # p − s = 2.
    batch_bytes, mb_bytes = 64 * 1024 * 4, 8 * (512 + 256) * 4
    assert peaks["gpipe"][0] == batch_bytes + 8 * mb_bytes
    assert peaks["1f1b"][0] == batch_bytes + 2 * mb_bytes
    # stage 1 (256→100, the loss): the int64 targets (one storage, like the inputs on stage 0) and
    # per micro-batch its received input, log-softmax's output (saved by log_softmax and nll_loss,
    # counted once) and nll_loss's total weight; 1F1B holds 1 micro-batch
    targets_bytes, last_mb = 64 * 8, 8 * (256 + 100) * 4 + 4
    assert peaks["gpipe"][1] == targets_bytes + 8 * last_mb
    assert peaks["1f1b"][1] == targets_bytes + last_mb


def test_meter_counts_storage_not_saves():
    x = torch.randn(4, 10, requires_grad=True)
    meter = activations.ActivationMeter(torch.nn.Linear(1, 1))
    with meter.saving():
        logp = torch.log_softmax(x, 1)  # saves its output
        # saves it again
        loss = torch.nn.functional.nll_loss(logp, torch.zeros(4, dtype=torch.long))
    # log-probs once and the targets; nll_loss's 4-byte total weight too, unless the allocator put
    # it where a parameter's storage is excluded; counting saves would count the log-probs twice
    logp_bytes, targets_bytes = 4 * 10 * 4, 4 * 8
    extra = meter.live_bytes - (logp_bytes + targets_bytes)
    assert extra in (0, 4)
    assert meter.live_bytes < 2 * logp_bytes + targets_bytes
    loss.backward()
    del loss, logp
    assert meter.live_bytes == 0 and meter.peak_bytes == logp_bytes + targets_bytes + extra


def _gpipe_timeline(m, f, b, gap, p=2):
    """GPipe boxes as an ideal pipeline draws them, ``gap`` seconds between boxes on the critical
    path, drawn by hand."""

    def box(stage, event, mb, start, length):
        return {
            "stage": stage,
            "rank": stage,
            "event": event,
            "microbatch": mb,
            "start": start,
            "end": start + length,
        }

    turn = (m + p - 1) * (f + gap)
    return [box(s, "forward", i, (s + i) * (f + gap), f) for s in range(p) for i in range(m)] + [
        box(s, "backward", i, turn + (p - 1 - s + i) * (b + gap), b)
        for s in range(p)
        for i in range(m)
    ]


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_bubble_and_step_costs_of_an_ideal_timeline(m):
    evs = _gpipe_timeline(m, 1.0, 2.0, 0.0)
    assert bubble.bubble_measured(evs) == pytest.approx(bubble.bubble_formula(2, m))
    assert bubble.bubble_measured(evs, by="rank") == pytest.approx(bubble.bubble_formula(2, m))
    costs = bubble.step_costs(evs)
    got = tuple(costs[k] for k in ("m", "p", "forward", "backward", "delay"))
    assert got == (m, 2, 1.0, 2.0, 0.0)
    assert costs["model"] == pytest.approx(bubble.bubble_formula(2, m))
    gap = 0.25  # the critical path has 2(m + p − 1) boxes and one gap fewer
    costs = bubble.step_costs(_gpipe_timeline(m, 1.0, 2.0, gap))
    assert costs["delay"] == pytest.approx(gap)
    assert costs["model"] == pytest.approx(
        bubble.bubble_measured(_gpipe_timeline(m, 1.0, 2.0, gap))
    )
    assert bubble.bubble_measured(_gpipe_timeline(m, 1.0, 2.0, gap)) > bubble.bubble_formula(2, m)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 1), (2, 8), (4, 8), (3, 5)])
def test_an_ideal_step_has_the_formulas_bubble(schedule, p, m):
    evs = bubble.ideal_events(schedule, p, m, forward_s=1.0, backward_s=2.0)
    for s in range(p):
        mine = [(e["event"], e["microbatch"]) for e in evs if e["stage"] == s]
        assert mine == bubble.box_order(schedule, s, p, m) == _expected_order(schedule, s, p, m)
    assert bubble.box_delays(evs) == pytest.approx([0.0] * (2 * p * m - 1))  # no gap anywhere
    assert bubble.bubble_measured(evs) == pytest.approx(bubble.bubble_formula(p, m))
    if (schedule, p) == ("gpipe", 2):  # the boxes drawn by hand below, with no gap

        def box(e):
            return e["stage"], e["event"], e["microbatch"], e["start"], e["end"]

        assert sorted(map(box, evs)) == sorted(map(box, _gpipe_timeline(m, 1.0, 2.0, 0.0)))


def test_choices_come_from_the_types():
    assert schedules.SCHEDULES == typing.get_args(schedules.Schedule)
    with pytest.raises(ValueError, match="schedule='zb': must be one of 'hand-gpipe', 'gpipe'"):
        schedules.PipelineConfig(schedule="zb").validate(2)
    with pytest.raises(ValueError, match="backend='mpi': must be one of 'auto', 'gloo', 'nccl'"):
        handoff.HandoffConfig(backend="mpi").validate(2)
    schedules.PipelineConfig(schedule="interleaved", sizes=[8] * 5).validate(2)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_box_delays_and_the_model_see_the_gaps(m):
    f, b, gap = 1.0, 2.0, 0.25
    assert bubble.box_delays(_gpipe_timeline(m, f, b, 0.0)) == pytest.approx([0.0] * (4 * m - 1))
    evs = _gpipe_timeline(m, f, b, gap)
    assert bubble.box_delays(evs) == pytest.approx([gap] * (4 * m - 1))  # every box but the first
    assert bubble.bubble_model(2, m, f, b, 0.0) == pytest.approx(bubble.bubble_formula(2, m))
    assert bubble.bubble_model(2, m, f, b, 0.0, stages_per_rank=2) == pytest.approx(
        bubble.bubble_formula(2, m, 2)
    )
    # the drawn timeline's span is (m + 1)(f + b + 2·gap) − gap: the step's first box has no delay
    span = (m + 1) * (f + b + 2 * gap) - gap
    assert bubble.bubble_measured(evs) == pytest.approx(1 - m * (f + b) / span)
    assert bubble.bubble_model(2, m, f, b, gap) == pytest.approx(bubble.bubble_measured(evs))


def test_median_step_is_the_step_of_the_median():
    records = [
        {"kind": "event", "step": s, "start": float(s), "value": v}
        for s, v in ((2, 0.3), (3, 0.1), (4, 0.2), (5, 0.9))
    ]

    def value(evs):
        return evs[0]["value"]

    assert timeline.median_step(records, value, (2, 3, 4)) == 4
    assert timeline.median_over_steps(records, value, (2, 3, 4)) == 0.2
    assert timeline.median_step(records, value, (2, 3, 4, 5)) == 4  # the lower middle one


@pytest.mark.timeout(60)
def test_handoff_worker_times_each_size(runs, no_leftovers):
    res = launch(
        handoff.handoff_worker,
        handoff.HandoffConfig(rows=[8, 2], width=16, reps=4),
        2,
        runs_dir=runs,
    ).wait(timeout=40)
    for rank in (0, 1):
        assert [(h["rows"], h["bytes"]) for h in res.values[rank]] == [
            (8, 8 * 16 * 4),
            (2, 2 * 16 * 4),
        ]
        # the floor is the minimum
        assert all(0 < h["handoff_ms"] <= h["median_ms"] for h in res.values[rank])


def test_thread_clock_counts_this_threads_cpu_and_run_queue_wait():
    (c0, w0), x = timeline.thread_clock(), 0
    for i in range(200_000):
        x += i
    c1, w1 = timeline.thread_clock()
    assert c1 > c0
    if os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"):
        assert w0 is not None and w1 >= w0
    else:
        assert w0 is None and w1 is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "schedule, stage, rank", [("1f1b", 1, 1), ("interleaved", 3, 1), ("interleaved", 2, 0)]
)
def test_failing_stage_is_reported(runs, no_leftovers, schedule, stage, rank):
    # interleaved: rank r holds stages r and r + p: stage 3 of 4 fails on rank 1, stage 2 on rank 0
    cfg = schedules.PipelineConfig(
        schedule=schedule, fail_stage=stage, timeout_s=600, sizes=[64] * 5, batch_size=8
    )
    with pytest.raises(WorkerFailed, match=f"injected failure in stage {stage} at step 2") as info:
        launch(schedules.worker, cfg, 2, runs_dir=runs).wait(timeout=40)
    assert info.value.rank == rank


@pytest.mark.timeout(60)
def test_article_version_holds_whole_model_and_diverges(runs, no_leftovers):
    run = launch(
        model_parallel_flaws.article_worker,
        model_parallel_flaws.ArticleConfig(steps=5),
        2,
        runs_dir=runs,
    )
    res = run.wait(timeout=40)
    whole = models.count_parameters(models.ArticleMLP())
    assert res.values == {0: {"parameters": whole}, 1: {"parameters": whole}}
    a, b = (torch.load(run.run_dir / f"rank{r}-model.pt", weights_only=True) for r in (0, 1))
    assert max_abs_diff(a, b) > 1e-5  # same start, no sync: apart


def test_naive_split_equals_unsplit_and_runs_one_stage_at_a_time():
    cfg = schedules.PipelineConfig(steps=3, batch_size=32)
    model, evs = naive.train_naive(cfg, [torch.device("cpu")] * 2)
    ref, _ = schedules.unsplit_reference(cfg)
    got = torch.nn.Sequential(*model.stages).state_dict()
    want = torch.nn.Sequential(*ref.split(2)).state_dict()
    torch.testing.assert_close(got, want)
    evs = sorted(evs, key=lambda e: e["start"])
    order = [(e["stage"], e["event"]) for e in evs[:4]]
    assert order == [(0, "forward"), (1, "forward"), (1, "backward"), (0, "backward")]
    assert all(a["end"] <= b["start"] + 1e-4 for a, b in zip(evs, evs[1:]))  # never two at once


def test_split_checker_refuses_each_wrong_split_with_its_hint():
    # exercise 04b.1's check; the solution passes, each mistake has its hint
    import copy

    from torch import nn

    from mgtutorial.exercises import ExerciseError
    from mgtutorial.exercises.splits import check_split

    mlp = models.ArticleMLP((64, 256, 256, 64, 32, 10))
    sub = mlp.subnets
    check_split("ex", "f", mlp, [nn.Sequential(*sub[:2]), nn.Sequential(*sub[2:])], 2)
    wrong = {
        "ModuleList": [sub[:1], nn.Sequential(*sub[1:])],
        "empty stage": [nn.Sequential(), nn.Sequential(*sub)],
        "copies": [copy.deepcopy(nn.Sequential(*sub[:1])), nn.Sequential(*sub[1:])],
        "whole model": [mlp, mlp],
        "missing or repeated": [nn.Sequential(*sub[:1]), nn.Sequential(*sub[2:])],
        "in order": [nn.Sequential(*sub[1:]), nn.Sequential(*sub[:1])],
        "largest stage": [nn.Sequential(*sub[:1]), nn.Sequential(*sub[1:])],
    }
    for hint, stages in wrong.items():
        with pytest.raises(ExerciseError, match=hint):
            check_split("ex", "f", mlp, stages, 2)
    # 04b.1's last case: the most even split is not the one with the smallest largest stage
    mlp = models.ArticleMLP((16, 16, 64, 128, 32, 128))
    sizes = [models.count_parameters(s) for s in mlp.subnets]
    sub = mlp.subnets
    splits = {
        cuts: [sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, 5))]
        for cuts in itertools.combinations(range(1, 5), 2)
    }
    even = min(splits, key=lambda c: max(splits[c]) - min(splits[c]))
    best = min(max(v) for v in splits.values())
    assert max(splits[even]) > best  # the case the exercise sets up
    stages = [nn.Sequential(*sub[a:b]) for a, b in zip((0, *even), (*even, 5))]
    with pytest.raises(ExerciseError, match="most even split") as err:
        check_split("ex", "f", mlp, stages, 3)
    assert f"{best:,}" not in str(err.value) and str(best) not in str(err.value)


def test_build_stage_builds_only_its_stage_with_the_whole_models_weights():
    cfg = schedules.PipelineConfig(sizes=[32, 16, 8, 4, 2])
    whole = schedules.initial_mlp(cfg).split(3)
    for s in range(3):
        stage = schedules.build_stage(cfg, s, 3)
        assert all(t.device.type == "cpu" for t in stage.parameters())
        torch.testing.assert_close(stage.state_dict(), whole[s].state_dict())
    other = schedules.build_stage(schedules.PipelineConfig(sizes=[32, 16, 8, 4, 2], seed=1), 0, 3)
    assert max_abs_diff(other.state_dict(), whole[0].state_dict()) > 1e-3  # the seed matters


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulated_device_keeps_the_arithmetic_and_the_schedules_order(
    schedule, runs, no_leftovers
):
    """A stage on a simulated device (pipeline.simulated.SimulatedDevice) trains the unsplit
    model's parameters, runs its boxes in the schedule's order, and every logged box lasts at least
    its device time (the sleep; without it the tiny MLP's boxes are far shorter)."""
    m, device_ms = 4, 40
    cfg = schedules.PipelineConfig(
        schedule=schedule,
        n_microbatches=m,
        batch_size=16,
        steps=2,
        sizes=[16] * 5,
        device_ms=device_ms,
    )
    run, res = _run(cfg, runs)
    _assert_equals_unsplit(run, res, cfg)
    records = runlog.read_run(run.run_dir)
    evs = timeline.events(records, step=2)
    for s in range(2):
        mine = [(e["event"], e["microbatch"]) for e in evs if e["stage"] == s]
        assert mine == _expected_order(schedule, s, 2, m)
    forward_s, backward_s = simulated.box_seconds(device_ms, 2, m)
    for e in timeline.events(records):
        assert e["end"] - e["start"] >= (forward_s if e["event"] == "forward" else backward_s)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule, m", [("gpipe", 2), ("1f1b", 4), ("interleaved", 2)])
def test_simulated_device_bubble_is_measured_near_the_formula(schedule, m, runs, no_leftovers):
    """The bubble measured from the wall-clock timestamps of a run on the simulated device is
    within 0.05 of (p − 1)/(v·m + p − 1); without the device's sleep the boxes of this tiny MLP
    would be far shorter than the hand-offs between them, and the bubble far above it."""
    v = 2 if schedule == "interleaved" else 1
    cfg = schedules.PipelineConfig(
        schedule=schedule,
        n_microbatches=m,
        batch_size=64,
        steps=3,
        sizes=[64] * 5,
        device_ms=480,
        save_params=False,
    )
    run = launch(schedules.worker, cfg, 2, runs_dir=runs, threads_per_rank=1)
    run.wait(timeout=120)
    records = runlog.read_run(run.run_dir)
    by = "rank" if v == 2 else "stage"
    measured = timeline.median_over_steps(
        records, lambda evs: bubble.bubble_measured(evs, by=by), (2, 3)
    )
    assert measured == pytest.approx(bubble.bubble_formula(2, m, v), abs=0.05)


def test_simulated_device_sleeps_what_the_arithmetic_leaves_of_the_device_time(monkeypatch):
    """hold() sleeps the rest of a box's device time (a forward of 50 ms that started 20 ms ago:
    about 30 ms), and not at all for a box whose arithmetic already took longer."""
    now, slept = 1000.0, []
    monkeypatch.setattr(simulated.time, "time", lambda: now)
    monkeypatch.setattr(simulated.time, "sleep", slept.append)
    device = simulated.SimulatedDevice(forward_s=0.05, backward_s=0.1)
    device.hold("forward", now - 0.02)
    device.hold("backward", now - 0.2)  # a box that took longer than its 0.1 s
    assert slept == [pytest.approx(0.03)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"])
def test_zero_bubble_schedules_equal_the_unsplit_model_on_gloo(schedule, runs, no_leftovers):
    from mgtutorial.pipeline import zero_bubble

    cfg = zero_bubble.ZeroBubbleConfig(schedule=schedule, n_microbatches=4)
    res = launch(zero_bubble.worker, cfg, 2, runs_dir=runs).wait(timeout=180)
    assert all(v["max_grad_diff"] < 1e-6 for v in res.values.values())
    order = res.values[0]["order"]
    actions = sorted(a for acts in order.values() for a in acts)
    assert actions == sorted(f"{s}{k}{i}" for s in range(4) for k in "FIW" for i in range(4))
    evs = zero_bubble.order_events(order, 4)
    assert bubble.bubble_measured(evs, by="rank") < bubble.bubble_formula(2, 4, 2)


def test_order_events_follow_dependencies_and_refuse_a_deadlock():
    from mgtutorial.pipeline import zero_bubble

    order = {0: ["0F0", "1F0", "1I0", "0I0", "1W0", "0W0"]}  # one rank, two stages
    evs = zero_bubble.order_events(order, 2)
    assert [(e["event"], e["stage"], e["start"]) for e in evs][:3] == [
        ("forward", 0, 0.0),
        ("forward", 1, 1.0),
        ("input", 1, 2.0),
    ]
    with pytest.raises(RuntimeError, match="deadlocks"):
        zero_bubble.order_events({0: ["0I0", "0F0"]}, 1)
    # a whole backward (interleaved 1F1B's B) waits like I and lasts I + W
    gpipe = {s: [f"{s}F{i}" for i in range(4)] + [f"{s}B{i}" for i in range(4)] for s in (0, 1)}
    evs = zero_bubble.order_events({r: acts for r, acts in gpipe.items()}, 2)
    assert bubble.bubble_measured(evs) == pytest.approx(bubble.bubble_formula(2, 4))
