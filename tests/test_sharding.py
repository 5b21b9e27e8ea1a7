"""Chapter 07: memory formula vs tensors held, ZeRO by hand, FSDP2, collectives, checkpoints,
refusals.

Two launches in all (2 ranks, then 4 ranks loading what the 2 saved); each returns every check's
numbers, which the tests below assert on.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mgtutorial import launch
from mgtutorial.runtime import env
from mgtutorial.sharding import checkpoint, fsdp, memory, model
from mgtutorial.sharding.worker import ShardConfig, worker

TOL = dict(rtol=1e-5, atol=1e-6)
CFG = dict(blocks=2, width=10, out_features=3, batch_size=8, steps=3)


def shapes(cfg=None):
    return [p.shape for p in model.make_model(cfg or ShardConfig(**CFG)).parameters()]


# --- the formula, without processes -----------------------------------------------------------


def test_formula_without_padding_is_the_textbook_one():
    sh, n = [(8, 4), (8,), (4, 8)], 4
    psi = sum(math.prod(s) for s in sh)

    def total(scheme, prec="fp32"):
        return memory.memory_per_rank(sh, n, scheme, prec)["total"]

    assert total("ddp") == total("ddp", "mixed") == 16 * psi
    assert total("zero1") == 8 * psi + 8 * psi // n
    assert total("zero2") == 4 * psi + 12 * psi // n
    assert total("zero3") == 16 * psi // n
    assert total("zero1", "mixed") == 4 * psi + 12 * psi // n
    assert memory.memory_per_rank(sh, 1, "zero3")["total"] == 16 * psi


def test_formula_counts_padding_like_torch_chunk():
    sh, n = shapes(), 4
    owned = [
        sum(
            torch.empty(s).chunk(n)[r].numel() if len(torch.empty(s).chunk(n)) > r else 0
            for s in sh
        )
        for r in range(n)
    ]
    padded = sum(torch.empty(s).chunk(n)[0].numel() for s in sh)
    for r in range(n):
        m = memory.memory_per_rank(sh, n, "zero3", rank=r)
        assert (m["params"], m["grads"], m["optimizer"]) == (4 * padded, 4 * padded, 8 * owned[r])
    assert owned[0] > owned[-1]  # the last rank owns fewer rows (and none of the head's 3)
    psi = sum(math.prod(s) for s in sh)
    assert memory.memory_per_rank(sh, n, "zero1")["params"] == 4 * n * -(-psi // n) > 4 * psi


def test_formula_refuses_bad_input():
    with pytest.raises(ValueError, match="scheme"):
        memory.memory_per_rank([(4,)], 2, "zero4")
    with pytest.raises(ValueError, match="rank"):
        memory.memory_per_rank([(4,)], 2, "ddp", rank=2)


def test_calculator_draws_from_the_formula():
    fig = memory.memory_figure(memory.memory_table([(1000,)]))
    heights = sorted(round(b.get_height()) for b in fig.axes[0].patches)
    want = sorted(r[k] for r in memory.memory_table([(1000,)]) for k in memory.PARTS)
    assert heights == want
    # builds the sliders and draws (no handle outside IPython)
    memory.calculator(params_billions=1.0, ranks=4)


# --- refusals before any rank starts ------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, nprocs, match",
    [
        (dict(batch_size=6), 4, "batch_size=6"),
        (dict(mesh_device="cuda"), 2, "mesh_device='cuda' does not match backend 'gloo'"),
        (dict(parts=["zero", "fdsp"]), 2, "parts=.*must be one of 'zero', 'fsdp'"),
        (dict(reduce="mean"), 2, "reduce='mean': must be one of 'avg'"),
        (dict(parts=["save"]), 2, "checkpoint_dir"),
    ],
)
def test_bad_config_refused_before_launch(kw, nprocs, match, runs, no_leftovers):
    with pytest.raises(ValueError, match=match):
        launch(worker, ShardConfig(backend="gloo", **kw), nprocs, runs_dir=runs)
    assert not list(runs.iterdir())  # no run directory: nothing started


# a one-process save, on purpose
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_of_another_shape_names_the_tensor(tmp_path):
    saved = model.make_model(ShardConfig(**CFG)).state_dict()
    dcp.save({"model": saved}, checkpoint_id=str(tmp_path), no_dist=True)
    wider = model.make_model(ShardConfig(**{**CFG, "width": 12}))
    with pytest.raises(ValueError, match=r"'blocks.0.lin.weight'.*\(10, 10\).*\(12, 12\)"):
        checkpoint.load_dcp(wider, tmp_path)
    deeper = model.make_model(ShardConfig(**{**CFG, "blocks": 3}))
    with pytest.raises(ValueError, match="'blocks.2.lin.weight'"):
        checkpoint.load_dcp(deeper, tmp_path)


# --- two ranks, then four -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def two(tmp_path_factory, ckpt):
    cfg = ShardConfig(
        parts=["zero", "fsdp", "counts", "mixed", "meta", "save"], checkpoint_dir=str(ckpt), **CFG
    )
    return launch(worker, cfg, 2, runs_dir=tmp_path_factory.mktemp("runs")).wait(timeout=240).values


@pytest.fixture(scope="module")
def four(tmp_path_factory, ckpt, two):
    cfg = ShardConfig(parts=["zero", "fsdp", "load", "practice"], checkpoint_dir=str(ckpt), **CFG)
    return launch(worker, cfg, 4, runs_dir=tmp_path_factory.mktemp("runs")).wait(timeout=400).values


def _check_parity_and_memory(values):
    n = len(values)
    for r, v in values.items():
        diffs = {**v["zero"]["max_diff"], **v["fsdp"]["max_diff"]}
        assert set(diffs) >= {
            "zero1",
            "zero2",
            "ddp",
            "zero_redundancy",
            "zero1_vs_zero_redundancy",
            "fsdp_vs_one_process",
            "fsdp_vs_ddp",
            "loss_vs_one_process",
        }
        assert max(diffs.values()) < 1e-5, diffs
        measured = {**v["zero"]["memory"], **v["fsdp"]["memory"]}
        for scheme in memory.SCHEMES:
            predicted = memory.memory_per_rank(shapes(), n, scheme, rank=r)
            assert measured[scheme] == predicted, (scheme, n, r)
        # ZeRO's reduced slice == that slice of one process's gradients
        assert v["zero"]["first_grad_diff"] < 1e-6
        # AdamW hides a missing ÷ N in the parameters
        assert v["fsdp"]["sum_params_vs_one_process"] < 1e-5
        g = v["fsdp"]["first_grads"]
        assert (
            g["avg"]["vs_mean"] < 1e-6 < 1e-2 < g["avg"]["vs_sum"]
        )  # torch 2.14.1 averages on gloo
        assert (
            g["sum_then_divide"]["vs_mean"] < 1e-6
            and g["sum"]["vs_sum"] < 1e-6 < 1e-2 < g["sum"]["vs_mean"]
        )
        assert all(
            pl == ["(Shard(dim=0),)", pl[1], "DTensor"] for pl in v["fsdp"]["placements"].values()
        )
    psi = sum(math.prod(s) for s in shapes())
    assert (
        sum(v["zero"]["memory"]["zero_redundancy"]["optimizer"] for v in values.values()) == 8 * psi
    )


@pytest.mark.timeout(300)
def test_two_ranks_equal_one_process_and_formula(two, no_leftovers):
    _check_parity_and_memory(two)


@pytest.mark.timeout(500)
def test_four_ranks_equal_one_process_and_formula(four, no_leftovers):
    _check_parity_and_memory(four)
    heads = [v["fsdp"]["placements"]["head.weight"][1] for v in four.values()]
    assert heads == [[1, 10], [1, 10], [1, 10], [0, 10]]


@pytest.mark.timeout(300)
def test_collectives_counted_equal_predicted(two, no_leftovers):
    rows = two[0]["counts"]
    assert {(r["blocks"], r["reshard_after_forward"]) for r in rows} == {
        (b, f) for b in (1, 2, 3) for f in (True, None, False)
    }
    for r in rows:
        assert (
            r["counted"]
            == r["predicted"]
            == fsdp.predicted_collectives(r["blocks"], r["reshard_after_forward"])
        )
    block = 4 * (10 * 10 + 10)
    head = 4 * (3 * 10 + 3)
    # gathered bytes inside block i: head + block i (resharded) or head + blocks 0..i (kept)
    for r in rows:
        kept = r["reshard_after_forward"] is False
        assert r["alive_bytes"] == [
            head + block * (i + 1 if kept else 1) for i in range(r["blocks"])
        ]


@pytest.mark.timeout(300)
def test_mixed_precision_and_meta_init(two, no_leftovers):
    mp = two[0]["mixed"]
    assert mp["inside_forward"] == {
        "input": "torch.bfloat16",
        "weight": "torch.bfloat16",
        "output": "torch.bfloat16",
    }
    assert (mp["sharded_param"], mp["sharded_grad"]) == ("torch.float32", "torch.float32")
    assert 0 < mp["max_loss_gap"] < 0.05
    for r, v in two.items():
        held = v["mixed"]["memory"]  # at rest: fp32 shards, fp32 gradient shards, fp32 Adam state
        assert held == memory.memory_per_rank(shapes(), 2, "zero3", "fp32", rank=r)
        mixed = memory.memory_per_rank(shapes(), 2, "zero3", "mixed", rank=r)
        assert held["params"] == 2 * mixed["params"]
        meta = v["meta"]
        assert meta["before"]["device"] == "meta"
        assert (
            meta["params_bytes"]
            == meta["formula"]
            == memory.memory_per_rank(shapes(), 2, "zero3", rank=r)["params"]
        )
        assert meta["within_init_bound"] and meta["distinct_rows"]


@pytest.mark.timeout(300)
def test_full_state_dict_loads_strictly_into_plain_model(two, ckpt, no_leftovers):
    assert two[0]["save"]["files"].keys() == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert two[0]["save"]["full_keys"] == sorted(model.make_model(ShardConfig(**CFG)).state_dict())
    # cpu_offload=True: only rank 0 receives the full state dict
    assert two[1]["save"]["full_keys"] == []
    plain = model.make_model(ShardConfig(**CFG))
    plain.load_state_dict(torch.load(ckpt / "full.pt", weights_only=True), strict=True)
    ref, _ = model.reference(ShardConfig(**CFG))
    torch.testing.assert_close(plain.state_dict(), ref.state_dict(), **TOL)


@pytest.mark.timeout(500)
def test_dcp_saved_on_two_loads_on_four_and_in_one_process(four, ckpt, no_leftovers):
    for v in four.values():
        assert v["load"]["max_diff_before"] > 1e-2 and v["load"]["max_diff_after"] == 0.0
    # resumed with the optimizer state: the run that never stopped; without it: not
    assert four[0]["load"]["resumed_model_and_optimizer_vs_straight"] < 1e-6
    assert four[0]["load"]["resumed_model_only_vs_straight"] > 1e-3
    one = model.make_model(ShardConfig(**{**CFG, "seed": 5}))
    checkpoint.load_dcp(one, ckpt / "dcp")
    torch.testing.assert_close(
        one.state_dict(), torch.load(ckpt / "full.pt", weights_only=True), rtol=0, atol=0
    )


@pytest.mark.timeout(500)
def test_accumulation_and_hsdp_count_their_collectives_and_equal_one_process(four, no_leftovers):
    for v in four.values():
        p, units = v["practice"], v["practice"]["blocks"] + 1
        # 2 micro-batches: a reduce-scatter per unit per micro-batch, or only in the last one
        assert p["sync_each"]["counts"]["reduce_scatter"] == 2 * units
        assert p["sync_last"]["counts"]["reduce_scatter"] == units
        # forward + backward all-gather every unit per micro-batch, unless the first backward
        # keeps them gathered (set_reshard_after_backward(False)): the second forward gathers none
        assert p["sync_last"]["counts"]["all_gather"] == 2 * 2 * units
        assert p["keep_gathered"]["counts"] == {"all_gather": 3 * units, "reduce_scatter": units}
        # HSDP: gathers and reduce-scatters inside a replica, one all-reduce per unit across
        assert p["hsdp"]["counts"] == {
            "all_gather": units + units - 1,  # the root stays gathered for backward
            "reduce_scatter": units,
            "all_reduce": units,
        }
        assert p["hsdp"]["placements"] == "(Replicate(), Shard(dim=0))"
        for name in ("sync_each", "sync_last", "keep_gathered", "hsdp"):
            assert p[name]["max_diff"] < 1e-5, name
        # without explicit prefetch a block's forward starts before the next block's all-gather;
        # with it, the next all-gather is issued first (inside the previous block's pre-forward)
        implicit, prefetch = (p["timeline"][k]["order"] for k in ("implicit", "prefetch"))
        assert implicit[:3] == ["fwd root", "AG root", "fwd 0"]
        assert implicit.index("fwd 1") < implicit.index("AG 1")
        assert prefetch.index("fwd 0") < prefetch.index("AG 1") < prefetch.index("fwd 1")
        # backward prefetches by default: block 1 is gathered before block 2's gradients reduce
        again = prefetch.index("AG 1", prefetch.index("bwd 2"))  # block 1's backward all-gather
        assert again < prefetch.index("RS 2")
        # on gloo every collective is waited for where it is issued: no compute while one runs
        for kind in ("implicit", "prefetch"):
            t = p["timeline"][kind]
            assert t["overlapped"] == 0, kind
            assert {row for row, *_ in t["spans"]} == {"compute", "FSDP call", "collective"}
        assert p["timeline"]["async"]["order"][:6] == prefetch[:6]
    # issued with unshard(async_op=True), the next all-gather runs on gloo's thread while block 0
    # computes: the same instrument measures it on every rank. How many compute ops fall inside
    # depends on when gloo's thread is scheduled (none at all on a loaded machine), so no test
    # asserts a count; 07b prints it per rank.
    assert all(v["practice"]["timeline"]["async"]["overlapped"] >= 0 for v in four.values())


def test_practice_needs_four_ranks(runs, no_leftovers):
    with pytest.raises(ValueError, match="even world size of at least 4"):
        launch(worker, ShardConfig(parts=["practice"]), 2, runs_dir=runs)


@pytest.mark.skipif(
    env.gpu_count() < 2,
    reason="needs 2 CUDA GPUs (NCCL, a 'cuda' mesh); the gloo tests above run the same checks "
    "on CPU",
)
@pytest.mark.timeout(300)
def test_same_checks_on_two_gpus_with_nccl(tmp_path, no_leftovers):
    cfg = ShardConfig(parts=["zero", "fsdp", "counts", "mixed"], backend="nccl", **CFG)
    values = launch(worker, cfg, 2, runs_dir=tmp_path).wait(timeout=240).values
    _check_parity_and_memory(values)
    rows = values[0]["counts"]
    assert all(r["counted"] == r["predicted"] for r in rows)
    peak = {r["reshard_after_forward"]: r["peak_cuda_bytes"] for r in rows if r["blocks"] == 3}
    assert peak[False] >= peak[True] > 0
    assert values[0]["mixed"]["inside_forward"]["weight"] == "torch.bfloat16"
    for r, v in values.items():  # bf16 compute, yet at rest the fp32 row, as on CPU
        assert v["mixed"]["memory"] == memory.memory_per_rank(shapes(), 2, "zero3", "fp32", rank=r)


def test_prefetch_reads_fsdp_labels_and_counts_compute_during_a_collective():
    from types import SimpleNamespace as NS

    from mgtutorial.sharding import prefetch

    assert prefetch.short_name("FSDP::all_gather (blocks.1)") == "AG 1"
    assert prefetch.short_name("FSDP::all_gather") == "AG root"
    assert prefetch.short_name("FSDP::all_gather_copy_out (blocks.1)") is None
    assert prefetch.short_name("FSDP::post_backward_reduce (blocks.0)") == "RS 0"

    def ev(name, thread, start, end):  # profiler times in µs
        return NS(name=name, thread=thread, time_range=NS(start=start, end=end))

    events = [
        ev("FSDP::pre_forward (blocks.0)", 1, 0, 100),
        ev("FSDP::all_gather (blocks.0)", 1, 10, 90),
        ev("gloo:all_gather", 2, 20, 80),
        ev("aten::addmm", 1, 50, 60),  # during the collective: counted
        ev("aten::tanh", 1, 120, 130),  # after it: not counted
    ]
    t = prefetch.read_spans(events)
    assert t["order"] == ["fwd 0", "AG 0"]
    assert t["overlapped"] == 1
    assert t["spans"][0] == ["FSDP call", "AG 0", 0.01, 0.09]
    fig = prefetch.timeline_figure({"made up": t})
    assert "compute ops during a collective: 1" in fig.axes[0].get_title()
    # no collective recorded off the training thread (NCCL under a CPU profile): not measured
    assert prefetch.read_spans(events[:2] + events[3:])["overlapped"] is None


@pytest.mark.timeout(240)
def test_the_bench_part_trains_every_set_up_side_by_side(runs, no_leftovers):
    values = launch(worker, ShardConfig(parts=["bench"], **CFG), 2, runs_dir=runs).wait(timeout=200)
    for rank in (0, 1):
        bench = values.values[rank]["bench"]
        assert list(bench) == ["ddp", "zero1", "zero2", "fsdp_reshard", "fsdp_keep"]
        assert all(b["step_s"] > 0 and b["bytes"] for b in bench.values())
