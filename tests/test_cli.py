"""The command line, both ways: it launches its own ranks, and it runs as one rank under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mgtutorial import runlog

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


@pytest.mark.timeout(120)
def test_cli_launches_locally(runs, no_leftovers):
    out = subprocess.run([sys.executable, "-m", "mgtutorial", *ARGS, "--nproc", "2", "--runs-dir", str(runs)],
                         capture_output=True, text=True, timeout=100, env=_env())
    assert out.returncode == 0, out.stderr
    assert "final test accuracy" in out.stdout
    (run_dir,) = runs.iterdir()
    _check_run_dir(run_dir)


@pytest.mark.timeout(120)
def test_cli_under_torchrun_does_not_launch_again(runs, no_leftovers):
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "mgtutorial", *ARGS,
                          "--runs-dir", str(runs), "--run-name", "tr"],
                         capture_output=True, text=True, timeout=100, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "final test accuracy" in out.stdout
    assert [p.name for p in runs.iterdir()] == ["tr"]  # one run directory: no nested launch
    _check_run_dir(runs / "tr")


def test_cli_bad_dataset_is_refused():
    out = subprocess.run([sys.executable, "-m", "mgtutorial", "ddp", "--dataset", "imagenet"],
                         capture_output=True, text=True, timeout=60, env=_env())
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_cli_refuses_missing_cifar10_before_any_rank(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mgtutorial", "ddp", "--dataset", "cifar10", "--data-root",
                          str(tmp_path / "none"), "--runs-dir", str(tmp_path / "runs")],
                         capture_output=True, text=True, timeout=60, env=_env())
    assert out.returncode == 1 and "CIFAR-10 is not in" in out.stderr and "python -m mgtutorial data cifar10" in out.stderr
    assert not (tmp_path / "runs").exists()  # no run directory: no rank was started
