"""Chapter 03: collectives, DDP from scratch, buckets/hooks, accumulation, pitfalls (gloo, 2
ranks)."""

from __future__ import annotations

import pytest
import torch

from mgtutorial import ddp, launch
from mgtutorial.common import models
from mgtutorial.ddp import collectives, internals, overlap
from mgtutorial.runtime import runlog
from mgtutorial.runtime.run import WorkerFailed

COMMON = dict(dataset="synthetic", batch_size=8, max_steps=4, evaluate=False)


def _params(path):
    return torch.load(path, weights_only=True)["model"]


def _assert_same(a: dict, b: dict):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_collectives_tour_values(runs, no_leftovers):
    run = launch(
        collectives.collectives_tour,
        collectives.TourConfig(size=4, barrier_delay_s=0.5),
        2,
        runs_dir=runs,
    )
    run.wait(timeout=40)
    recs = {(r["op"], r["rank"]): r for r in runlog.read_run(run.run_dir)}
    r0, r1 = [0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0]
    total = [a + b for a, b in zip(r0, r1)]
    for rank in (0, 1):
        assert recs[("all_reduce (sum)", rank)]["after"] == total
        assert recs[("all_reduce (average)", rank)]["after"] == [t / 2 for t in total]
        assert recs[("broadcast (from rank 0)", rank)]["after"] == r0
        assert recs[("all_gather", rank)]["after"] == r0 + r1
    assert recs[("reduce_scatter (sum)", 0)]["after"] == total[:2]
    assert recs[("reduce_scatter (sum)", 1)]["after"] == total[2:]
    assert recs[("send/recv (ring: to rank+1)", 0)]["after"] == r1
    assert recs[("send/recv (ring: to rank+1)", 1)]["after"] == r0
    # rank 0 left the barrier only after the last rank, which slept first, had entered it
    assert recs[("barrier", 0)]["time"] >= recs[("barrier", 1)]["entered"]
    assert collectives.movement_figure(list(recs.values())) is not None


@pytest.mark.timeout(120)
def test_from_scratch_equals_ddp_equals_single_process(runs, no_leftovers):
    scratch, lib = runs / "scratch.pt", runs / "ddp.pt"
    r = launch(
        collectives.scratch_worker,
        ddp.DDPConfig(checkpoint=str(scratch), **COMMON),
        2,
        runs_dir=runs,
    ).wait(timeout=60)
    assert r.values[0]["allreduce_calls_per_step"] == 6  # one per parameter tensor, no buckets
    launch(ddp.worker, ddp.DDPConfig(checkpoint=str(lib), **COMMON), 2, runs_dir=runs).wait(
        timeout=60
    )
    reference = ddp.combined_batch_reference(ddp.DDPConfig(**COMMON), 2).state_dict()
    _assert_same(_params(scratch), _params(lib))
    _assert_same(_params(scratch), reference)


@pytest.mark.timeout(120)
def test_accumulation_syncs_once_per_step_and_equals_combined_data(runs, no_leftovers):
    k, ckpt = 3, runs / "accum.pt"
    cfg = overlap.HooksConfig(
        accumulation_steps=k, bucket_cap_mb=25, checkpoint=str(ckpt), **COMMON
    )
    run = launch(overlap.hooks_worker, cfg, 2, runs_dir=runs)
    run.wait(timeout=60)
    syncs = [r for r in runlog.read_run(run.run_dir) if r.get("kind") == "sync"]
    assert len(syncs) == 2 * COMMON["max_steps"]
    # one 25 MiB bucket, once per optimizer step
    assert all(r["allreduce_calls"] == 1 for r in syncs)
    reference = ddp.combined_batch_reference(
        ddp.DDPConfig(**{**COMMON, "batch_size": k * COMMON["batch_size"]}), 2
    )
    _assert_same(_params(ckpt), reference.state_dict())


@pytest.mark.timeout(60)
def test_smaller_buckets_mean_more_allreduce_calls(runs, no_leftovers):
    run = launch(
        overlap.hooks_worker, overlap.HooksConfig(bucket_cap_mb=0.5, **COMMON), 2, runs_dir=runs
    )
    run.wait(timeout=40)
    last = [r for r in runlog.read_run(run.run_dir) if r.get("kind") == "sync" and r["step"] == 4]
    n_params = sum(p.numel() for p in models.ArticleCNN().parameters())
    for r in last:
        assert r["allreduce_calls"] >= 2 and sum(r["bucket_sizes"]) == n_params


@pytest.mark.timeout(60)
def test_unused_parameter_fails_fast_and_flag_fixes_it(runs, no_leftovers):
    with pytest.raises(WorkerFailed, match="find_unused_parameters=True"):  # not the 600 s timeout
        launch(
            internals.pitfall_worker,
            internals.PitfallConfig(unused_layer=True, timeout_s=600, **COMMON),
            2,
            runs_dir=runs,
        ).wait(timeout=40)
    r = launch(
        internals.pitfall_worker,
        internals.PitfallConfig(unused_layer=True, find_unused_parameters=True, **COMMON),
        2,
        runs_dir=runs,
    ).wait(timeout=40)
    assert r.values[0]["steps"] == COMMON["max_steps"]


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_uneven_inputs_time_out_and_join_finishes(runs, no_leftovers):
    timeout_s = 3
    cfg = internals.PitfallConfig(extra_batches_last_rank=2, timeout_s=timeout_s, **COMMON)
    run = launch(internals.pitfall_worker, cfg, 2, runs_dir=runs)
    # gloo words it "Timed out waiting …" or "Application timeout caused pair closure"
    with pytest.raises(WorkerFailed, match="(?i)timed out|timeout"):
        run.wait(timeout=60)
    loop_end = [r for r in runlog.read_run(run.run_dir) if r.get("kind") == "loop_done"]
    assert [r["rank"] for r in loop_end] == [0]  # rank 1 never got past its extra step
    err = runlog.read_json(run.run_dir / f"rank{0}.error.json")
    assert err["time"] > loop_end[0]["time"]  # rank 0 finished its loop, then waited in vain
    cfg = internals.PitfallConfig(
        extra_batches_last_rank=2, use_join=True, timeout_s=timeout_s, **COMMON
    )
    r = launch(internals.pitfall_worker, cfg, 2, runs_dir=runs).wait(timeout=40)
    assert r.values == {0: {"steps": 4}, 1: {"steps": 6}}


@pytest.mark.timeout(60)
def test_async_allreduce_returns_before_the_late_rank_arrives(runs, no_leftovers):
    cfg = collectives.TourConfig(size=4, barrier_delay_s=0.5)
    r = launch(collectives.async_allreduce, cfg, 2, runs_dir=runs).wait(timeout=40).values
    assert r[0]["completed_after_call"] is False  # rank 1 had not called it yet
    # rank 0 waited in wait(), not in the call
    assert r[0]["returned"] < r[1]["called"] <= r[0]["done"]
    for v in r.values():
        assert v["result"] == [10.0, 12.0, 14.0, 16.0]
