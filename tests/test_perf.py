"""Chapter 09: the cost model's and the scaling arithmetic on hand-computed cases, the α–β fit, and
the profiler trace and sweeps of real 2-rank runs (their values and counts, never their
durations)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
import workers
from torch.utils.flop_counter import FlopCounterMode

from mgtutorial import launch
from mgtutorial.common import models
from mgtutorial.perf import costmodel, scaling, sweeps, timing
from mgtutorial.sharding import memory
from mgtutorial.tensor_parallel import cost

MIB = 1024 * 1024


def test_alpha_beta_fit_recovers_known_values():
    alpha, beta = 50e-6, 1e-9  # 50 µs, 1 GB/s
    sizes = [4096 * 4**i for i in range(8)]
    exact = [alpha + beta * s for s in sizes]
    a, b = costmodel.fit_alpha_beta(sizes, exact)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)
    rng = random.Random(0)
    noisy = [t * (1 + rng.uniform(-0.03, 0.03)) for t in exact]
    a, b = costmodel.fit_alpha_beta(sizes, noisy)
    assert a == pytest.approx(alpha, rel=0.1) and b == pytest.approx(beta, rel=0.1)


def test_alpha_beta_fit_refuses_bad_input():
    with pytest.raises(ValueError, match="≥ 2"):
        costmodel.fit_alpha_beta([1.0], [1.0])
    with pytest.raises(ValueError, match="equal"):
        costmodel.fit_alpha_beta([8.0, 8.0], [1.0, 2.0])


@pytest.mark.parametrize(
    "op, n, factor",
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 4, 1.5),
        ("all_reduce", 8, 1.75),
        ("all_reduce", 1, 0.0),
        ("all_gather", 2, 0.5),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 8, 0.875),
        ("broadcast", 2, 1.0),
        ("broadcast", 8, 1.0),
    ],
)
def test_bus_factors_are_nccl_tests(op, n, factor):
    assert costmodel.bus_factor(op, n) == pytest.approx(factor)


def test_bandwidths_and_errors():
    assert costmodel.algbw(MIB, 1e-3) == pytest.approx(1.048576e9)
    assert costmodel.busbw("all_reduce", MIB, 1e-3, 4) == pytest.approx(1.5 * 1.048576e9)
    with pytest.raises(ValueError, match="not one of"):
        costmodel.bus_factor("alltoall", 2)
    with pytest.raises(ValueError, match="at least 1"):
        costmodel.bus_factor("all_reduce", 0)
    with pytest.raises(ValueError, match="positive"):
        costmodel.algbw(10, 0.0)


def test_ring_time_by_hand():
    assert costmodel.ring_time("all_reduce", 400, 1, 100, 1) == 0.0
    assert costmodel.ring_time("all_reduce", 400, 4, 100, 1) == pytest.approx(
        6 + 1.5 * 4
    )  # 2(n−1) steps
    assert costmodel.ring_time("all_gather", 400, 4, 100, 1) == pytest.approx(3 + 0.75 * 4)


def test_bucket_layout_by_hand():
    cnn = [40, 2560, 256, 1_605_632, 128, 9600]  # the article's CNN, backward order
    assert costmodel.bucket_layout(cnn, 25 * MIB, MIB) == [1_608_488, 9728]
    assert costmodel.bucket_layout([3, 3, 3, 3], 5) == [6, 6]
    # a gradient larger than the cap: its own bucket
    assert costmodel.bucket_layout([10, 1, 1], 5) == [10, 2]
    assert costmodel.bucket_layout([1, 1], 100) == [2]


def test_step_time_model_by_hand():
    # buckets of 1 and 3 bytes, α = 0.5 s, β = 1 s/byte, backward 4 s:
    # bucket 0 ready at 1 s, done at 2.5 s; bucket 1 ready at 4 s, done at 7.5 s → 3.5 s exposed
    t = costmodel.ddp_step_time(1.0, 4.0, 0.5, [1, 3], alpha=0.5, beta=1.0)
    assert t == pytest.approx(
        {"step": 9.0, "compute": 5.5, "comm": 5.0, "exposed": 3.5, "hidden": 1.5}
    )
    t = costmodel.ddp_step_time(
        1.0, 4.0, 0.5, [1, 3], alpha=0.5, beta=1.0, overlap=False, extra_s=0.25
    )
    assert t["exposed"] == pytest.approx(5.0) and t["step"] == pytest.approx(10.75)
    assert costmodel.ddp_step_time(1.0, 4.0, 0.5, [], 0.5, 1.0)["step"] == pytest.approx(5.5)
    # bucket 0 ready after half of backward (2 s), done at 3.5 s; bucket 1 at 4 s, done 7.5 s
    t = costmodel.ddp_step_time(1.0, 4.0, 0.5, [1, 3], alpha=0.5, beta=1.0, ready=[0.5, 1.0])
    assert (t["exposed"], t["hidden"]) == pytest.approx((3.5, 1.5))
    # bucket 0 ready at 1 s, done at 4.5 s; bucket 1 ready at 10 s, done at 11.5 s
    t = costmodel.ddp_step_time(1.0, 10.0, 0.0, [3, 1], alpha=0.5, beta=1.0, ready=[0.1, 1.0])
    assert (t["exposed"], t["step"]) == pytest.approx((1.5, 12.5))


def test_ddp_added_time_by_hand():
    # buckets of 1 and 3 bytes, α = 0.5 s, β = 1 s/byte: 1.5 + 3.5 = 5 s of all-reduces, none
    # hidden; plus 0.25 s of DDP's own work
    t = costmodel.ddp_added_time([1, 3], alpha=0.5, beta=1.0, own_s=0.25)
    assert t == pytest.approx({"all_reduces": 5.0, "own": 0.25, "added": 5.25})
    # one bucket of the same 4 bytes pays α once: 4.5 s
    assert costmodel.ddp_added_time([4], 0.5, 1.0, 0.0)["added"] == pytest.approx(4.5)
    assert costmodel.ddp_added_time([], 0.5, 1.0, 0.1)["added"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="own_s=-0.1"):
        costmodel.ddp_added_time([1], 0.5, 1.0, -0.1)


def test_added_verdict_on_constructed_numbers():
    assert costmodel.added_verdict(2.0, 3.0, 2.5).startswith("not resolved")  # noise ≥ the term
    assert costmodel.added_verdict(2.0, 9.0, 2.5) == "✗ model below"  # a miss beyond the noise
    assert costmodel.added_verdict(2.0, 2.2, 0.1) == "✓"  # within 15 %
    assert costmodel.added_verdict(2.0, 2.5, 0.3) == "✓"  # within 15 % + the spread
    assert costmodel.added_verdict(2.0, 3.0, 0.1) == "✗ model below"
    assert costmodel.added_verdict(2.0, 1.0, 0.1) == "✗ model above"


def test_own_config_refuses_more_than_one_rank_and_bad_sizes():
    with pytest.raises(ValueError, match="nprocs=2"):
        sweeps.OwnConfig().validate(2)
    with pytest.raises(ValueError, match="batch_size=0"):
        sweeps.OwnConfig(batch_size=0).validate(1)


@pytest.mark.timeout(120)
def test_ddp_own_worker_reports_its_terms(runs, no_leftovers):
    got = (
        launch(sweeps.ddp_own_worker, sweeps.OwnConfig(repeats=5), 1, runs_dir=runs)
        .wait(timeout=100)
        .values[0]
    )
    assert set(got) == {
        "batch_size",
        "plain_s",
        "own_s",
        "own_raw_s",
        "own_wall_s",
        "fwd_s",
        "bwd_s",
        "opt_s",
    }
    assert got["batch_size"] == 1 and got["plain_s"] > 0
    assert got["own_s"] == max(0.0, got["own_raw_s"])  # clamped only where the median is < 0
    # every term measured, none missing or infinite; each per-phase term is a median of
    # differences (DDP − plain) and may be below 0 under load, and how large they are is a
    # measurement of this machine at this moment, so no test compares them
    assert all(math.isfinite(got[k]) for k in got)


def test_flops_match_torch_flop_counter():
    model = models.ArticleCNN(in_shape=(3, 32, 32))
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(4, 3, 32, 32))
    assert scaling.article_cnn_flops(4) == counter.get_total_flops()
    assert scaling.train_flops(10) == 30


TOY = costmodel.Hardware(
    name="toy",
    peak_flops=1e4,
    intra_bw=100.0,
    inter_bw=10.0,
    gpus_per_node=2,
    latency=0.0,
    sources="test",
)


def test_one_dtype_table_prices_07_08_and_09():
    assert costmodel.FP32.per_param == (4, 4, 8)
    assert costmodel.ZERO_MIXED.per_param == (2, 2, 12)
    amp = costmodel.BF16_FP32_REDUCE  # chapter 07's reduce_dtype=float32, DDP under autocast
    assert amp.per_param == (4, 4, 8) and (amp.nbytes("compute"), amp.nbytes("grads")) == (2, 4)
    assert memory.BYTES_PER_PARAM == {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}
    big = cost.comm_bytes(b=1, s=8, h=4, ffn=16, tp=2)
    assert big["ddp_step"] == 4 * big["params"] and big["tp_forward"] == 2 * 8 * 4 * 2
    assert cost.comm_bytes(b=1, s=8, h=4, ffn=16, tp=2, elem=2)["ddp_step"] == 2 * big["params"]


def test_mfu_counts_attention_as_palm_does():
    assert scaling.mfu(params=1e6, tokens=1e3, seconds=1.0, peak_flops=1.2e10) == pytest.approx(0.5)
    per_token = scaling.model_flops_per_token(1e6, layers=2, hidden=10, seq=50)
    assert per_token == 6e6 + 12 * 2 * 10 * 50
    got = scaling.mfu(1e6, 1e3, 1.0, 1.2e10, attention_flops_per_token=per_token - 6e6)
    assert got == pytest.approx(per_token * 1e3 / 1.2e10)


def test_ring_bandwidth_is_one_model_for_every_group():
    hw = costmodel.H100
    assert hw.ring_bw(8) == 450e9 and hw.ring_bw(16) == 400e9  # 8 NDR ports × 50 GB/s
    assert hw.ring_bw(8, per_node=1) == 50e9  # one GPU per node: its port's share
    one_port = dataclasses.replace(hw, nics_per_node=1)
    assert one_port.ring_bw(64) == 50e9 and one_port.ring_bw(8, per_node=1) == 50e9 / 8
    assert hw.ring_bw(4, per_node=4) == 450e9  # four GPUs of one node


def test_cluster_predictions_by_hand():
    model, hw = scaling.Transformer(layers=2, hidden=10, seq=4), TOY
    assert model.params == 12 * 2 * 100
    # compute = 6·2400·1/(1e4·0.5) = 2.88 s; DDP all-reduce of 2400 fp32 gradients = 9600 bytes
    # on 2 GPUs at 100 B/s = 96 s
    ddp = scaling.predict_step("ddp", model, 2, 1, hw)
    assert ddp["compute"] == pytest.approx(2.88) and ddp["comm"] == pytest.approx(96.0)
    assert ddp["exposed"] == pytest.approx(96.0 - 2.88 * 2 / 3)
    assert ddp["efficiency"] == pytest.approx(2.88 / (2.88 + 96.0 - 1.92))
    # every tensor at 2 bytes, as before the dtype table: 48 s
    assert scaling.predict_step("ddp", model, 2, 1, hw, bytes_per_value=2)["comm"] == 48.0
    # beyond a node: 10 B/s; 2 all-gathers of 4800 bf16 bytes + a reduce-scatter of 9600 fp32
    fsdp = scaling.predict_step("fsdp2", model, 4, 1, hw)
    assert fsdp["comm"] == pytest.approx(0.75 * (2 * 4800 + 9600) / 10)
    # TP inside the node of 2 × FSDP2 over 2 nodes (one GPU per node: half the node's port)
    tp = scaling.predict_step("tp", model, 4, 1, hw)
    act = 2 * 1 * 2 * 10  # bf16, 1 token per GPU × the TP group's 2 GPUs × hidden
    tp_comm = 4 * 2 * act / 100  # 8 all-reduces over 2 GPUs: 2(n−1)/n = 1
    assert (tp["tp"], tp["dp"]) == (2, 2)
    assert tp["comm"] == pytest.approx(tp_comm + 0.5 * (2 * 2400 + 4800) / 5)
    assert tp["exposed"] == pytest.approx(tp_comm + tp["comm"] - tp_comm - 2.88)
    assert scaling.predict_step("ddp", model, 1, 1, hw)["efficiency"] == 1.0
    two_ports = costmodel.Hardware(**{**vars(hw), "nics_per_node": 2})
    assert [two_ports.ring_bw(n) for n in (2, 4)] == [100.0, 20.0]
    assert scaling.predict_step("fsdp2", model, 4, 1, two_ports)["comm"] == pytest.approx(720.0)
    assert costmodel.Hardware(**{**vars(hw), "nics_per_node": 50}).ring_bw(4) == 100.0
    with pytest.raises(ValueError, match="strategy"):
        scaling.predict_step("zero3", model, 2, 1, hw)
    with pytest.raises(ValueError, match="tp_degree=3"):
        scaling.predict_step("tp", model, 4, 1, hw, tp_degree=3)


def test_closed_forms_agree_with_predict_step():
    hw, model = costmodel.H100, scaling.Transformer(layers=24, hidden=2048)
    free = dataclasses.replace(hw, latency=0.0)
    for strategy in ("ddp", "fsdp2"):
        t = scaling.crossover_tokens(strategy, 64, 50e9, free)
        at = scaling.predict_step(strategy, model, 64, t, free, link_bw=50e9)
        assert at["exposed"] == pytest.approx(0.0, abs=1e-12)
        above = scaling.predict_step(strategy, model, 64, 0.9 * t, free, link_bw=50e9)
        assert above["exposed"] > 0
    ratio = scaling.tp_comm_ratio(8, 2048, hw.ring_bw(8), free)
    tp = scaling.predict_step("tp", model, 8, 2048, free)
    assert tp["exposed"] / tp["compute"] == pytest.approx(ratio)


def test_matmul_peak_is_a_median_at_the_size_that_saturates(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine: still the CPU
    mp = timing.matmul_peak(sizes=(16, 32, 64), repeats=9)
    assert mp["n"] == max(mp["by_size"], key=mp["by_size"].get)  # the best median of 5 calls
    q1, q3 = mp["quartiles"]
    assert q1 <= mp["flops"] <= q3 <= mp["best"]  # the median of 9 lies between its quartiles


def test_lockstep_time_waits_for_the_slowest_rank():
    # step by step the slower of the two ranks: [3, 4, 5] → median 4 (each rank's median is 2 or 3)
    assert scaling.lockstep_time([[1.0, 4.0, 2.0], [3.0, 2.0, 5.0]]) == 4.0
    assert scaling.lockstep_time([[1.0, 4.0, 2.0], [3.0, 2.0, 5.0]], stat=min) == 3.0


def test_summarize():
    s = timing.summarize([3.0, 1.0, 2.0, 4.0, 5.0])
    assert (s["median"], s["min"], s["max"]) == (3.0, 1.0, 5.0) and s["iqr"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a CUDA GPU")
def test_cuda_events_time_a_kernel():
    a = torch.randn(1024, 1024, device="cuda")
    assert all(t > 0 for t in timing.time_cuda_events(lambda: a @ a, repeats=3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cuda_events_without_cuda_name_the_cpu_timer():
    with pytest.raises(RuntimeError, match="CUDA events need a CUDA GPU; on CPU use time_op"):
        timing.time_cuda_events(lambda: None)


def test_bad_sweep_and_step_configs_refused_before_start(runs):
    with pytest.raises(ValueError, match="alltoall"):
        launch(sweeps.sweep_worker, sweeps.SweepConfig(ops=["alltoall"]), 2, runs_dir=runs)
    with pytest.raises(ValueError, match="lr"):
        launch(sweeps.step_worker, sweeps.StepConfig(variants=[{"lr": 1.0}]), 2, runs_dir=runs)
    with pytest.raises(ValueError, match="mode one of"):
        launch(sweeps.step_worker, sweeps.StepConfig(variants=[{"mode": "solo"}]), 2, runs_dir=runs)
    assert not list(runs.iterdir())


@pytest.mark.timeout(240)
def test_profiled_ddp_step_has_one_all_reduce_per_bucket(runs, no_leftovers):
    cfg = sweeps.StepConfig(
        dataset="synthetic",
        backend="gloo",
        warmup=1,
        steps=2,
        profile=True,
        variants=[{"batch_size": 8}, {"batch_size": 4}],
    )
    result = launch(sweeps.step_worker, cfg, 2, runs_dir=runs).wait(timeout=200)
    for rank in (0, 1):
        value, second = result.values[rank]
        # the profiled step is not timed
        assert "trace" not in second and len(value["step_times"]) == 2
        events = timing.trace_events(value["trace"])
        comm = [e for e in events if e["kind"] == "all_reduce"]
        backward = [e for e in events if e["kind"] == "backward"]
        buckets = costmodel.bucket_layout(value["grad_bytes"], 25 * MIB, MIB)
        assert [e["name"] for e in comm] == ["gloo:all_reduce"] * len(buckets)
        # each bucket's all-reduce is launched during backward (DDP's hook, on the training thread);
        # when gloo's thread runs it depends on free cores, so its start is not asserted
        launches = [e for e in events if e["kind"] == "all_reduce_launch"]
        backward_end = max(e["start"] + e["dur"] for e in backward)
        assert len(comm) == 2 and len(launches) == 2
        assert all(min(e["start"] for e in backward) < e["start"] < backward_end for e in launches)
        assert sum(e["kind"] == "forward" for e in events) == 1


@pytest.mark.timeout(240)
def test_sweep_and_step_workers_report_every_point(runs, no_leftovers):
    sweep = launch(
        sweeps.sweep_worker,
        sweeps.SweepConfig(sizes=[4096, 65536], repeats=2, backend="gloo"),
        2,
        runs_dir=runs,
    )
    steps = launch(
        sweeps.step_worker,
        sweeps.StepConfig(
            dataset="synthetic",
            backend="gloo",
            warmup=1,
            steps=3,
            variants=[{"batch_size": 8}, {"batch_size": 4, "static_graph": True}],
        ),
        2,
        runs_dir=runs,
    )
    alone = launch(
        sweeps.step_worker,
        sweeps.StepConfig(
            dataset="synthetic",
            backend="gloo",
            warmup=1,
            steps=2,
            variants=[
                {"batch_size": 8, "mode": "alone"},
                {"batch_size": 8, "mode": "independent"},
                {"batch_size": 8, "mode": "lockstep"},
            ],
        ),
        2,
        runs_dir=runs,
    )
    records = sweep.wait(timeout=200).values[0]
    assert [(r["op"], r["nbytes"]) for r in records] == [
        (op, s) for op in costmodel.COLLECTIVES for s in (4096, 65536)
    ]
    assert all(len(r["times"]) == 2 and r["world_size"] == 2 for r in records)
    assert all(0 < r["cpu_min_s"] for r in records)  # the process's CPU time of a call
    variants = steps.wait(timeout=200).values[1]
    assert [(v["batch_size"], v.get("static_graph"), len(v["step_times"])) for v in variants] == [
        (8, None, 2),
        (4, True, 2),
    ]
    assert all(v["world_size"] == 2 for v in variants)
    assert all(len(v["cpu_times"]) == len(v["step_times"]) for v in variants)
    # the training thread's CPU is part of the process's, step by step
    assert all(
        len(v["thread_cpu_times"]) == len(v["cpu_times"])
        and all(0 < t <= c + 1e-3 for t, c in zip(v["thread_cpu_times"], v["cpu_times"]))
        for v in variants
    )
    assert all(0 < v["fwd_cpu_s"] and 0 < v["bwd_cpu_s"] for v in variants)
    alone = alone.wait(timeout=200).values
    idle = alone[1][0]  # rank 1 waited from rank 0's start to its end, building nothing
    assert {k: v for k, v in idle.items() if k != "idle_cpu_s"} == {
        "batch_size": 8,
        "mode": "alone",
        "idle": True,
    }
    assert 0 <= idle["idle_cpu_s"] < sum(alone[0][0]["cpu_times"])  # less than rank 0 trained
    trained_alone = [alone[0][0], alone[0][1], alone[1][1], alone[0][2], alone[1][2]]
    assert [v["world_size"] for v in trained_alone] == [1, 1, 1, 1, 1]
    # lockstep: a barrier after every step, so the ranks' step starts stay together
    assert len(alone[0][2]["step_times"]) == len(alone[1][2]["step_times"]) == 1


def test_scaling_ratios_by_hand():
    def runs(mode, *rates, **extra):
        return [
            {"batch_size": b, "mode": mode, "samples_per_s": r, **extra}
            for b, r in zip((32, 64), rates)
        ]

    values = {
        0: runs("alone", 100, 200)
        + runs("independent", 90, 190)
        + runs("ddp", 60, 180)
        + runs("ddp", 1, 1, static_graph=True),
        1: [{"batch_size": b, "mode": "alone", "idle": True} for b in (32, 64)]
        + runs("independent", 100, 190)
        + runs("ddp", 60, 180)
        + runs("ddp", 1, 1, static_graph=True),
    }
    rows = scaling.scaling_ratios(values)
    assert rows == [
        {
            "batch_size": 32,
            "ceiling_2v1": 1.9,
            "scaling_2v1": 1.2,
            "fraction": pytest.approx(1.2 / 1.9),
        },
        {
            "batch_size": 64,
            "ceiling_2v1": 1.9,
            "scaling_2v1": 1.8,
            "fraction": pytest.approx(1.8 / 1.9),
        },
    ]


@pytest.mark.timeout(240)
def test_gloo_reduce_scatter_is_an_all_reduce(runs, no_leftovers):
    """What chapters 07a and 09a say of gloo: reduce_scatter_single all-reduces the input."""
    jobs = {
        op: launch(
            workers.profiled_collective, workers.ProfiledCollectiveConfig(op=op), 2, runs_dir=runs
        )
        for op in ("reduce_scatter", "all_gather")
    }
    names = {op: job.wait(timeout=200).values for op, job in jobs.items()}
    assert names["reduce_scatter"] == {0: ["gloo:all_reduce"], 1: ["gloo:all_reduce"]}
    assert names["all_gather"] == {0: ["gloo:all_gather"], 1: ["gloo:all_gather"]}
