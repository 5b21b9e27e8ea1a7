"""DDP == one process on the combined batch; global loss; checkpoints and resume."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import workers

from mgtutorial import ddp, launch
from mgtutorial.common import checkpoint, models
from mgtutorial.common.compare import max_abs_diff
from mgtutorial.runtime import runlog


def _params(path):
    return torch.load(path, weights_only=True)["model"]


@pytest.mark.timeout(90)
def test_ddp_equals_single_process_on_combined_batch(runs, no_leftovers):
    ckpt = runs / "ddp.pt"
    cfg = ddp.DDPConfig(
        dataset="synthetic",
        batch_size=8,
        max_steps=5,
        lr=0.05,
        evaluate=False,
        checkpoint=str(ckpt),
    )
    launch(ddp.worker, cfg, 2, runs_dir=runs).wait(timeout=60)
    got = _params(ckpt)
    ref = ddp.combined_batch_reference(cfg, 2).state_dict()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # the comparison can fail: one process on rank 0's batches alone ends elsewhere
    alone = ddp.combined_batch_reference(cfg, 1).state_dict()
    assert max_abs_diff(alone, got) > 1e-4


@pytest.mark.timeout(60)
def test_global_loss_is_mean_over_ranks(runs, no_leftovers):
    run = launch(workers.fixed_loss, workers.FixedLossConfig(base=1.0, steps=3), 2, runs_dir=runs)
    run.wait(timeout=30)
    recs = [r for r in runlog.read_run(run.run_dir) if r.get("kind") == "train"]
    assert len(recs) == 6
    assert {r["loss"] for r in recs if r["rank"] == 0} == {1.0}
    assert {r["loss"] for r in recs if r["rank"] == 1} == {2.0}
    assert all(r["global_loss"] == 1.5 for r in recs)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_checkpoint_written_once_loads_strict_and_resume_continues(runs, no_leftovers):
    common = dict(dataset="synthetic", batch_size=16, evaluate=False)
    ckpt = runs / "resume.pt"
    run1 = launch(
        ddp.worker, ddp.DDPConfig(epochs=1, checkpoint=str(ckpt), **common), 2, runs_dir=runs
    )
    r1 = run1.wait(timeout=60)
    saves = [r for r in runlog.read_run(run1.run_dir) if r.get("kind") == "checkpoint"]
    assert [(s["rank"], s["epoch"]) for s in saves] == [(0, 1)]  # rank 0 only, once per epoch
    state = torch.load(ckpt, weights_only=True, map_location="cpu")
    assert not [k for k in state["model"] if k.startswith("module.")]
    assert state["epoch"] == 1 and state["step"] == r1.values[0]["steps"]
    models.ArticleCNN((3, 32, 32)).load_state_dict(state["model"], strict=True)
    assert not list(runs.glob("*.tmp"))

    run2 = launch(
        ddp.worker,
        ddp.DDPConfig(epochs=2, checkpoint=str(ckpt), resume=True, **common),
        2,
        runs_dir=runs,
    )
    run2.wait(timeout=60)
    steps = [
        r["step"]
        for r in runlog.read_run(run2.run_dir)
        if r.get("kind") == "train" and r["rank"] == 0
    ]
    assert steps[0] == state["step"] + 1  # continues, does not start over
    straight = runs / "straight.pt"
    launch(
        ddp.worker, ddp.DDPConfig(epochs=2, checkpoint=str(straight), **common), 2, runs_dir=runs
    ).wait(timeout=60)
    torch.testing.assert_close(_params(ckpt), _params(straight))  # resumed == uninterrupted


@pytest.mark.timeout(120)
def test_max_steps_cut_epoch_resumes_mid_epoch(runs, no_leftovers):
    common = dict(
        dataset="synthetic", batch_size=16, evaluate=False, checkpoint=str(runs / "cut.pt")
    )
    launch(ddp.worker, ddp.DDPConfig(epochs=1, max_steps=3, **common), 2, runs_dir=runs).wait(
        timeout=60
    )
    state = torch.load(runs / "cut.pt", weights_only=True)
    assert (state["epoch"], state["batch"], state["step"]) == (0, 3, 3)  # not "1 epoch done"
    run = launch(ddp.worker, ddp.DDPConfig(epochs=1, resume=True, **common), 2, runs_dir=runs)
    res = run.wait(timeout=60)
    per_epoch = -(-256 // (16 * 2))  # synthetic train set: 256 samples, 2 ranks × 16
    assert res.values[0]["steps"] == per_epoch  # the rest of epoch 0 was trained, nothing skipped


def test_checkpoint_roundtrip_without_processes(tmp_path):
    model = models.ArticleCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()
    checkpoint.save_checkpoint(tmp_path / "c.pt", model, opt, epoch=3, step=7)
    fresh = models.ArticleCNN()
    opt2 = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    state = checkpoint.load_checkpoint(tmp_path / "c.pt", fresh, opt2)
    assert (state["epoch"], state["step"]) == (3, 7)
    for a, b in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(a, b)
    assert opt2.state_dict()["state"][0]["momentum_buffer"].abs().sum() > 0


@pytest.mark.parametrize("content", [b"not a checkpoint at all", b"", "torch-without-model"])
def test_load_checkpoint_names_a_file_it_did_not_write(tmp_path, content):
    path = tmp_path / "c.pt"
    if content == "torch-without-model":
        torch.save({"weights": torch.zeros(2)}, path)
    else:
        path.write_bytes(content)
    with pytest.raises(
        ValueError, match="c.pt .*(is not a checkpoint written by|holds no 'model')"
    ):
        checkpoint.load_checkpoint(path, models.ArticleCNN())


@pytest.mark.timeout(90)
def test_epoch_line_is_epoch_mean_and_throughput_counts_training_time(runs, no_leftovers):
    cfg = ddp.DDPConfig(dataset="synthetic", epochs=2, batch_size=32, evaluate=False)
    run = launch(ddp.worker, cfg, 2, runs_dir=runs)
    res = run.wait(timeout=60)
    recs = [r for r in runlog.read_run(run.run_dir) if r.get("kind") == "train" and r["rank"] == 0]
    printed = [
        float(ln.rsplit(" ", 1)[1])
        for ln in run.log_path(0, "out").read_text().splitlines()
        if "epoch mean loss" in ln
    ]
    means = [
        sum(r["global_loss"] for r in recs if r["epoch"] == e) / sum(r["epoch"] == e for r in recs)
        for e in (0, 1)
    ]
    assert printed == pytest.approx(means, abs=5e-5)  # 4 decimals printed
    assert printed[1] != pytest.approx(recs[-1]["global_loss"], abs=5e-5)  # not the last step's
    for v in res.values.values():
        assert v["samples"] == 2 * 128
        assert v["samples_per_s"] * v["train_time_s"] == pytest.approx(v["samples"])


def test_the_reference_stops_where_the_ranks_stop():
    """256 synthetic samples on 2 ranks of 64 are 2 steps per epoch: with 3 epochs the ranks go
    on into epoch 1 (refused); with 1 they stop after 2 steps, and so does the reference."""
    cfg = ddp.DDPConfig(dataset="synthetic", batch_size=64, max_steps=4, evaluate=False)
    with pytest.raises(ValueError, match="epoch 0 has 2 steps of 64 per rank on 2 rank"):
        ddp.combined_batch_reference(cfg, 2)
    one_epoch = dataclasses.replace(cfg, epochs=1)
    two_steps = dataclasses.replace(cfg, epochs=1, max_steps=2)
    torch.testing.assert_close(
        ddp.combined_batch_reference(one_epoch, 2).state_dict(),
        ddp.combined_batch_reference(two_steps, 2).state_dict(),
    )
    # chapter 02's check run on 8 ranks: epoch 0 of the digits has 6 steps of 32, epochs=1
    check = ddp.DDPConfig(dataset="digits", epochs=1, max_steps=10, evaluate=False, tf32=False)
    assert ddp.combined_batch_reference(check, 8) is not None


@pytest.mark.parametrize("nprocs", [2, 3, 4, 8])
def test_chapter_03b_timed_runs_stay_in_epoch_0(nprocs):
    """03b's TIMED config, sized from the number of ranks, fits epoch 0 of the digits on a
    machine with 2 to 8 GPUs (a rank per GPU)."""
    from mgtutorial import load_dataset

    images = len(load_dataset("digits")[0])
    cfg = ddp.DDPConfig(
        dataset="digits",
        batch_size=min(32, images // (10 * nprocs)),
        max_steps=10,
        evaluate=False,
        tf32=False,
    )
    loaders = [ddp.rank_loader(load_dataset("digits")[0], cfg, r, nprocs) for r in range(nprocs)]
    assert min(len(loader) for loader in loaders) >= cfg.max_steps
