"""Chapter 06: each flaw of the article's samples shows its symptom, and the fixed form works.

If a future PyTorch changes one of these behaviours, the matching test fails and the chapter's
text needs a look.
"""

from __future__ import annotations

import pytest

from mgtutorial import article as A
from mgtutorial import launch
from mgtutorial import model_parallel as MP
from mgtutorial.launch import WorkerFailed
from mgtutorial.models import ArticleCNN, cnn_flatten_size


def _flaw(flaw, runs, **kw):
    return launch(A.flaw_worker, A.FlawConfig(flaw=flaw, **kw), 2, runs_dir=runs).wait(timeout=60).values


def test_flatten_4608_fails_or_silently_makes_wrong_rows():
    with pytest.raises(RuntimeError, match=r"shape '\[-1, 4608\]' is invalid for input of size 25088"):
        A.flatten_as_written(4)
    assert A.flatten_as_written(36) == (49, 4608)  # no error: 36 images became 49 rows
    assert "Expected input batch_size (49) to match target batch_size (36)" in A.loss_after_wrong_view(36)
    assert cnn_flatten_size((3, 32, 32)) == 6272 and ArticleCNN()(A.torch.zeros(36, 3, 32, 32)).shape == (36, 10)


@pytest.mark.timeout(60)
def test_ddp_device_ids_with_cpu_module_and_the_fix(runs, no_leftovers):
    values = _flaw("device_ids", runs)
    for r, v in values.items():
        assert f"got device_ids [{r}]" in v["as_written"] and "module parameters {device(type='cpu')}" in v["as_written"]
        assert v["fixed"] == "DistributedDataParallel on cpu"


@pytest.mark.timeout(120)
def test_without_distributed_sampler_ranks_see_the_same_batches(runs, no_leftovers):
    plain = _flaw("no_sampler", runs)
    assert plain[0]["ids"] == plain[1]["ids"]  # identical work on both ranks
    assert sorted(plain[0]["ids"]["0"]) == list(range(16))  # each rank walks the whole data set
    no_epoch = _flaw("no_set_epoch", runs)
    for v in no_epoch.values():
        assert v["ids"]["0"] == v["ids"]["1"]  # same order every epoch
    fixed = _flaw("fixed_sampler", runs)
    assert not set(fixed[0]["ids"]["0"]) & set(fixed[1]["ids"]["0"])
    assert fixed[0]["ids"]["0"] != fixed[0]["ids"]["1"]


@pytest.mark.timeout(60)
def test_summed_epoch_loss_differs_per_rank_global_mean_agrees(runs, no_leftovers):
    v = _flaw("summed_loss", runs)
    assert abs(v[0]["summed"] - v[1]["summed"]) > 0.5
    assert v[0]["global_mean"] == v[1]["global_mean"] < min(v[0]["summed"], v[1]["summed"])


@pytest.mark.timeout(60)
def test_no_destroy_leaves_the_group_up(runs, no_leftovers):
    assert all(v["initialized_at_exit"] for v in _flaw("no_destroy", runs).values())


@pytest.mark.timeout(60)
def test_rank_equals_gpu_index_collides_on_two_nodes(runs, no_leftovers):
    run = launch(A.rank_from_gpu_worker, A.RankConfig(gpus_per_node=1, timeout_s=5), 2, runs_dir=runs)
    with pytest.raises(WorkerFailed, match="EADDRINUSE|address already in use|timeout|Timed out"):
        run.wait(timeout=40)
    claims = [r["claimed_rank"] for r in A.runlog.read_run(run.run_dir) if r.get("kind") == "rank_claim"]
    assert claims == [0, 0]
    fixed = launch(A.rank_from_gpu_worker, A.RankConfig(gpus_per_node=1, use_local_rank_as_rank=False), 2,
                   runs_dir=runs).wait(timeout=40)
    assert {v["rank"] for v in fixed.values.values()} == {0, 1}


@pytest.mark.timeout(90)
def test_world_size_gpus_times_subnets_waits_for_ranks_that_never_come(runs, no_leftovers):
    cfg = A.RankConfig(use_local_rank_as_rank=False, claimed_world_size=6, gpus_per_node=2, timeout_s=4)
    with pytest.raises(WorkerFailed, match="timeout|Timed out"):
        launch(A.rank_from_gpu_worker, cfg, 3, runs_dir=runs).wait(timeout=60)


def test_env_init_without_master_addr_and_set_start_method_twice():
    assert "MASTER_ADDR expected, but not set" in A.init_without_master_env()
    assert A.set_start_method_twice() == "RuntimeError: context has already been set"


def test_retain_graph_keeps_a_steps_activations_alive():
    kept, freed = A.retained_graph_bytes(True), A.retained_graph_bytes(False)
    assert freed == [0, 0, 0]
    assert kept[0] > 0 and kept == [kept[0]] * 3  # one step's worth, every step


@pytest.mark.timeout(60)
def test_model_parallel_sample_is_whole_copies(runs, no_leftovers):
    res = launch(MP.article_worker, MP.ArticleConfig(steps=3), 2, runs_dir=runs).wait(timeout=40)
    assert res.values[0]["parameters"] == res.values[1]["parameters"] == MP.models.count_parameters(MP.models.ArticleMLP())
