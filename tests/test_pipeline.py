"""Chapter 04: every pipeline schedule equals the unsplit model; timelines; memory; failures."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from mgtutorial import launch
from mgtutorial.common import models
from mgtutorial.pipeline import naive as MP
from mgtutorial.pipeline import schedules as P
from mgtutorial.pipeline import timeline as T
from mgtutorial.runtime import runlog
from mgtutorial.runtime.run import WorkerFailed


def _run(cfg, runs, n=2):
    run = launch(P.worker, cfg, n, runs_dir=runs)
    return run, run.wait(timeout=90)


def _assert_equals_unsplit(run, res, cfg, n=2):
    ref, ref_losses = P.unsplit_reference(cfg)
    got = P.gather_params(run.run_dir, cfg, n)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
    assert res.values[n - 1]["losses"] == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.timeout(180)
def test_hand_gpipe_equals_library_gpipe_and_1f1b_equals_unsplit(runs, no_leftovers):
    params = {}
    for schedule in ("hand-gpipe", "gpipe", "1f1b"):
        cfg = P.PipelineConfig(schedule=schedule, n_microbatches=4, batch_size=32, steps=3)
        run, res = _run(cfg, runs)
        _assert_equals_unsplit(run, res, cfg)
        params[schedule] = P.gather_params(run.run_dir, cfg, 2)
    for k in params["gpipe"]:
        torch.testing.assert_close(params["hand-gpipe"][k], params["gpipe"][k])
    # the check can fail: one step fewer is a different model
    ref_short, _ = P.unsplit_reference(P.PipelineConfig(steps=2, batch_size=32))
    assert any(
        (ref_short.state_dict()[k] - params["gpipe"][k]).abs().max() > 1e-4 for k in params["gpipe"]
    )


@pytest.mark.timeout(120)
def test_interleaved_two_stages_per_rank_equals_unsplit(runs, no_leftovers):
    m = 4
    cfg = P.PipelineConfig(
        schedule="interleaved",
        n_microbatches=m,
        batch_size=32,
        steps=2,
        sizes=[1024, 512, 256, 128, 100],
        input_grad=True,
    )
    run, res = _run(cfg, runs)
    _assert_equals_unsplit(run, res, cfg)
    evs = T.events(runlog.read_run(run.run_dir), step=2)
    assert {(e["stage"], e["rank"]) for e in evs} == {
        (0, 0),
        (1, 1),
        (2, 0),
        (3, 1),
    }  # stage s on rank s % 2
    for s in range(4):
        for kind in ("forward", "backward"):
            assert sorted(
                e["microbatch"] for e in evs if e["stage"] == s and e["event"] == kind
            ) == list(range(m))
    by = {(e["event"], e["stage"], e["microbatch"]): e for e in evs}
    for s in range(1, 4):
        for i in range(m):
            assert by[("forward", s, i)]["start"] >= by[("forward", s - 1, i)]["end"]
    assert 0 < T.bubble_measured(evs, by="rank") < 1


@pytest.mark.timeout(120)
def test_indivisible_batch_hand_written_weights_by_share(runs, no_leftovers):
    cfg = P.PipelineConfig(schedule="hand-gpipe", n_microbatches=3, batch_size=32, steps=3)
    assert P.microbatch_sizes(32, 3) == [11, 11, 10]
    run, res = _run(cfg, runs)
    _assert_equals_unsplit(run, res, cfg)


def test_indivisible_batch_library_refused_before_any_process(runs):
    for schedule in ("gpipe", "1f1b"):
        with pytest.raises(ValueError, match="batch_size=32 is not divisible by n_microbatches=3"):
            launch(
                P.worker,
                P.PipelineConfig(schedule=schedule, n_microbatches=3, batch_size=32),
                2,
                runs_dir=runs,
            )
    with pytest.raises(
        ValueError, match="interleaved needs n_microbatches divisible by the ranks: 3 % 2"
    ):
        launch(
            P.worker,
            P.PipelineConfig(schedule="interleaved", n_microbatches=3, batch_size=33),
            2,
            runs_dir=runs,
        )
    with pytest.raises(ValueError, match="1F1B needs n_microbatches ≥ stages: 1 < 2"):
        launch(P.worker, P.PipelineConfig(schedule="1f1b", n_microbatches=1), 2, runs_dir=runs)
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
    cfg = P.PipelineConfig(
        schedule=schedule, n_microbatches=m, batch_size=32, steps=2, save_params=False
    )
    run, res = _run(cfg, runs)
    recs = runlog.read_run(run.run_dir)
    for step in (1, 2):
        evs = T.events(recs, step)
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
        assert 0 < T.bubble_measured(evs) < 1
    for rank in range(
        p
    ):  # one CPU time and one run-queue wait per step, from the main thread's clocks
        v = res.values[rank]
        assert len(v["step_times_s"]) == len(v["step_cpu_s"]) == len(v["step_wait_s"]) == cfg.steps
        assert all(c > 0 for c in v["step_cpu_s"])
        assert all(w is None or w >= 0 for w in v["step_wait_s"])


@pytest.mark.timeout(120)
def test_1f1b_holds_fewer_activations_than_gpipe(runs, no_leftovers):
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        cfg = P.PipelineConfig(
            schedule=schedule, n_microbatches=8, batch_size=64, steps=1, save_params=False
        )
        _, res = _run(cfg, runs)
        peaks[schedule] = (
            res.values[0]["peak_activation_bytes"],
            res.values[1]["peak_activation_bytes"],
        )
    # stage 0 (1024→512→ReLU→256→ReLU) keeps the input batch (one storage: the micro-batches are views
    # of it) and, per micro-batch until its backward, each ReLU's output (which the next Linear also
    # saves: one storage). GPipe holds all 8 micro-batches at once, 1F1B at most p − s = 2.
    batch_bytes, mb_bytes = 64 * 1024 * 4, 8 * (512 + 256) * 4
    assert peaks["gpipe"][0] == batch_bytes + 8 * mb_bytes
    assert peaks["1f1b"][0] == batch_bytes + 2 * mb_bytes
    # stage 1 (256→100, the loss): the int64 targets (one storage, like the inputs on stage 0) and per
    # micro-batch its received input, log-softmax's output (saved by log_softmax and nll_loss, counted
    # once) and nll_loss's total weight; 1F1B holds 1 micro-batch
    targets_bytes, last_mb = 64 * 8, 8 * (256 + 100) * 4 + 4
    assert peaks["gpipe"][1] == targets_bytes + 8 * last_mb
    assert peaks["1f1b"][1] == targets_bytes + last_mb


def test_meter_counts_storage_not_saves():
    x = torch.randn(4, 10, requires_grad=True)
    meter = T.ActivationMeter(torch.nn.Linear(1, 1))
    with meter.saving():
        logp = torch.log_softmax(x, 1)  # saves its output
        loss = torch.nn.functional.nll_loss(
            logp, torch.zeros(4, dtype=torch.long)
        )  # saves it again
    # log-probs once and the targets; nll_loss's 4-byte total weight too, unless the allocator put it
    # where a parameter's storage is excluded; counting saves would count the log-probs twice
    logp_bytes, targets_bytes = 4 * 10 * 4, 4 * 8
    extra = meter.live_bytes - (logp_bytes + targets_bytes)
    assert extra in (0, 4)
    assert meter.live_bytes < 2 * logp_bytes + targets_bytes
    loss.backward()
    del loss, logp
    assert meter.live_bytes == 0 and meter.peak_bytes == logp_bytes + targets_bytes + extra


def _gpipe_timeline(m, f, b, gap, p=2):
    """GPipe boxes as an ideal pipeline draws them, ``gap`` seconds between boxes on the critical path."""

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
    assert T.bubble_measured(evs) == pytest.approx(T.bubble_formula(2, m))
    assert T.bubble_measured(evs, by="rank") == pytest.approx(T.bubble_formula(2, m))
    costs = T.step_costs(evs)
    assert (costs["m"], costs["p"], costs["forward"], costs["backward"], costs["delay"]) == (
        m,
        2,
        1.0,
        2.0,
        0.0,
    )
    assert costs["model"] == pytest.approx(T.bubble_formula(2, m))
    gap = 0.25  # the critical path has 2(m + p − 1) boxes and one gap fewer
    costs = T.step_costs(_gpipe_timeline(m, 1.0, 2.0, gap))
    assert costs["delay"] == pytest.approx(gap)
    assert costs["model"] == pytest.approx(T.bubble_measured(_gpipe_timeline(m, 1.0, 2.0, gap)))
    assert T.bubble_measured(_gpipe_timeline(m, 1.0, 2.0, gap)) > T.bubble_formula(2, m)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_box_delays_and_the_model_see_the_gaps(m):
    f, b, gap = 1.0, 2.0, 0.25
    assert T.box_delays(_gpipe_timeline(m, f, b, 0.0)) == pytest.approx([0.0] * (4 * m - 1))
    evs = _gpipe_timeline(m, f, b, gap)
    assert T.box_delays(evs) == pytest.approx([gap] * (4 * m - 1))  # every box but the first
    assert T.bubble_model(2, m, f, b, 0.0) == pytest.approx(T.bubble_formula(2, m))
    assert T.bubble_model(2, m, f, b, 0.0, stages_per_rank=2) == pytest.approx(
        T.bubble_formula(2, m, 2)
    )
    # the drawn timeline's span is (m + 1)(f + b + 2·gap) − gap: the step's first box has no delay
    span = (m + 1) * (f + b + 2 * gap) - gap
    assert T.bubble_measured(evs) == pytest.approx(1 - m * (f + b) / span)
    assert T.bubble_model(2, m, f, b, gap) == pytest.approx(T.bubble_measured(evs))


def test_median_step_is_the_step_of_the_median():
    records = [
        {"kind": "event", "step": s, "start": float(s), "value": v}
        for s, v in ((2, 0.3), (3, 0.1), (4, 0.2), (5, 0.9))
    ]
    value = lambda evs: evs[0]["value"]
    assert T.median_step(records, value, (2, 3, 4)) == 4
    assert T.median_over_steps(records, value, (2, 3, 4)) == 0.2
    assert T.median_step(records, value, (2, 3, 4, 5)) == 4  # the lower middle one


@pytest.mark.timeout(60)
def test_handoff_worker_times_each_size(runs, no_leftovers):
    res = launch(
        T.handoff_worker, T.HandoffConfig(rows=[8, 2], width=16, reps=4), 2, runs_dir=runs
    ).wait(timeout=40)
    for rank in (0, 1):
        assert [(h["rows"], h["bytes"]) for h in res.values[rank]] == [
            (8, 8 * 16 * 4),
            (2, 2 * 16 * 4),
        ]
        assert all(
            0 < h["handoff_ms"] <= h["median_ms"] for h in res.values[rank]
        )  # the floor: the minimum


def test_thread_clock_counts_this_threads_cpu_and_run_queue_wait():
    (c0, w0), x = T.thread_clock(), 0
    for i in range(200_000):
        x += i
    c1, w1 = T.thread_clock()
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
    # interleaved: rank r holds stages r and r + p, so stage 3 of 4 fails on rank 1, stage 2 on rank 0
    cfg = P.PipelineConfig(
        schedule=schedule, fail_stage=stage, timeout_s=600, sizes=[64] * 5, batch_size=8
    )
    with pytest.raises(WorkerFailed, match=f"injected failure in stage {stage} at step 2") as info:
        launch(P.worker, cfg, 2, runs_dir=runs).wait(timeout=40)
    assert info.value.rank == rank


@pytest.mark.timeout(60)
def test_article_version_holds_whole_model_and_diverges(runs, no_leftovers):
    run = launch(MP.article_worker, MP.ArticleConfig(steps=5), 2, runs_dir=runs)
    res = run.wait(timeout=40)
    whole = models.count_parameters(models.ArticleMLP())
    assert res.values == {0: {"parameters": whole}, 1: {"parameters": whole}}
    a, b = (torch.load(run.run_dir / f"rank{r}-model.pt", weights_only=True) for r in (0, 1))
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-5  # same start, no sync: apart


def test_naive_split_equals_unsplit_and_runs_one_stage_at_a_time():
    cfg = P.PipelineConfig(steps=3, batch_size=32)
    model, evs = MP.train_naive(cfg, [torch.device("cpu")] * 2)
    ref, _ = P.unsplit_reference(cfg)
    got = torch.nn.Sequential(*model.stages).state_dict()
    want = torch.nn.Sequential(*ref.split(2)).state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k])
    evs = sorted(evs, key=lambda e: e["start"])
    assert [(e["stage"], e["event"]) for e in evs[:4]] == [
        (0, "forward"),
        (1, "forward"),
        (1, "backward"),
        (0, "backward"),
    ]
    assert all(a["end"] <= b["start"] + 1e-4 for a, b in zip(evs, evs[1:]))  # never two at once
