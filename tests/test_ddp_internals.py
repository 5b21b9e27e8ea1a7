"""Chapters 03b and 03c: DDP's default buckets and their timing, Join's gradient scale,
SyncBatchNorm by hand and the SyncBatchNorm worker through its CPU seam (gloo, 2 ranks), each
against an independent computation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mgtutorial import launch
from mgtutorial.common import models
from mgtutorial.ddp import batchnorm, internals, overlap
from mgtutorial.runtime import env, runlog

COMMON = dict(dataset="synthetic", batch_size=8, max_steps=4, evaluate=False)


def _syncs(run):
    return [r for r in runlog.read_run(run.run_dir) if r.get("kind") == "sync"]


def _buckets(sizes: list[int], first_cap_bytes: int) -> list[int]:
    """Float32 tensors taken in order; the first bucket closes once it holds ≥ its cap (the others
    have the 25 MiB cap, which our CNN does not reach)."""
    buckets, current = [], 0
    for n in sizes:
        current += n
        if not buckets and current * 4 >= first_cap_bytes:
            buckets.append(current)
            current = 0
    return buckets + ([current] if current else [])


@pytest.mark.timeout(90)
def test_default_buckets_find_unused_parameters_and_static_graph(runs, no_leftovers):
    default = launch(overlap.hooks_worker, overlap.HooksConfig(**COMMON), 2, runs_dir=runs)
    unused = launch(
        overlap.hooks_worker,
        overlap.HooksConfig(find_unused_parameters=True, **COMMON),
        2,
        runs_dir=runs,
    )
    static = launch(
        overlap.hooks_worker, overlap.HooksConfig(static_graph=True, **COMMON), 2, runs_dir=runs
    )
    default.wait(timeout=60), unused.wait(timeout=60), static.wait(timeout=60)
    sizes = [p.numel() for p in models.ArticleCNN().parameters()]
    cap = torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
    rebuilt = _buckets(sizes[::-1], cap)  # rebuilt in the order the gradients became ready
    initial = _buckets(sizes, cap)[::-1]  # assigned in parameters() order, launched in reverse
    assert len(rebuilt) == 2 and rebuilt != initial
    total = sum(rebuilt)
    for rec in _syncs(default):  # one bucket in step 1, then the 1 MiB first bucket
        assert rec["bucket_sizes"] == ([total] if rec["step"] == 1 else rebuilt)
    for rec in _syncs(unused):  # assigned at construction with the caps, never rebuilt
        assert rec["bucket_sizes"] == initial
    for rec in _syncs(static):  # static_graph: one bucket for two steps, rebuilt before step 3
        assert rec["bucket_sizes"] == ([total] if rec["step"] <= 2 else rebuilt)


@pytest.mark.timeout(60)
def test_bucket_launch_and_completion_inside_backward(runs, no_leftovers):
    run = launch(
        overlap.hooks_worker, overlap.HooksConfig(bucket_cap_mb=0.5, **COMMON), 2, runs_dir=runs
    )
    run.wait(timeout=40)
    for rec in _syncs(run):
        assert len(rec["bucket_launched"]) == len(rec["bucket_done"]) == rec["allreduce_calls"]
        assert rec["backward_start"] <= rec["bucket_launched"][0]
        for launched, done in zip(rec["bucket_launched"], rec["bucket_done"]):
            # gloo: backward() waits for every bucket
            assert launched <= done <= rec["backward_end"]


@pytest.mark.timeout(90)
def test_join_divides_the_trained_ranks_gradient(runs, no_leftovers):
    ratios = {}
    for initial in (True, False):
        cfg = internals.PitfallConfig(
            extra_batches_last_rank=2,
            use_join=True,
            divide_by_initial_world_size=initial,
            backend="gloo",
            **COMMON,
        )
        run = launch(internals.pitfall_worker, cfg, 2, runs_dir=runs)
        assert run.wait(timeout=60).values == {0: {"steps": 4}, 1: {"steps": 6}}
        ratios[initial] = {
            r["step"]: r["ratio"]
            for r in runlog.read_run(run.run_dir)
            if r.get("kind") == "grad_scale" and r["rank"] == 1
        }
    for step in (5, 6):  # rank 0 has joined: its zeros count (True) or not (False)
        assert ratios[True][step] == pytest.approx(0.5, rel=1e-5)
        assert ratios[False][step] == pytest.approx(1.0, rel=1e-5)
    # both ranks trained: not half
    assert all(abs(ratios[True][s] - 0.5) > 1e-3 for s in range(1, 5))


def _combined_batchnorm(cfg):
    """Plain BatchNorm2d in one process on both ranks' inputs together: (inputs, layer, outputs
    per rank)."""
    inputs = [batchnorm.batchnorm_inputs(cfg, r) for r in range(2)]
    bn = nn.BatchNorm2d(cfg.channels, momentum=1.0, affine=False)
    return inputs, bn, bn(torch.cat(inputs)).split([len(x) for x in inputs])


@pytest.mark.timeout(60)
def test_batchnorm_by_hand_equals_batchnorm_on_the_combined_batch(runs, no_leftovers):
    cfg = batchnorm.BatchNormConfig(backend="gloo")
    got = launch(batchnorm.batchnorm_by_hand_worker, cfg, 2, runs_dir=runs).wait(timeout=40).values
    inputs, bn, want = _combined_batchnorm(cfg)
    n = sum(len(x) for x in inputs) * 16
    for r in range(2):
        torch.testing.assert_close(torch.tensor(got[r]["out"]), want[r], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(got[r]["mean"]), bn.running_mean)
        unbiased = torch.tensor(got[r]["var"]) * n / (n - 1)
        torch.testing.assert_close(unbiased, bn.running_var)
        assert got[r]["count"] == n
    # the control: one rank's own statistics
    plain = nn.BatchNorm2d(cfg.channels, affine=False)(inputs[1])
    assert (plain - want[1]).abs().max() > 0.1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="SyncBatchNorm needs 2 CUDA GPUs (NCCL)")
@pytest.mark.timeout(120)
def test_sync_batchnorm_on_gpus_equals_batchnorm_on_the_combined_batch(runs, no_leftovers):
    cfg = batchnorm.BatchNormConfig(backend="nccl")
    got = launch(batchnorm.sync_batchnorm_worker, cfg, 2, runs_dir=runs).wait(timeout=90).values
    _, bn, want = _combined_batchnorm(cfg)
    for r in range(2):
        torch.testing.assert_close(torch.tensor(got[r]["out"]), want[r], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(
            torch.tensor(got[r]["running_mean"]), bn.running_mean, rtol=1e-4, atol=1e-4
        )
        torch.testing.assert_close(
            torch.tensor(got[r]["running_var"]), bn.running_var, rtol=1e-4, atol=1e-4
        )


@pytest.mark.timeout(90)
def test_sync_batchnorm_worker_with_the_stand_in_equals_the_statistics_by_hand(runs, no_leftovers):
    """The worker of the notebook's GPU cell, on CPU: only the conversion differs (the seam)."""
    cfg = batchnorm.BatchNormConfig(backend="gloo", sync_layer="by_hand")
    worker = launch(batchnorm.sync_batchnorm_worker, cfg, 2, runs_dir=runs)
    by_hand = launch(batchnorm.batchnorm_by_hand_worker, cfg, 2, runs_dir=runs)
    got, stats = worker.wait(timeout=60).values, by_hand.wait(timeout=60).values
    inputs, bn, want = _combined_batchnorm(cfg)
    n = stats[0]["count"]
    for r in range(2):
        torch.testing.assert_close(torch.tensor(got[r]["out"]), torch.tensor(stats[r]["out"]))
        torch.testing.assert_close(
            torch.tensor(got[r]["running_mean"]), torch.tensor(stats[r]["mean"])
        )
        unbiased = torch.tensor(stats[r]["var"]) * n / (n - 1)
        torch.testing.assert_close(torch.tensor(got[r]["running_var"]), unbiased)
        torch.testing.assert_close(torch.tensor(got[r]["out"]), want[r], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(got[r]["running_var"]), bn.running_var)


