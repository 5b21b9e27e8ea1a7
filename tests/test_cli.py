"""The command line, both ways: it launches its own ranks, and it runs as one rank under
torchrun; its options are generated from the config dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

from mgtutorial import ddp
from mgtutorial.__main__ import build_parser
from mgtutorial.cli_options import add_config_options, config_from, field_docs
from mgtutorial.common import data
from mgtutorial.common.config import Config
from mgtutorial.hello import HelloConfig
from mgtutorial.pipeline import schedules as pipeline
from mgtutorial.runtime import runlog

ARGS = ["ddp", "--epochs", "1", "--max-steps", "6", "--dataset", "digits"]


def _env():
    e = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(var, None)
    return e


def _check_run_dir(run_dir: Path):
    for r in (0, 1):
        recs = [x for x in runlog.read_run(run_dir) if x["rank"] == r and x.get("kind") == "train"]
        assert [x["step"] for x in recs] == list(range(1, 7)), f"rank {r}"
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert json.loads((run_dir / "config.json").read_text())["config"]["max_steps"] == 6


@pytest.mark.timeout(240)  # a hang's limit, not a speed target: 2 ranks take ~20 s when quiet
@pytest.mark.slow
def test_cli_launches_locally(runs, no_leftovers):
    out = subprocess.run(
        [sys.executable, "-m", "mgtutorial", *ARGS, "--nproc", "2", "--runs-dir", str(runs)],
        capture_output=True,
        text=True,
        timeout=220,
        env=_env(),
    )
    assert out.returncode == 0, out.stderr
    assert "final test accuracy" in out.stdout
    (run_dir,) = runs.iterdir()
    _check_run_dir(run_dir)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_cli_under_torchrun_does_not_launch_again(runs, no_leftovers):
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "mgtutorial"]
    out = subprocess.run(
        [*launcher, *ARGS, "--runs-dir", str(runs), "--run-name", "tr"],
        capture_output=True,
        text=True,
        timeout=100,
        env=_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "final test accuracy" in out.stdout
    assert [p.name for p in runs.iterdir()] == ["tr"]  # one run directory: no nested launch
    _check_run_dir(runs / "tr")


def test_cli_bad_choice_is_a_usage_error():
    out = subprocess.run(
        [sys.executable, "-m", "mgtutorial", "hello", "--backend", "mpi"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert out.returncode == 2 and "invalid choice: 'mpi'" in out.stderr


def test_cli_bad_dataset_is_refused_before_any_rank(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mgtutorial", "ddp", "--dataset", "imagenet"]
        + ["--runs-dir", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    # a usage error where the field is a Literal, else the config's own validate
    assert out.returncode in (1, 2) and "imagenet" in out.stderr
    assert not (tmp_path / "runs").exists()


@dataclasses.dataclass(kw_only=True)
class ChoicesConfig(Config):
    """A config of the kinds of field the options are generated from."""

    mode: Literal["fast", "exact"] = "fast"
    """A choice."""
    order: Literal[1, 2] | None = None
    """A choice that may stay unset."""
    sizes: list[int] = dataclasses.field(default_factory=lambda: [4, 2])
    """Several numbers."""
    note: str = "x"
    """Free text (100% of it)."""
    timeout_s: float = 1.0
    """Seconds (an alias: --timeout)."""
    verbose: bool = True
    """Print more."""


def test_every_literal_field_gets_its_choices_from_the_type(capsys):
    p = argparse.ArgumentParser()
    add_config_options(p, ChoicesConfig)
    p.set_defaults(config_class=ChoicesConfig)
    assert config_from(p.parse_args([])) == ChoicesConfig()
    args = p.parse_args(
        ["--mode", "exact", "--order", "2", "--sizes", "8", "4", "--timeout", "3", "--no-verbose"]
    )
    assert config_from(args) == ChoicesConfig(
        mode="exact", order=2, sizes=[8, 4], timeout_s=3.0, verbose=False
    )
    for argv in (["--mode", "quick"], ["--order", "3"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    assert "invalid choice" in capsys.readouterr().err
    text = " ".join(p.format_help().split())
    assert "--mode {fast,exact}" in text and "--order {1,2}" in text
    assert "--note NOTE Free text (100% of it). (default: x)" in text


@pytest.mark.slow
def test_cli_refuses_missing_cifar10_before_any_rank(tmp_path):
    argv = ["ddp", "--dataset", "cifar10", "--data-root", str(tmp_path / "none")]
    out = subprocess.run(
        [sys.executable, "-m", "mgtutorial", *argv, "--runs-dir", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert (
        out.returncode == 1
        and "CIFAR-10 is not in" in out.stderr
        and f"python -m mgtutorial data cifar10 --root {tmp_path / 'none'}\n" in out.stderr
    )
    assert not (tmp_path / "runs").exists()  # no run directory: no rank was started


@pytest.mark.parametrize(
    "command, cls",
    [("ddp", ddp.DDPConfig), ("pipeline", pipeline.PipelineConfig), ("hello", HelloConfig)],
)
def test_options_are_the_config_fields_with_their_defaults(command, cls):
    args = build_parser().parse_args([command])
    assert config_from(args) == cls()  # every field, and the same defaults as the dataclass
    for f in dataclasses.fields(cls):
        assert field_docs(cls)[f.name], f"{cls.__name__}.{f.name} has no docstring for --help"


def test_options_set_config_fields():
    argv = ["ddp", "--no-evaluate", "--timeout", "5", "--max-steps", "3", "--dataset", "digits"]
    args = build_parser().parse_args(argv + ["--backend", "gloo"])
    assert config_from(args) == ddp.DDPConfig(
        evaluate=False, timeout_s=5.0, max_steps=3, dataset="digits", backend="gloo"
    )
    args = build_parser().parse_args(["pipeline", "--microbatches", "2", "--sizes", "8", "4", "2"])
    assert config_from(args) == pipeline.PipelineConfig(n_microbatches=2, sizes=[8, 4, 2])
    args = build_parser().parse_args(["hello", "--backend", "gloo"])
    assert config_from(args) == HelloConfig(backend="gloo")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "argv, expect",
    [
        (["hello", "--nproc", "2"], "sum of ranks 1"),
        (
            [
                "pipeline",
                "--nproc",
                "2",
                "--steps",
                "2",
                "--batch-size",
                "16",
                "--sizes",
                "32",
                "16",
                "8",
            ],
            "stage 0 peak activations",
        ),
    ],
)
@pytest.mark.slow
def test_cli_hello_and_pipeline(argv, expect, runs, no_leftovers):
    out = subprocess.run(
        [sys.executable, "-m", "mgtutorial", *argv, "--runs-dir", str(runs)],
        capture_output=True,
        text=True,
        timeout=100,
        env=_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert expect in out.stdout


@pytest.mark.slow
def test_cli_describe():
    out = subprocess.run(
        [sys.executable, "-m", "mgtutorial", "describe"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert out.returncode == 0 and "backend: " in out.stdout and "default_nprocs: " in out.stdout


def test_cli_runs_dir_that_is_a_file_is_an_error_not_a_traceback(tmp_path, capsys):
    from mgtutorial.__main__ import main

    not_a_dir = tmp_path / "runs"
    not_a_dir.write_text("a file, not a folder")
    assert main([*ARGS, "--nproc", "2", "--runs-dir", str(not_a_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_cli_interrupt_says_ranks_were_stopped(monkeypatch, capsys):
    from mgtutorial import __main__ as cli

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_launch_locally", interrupted)
    assert cli.main(ARGS) == 130
    assert capsys.readouterr().err == "interrupted: every rank was stopped.\n"


def test_cli_data_offline_is_an_error_with_the_fix(monkeypatch, tmp_path, capsys):
    from mgtutorial import __main__ as cli

    def offline(root, download):
        raise OSError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(data, "load_cifar10", offline)
    assert cli.main(["data", "cifar10", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "could not download CIFAR-10" in err and "digits" in err


def test_cli_under_torchrun_refuses_before_writing_anything(monkeypatch, tmp_path, capsys):
    from mgtutorial import __main__ as cli

    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(name, value)
    # set here (as torchrun's ranks would derive it), so that monkeypatch restores the environment:
    # the CLI sets it with setdefault, and a variable left behind would redirect every later run
    monkeypatch.setenv(runlog.RUN_DIR_ENV, str(tmp_path / "refused"))
    assert (
        cli.main(["ddp", "--epochs", "0", "--runs-dir", str(tmp_path), "--run-name", "refused"])
        == 1
    )
    assert "epochs=0" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_cli_help_has_no_rest_markup(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["ddp", "--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text and ":mod:" not in text
