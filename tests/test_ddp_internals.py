"""Chapter 03b: DDP's default buckets and their timing, Join's gradient scale, SyncBatchNorm by hand
(gloo, 2 ranks), each against an independent computation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mgtutorial import launch
from mgtutorial.common import models
from mgtutorial.ddp import internals as DI
from mgtutorial.runtime import runlog

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
    default = launch(DI.hooks_worker, DI.HooksConfig(**COMMON), 2, runs_dir=runs)
    unused = launch(
        DI.hooks_worker, DI.HooksConfig(find_unused_parameters=True, **COMMON), 2, runs_dir=runs
    )
    static = launch(DI.hooks_worker, DI.HooksConfig(static_graph=True, **COMMON), 2, runs_dir=runs)
    default.wait(timeout=60), unused.wait(timeout=60), static.wait(timeout=60)
    sizes, cap = (
        [p.numel() for p in models.ArticleCNN().parameters()],
        torch.distributed._DEFAULT_FIRST_BUCKET_BYTES,
    )
    rebuilt = _buckets(
        sizes[::-1], cap
    )  # rebuilt in the order the gradients became ready (reverse)
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
    run = launch(DI.hooks_worker, DI.HooksConfig(bucket_cap_mb=0.5, **COMMON), 2, runs_dir=runs)
    run.wait(timeout=40)
    for rec in _syncs(run):
        assert len(rec["bucket_launched"]) == len(rec["bucket_done"]) == rec["allreduce_calls"]
        assert rec["backward_start"] <= rec["bucket_launched"][0]
        for launched, done in zip(rec["bucket_launched"], rec["bucket_done"]):
            assert (
                launched <= done <= rec["backward_end"]
            )  # gloo: backward() waits for every bucket


@pytest.mark.timeout(90)
def test_join_divides_the_trained_ranks_gradient(runs, no_leftovers):
    ratios = {}
    for initial in (True, False):
        cfg = DI.PitfallConfig(
            extra_batches_last_rank=2,
            use_join=True,
            divide_by_initial_world_size=initial,
            backend="gloo",
            **COMMON,
        )
        run = launch(DI.pitfall_worker, cfg, 2, runs_dir=runs)
        assert run.wait(timeout=60).values == {0: {"steps": 4}, 1: {"steps": 6}}
        ratios[initial] = {
            r["step"]: r["ratio"]
            for r in runlog.read_run(run.run_dir)
            if r.get("kind") == "grad_scale" and r["rank"] == 1
        }
    for step in (5, 6):  # rank 0 has joined: its zeros count (True) or not (False)
        assert ratios[True][step] == pytest.approx(0.5, rel=1e-5)
        assert ratios[False][step] == pytest.approx(1.0, rel=1e-5)
    assert all(
        abs(ratios[True][s] - 0.5) > 1e-3 for s in range(1, 5)
    )  # both ranks trained: not half


def _combined_batchnorm(cfg):
    """Plain BatchNorm2d in one process on both ranks' inputs together: (inputs, layer, outputs per rank)."""
    inputs = [DI.batchnorm_inputs(cfg, r) for r in range(2)]
    bn = nn.BatchNorm2d(cfg.channels, momentum=1.0, affine=False)
    return inputs, bn, bn(torch.cat(inputs)).split([len(x) for x in inputs])


@pytest.mark.timeout(60)
def test_batchnorm_by_hand_equals_batchnorm_on_the_combined_batch(runs, no_leftovers):
    cfg = DI.BatchNormConfig(backend="gloo")
    got = launch(DI.batchnorm_by_hand_worker, cfg, 2, runs_dir=runs).wait(timeout=40).values
    inputs, bn, want = _combined_batchnorm(cfg)
    n = sum(len(x) for x in inputs) * 16
    for r in range(2):
        torch.testing.assert_close(torch.tensor(got[r]["out"]), want[r], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(got[r]["mean"]), bn.running_mean)
        torch.testing.assert_close(
            torch.tensor(got[r]["var"]) * n / (n - 1), bn.running_var
        )  # unbiased
        assert got[r]["count"] == n
    plain = nn.BatchNorm2d(cfg.channels, affine=False)(
        inputs[1]
    )  # the control: one rank's statistics
    assert (plain - want[1]).abs().max() > 0.1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="SyncBatchNorm needs 2 CUDA GPUs (NCCL)")
@pytest.mark.timeout(120)
def test_sync_batchnorm_on_gpus_equals_batchnorm_on_the_combined_batch(runs, no_leftovers):
    cfg = DI.BatchNormConfig(backend="nccl")
    got = launch(DI.sync_batchnorm_worker, cfg, 2, runs_dir=runs).wait(timeout=90).values
    _, bn, want = _combined_batchnorm(cfg)
    for r in range(2):
        torch.testing.assert_close(torch.tensor(got[r]["out"]), want[r], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(
            torch.tensor(got[r]["running_mean"]), bn.running_mean, rtol=1e-4, atol=1e-4
        )
        torch.testing.assert_close(
            torch.tensor(got[r]["running_var"]), bn.running_var, rtol=1e-4, atol=1e-4
        )
