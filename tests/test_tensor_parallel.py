"""Chapter 08: tensor parallelism by hand and with DTensor equals the unsplit block; collective
counts; sequence parallelism; the pitfalls; a 2-D (dp × tp) mesh equals one process; the
refusals."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from mgtutorial import launch
from mgtutorial.tensor_parallel import config, cost, fg, mesh2d, transformer, worker

CFG = config.TPConfig()
ACT = CFG.batch * CFG.seq * CFG.h * 4  # bytes of one (b, s, h) float32 activation


@pytest.mark.timeout(120)
def test_every_split_equals_unsplit_with_counted_collectives(runs, no_leftovers):
    values = launch(worker.worker, CFG, 2, runs_dir=runs).wait(timeout=90).values
    assert sorted(values) == [0, 1]
    for v in values.values():  # each rank compared its slices with assert_close; the largest gaps
        splits = {k: x for k, x in v.items() if k not in ("pitfalls", "loss_parallel")}
        assert len(splits) == 6 and all(split["max_diff"] < 1e-5 for split in splits.values())
        one, two = {"all_reduce": 1}, {"all_reduce": 2}
        for name in ("hand_mlp", "hand_attention"):
            assert v[name]["counts"]["forward"] == one and v[name]["counts"]["backward"] == one
            assert v[name]["fg_counts"] == {"forward": 1, "backward": 1}
        assert v["hand_block"]["fg_counts"] == {"forward": 2, "backward": 2}
        for name in ("hand_block", "dtensor"):
            assert v[name]["counts"]["forward"] == two and v[name]["counts"]["backward"] == two
        # every call, in order
        assert v["dtensor"]["counts"]["bytes"] == {"all_reduce": [[ACT, ACT]] * 2}
        # without PrepareModuleInput, q, k and v each all-reduce their input's gradient
        assert v["dtensor_unprepared"]["counts"]["backward"] == {"all_reduce": 4}
        sp = v["sequence_parallel"]["counts"]
        assert sp["forward"] == sp["backward"] == {"all_gather": 2, "reduce_scatter": 2}
        assert sp["bytes"] == {
            "all_gather": [[ACT // 2, ACT]] * 2,
            "reduce_scatter": [[ACT, ACT // 2]] * 2,
        }
        # the LayerNorms' gradients: left Partial by sequence parallelism, else plain tensors
        assert v["sequence_parallel"]["norm_grad"] == ["Partial(sum)"]
        assert v["dtensor"]["norm_grad"] == []
        placements = v["dtensor"]["placements"]
        assert placements["attn.wq.weight"] == ["DTensor", ["Shard(dim=0)"], [CFG.h // 2, CFG.h]]
        assert placements["attn.wo.weight"] == ["DTensor", ["Shard(dim=1)"], [CFG.h, CFG.h // 2]]
        assert placements["mlp.w2.bias"] == ["DTensor", ["Replicate()"], [CFG.h]]
        assert placements["mlp_norm.weight"] == ["Parameter", [], [CFG.h]]
        _assert_pitfalls(v["pitfalls"])
        lp = v["loss_parallel"]  # the loss on vocabulary-sharded logits == one process's
        assert lp["max_diff"] < 1e-5 and lp["logits_placements"] == ["S(2)"]
        assert lp["local_logit_bytes"] * 2 == lp["full_logit_bytes"]  # never gathered whole
        assert set(lp["counts"]) == {"all_reduce"}


@pytest.mark.timeout(180)
def test_2d_mesh_fsdp_times_tp_equals_one_process(runs, no_leftovers):
    cfg = config.MeshConfig()
    res = launch(mesh2d.mesh_worker, cfg, 4, runs_dir=runs).wait(timeout=150)
    ref, ref_losses = mesh2d.reference(cfg)
    got = torch.load(res.run_dir / "final.pt", weights_only=True)
    torch.testing.assert_close(got, ref.state_dict(), rtol=1e-5, atol=1e-6)
    coords = {r: tuple(v["coords"]) for r, v in res.values.items()}
    assert coords == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    assert all("must have the same mesh" in v["torch_clip_error"] for v in res.values.values())
    # the mean over dp ranks of their half-batch losses is the whole batch's
    for step in range(cfg.steps):
        mean = (res.values[0]["losses"][step] + res.values[2]["losses"][step]) / 2
        assert mean == pytest.approx(ref_losses[step], rel=1e-5)
    rows = [tuple(res.values[r]["layout"]["mlp.w1.weight"]["rows"][0]) for r in range(4)]
    assert rows == [(0, 7), (16, 23), (8, 15), (24, 31)]  # FSDP's dp shards inside each TP shard
    wo_cols = [res.values[r]["layout"]["attn.wo.weight"]["cols"] for r in range(4)]
    assert wo_cols == [[[0, 7]], [[8, 15]], [[0, 7]], [[8, 15]]]
    assert mesh2d.layout_figure(res.values) is not None
    # the check can fail: one step fewer is a different model
    short, _ = mesh2d.reference(config.MeshConfig(steps=cfg.steps - 1))
    assert any((short.state_dict()[k] - got[k]).abs().max() > 1e-4 for k in got)


def _assert_pitfalls(v):  # each pitfall reproduced, then fixed
    assert v["forgot_heads"].startswith("RuntimeError: shape")
    assert "is invalid for input of size" in v["forgot_heads"]
    assert "mixed torch.Tensor and DTensor" in v["clip_error"]
    assert "mixed torch.Tensor and DTensor" in v["foreach_error"]
    assert v["clip_norm_rel_diff"] < 1e-6 and v["for_loop_param_diff"] < 1e-5
    assert v["sp_all_dtensor"] and v["sp_clip_norm_rel_diff"] < 1e-6
    assert v["sp_foreach_param_diff"] < 1e-5
    # 2 LayerNorms × (weight, bias): Partial gradients, all-reduced each time they are read
    norm_params = 4
    assert v["sp_step_counts"] == {"all_reduce": norm_params}
    assert v["sp_clip_counts"] == {"all_reduce": norm_params + 1}  # + the sum of the sharded norms
    d = v["dropout"]
    assert d["replicated_diff_per_rank_seed"] > 0 and d["replicated_diff_shared_seed"] == 0
    assert d["sharded_agree_shared_seed"] == 1.0 and 0.3 < d["sharded_agree_per_rank_seed"] < 0.7


def test_indivisible_heads_refused_before_any_rank_starts(runs):
    heads = r"n_heads=6 is not divisible by the tensor-parallel degree tp=4"
    with pytest.raises(ValueError, match=heads):
        launch(worker.worker, config.TPConfig(n_heads=6, h=24), 4, runs_dir=runs)
    with pytest.raises(ValueError, match=r"ffn=30 is not divisible"):
        launch(worker.worker, config.TPConfig(ffn=30), 4, runs_dir=runs)
    with pytest.raises(ValueError, match=r"multiples of dp=3"):
        launch(mesh2d.mesh_worker, config.MeshConfig(dp=3), 4, runs_dir=runs)
    # the choices come from the Literal type; the 2-D mesh checks the TP degree world size / dp
    with pytest.raises(ValueError, match=r"backend='mpi': must be one of 'auto', 'gloo', 'nccl'"):
        config.TPConfig(backend="mpi").validate(2)
    with pytest.raises(ValueError, match=r"n_heads=2 is not divisible by the tensor-parallel .*=4"):
        launch(mesh2d.mesh_worker, config.MeshConfig(dp=1, n_heads=2, h=8), 4, runs_dir=runs)
    with pytest.raises(ValueError, match=r"dp=0: must be at least 1"):
        launch(mesh2d.mesh_worker, config.MeshConfig(dp=0), 4, runs_dir=runs)
    assert not list(runs.iterdir())  # no run directory: nothing started
    with pytest.raises(ValueError, match="n_heads=3"):
        fg.HandTPAttention(transformer.Attention(12, 3), rank=0, tp=2)
    with pytest.raises(ValueError, match="h=10 is not divisible by n_heads=4"):
        transformer.check_heads(4, 10, 2)


def test_comm_bytes_from_the_config():
    h, ffn = 16, 32
    c = cost.comm_bytes(b=2, s=8, h=h, ffn=ffn, tp=2, elem=4)
    assert c["tp_forward"] == 2 * 2 * 8 * h * 4  # two (b, s, h) all-reduces per block
    assert c["tp_step"] == 2 * c["tp_forward"]
    assert c["tp_step_per_rank"] == c["tp_step"]  # 2(n-1)/n = 1
    assert c["params"] == sum(p.numel() for p in transformer.Block(h, 4, ffn).parameters())
    assert c["ddp_step"] == 4 * c["params"]


def test_unsplit_name_and_hand_shard():
    assert fg.unsplit_name("mlp.b1") == "mlp.w1.bias"
    assert fg.unsplit_name("attn.o_bias") == "attn.wo.bias"
    assert fg.unsplit_name("attn_norm.weight") == "attn_norm.weight"
    full = torch.arange(12.0).view(3, 4)
    assert fg.hand_shard("attn.wo", full, 1, 2).tolist() == [[2, 3], [6, 7], [10, 11]]
    assert fg.hand_shard("w1", torch.arange(4.0), 0, 2).tolist() == [0, 1]
    assert mesh2d.index_runs([0, 1, 2, 5, 6, 9]) == [[0, 2], [5, 6], [9, 9]]


def test_column_then_row_slices_sum_to_the_unsplit_mlp():
    """The arithmetic of the split, without processes: the ranks' partial outputs sum to the
    MLP's."""
    torch.manual_seed(0)
    mlp, x = transformer.MLP(16, 32), torch.randn(2, 8, 16)
    parts = [fg.HandTPMLP(mlp, r, 4) for r in range(4)]
    partial = [F.linear(F.gelu(F.linear(x, p.w1, p.b1)), p.w2) for p in parts]
    torch.testing.assert_close(sum(partial) + parts[0].b2, mlp(x))
    # the check can fail: rank r's inner features with another rank's slice of w2 are not the MLP
    mixed = [F.linear(F.gelu(F.linear(x, p.w1, p.b1)), q.w2) for p, q in zip(parts, parts[::-1])]
    assert not torch.allclose(sum(mixed) + parts[0].b2, mlp(x), atol=1e-3)
