"""Every bad value is refused before a rank starts, naming the value and the fix: what passed
validation and failed inside a rank before (a seed, a timeout, a float epoch count, another
worker's config, no config, a download without a network, a checkpoint folder that cannot be
written, pipeline data that cannot fit), and what was silently ignored (a snapshot interval without
a checkpoint, a resume with other settings)."""

from __future__ import annotations

import socket
import sys
from collections import namedtuple

import psutil
import pytest
import torch
import workers

from mgtutorial import ddp, launch
from mgtutorial.common import checkpoint, data
from mgtutorial.pipeline import schedules
from mgtutorial.runtime import env
from mgtutorial.scale.elastic import ElasticConfig

DIGITS = dict(dataset="digits")


@pytest.mark.parametrize(
    "cfg, error, match",
    [
        (ddp.DDPConfig(epochs=2.5), TypeError, r"epochs=2.5 is a float: it must be an int"),
        (ddp.DDPConfig(lr="0.1"), TypeError, r"lr='0.1' is a str: it must be a number"),
        (ddp.DDPConfig(seed=2**64), ValueError, r"seed=18446744073709551616: a seed must be"),
        (ddp.DDPConfig(timeout_s=0.001), ValueError, r"timeout_s=0.001: must be at least 1 s"),
        (ddp.DDPConfig(momentum=5), ValueError, r"momentum=5: SGD's momentum must be below 1"),
        (ddp.DDPConfig(download=True, **DIGITS), None, None),  # digits never download
    ],
)
def test_values_that_used_to_fail_inside_a_rank(cfg, error, match):
    if error is None:
        cfg.validate(2)
        return
    with pytest.raises(error, match=match):
        cfg.validate(2)


@pytest.mark.parametrize(
    "worker, cfg, match",
    [
        (ddp.worker, ddp.DDPConfig(epochs=2.5), r"epochs=2.5 is a float"),
        (ddp.worker, None, r"cfg=None: worker mgtutorial.ddp.trainer.worker takes a DDPConfig"),
        (
            ddp.worker,
            schedules.PipelineConfig(),
            r"cfg is a PipelineConfig, but worker mgtutorial.ddp.trainer.worker takes a DDPConfig",
        ),
        (workers.fixed_loss, workers.FixedLossConfig(steps=1.5), r"steps=1.5 is a float"),
    ],
)
def test_launch_refuses_before_any_rank(worker, cfg, match, runs):
    with pytest.raises(TypeError, match=match):
        launch(worker, cfg, 2, runs_dir=runs)
    assert not list(runs.iterdir())  # no run directory: nothing started


def test_a_subclass_of_the_worker_config_is_accepted():
    from mgtutorial.runtime.launcher import check_config

    check_config(ddp.worker, ElasticConfig(**DIGITS), 2, "gloo")


def test_a_download_without_a_network_is_refused_before_any_rank(monkeypatch, tmp_path, runs):
    def offline(address, timeout=None):
        raise OSError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(socket, "create_connection", offline)
    cfg = ddp.DDPConfig(dataset="cifar10", download=True, data_root=str(tmp_path / "data"))
    with pytest.raises(ConnectionError, match=r"cannot reach www.cs.toronto.edu .*digits"):
        launch(ddp.worker, cfg, 2, runs_dir=runs)
    assert not list(runs.iterdir()) and not (tmp_path / "data").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="/sys refuses new files on Linux only")
def test_a_checkpoint_folder_that_cannot_be_written_is_refused_before_training():
    cfg = ddp.DDPConfig(checkpoint="/sys/mgtutorial/ddp.pt", **DIGITS)
    with pytest.raises(ValueError, match=r"checkpoint='/sys/mgtutorial/ddp.pt'.*cannot write in"):
        cfg.validate(2)


def test_a_checkpoint_under_a_file_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("not a folder")
    cfg = ddp.DDPConfig(checkpoint=str(tmp_path / "notes.txt" / "ddp.pt"), **DIGITS)
    with pytest.raises(ValueError, match=r"notes.txt is a file, not a folder"):
        cfg.validate(2)


