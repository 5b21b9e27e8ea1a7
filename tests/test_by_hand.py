"""Chapter 03b's DDP by hand with overlap (per parameter, then bucketed) against DDP and one
process on the combined batch, the gradients' storages with ``gradient_as_bucket_view``, and the
collectives counted per step with ``CommDebugMode`` (chapter 03c: ``find_unused_parameters``'
extra all-reduce, ``Join``'s two). Gloo, 2 ranks."""

from __future__ import annotations

import pytest
import torch

from mgtutorial import ddp, launch
from mgtutorial.common import models
from mgtutorial.ddp import by_hand, internals, overlap
from mgtutorial.runtime import runlog

COMMON = dict(dataset="synthetic", batch_size=8, max_steps=4, evaluate=False)


def _records(run, kind: str, rank: int = 0) -> list[dict]:
    return [r for r in runlog.of_kind(runlog.read_run(run.run_dir), kind) if r["rank"] == rank]


@pytest.mark.timeout(180)
def test_ddp_by_hand_overlapped_equals_ddp_and_one_process(runs, no_leftovers):
    paths = {cap: runs / f"by_hand_{cap}.pt" for cap in (None, 1.0)}
    hand = {
        cap: launch(
            by_hand.by_hand_worker,
            by_hand.ByHandConfig(bucket_cap_mb=cap, checkpoint=str(path), **COMMON),
            2,
            runs_dir=runs,
        )
        for cap, path in paths.items()
    }
    lib = launch(
        overlap.hooks_worker,
        overlap.HooksConfig(checkpoint=str(runs / "ddp.pt"), **COMMON),
        2,
        runs_dir=runs,
    )
    results = {cap: run.wait(timeout=120) for cap, run in hand.items()}
    lib.wait(timeout=120)
    reference = ddp.combined_batch_reference(ddp.DDPConfig(**COMMON), 2).state_dict()
    library = torch.load(runs / "ddp.pt", weights_only=True)["model"]
    for cap, path in paths.items():
        state = torch.load(path, weights_only=True)["model"]
        torch.testing.assert_close(state, reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state, library, rtol=1e-6, atol=1e-7)
        for rank in (0, 1):
            syncs = _records(results[cap], "sync", rank)
            assert [s["step"] for s in syncs] == [1, 2, 3, 4]
            for s in syncs:  # every all-reduce launched inside backward(), every one completed
                assert all(
                    s["backward_start"] <= t <= s["backward_end"] for t in s["bucket_launched"]
                )
                assert len(s["bucket_done"]) == s["allreduce_calls"]
    per_param = _records(results[None], "sync")
    assert [s["allreduce_calls"] for s in per_param] == [6] * 4
    assert per_param[0]["bucket_sizes"] == [10, 640, 64, 401408, 2400, 32]  # reverse order
    bucketed = _records(results[1.0], "sync")
    assert [s["bucket_sizes"] for s in bucketed] == [[402122, 2432]] * 4
    fig = overlap.timeline_figure({"by hand": per_param[1:], "buckets": bucketed[1:]})
    assert len(fig.axes) == 2


@pytest.mark.timeout(180)
def test_collectives_counted_per_step_unused_parameters_and_join(runs, no_leftovers):
    counted = {
        flag: launch(
            overlap.hooks_worker,
            overlap.HooksConfig(find_unused_parameters=flag, count_collectives=True, **COMMON),
            2,
            runs_dir=runs,
        )
        for flag in (False, True)
    }
    joined = launch(
        internals.pitfall_worker,
        internals.PitfallConfig(extra_batches_last_rank=1, use_join=True, **COMMON),
        2,
        runs_dir=runs,
    )
    syncs = {flag: _records(run.wait(timeout=120), "sync") for flag, run in counted.items()}
    calls = {flag: [s["collectives"]["all_reduce"] for s in recs] for flag, recs in syncs.items()}
    hooked = {flag: [s["allreduce_calls"] for s in recs] for flag, recs in syncs.items()}
    assert calls[False] == hooked[False] == [1, 2, 2, 2]  # the buckets, rebuilt after step 1
    assert hooked[True] == [2] * 4 and calls[True] == [3] * 4  # + the used-parameter map
    steps = _records(joined.wait(timeout=120), "train_local")
    assert [s["collectives"]["all_reduce"] for s in steps] == [3, 4, 4, 4]  # + Join's two
    own = [4 * p.numel() for p in models.ArticleCNN().parameters()]
    assert all(s["grad_storages"] == own for s in syncs[False])  # a tensor per gradient


@pytest.mark.timeout(120)
def test_gradient_as_bucket_view_and_autocast(runs, no_leftovers):
    """The gradients live in the buckets; under autocast the buckets stay float32."""
    cfg = overlap.HooksConfig(gradient_as_bucket_view=True, autocast=True, **COMMON)
    syncs = _records(launch(overlap.hooks_worker, cfg, 2, runs_dir=runs).wait(timeout=90), "sync")
    for s in syncs:
        assert sorted(s["grad_storages"]) == sorted(4 * n for n in s["bucket_sizes"])
        assert s["logits_dtype"] == "torch.bfloat16"
        assert s["bucket_dtypes"] == ["torch.float32"] * len(s["bucket_sizes"])
