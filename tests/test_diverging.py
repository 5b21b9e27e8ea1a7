"""A diverging run is not "done": the first loss that is not a finite number stops the run with an
error naming the step and the likely cause, in every training loop that logs a loss, in a notebook
(WorkerFailed) and on the command line (a non-zero exit)."""

from __future__ import annotations

import math

import pytest
import torch

from mgtutorial import WorkerFailed, ddp, launch
from mgtutorial.common.finite import LossNotFinite, check_loss, likely_cause
from mgtutorial.pipeline import schedules
from mgtutorial.runtime import env, runlog
from mgtutorial.sharding import model as shard_model
from mgtutorial.sharding.worker import ShardConfig


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_loss_that_is_not_a_number_is_refused_with_the_step_and_the_cause(loss):
    cfg = ddp.DDPConfig(lr=50.0)
    with pytest.raises(LossNotFinite) as info:
        check_loss(loss, step=7, cfg=cfg)
    assert (info.value.step, str(info.value.loss)) == (7, str(loss))
    assert f"the loss is {loss} at step 7: training diverged" in str(info.value)
    assert "Likely cause: lr=50.0 (default 0.01) is too large" in str(info.value)
    assert check_loss(2.5, step=1, cfg=cfg) == 2.5


def test_the_likely_cause_names_lr_and_momentum_as_they_are():
    assert likely_cause(ddp.DDPConfig()).startswith("lr=0.01 (default 0.01) or momentum=0.9")
    assert likely_cause(ddp.DDPConfig(momentum=0.99)).startswith("momentum=0.99 (default 0.9)")
    assert likely_cause(schedules.PipelineConfig(lr=9.0)).startswith("lr=9.0 (default 0.05)")
    assert likely_cause(None) == "a learning rate too large for this model and data"


def test_the_sharded_loop_stops_at_the_first_non_finite_loss():
    cfg = ShardConfig(lr=1e30, steps=6)
    model = shard_model.make_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    ctx = env.DistContext.single_process()
    with pytest.raises(LossNotFinite, match=r"at step [2-6]: .* lr=1e\+30 \(default 0.05\)"):
        shard_model.train(model, opt.step, cfg, ctx, opt.zero_grad)


@pytest.mark.timeout(150)
def test_ddp_trainer_stops_every_rank_at_the_step_that_diverged(runs, no_leftovers):
    cfg = ddp.DDPConfig(dataset="synthetic", lr=1e6, max_steps=12, evaluate=False)
    run = launch(ddp.worker, cfg, 2, runs_dir=runs)
    with pytest.raises(WorkerFailed) as info:
        run.wait(timeout=120)
    assert info.value.exc_type == "LossNotFinite"
    assert "lr=1000000.0 (default 0.01) is too large" in info.value.message
    train = runlog.of_kind(runlog.read_run(run.run_dir), "train")
    last = max(r["step"] for r in train)
    assert f"at step {last}:" in info.value.message and last < 12  # stopped there, not at the end
    assert not math.isfinite(train[-1]["global_loss"])


@pytest.mark.timeout(150)
def test_the_pipeline_worker_stops_too(runs, no_leftovers):
    cfg = schedules.PipelineConfig(
        lr=1e8, steps=8, batch_size=16, sizes=[32, 16, 8], backend="gloo"
    )
    run = launch(schedules.worker, cfg, 2, runs_dir=runs)
    with pytest.raises(WorkerFailed) as info:
        run.wait(timeout=120)
    assert info.value.rank == 1 and info.value.exc_type == "LossNotFinite"  # the last stage
    assert "lr=100000000.0 (default 0.05) is too large" in info.value.message
