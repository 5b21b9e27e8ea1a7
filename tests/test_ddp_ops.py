"""What DDP adds to a step, op by op (mgtutorial/perf/ddp_ops.py, chapter 09b): the breakdown's
arithmetic on made-up tables, and a real 2-rank profile checked on its counts (which ops, how many
calls per step), never on durations."""

from __future__ import annotations

import math

import pytest

from mgtutorial import launch
from mgtutorial.perf import ddp_ops


def _table(training: dict, gloo: dict | None = None, step_s: float = 0.0, cpu_s=0.0) -> dict:
    return {"training": training, "gloo": gloo or {}, "step_s": step_s, "cpu_s": cpu_s}


def test_breakdown_sums_the_added_ops_and_the_shared_ones():
    lock = _table(
        {"aten::mm": (3, 0.010), "c10d::barrier": (1, 0.004), ddp_ops.BACKWARD: (1, 0.002)},
        step_s=0.020,
    )
    ddp = _table(
        {
            "aten::mm": (3, 0.012),  # shared, 2 ms slower
            "c10d::barrier": (1, 0.001),  # shared, 3 ms faster
            ddp_ops.BACKWARD: (1, 0.0025),  # shared, 0.5 ms slower: the wait at backward's end
            "c10d::allreduce_": (2, 0.005),
            "aten::copy_": (12, 0.0004),
            "mystery": (1, 0.0001),
        },
        {"gloo:all_reduce": (2, 0.0)},
        step_s=0.030,
        cpu_s=0.001,
    )
    b = ddp_ops.breakdown(lock, ddp)
    assert b["measured_cpu_s"] == pytest.approx(0.001)
    assert [r["name"] for r in b["added_ops"]] == ["c10d::allreduce_", "aten::copy_", "mystery"]
    assert [r["calls"] for r in b["added_ops"]] == [2, 12, 1]
    launches, own, (compute, barrier, backward) = (
        ddp_ops.GROUPS[0][0],
        ddp_ops.GROUPS[1][0],
        ddp_ops.SHARED,
    )
    assert list(b["groups"]) == [launches, own, "other", compute, barrier, backward]
    assert b["groups"][launches] == (2, 0.005)
    assert b["groups"][own] == (12, pytest.approx(0.0004))
    assert b["groups"][compute] == (0.0, pytest.approx(0.002))
    assert b["groups"][barrier] == (0.0, pytest.approx(-0.003))
    assert b["groups"][backward] == (0.0, pytest.approx(0.0005))
    assert b["accounted_s"] == pytest.approx(0.005 + 0.0004 + 0.0001 - 0.001 + 0.0005)
    assert b["measured_s"] == pytest.approx(0.010)
    assert b["unaccounted_s"] == pytest.approx(0.010 - 0.005)
    assert b["gloo"] == {"gloo:all_reduce": (2, 0.0)}


def test_runqueue_s_counts_up():
    a = ddp_ops.runqueue_s()
    assert ddp_ops.runqueue_s() >= a >= 0.0


def test_runqueue_s_is_nan_where_schedstat_is_missing(monkeypatch):
    import threading

    monkeypatch.setattr(threading, "get_native_id", lambda: -1)  # no such task: no file
    assert math.isnan(ddp_ops.runqueue_s())


def test_group_of_files_ddps_ops():
    assert ddp_ops.group_of("c10d::allreduce_") == ddp_ops.GROUPS[0][0]
    for name in ("DistributedDataParallel.forward", "torch::distributed::reducer::mul_out"):
        assert ddp_ops.group_of(name) == ddp_ops.GROUPS[1][0]
    assert ddp_ops.group_of("aten::mm") == "other"


def test_config_refuses_a_warmup_that_skips_the_rebuild():
    with pytest.raises(ValueError, match="warmup=1"):
        ddp_ops.OpsConfig(warmup=1).validate(2)


def test_paired_breakdown_keeps_means_that_add_up_and_checks_the_counts():
    lock = [_table({"aten::mm": (3, 0.010)}, step_s=0.020 + k / 1000) for k in range(3)]
    ddp = [
        _table({"aten::mm": (3, 0.011), "c10d::allreduce_": (2, 0.001 * (k + 1))}, step_s=0.025)
        for k in range(3)
    ]
    b = ddp_ops.paired_breakdown(lock, ddp)
    assert b["pairs"] == 3 and b["counts_agree"]
    assert b["groups"][ddp_ops.GROUPS[0][0]] == (2, pytest.approx(0.002))  # mean of 1, 2, 3 ms
    assert b["measured_s"] == pytest.approx(0.004)  # mean of 5, 4, 3 ms
    lines = sum(s for _, s in b["groups"].values())
    assert lines == pytest.approx(b["accounted_s"])
    assert lines + b["unaccounted_s"] == pytest.approx(b["measured_s"])  # the table adds up
    ddp[1]["training"]["c10d::allreduce_"] = (3, 0.001)
    assert not ddp_ops.paired_breakdown(lock, ddp)["counts_agree"]


@pytest.mark.timeout(180)
def test_a_real_profile_counts_what_ddp_adds(runs, no_leftovers):
    cfg = ddp_ops.OpsConfig(batch_size=4, pairs=2)
    values = launch(ddp_ops.ddp_ops_worker, cfg, 2, runs_dir=runs).wait(timeout=150).values
    for rank, got in values.items():
        assert got["rank"] == rank and len(got["lockstep"]) == len(got["ddp"]) == 2
        b = ddp_ops.paired_breakdown(got["lockstep"], got["ddp"])
        assert b["counts_agree"] and all(s["cpu_s"] > 0 for s in got["ddp"])
        assert all(s["runqueue_s"] >= 0 for s in got["ddp"] + got["lockstep"])
        calls = {r["name"]: r["calls"] for r in b["added_ops"]}
        # two buckets (fc2 + fc1, then conv1): one launch and one gloo all-reduce each, per step
        assert calls["c10d::allreduce_"] == 2
        assert b["gloo"]["gloo:all_reduce"][0] == 2
        assert calls["DistributedDataParallel.forward"] == 1
        # six gradients: each averaged into its bucket, and copied back after the all-reduce
        assert calls["torch::distributed::reducer::mul_out"] == 6
        assert calls["torch.distributed.ddp.reducer::copy_bucket_to_grad"] == 6
        for step in got["lockstep"]:
            assert "c10d::allreduce_" not in step["training"]
            assert step["training"]["c10d::barrier"][0] == 1  # the barrier that ends the step
            assert step["training"][ddp_ops.BACKWARD][0] == 1