def test_runs_dir_errors_name_the_option_not_the_run_folder(tmp_path):
    not_a_dir = tmp_path / "runs"
    not_a_dir.write_text("a file")
    with pytest.raises(ValueError, match=r"^runs_dir \(--runs-dir\)='.*runs': .* is a file"):
        launch(ddp.worker, ddp.DDPConfig(**DIGITS), 2, runs_dir=not_a_dir)


def test_pipeline_data_that_cannot_fit_is_refused_with_the_figure(monkeypatch):
    memory = namedtuple("memory", "available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(8 * 2**30))
    with pytest.raises(ValueError) as info:
        schedules.PipelineConfig(steps=100_000).validate(2)
    message = str(info.value)
    assert "every rank builds all its batches before the first step, 48.9 GiB for 2 rank(s)" in (
        message
    )
    assert "more than half of the 8.0 GiB available. Use at most steps=8176" in message
    schedules.PipelineConfig(steps=8176).validate(2)


def test_snapshots_without_a_checkpoint_file_are_refused():
    with pytest.raises(ValueError, match=r"checkpoint_every=5 needs a file .*\(--checkpoint"):
        ElasticConfig(checkpoint_every=5, **DIGITS).validate(2)
    with pytest.raises(ValueError, match=r"fail_step=-7: must be at least 1 \(or -1: never\)"):
        ElasticConfig(fail_rank=1, fail_step=-7, **DIGITS).validate(2)


def test_a_resume_with_another_data_set_or_batch_size_is_refused(tmp_path):
    path = tmp_path / "new" / "ddp.pt"  # a folder the first save makes
    cfg = ddp.DDPConfig(checkpoint=str(path), batch_size=16, max_steps=1, **DIGITS)
    model, train_set, test_set, opt = ddp.build(cfg, env.DistContext.single_process())
    ddp.Trainer(model, train_set, test_set, opt, env.DistContext.single_process(), cfg)
    assert checkpoint.settings_path(path).read_text() == '{"batch_size": 16, "dataset": "digits"}'
    torch.save({"model": {}}, path)  # a checkpoint now exists to resume from
    again = dict(checkpoint=str(path), resume=True)
    ddp.DDPConfig(batch_size=16, **again, **DIGITS).validate(2)
    with pytest.raises(ValueError, match=r"batch_size=32 \(the checkpoint's: 16\)"):
        ddp.DDPConfig(**again, **DIGITS).validate(2)
    with pytest.raises(ValueError, match=r"dataset='synthetic' \(the checkpoint's: 'digits'\)"):
        ddp.DDPConfig(batch_size=16, dataset="synthetic", **again).validate(2)


def test_fetching_cifar10_leaves_nothing_behind_when_it_fails(monkeypatch, tmp_path):
    from mgtutorial.__main__ import main

    def half_then_fail(root, download):  # torchvision makes the folder, then the network drops
        root.mkdir(parents=True)
        (root / "cifar-10-python.tar.gz").write_bytes(b"half")
        raise OSError("connection reset")

    monkeypatch.setattr(data, "check_reachable", lambda url: None)
    monkeypatch.setattr(data, "load_cifar10", half_then_fail)
    root = tmp_path / "missing" / "data"
    assert main(["data", "cifar10", "--root", str(root)]) == 1
    assert not (tmp_path / "missing").exists()  # neither the folder nor the parent it made


def test_data_root_that_is_a_file_is_named_not_the_network(tmp_path, capsys):
    from mgtutorial.__main__ import main

    a_file = tmp_path / "data"
    a_file.write_text("not a folder")
    assert main(["data", "cifar10", "--root", str(a_file)]) == 1
    err = capsys.readouterr().err
    assert f"{a_file} is a file, not a folder" in err and "network" not in err


def test_the_cifar10_fetch_command_names_a_root_that_is_not_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("MGTUTORIAL_DATA", str(tmp_path / "default"))
    with pytest.raises(FileNotFoundError, match=r"data cifar10\n"):  # the default: no --root
        data.check_available("cifar10", tmp_path / "default")
    elsewhere = tmp_path / "else where"  # quoted, so the command runs as printed
    with pytest.raises(FileNotFoundError) as refused:
        data.check_available("cifar10", elsewhere)
    assert f"    .venv/bin/python -m mgtutorial data cifar10 --root '{elsewhere}'\n" in str(
        refused.value
    )