def test_convert_by_hand_keeps_the_model_and_its_layers_state():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(nn.BatchNorm2d(4, momentum=0.3)))
    inner = model[1][0]
    with torch.no_grad():
        inner.weight.uniform_()
        inner.running_mean.fill_(2.0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    converted = batchnorm.convert_by_hand(model)
    assert converted is model and isinstance(model[1][0], batchnorm.SyncBatchNormByHand)
    assert model[1][0].momentum == 0.3
    torch.testing.assert_close(model.state_dict(), state)
    # without a process group it is plain BatchNorm2d
    x = torch.randn(5, 4, 6, 6)
    ref = nn.BatchNorm2d(4, momentum=0.3)
    ref.load_state_dict(inner.state_dict())
    torch.testing.assert_close(model[1][0](x), ref(x))


def test_torchs_layer_is_refused_on_cpu_before_training_and_the_stand_in_is_not():
    cpu_rank = env.DistContext(
        rank=0,
        local_rank=0,
        world_size=2,
        backend="gloo",
        device=torch.device("cpu"),
        initialized=True,
    )
    with pytest.raises(RuntimeError, match="SyncBatchNorm needs a CUDA GPU"):
        batchnorm.apply_sync_batchnorm(nn.BatchNorm2d(3), cpu_rank)
    layer = batchnorm.apply_sync_batchnorm(nn.BatchNorm2d(3), cpu_rank, "by_hand")
    assert isinstance(layer, batchnorm.SyncBatchNormByHand)


@pytest.fixture
def one_rank_group():
    """A gloo process group of world size 1 in this process (an in-memory store), removed after."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_stand_in_on_one_rank_is_batchnorm_and_refuses_a_gradient(one_rank_group):
    x = torch.randn(6, 3, 5, 5) * 2 + 1
    ref, layer = nn.BatchNorm2d(3, momentum=0.3), batchnorm.SyncBatchNormByHand(3, momentum=0.3)
    layer.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for _ in range(2):  # the running statistics move by the momentum each time
            torch.testing.assert_close(layer(x), ref(x))
    torch.testing.assert_close(layer.state_dict(), ref.state_dict())
    with pytest.raises(RuntimeError, match="forward pass only"):
        layer(x)  # the weight requires a gradient: the stand-in has no backward
