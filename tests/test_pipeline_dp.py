"""Chapter 04b, section 6: pipeline × data parallel on a 2 × 2 mesh equals one process; without the
replicas' all-reduce it does not; bad meshes and batches are refused before any rank starts."""

from __future__ import annotations

import pytest
import torch

from mgtutorial import launch
from mgtutorial.common.compare import max_abs_diff
from mgtutorial.pipeline import pp_dp, schedules


@pytest.mark.timeout(240)
def test_pp_dp_on_a_2x2_mesh_equals_one_process_and_needs_the_all_reduce(runs, no_leftovers):
    cfg = pp_dp.PPDPConfig(dp=2, schedule="1f1b", n_microbatches=2, batch_size=32, steps=3)
    ref, ref_losses = schedules.unsplit_reference(cfg)
    res = launch(pp_dp.worker, cfg, 4, runs_dir=runs, threads_per_rank=1)
    out = res.wait(timeout=180)
    assert {r: v["coords"] for r, v in out.values.items()} == {
        0: [0, 0],
        1: [1, 0],
        2: [0, 1],
        3: [1, 1],
    }  # "pp" outer: a stage's replicas are neighbouring ranks
    for d in range(2):
        got = pp_dp.replica_params(res.run_dir, cfg, d, 2)
        torch.testing.assert_close(got, ref.state_dict(), rtol=1e-5, atol=1e-6)
    # each rank all-reduces each of its stage's 4 parameters (2 Linear: weight, bias) once a step
    assert all(v["collectives"] == {"all_reduce": 4} for v in out.values.values())
    # the last stage of each replica sees its half of the batch: the mean of the two is the loss
    halves = [out.values[r]["losses"] for r in (2, 3)]
    assert [(a + b) / 2 for a, b in zip(*halves)] == pytest.approx(ref_losses, rel=1e-5)

    # the negative control: without the all-reduce the replicas drift from one process and apart
    alone = pp_dp.PPDPConfig(**{**cfg.__dict__, "all_reduce": False})
    res = launch(pp_dp.worker, alone, 4, runs_dir=runs, threads_per_rank=1)
    out = res.wait(timeout=180)
    params = [pp_dp.replica_params(res.run_dir, alone, d, 2) for d in range(2)]
    assert all(max_abs_diff(p, ref.state_dict()) > 1e-4 for p in params)
    assert max_abs_diff(params[0], params[1]) > 1e-4
    assert all(v["collectives"] == {} for v in out.values.values())


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "wrap, collectives",
    [("ddp", {"all_reduce": 1}), ("fsdp", {"all_gather": 1, "reduce_scatter": 1})],
)
def test_library_wrapped_stages_equal_one_process_and_reduce_once_a_step(
    wrap, collectives, runs, no_leftovers
):
    """The stage wrapped in DDP or sharded with FSDP2 over mesh["dp"], driven by the library's
    stage: each replica equals one process, and each rank's step makes one reduction (DDP: one
    bucket's all-reduce; FSDP: one reduce-scatter, one all-gather), not one per micro-batch."""
    cfg = pp_dp.PPDPConfig(
        dp=2, schedule="1f1b", n_microbatches=4, batch_size=32, steps=3, wrap=wrap
    )
    ref, _ = schedules.unsplit_reference(cfg)
    res = launch(pp_dp.worker, cfg, 4, runs_dir=runs, threads_per_rank=1)
    out = res.wait(timeout=180)
    for d in range(2):
        got = pp_dp.replica_params(res.run_dir, cfg, d, 2)
        torch.testing.assert_close(got, ref.state_dict(), rtol=1e-5, atol=1e-6)
    assert all(v["collectives"] == collectives for v in out.values.values())


@pytest.mark.parametrize(
    "nprocs, fields, message",
    [
        (3, {}, r"world size 3 is not dp × pp with dp=2 .* at least 4"),
        (2, {}, r"world size 2 is not dp × pp with dp=2"),
        (4, {"batch_size": 60}, r"batch_size=60 is not divisible by dp × n_microbatches = 2 × 4"),
        (4, {"schedule": "interleaved"}, r"schedule='interleaved'"),
        (4, {"n_microbatches": 1}, r"1F1B needs n_microbatches ≥ stages: 1 < 2"),
        (4, {"dp": 0}, r"dp=0: must be at least 1"),
        (4, {"wrap": "ddp", "all_reduce": False}, r"all_reduce=False .* only with wrap='hand'"),
        (4, {"wrap": "ddp", "n_microbatches": 2}, r"n_microbatches ≥ 3"),
    ],
)
def test_pp_dp_config_refuses_with_the_value_and_the_fix(nprocs, fields, message, runs):
    with pytest.raises(ValueError, match=message):
        launch(pp_dp.worker, pp_dp.PPDPConfig(**fields), nprocs, runs_dir=runs)
    assert not list(runs.iterdir())  # refused before any rank or run directory
    pp_dp.PPDPConfig(dp=1).validate(2)  # one replica: a plain pipeline
