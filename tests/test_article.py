"""Chapter 06: each flaw of the article's samples shows its symptom, and the fixed form works.

If a future PyTorch changes one of these behaviours, the matching test fails and the chapter's
text needs a look.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mgtutorial import launch
from mgtutorial.article import ddp_flaws, model_parallel_flaws
from mgtutorial.common.models import ArticleCNN, ArticleMLP, cnn_flatten_size, count_parameters
from mgtutorial.pipeline.activations import ActivationMeter
from mgtutorial.runtime import runlog
from mgtutorial.runtime.run import WorkerFailed


def _flaw(flaw, runs, **kw):
    run = launch(ddp_flaws.flaw_worker, ddp_flaws.FlawConfig(flaw=flaw, **kw), 2, runs_dir=runs)
    return run.wait(timeout=60).values


def test_flatten_4608_fails_or_silently_makes_wrong_rows():
    conv, pool = nn.Conv2d(3, 32, 5), nn.MaxPool2d(2)  # the sample's layers, as in the notebook

    def features(b):
        return pool(torch.relu(conv(torch.zeros(b, 3, 32, 32))))

    with pytest.raises(
        RuntimeError, match=r"shape '\[-1, 4608\]' is invalid for input of size 25088"
    ):
        features(4).view(-1, 4608)
    rows = features(36).view(-1, 4608)
    assert rows.shape == (49, 4608)  # no error: 36 images became 49 rows
    with pytest.raises(
        ValueError, match=r"Expected input batch_size \(49\) to match target batch_size \(36\)"
    ):
        nn.functional.cross_entropy(nn.Linear(4608, 10)(rows), torch.zeros(36, dtype=torch.long))
    assert cnn_flatten_size((3, 32, 32)) == 6272
    assert ArticleCNN()(torch.zeros(36, 3, 32, 32)).shape == (36, 10)


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_ddp_device_ids_with_cpu_module_and_the_fix(runs, no_leftovers):
    values = _flaw("device_ids", runs)
    for r, v in values.items():
        assert f"got device_ids [{r}]" in v["as_written"]
        assert "module parameters {device(type='cpu')}" in v["as_written"]
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
    # the ranks' numbers are batch_losses', computed here in one process
    own = [ddp_flaws.batch_losses(r) for r in (0, 1)]
    assert [v[r]["summed"] for r in (0, 1)] == pytest.approx([sum(x) for x in own])
    assert v[0]["global_mean"] == pytest.approx(sum(own[0] + own[1]) / len(own[0] + own[1]))


def test_a_flaw_not_in_the_type_is_refused():
    with pytest.raises(ValueError, match="flaw='typo': must be one of 'device_ids', 'no_sampler'"):
        ddp_flaws.FlawConfig(flaw="typo").validate(2)


@pytest.mark.timeout(180)
def test_exit_without_destroy_on_gloo_warns_never_and_may_abort(no_leftovers):
    """The chapter (06a, 1.7): ranks that end as scripts do, with the group still up. On gloo torch
    prints no warning, and a rank can abort in the teardown of gloo's threads; with
    destroy_process_group every rank ends cleanly. The exit the NCCL warning comes from must have
    run (EXIT_REACHED), or the absence of a warning would prove nothing (a launch rank, which
    ends with os._exit, never gets there)."""
    kept = [r for _ in range(2) for r in ddp_flaws.exit_without_destroy("gloo", nprocs=2)]
    for r in kept:
        assert r["exit_reached"], r  # the interpreter's exit ran: where NCCL's destructor warns
        assert r["initialized_at_exit"] is True, r
        assert "destroy_process_group" not in r["stderr"], r  # gloo: no warning
        # the one way it can go wrong: an abort (SIGABRT) in gloo's teardown
        assert r["returncode"] == 0 or (r["returncode"] == -6 and r["aborted"]), r
    fixed = ddp_flaws.exit_without_destroy("gloo", nprocs=2, destroy=True)
    assert [(r["returncode"], r["initialized_at_exit"]) for r in fixed] == [(0, False)] * 2
    assert [r["stderr"] for r in fixed] == [ddp_flaws.EXIT_REACHED + "\n"] * 2


def test_exit_without_destroy_refuses_a_bad_backend_before_starting():
    with pytest.raises(ValueError, match="backend='mpi': use 'gloo' or 'nccl'"):
        ddp_flaws.exit_without_destroy("mpi")
    with pytest.raises(ValueError, match="nprocs=0: run at least one rank"):
        ddp_flaws.exit_without_destroy(nprocs=0)


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_rank_equals_gpu_index_collides_on_two_nodes(runs, no_leftovers):
    run = launch(
        ddp_flaws.rank_from_gpu_worker,
        ddp_flaws.RankConfig(gpus_per_node=1, timeout_s=5),
        2,
        runs_dir=runs,
    )
    with pytest.raises(WorkerFailed, match="EADDRINUSE|address already in use|timeout|Timed out"):
        run.wait(timeout=40)
    claims = [
        r["claimed_rank"] for r in runlog.read_run(run.run_dir) if r.get("kind") == "rank_claim"
    ]
    assert claims == [0, 0]
    fixed = launch(
        ddp_flaws.rank_from_gpu_worker,
        ddp_flaws.RankConfig(gpus_per_node=1, use_local_rank_as_rank=False),
        2,
        runs_dir=runs,
    ).wait(timeout=40)
    assert {v["rank"] for v in fixed.values.values()} == {0, 1}


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_world_size_gpus_times_subnets_waits_for_ranks_that_never_come(runs, no_leftovers):
    cfg = ddp_flaws.RankConfig(
        use_local_rank_as_rank=False, claimed_world_size=6, gpus_per_node=2, timeout_s=4
    )
    with pytest.raises(WorkerFailed, match="timeout|Timed out"):
        launch(ddp_flaws.rank_from_gpu_worker, cfg, 3, runs_dir=runs).wait(timeout=60)


@pytest.mark.slow
def test_env_init_without_master_addr_and_set_start_method_twice():
    init = (
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='env://', rank=0, world_size=2)"
    )
    assert "MASTER_ADDR expected, but not set" in ddp_flaws.last_error_line(init)
    twice = "import torch.multiprocessing as mp\n" + "mp.set_start_method('spawn')\n" * 2
    assert ddp_flaws.last_error_line(twice) == "RuntimeError: context has already been set"
    assert ddp_flaws.last_error_line("print('fine')") == "no error"


def _alive_after_each_step(retain_graph: bool, steps: int = 3) -> list[int]:
    model, x, y = ArticleMLP(), torch.randn(64, 1024), torch.randint(0, 100, (64,))
    opt, meter, alive = torch.optim.SGD(model.parameters(), lr=0.01), ActivationMeter(model), []
    for _ in range(steps):
        opt.zero_grad()
        with meter.saving():
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward(retain_graph=retain_graph)
        opt.step()
        alive.append(meter.live_bytes)
    return alive


def test_retain_graph_keeps_a_steps_activations_alive():
    kept, freed = _alive_after_each_step(True), _alive_after_each_step(False)
    assert freed == [0, 0, 0]
    assert kept[0] > 0 and kept == [kept[0]] * 3  # one step's worth, every step
    # each storage once: every layer's float32 input and the log-softmax, the int64 targets, and
    # the loss's float32 total weight (a ReLU output saved twice, by ReLU and the next Linear,
    # counts once)
    assert kept[0] == 64 * (1024 + 512 + 256 + 100) * 4 + 64 * 8 + 4


@pytest.mark.timeout(60)
def test_model_parallel_sample_is_whole_copies(runs, no_leftovers):
    cfg = model_parallel_flaws.ArticleConfig(steps=3)
    res = launch(model_parallel_flaws.article_worker, cfg, 2, runs_dir=runs).wait(timeout=40)
    whole = count_parameters(ArticleMLP())
    assert res.values[0]["parameters"] == res.values[1]["parameters"] == whole
    records = runlog.read_run(res.run_dir)
    start = {r["rank"]: r["checksum"] for r in runlog.of_kind(records, "article_start")}
    sums = {(r["rank"], r["step"]): r["checksum"] for r in runlog.of_kind(records, "article")}
    assert start[0] == start[1]  # the same starting weights …
    assert all(sums[0, s] != sums[1, s] for s in (1, 2, 3))  # … then copies that drift apart


def test_c10d_counting_mode_counts_collectives_and_nothing_else():
    import torch.distributed as dist

    from mgtutorial.common.compare import c10d_counting_mode

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(3)
        with c10d_counting_mode() as mode:
            (t * 2).sum()
            dist.all_reduce(t)
            dist.all_reduce(t)
        assert mode.counts == {"c10d.allreduce_": 2}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_split_step_sends_and_receives_where_the_sample_does_not(runs, no_leftovers):
    """The positive control of 06b section 2.4: the counter sees point-to-point traffic."""
    cfg = model_parallel_flaws.ArticleConfig(backend="gloo")
    got = launch(model_parallel_flaws.split_step_worker, cfg, 2, runs_dir=runs).wait(timeout=100)
    assert got.values == {r: {"c10d.send": 1, "c10d.recv_": 1} for r in (0, 1)}
