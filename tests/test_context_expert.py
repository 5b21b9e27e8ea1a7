"""Chapter 10: ring attention (non-causal, causal, zig-zag) equals full attention on one process,
outputs and gradients, on 2 and 4 ranks, with its sends counted as predicted and a wrong merge
caught; the MoE layer with its experts split over 2 and 4 ranks equals the one-process layer, its
all-to-alls counted as predicted; the arithmetic of attention's cost, zig-zag and the 5-D mesh;
every refusal."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mgtutorial import launch
from mgtutorial.context_expert import (
    attention_cost,
    config,
    cp_worker,
    ep_worker,
    mesh5d,
    moe,
    online_softmax,
    ring_attention,
    zigzag,
)
from mgtutorial.perf import costmodel

# --- one process: the pieces -------------------------------------------------------------------


def _qkv(s=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, s, 4, generator=g) for _ in range(3)]


@pytest.mark.parametrize("causal", [False, True])
def test_merging_blocks_equals_softmax_over_all_keys(causal):
    q, k, v = _qkv()
    pos = torch.arange(8)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    for kb, vb, pb in zip(k.chunk(4, 2), v.chunk(4, 2), pos.chunk(4)):
        mask = online_softmax.visible(pos, pb, causal)
        out, lse = online_softmax.merge(
            out, lse, *online_softmax.block_attention(q, kb, vb, mask, 0.5)
        )
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    # the negative control: adding the blocks' own softmaxes is far off
    two = [
        online_softmax.block_attention(q, k[..., :4, :], v[..., :4, :], None, 0.5),
        online_softmax.block_attention(q, k[..., 4:, :], v[..., 4:, :], None, 0.5),
    ]
    summed, _ = cp_worker.summed(*two[0], *two[1])
    full = F.scaled_dot_product_attention(q, k, v)
    assert (summed - full).abs().max() > 0.1


def test_a_row_that_sees_no_key_stays_zero_until_a_block_shows_one():
    q, k, v = _qkv()
    pos_q, pos_k = torch.arange(4), torch.arange(4, 8)  # every key after every query
    out, lse = online_softmax.block_attention(
        q[..., :4, :], k[..., 4:, :], v[..., 4:, :], online_softmax.visible(pos_q, pos_k, True), 0.5
    )
    assert torch.isneginf(lse).all() and (out == 0).all()
    merged, _ = online_softmax.merge(out, lse, out, lse)
    assert not merged.isnan().any()


def test_zigzag_is_torchs_head_tail_balancer_and_balances_the_causal_work():
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _HeadTailLoadBalancer,
    )

    for cp, seq in [(2, 16), (4, 16), (4, 32)]:
        torch_order = _HeadTailLoadBalancer(seq, cp, "cpu")._generate_indices()[0]
        ours = torch.cat([zigzag.positions(r, cp, seq, "zigzag") for r in range(cp)])
        assert ours.tolist() == torch_order.tolist()
        x = torch.randn(1, 2, seq, 3)
        for layout in zigzag.LAYOUTS:
            parts = [zigzag.shard(x, r, cp, layout) for r in range(cp)]
            assert torch.equal(zigzag.unshard(parts, layout), x)
        assert zigzag.imbalance(cp, seq, "zigzag") == 1.0
    assert [zigzag.block_work(r, 2, 16, "contiguous") for r in range(2)] == [64, 128]
    assert [zigzag.block_work(r, 4, 16, "zigzag") for r in range(4)] == [40] * 4
    assert zigzag.imbalance(2, 16, "contiguous") == pytest.approx(4 / 3)
    assert zigzag.imbalance(8, 64, "contiguous") == pytest.approx(16 / 9)
    with pytest.raises(ValueError, match="layout='ring'"):
        zigzag.positions(0, 2, 16, "ring")


@pytest.mark.parametrize("s", [16, 64])
def test_attention_cost_measured_equals_predicted(s):
    got, want = attention_cost.measured(1, 2, s, 8), attention_cost.predicted(1, 2, s, 8)
    assert got["flops"] == want["flops"] and got["saved_bytes"] == want["saved_bytes"]
    assert attention_cost.scores_per_rank(1, 8, 1024, tp=2) == 4 * 1024 * 1024 * 2
    assert attention_cost.scores_per_rank(1, 8, 1024, cp=2) == 8 * 512 * 1024 * 2
    assert attention_cost.layer_activation_bytes(1024, 1, 64, 4, cp=4) == 256 * 64 * 34
    assert attention_cost.layer_activation_bytes(64, 1, 64, 4, flash=False) == 64 * 64 * (34 + 20)


def test_ring_bytes_prediction():
    assert ring_attention.ring_bytes(2, 2, 16, 8, 2) == {
        "block": 2048,
        "forward": 2048,
        "backward": 3 * 2048,
        "forward_sends": 1,
        "backward_sends": 3,
    }


def test_routing_fills_first_choices_first_and_drops_past_capacity():
    # 3 tokens, 2 experts, top-2: every token picks both; first choices fill the queues first
    logits = torch.tensor([[2.0, 0.0], [2.0, 0.0], [0.0, 2.0]])
    r = moe.route(logits, top_k=2, slots=2)
    assert r.experts.tolist() == [[0, 1], [0, 1], [1, 0]]
    assert r.slot.tolist() == [[0, 1], [1, 2], [0, 2]]
    assert r.kept.tolist() == [[True, True], [True, False], [True, False]]
    assert moe.capacity(12, 4, 2, 1.0) == 6 and moe.capacity(12, 4, 2, 1.25) == 8
    uniform = moe.route(torch.zeros(4, 4), 1, 4)
    uniform.experts = torch.arange(4)[:, None]
    assert moe.balancing_loss(uniform).item() == pytest.approx(1.0)


def test_groups_change_the_layer_so_the_ep_comparison_can_fail():
    cfg = config.EPConfig(tokens=12)
    layer, (x, _) = moe.MoE(cfg), moe.tokens(cfg, 2)
    one, s1 = moe.moe(layer, x, 1)
    two, s2 = moe.moe(layer, x, 2)
    assert sum(s1["per_expert"]) + s1["dropped"] == sum(s2["per_expert"]) + s2["dropped"] == 48
    assert (one - two).abs().max() > 1e-3  # capacity is per group


def test_balancing_loss_evens_out_the_router():
    cfg = config.EPConfig(tokens=32)
    off, on = moe.train_router(cfg, 0.0), moe.train_router(cfg, 1.0)
    assert off[0] == on[0]  # the same start
    assert on[-1]["dropped"] < off[-1]["dropped"] and on[-1]["aux"] < off[-1]["aux"]


# --- the 5-D mesh --------------------------------------------------------------------------------


def test_mesh5d_places_groups_and_counts_states():
    model, hw = mesh5d.MoEModel(), costmodel.H100
    lay = mesh5d.Layout(tp=8, ep=8)
    mesh5d.check_layout(lay, model, 64)
    assert mesh5d.stride(lay, ("tp",)) == 1 and mesh5d.stride(lay, ("ep",)) == 8
    assert mesh5d.group_bw(lay, ("tp",)) == hw.intra_bw
    assert mesh5d.group_bw(lay, ("ep",)) == hw.inter_bw  # every ep neighbour in another node
    swapped = mesh5d.Layout(tp=8, ep=8, order=("pp", "dp", "cp", "tp", "ep"))
    assert mesh5d.group_bw(swapped, ("tp",)) == hw.inter_bw
    rows = {r["dim"]: r for r in mesh5d.traffic(lay, model)}
    assert set(rows) == {"tp", "ep", "dp·ep·cp"}  # groups of one rank send nothing
    assert rows["tp"]["calls"] == 4 * model.layers * lay.micro_batches
    tp_in = mesh5d.step_time(lay, model)["tp"]
    assert 8 * tp_in < mesh5d.step_time(swapped, model)["tp"] < 9 * tp_in  # 450 vs 50 GB/s
    mem = mesh5d.memory(lay, model)
    dense, experts = model.dense_params / 8 / 8, model.expert_params / 64
    assert mem["states"] == pytest.approx(16 * (dense + experts), rel=1e-6)
    assert "fits in 80 GB" in mesh5d.report(lay, model)


@pytest.mark.parametrize(
    "lay, match",
    [
        (mesh5d.Layout(tp=8), "pp·dp·ep·cp·tp = 8, not the 64 GPUs"),
        (mesh5d.Layout(tp=16, ep=4), "kv_heads=8 is not divisible by tp=16"),
        (mesh5d.Layout(ep=16, tp=4), "experts=8 is not divisible by ep=16"),
        (mesh5d.Layout(pp=64), "layers=32 is not divisible by pp=64"),
        (mesh5d.Layout(dp=64), "batch=64 is not divisible by dp·ep·micro_batches=512"),
        (mesh5d.Layout(tp=8, ep=8, order=("pp", "dp", "tp")), "list each of"),
    ],
)
def test_mesh5d_refusals(lay, match):
    with pytest.raises(ValueError, match=match):
        mesh5d.check_layout(lay, mesh5d.MoEModel(), 64)


# --- refusals before any rank starts -------------------------------------------------------------


@pytest.mark.parametrize(
    "worker, cfg, nprocs, match",
    [
        (cp_worker.worker, config.CPConfig(seq=10), 2, r"seq=10 is not divisible by 2 × cp = 4"),
        (cp_worker.worker, config.CPConfig(seq=12), 4, r"Use seq a multiple of 8 \(e.g. 8 or 16\)"),
        (ep_worker.worker, config.EPConfig(experts=3), 2, r"experts=3 is not divisible by the EP"),
        (ep_worker.worker, config.EPConfig(top_k=5), 2, r"top_k=5 is larger than experts=4"),
        (ep_worker.worker, config.EPConfig(capacity_factor=0.0), 2, r"capacity_factor=0.0"),
        (cp_worker.worker, config.CPConfig(backend="mpi"), 2, r"backend='mpi'"),
    ],
)
def test_refused_before_any_rank_starts(runs, worker, cfg, nprocs, match):
    with pytest.raises(ValueError, match=match):
        launch(worker, cfg, nprocs, runs_dir=runs)
    assert not any(runs.iterdir())


def test_seq_refusal_names_the_fix():
    with pytest.raises(ValueError, match=r"Use seq a multiple of 4 \(e.g. 8 or 12\)"):
        config.check_seq(10, 2)


# --- ranks ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("nprocs", [2, 4])
def test_ring_attention_equals_one_process(runs, no_leftovers, nprocs):
    cfg = config.CPConfig()
    values = launch(cp_worker.worker, cfg, nprocs, runs_dir=runs).wait(timeout=200).values
    want = ring_attention.ring_bytes(cfg.batch, cfg.heads, cfg.seq, cfg.head_dim, nprocs)
    assert sorted(values) == list(range(nprocs))
    for rank, v in values.items():
        for name, causal, layout in cp_worker.CASES:  # each compared in the rank with assert_close
            case = v[name]
            assert case["max_diff"] < 1e-5
            assert case["counts"] == {
                "forward_sends": want["forward_sends"],
                "forward_bytes": want["forward"],
                "backward_sends": want["backward_sends"],
                "backward_bytes": want["backward"],
            }
            assert case["work"]["pairs"] == zigzag.block_work(rank, nprocs, cfg.seq, layout, causal)
        # contiguous causal: rank r skips the blocks of the ranks after it
        assert v["causal"]["work"].get("skipped", 0) == nprocs - 1 - rank
        assert v["wrong_merge"] > 0.1  # the negative control: a wrong merge is far off
        assert (
            v["positions"]["zigzag"] == zigzag.positions(rank, nprocs, cfg.seq, "zigzag").tolist()
        )
        cp = v["context_parallel"]
        assert not cp["ran"] and "_scaled_dot_product_flash_attention_for_cpu" in cp["error"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("nprocs", [2, 4])
def test_expert_parallel_equals_one_process(runs, no_leftovers, nprocs):
    cfg = config.EPConfig()
    values = launch(ep_worker.worker, cfg, nprocs, runs_dir=runs).wait(timeout=200).values
    v0 = values[0]
    per_expert = [c for r in range(nprocs) for c in values[r]["per_expert"]]
    assert per_expert == v0["ref_per_expert"]
    assert sum(v["dropped"] for v in values.values()) == v0["ref_dropped"]
    for rank, v in values.items():
        assert v["max_diff"] < 1e-5  # output, token, router and expert gradients
        assert v["counted"] == v["predicted"]
        assert v["counted"]["calls"] == 5
        assert v["comm"] == {"forward": {"all_to_all": 3}, "backward": {"all_to_all": 2}}
        assert v["send"] == v["plan"][rank]
        assert v["recv"] == [row[rank] for row in v["plan"]]
    kept = sum(per_expert)
    assert kept + v0["ref_dropped"] == nprocs * cfg.tokens * cfg.top_k
    assert math.ceil(cfg.tokens * cfg.top_k / cfg.experts) * nprocs >= max(per_expert)


def test_trim_keeps_the_visible_half_of_a_zigzag_block():
    pos = [zigzag.positions(r, 2, 16, "zigzag") for r in range(2)]  # [0-3, 12-15], [4-11]
    rows, cols = ring_attention.trim(online_softmax.visible(pos[1], pos[0], True))
    assert rows.tolist() == list(range(8)) and cols.tolist() == [0, 1, 2, 3]  # keys 0-3
    rows, cols = ring_attention.trim(online_softmax.visible(pos[0], pos[1], True))
    assert rows.tolist() == [4, 5, 6, 7] and cols.tolist() == list(range(8))  # queries 12-15
    assert ring_attention.trim(None) == (slice(None), slice(None))
