"""Every ``validate()`` refusal: a clear error naming the value, before any rank starts."""

from __future__ import annotations

import pytest
import torch

from mgtutorial import ddp, launch
from mgtutorial.ddp import overlap
from mgtutorial.pipeline import handoff, schedules
from mgtutorial.runtime import runlog


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: ddp.DDPConfig(epochs=0), ValueError, "epochs=0: must be at least 1"),
        (lambda: ddp.DDPConfig(batch_size=0), ValueError, "batch_size=0: must be at least 1"),
        (lambda: ddp.DDPConfig(max_steps=0), ValueError, "max_steps=0: must be at least 1"),
        (lambda: ddp.DDPConfig(lr=0), ValueError, "lr=0: must be positive"),
        (lambda: ddp.DDPConfig(lr=float("nan")), ValueError, "lr=nan: must be a finite number"),
        (lambda: ddp.DDPConfig(lr=float("inf")), ValueError, "lr=inf: must be a finite number"),
        (lambda: ddp.DDPConfig(momentum=-5), ValueError, "momentum=-5: must be at least 0"),
        (lambda: ddp.DDPConfig(timeout_s=0), ValueError, "timeout_s=0: must be at least 1 s"),
        (lambda: ddp.DDPConfig(seed=-1), ValueError, "seed=-1: a seed must be an int from 0"),
        (
            lambda: ddp.DDPConfig(resume=True),
            ValueError,
            "resume=True needs the file to resume from",
        ),
        (lambda: ddp.DDPConfig(dataset="imagenet"), ValueError, "dataset='imagenet'"),
        (
            lambda: ddp.DDPConfig(dataset="cifar10", data_root="/nonexistent"),
            FileNotFoundError,
            "CIFAR-10 is not in /nonexistent",
        ),
        (
            lambda: overlap.HooksConfig(accumulation_steps=0),
            ValueError,
            "accumulation_steps=0: need at least 1",
        ),
        (
            lambda: overlap.HooksConfig(lr=-1),
            ValueError,
            "lr=-1",
        ),  # the base class's checks still apply
        (lambda: schedules.PipelineConfig(schedule="zb"), ValueError, "schedule='zb'"),
        (
            lambda: schedules.PipelineConfig(n_microbatches=0),
            ValueError,
            "n_microbatches=0 must be between 1 and batch_size=64",
        ),
        (
            lambda: schedules.PipelineConfig(batch_size=30, n_microbatches=4),
            ValueError,
            "batch_size=30 is not divisible by n_microbatches=4",
        ),
        (
            lambda: schedules.PipelineConfig(schedule="1f1b", n_microbatches=1),
            ValueError,
            r"1F1B needs n_microbatches ≥ stages: 1 < 2",
        ),
        (
            lambda: schedules.PipelineConfig(sizes=[8, 4]),
            ValueError,
            r"2 stages \(2 ranks × 1\) but the MLP has only 1 sub-networks \(sizes=\[8, 4\]\): "
            r"give at least 3 layer widths \(--sizes\), or run on fewer ranks \(--nproc 1\)",
        ),
        (  # interleaved: two stages per rank, so the fewer ranks are half the sub-networks
            lambda: schedules.PipelineConfig(schedule="interleaved", sizes=[64, 32, 16, 8]),
            ValueError,
            r"4 stages \(2 ranks × 2\) but the MLP has only 3 sub-networks .*: give at least 5 "
            r"layer widths \(--sizes\), or run on fewer ranks \(--nproc 1\)\.",
        ),
        (  # one sub-network: no number of ranks gives it two stages
            lambda: schedules.PipelineConfig(schedule="interleaved", sizes=[8, 4]),
            ValueError,
            r"give at least 5 layer widths \(--sizes\)\.$",
        ),
        (lambda: schedules.PipelineConfig(steps=0), ValueError, "steps=0: must be at least 1"),
        (lambda: handoff.HandoffConfig(reps=2), ValueError, r"reps ≥ 3 \(got 2\)"),
        (
            lambda: schedules.PipelineConfig(sizes=[64, -4, 8]),
            ValueError,
            r"sizes=\[64, -4, 8\]: give at least two layer widths",
        ),
        (
            lambda: schedules.PipelineConfig(lr=float("nan")),
            ValueError,
            "lr=nan: must be a finite number",
        ),
        (
            lambda: schedules.PipelineConfig(fail_stage=2),
            ValueError,
            r"fail_stage=2: must be -1 \(none\) or a stage of the job, 0 … 1",
        ),
    ],
)
def test_validate_refuses(make, error, match):
    cfg = make()
    with pytest.raises(error, match=match):
        cfg.validate(2)


def test_checkpoint_that_is_not_one_is_refused_before_it_is_overwritten(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("a file the user keeps")
    for path, match in ((notes, "exists and is not a checkpoint"), (tmp_path, "is a folder")):
        for resume in (False, True):
            with pytest.raises(ValueError, match=match):
                ddp.DDPConfig(checkpoint=str(path), resume=resume).validate(2)
    assert notes.read_text() == "a file the user keeps"
    real = tmp_path / "c.pt"
    torch.save({"model": {}}, real)
    # a torch file, and a new name, are fine
    ddp.DDPConfig(checkpoint=str(real), resume=True).validate(2)
    ddp.DDPConfig(checkpoint=str(tmp_path / "new.pt")).validate(2)


def test_refusal_comes_before_any_rank(runs):
    with pytest.raises(ValueError, match="accumulation_steps=0"):
        launch(overlap.hooks_worker, overlap.HooksConfig(accumulation_steps=0), 2, runs_dir=runs)
    assert not list(runs.iterdir())


@pytest.mark.timeout(120)
def test_accumulation_past_an_epoch_goes_on_into_the_next(runs, no_leftovers):
    # 256 synthetic samples, 2 ranks: 128 per rank = 5⅓ steps of 3 × 8; 8 steps need a second epoch
    # one bucket (25 MB): one all-reduce per optimizer step
    cfg = overlap.HooksConfig(
        dataset="synthetic",
        batch_size=8,
        accumulation_steps=3,
        max_steps=8,
        evaluate=False,
        bucket_cap_mb=25,
    )
    result = launch(overlap.hooks_worker, cfg, 2, runs_dir=runs).wait(timeout=100)
    assert {r: v["steps"] for r, v in result.values.items()} == {0: 8, 1: 8}
    syncs = runlog.of_kind(runlog.read_run(result.run_dir), "sync")
    assert [s["step"] for s in syncs if s["rank"] == 0] == list(range(1, 9))
    assert {s["allreduce_calls"] for s in syncs} == {1}
