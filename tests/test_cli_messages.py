"""What the command line says: an error on a line of its own after the progress bar, one line for
an interrupted torchrun job, a diverging run's non-zero exit, --run-name used both ways and refused
where it would mix two runs' logs, and help texts that say one thing."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from mgtutorial import __main__ as cli
from mgtutorial.__main__ import build_parser
from mgtutorial.common.finite import LossNotFinite
from mgtutorial.runtime import live, runlog
from mgtutorial.runtime.failure import WorkerFailed

TORCHRUN_ENV = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


class _FailingRun:
    """A run whose ranks logged a plan and two steps, then failed."""

    nprocs = 2

    def __init__(self, run_dir):
        self.run_dir, self.polls = run_dir, 0
        records = [{"kind": "plan", "rank": 0, "steps": 10, "time": time.time()}]
        records += [
            {"kind": "train", "rank": 0, "step": s, "epoch": 0, "loss": 2.0, "global_loss": 2.0}
            | {"samples": 32 * s, "time": time.time()}
            for s in (1, 2)
        ]
        lines = "".join(json.dumps(r) + "\n" for r in records)
        runlog.rank_file(run_dir, 0, "jsonl").write_text(lines)

    def alive(self):
        return 1

    def poll(self):
        self.polls += 1
        if self.polls > 2:
            raise WorkerFailed(1, "RuntimeError", "boom", self.run_dir / "rank1.err")


def test_the_error_after_a_progress_bar_starts_a_line_of_its_own(tmp_path, capsys):
    with pytest.raises(WorkerFailed) as info:
        live.follow_terminal(_FailingRun(tmp_path), png=False)
    print(f"error: {info.value}", file=sys.stderr)
    err = capsys.readouterr().err
    assert "2/10" in err and "\nerror: rank 1 failed with RuntimeError: boom" in err


def test_a_run_that_logs_no_step_shows_no_bar(tmp_path, capsys):
    class Quiet(_FailingRun):
        def __init__(self, run_dir):
            self.run_dir, self.polls = run_dir, 0

    with pytest.raises(WorkerFailed):
        live.follow_terminal(Quiet(tmp_path), png=False)
    assert capsys.readouterr().err == ""  # no "0step [00:02, ?step/s]"


def test_one_step_is_one_step():
    assert cli._ddp_report({"steps": 1, "test_acc": None}) == "1 step per rank"
    assert cli._ddp_report({"steps": 2, "test_acc": 0.5}).startswith("2 steps per rank, final")


@pytest.mark.parametrize(
    "rank, said", [("0", "interrupted: torchrun stops every rank.\n"), ("1", "")]
)
def test_an_interrupted_torchrun_job_says_so_once(rank, said, monkeypatch, capsys):
    for name, value in {**TORCHRUN_ENV, "RANK": rank}.items():
        monkeypatch.setenv(name, value)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run_under_torchrun", interrupted)
    assert cli.main(["hello"]) == 130
    assert capsys.readouterr().err == said


def test_a_diverging_rank_under_torchrun_exits_non_zero(monkeypatch, capsys):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)

    def diverged(*args):
        raise LossNotFinite("the loss is nan at step 3: training diverged", 3, float("nan"))

    monkeypatch.setattr(cli, "_run_under_torchrun", diverged)
    assert cli.main(["ddp", "--lr", "1e6"]) == 1
    assert (
        capsys.readouterr().err == "[rank 0] error: the loss is nan at step 3: training diverged\n"
    )


def test_run_name_names_a_run_launched_from_the_shell(monkeypatch):
    seen = {}

    def fake_launch(worker, cfg, nproc, runs_dir, name):
        seen["name"] = name
        raise ValueError("stop here")

    monkeypatch.setattr("mgtutorial.runtime.launcher.launch", fake_launch)
    assert cli.main(["hello", "--run-name", "mine"]) == 1
    assert seen["name"] == "mine"


def test_a_torchrun_run_name_that_holds_a_run_is_refused(monkeypatch, tmp_path, capsys):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(runlog.RUN_DIR_ENV, str(tmp_path / "taken"))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.json").write_text("{}")
    argv = ["hello", "--runs-dir", str(tmp_path), "--run-name", "taken"]
    assert cli.main(argv) == 1
    assert "taken already holds an earlier run" in capsys.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restart of *another* job: refused
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")
    assert cli.main(argv) == 1
    assert "taken already holds an earlier run" in capsys.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    (tmp_path / "taken" / "torchelastic_run_id").write_text("job-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # this job's, whatever the count says
    monkeypatch.setattr(cli, "_run_under_torchrun", lambda *a: (tmp_path / "taken", {}))
    monkeypatch.setattr(cli, "_hello_report", lambda summary: "ok")
    assert cli.main(argv) == 0


def test_help_texts_say_one_thing(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["ddp", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    tf32 = text[text.rindex("--no-tf32 ") :][:260]  # its description, not the usage line
    assert "True:" not in tf32 and "On by default; this switch turns it off." in tf32
    root = text[text.rindex("--data-root ") :][:160]
    assert root.count("default") == 1


def test_top_level_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text and ":class:" not in text
    assert "(DDPConfig, PipelineConfig" in text and "Commands:\n" in text  # roles as names


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_diverging_run_from_the_shell_exits_non_zero(tmp_path):
    argv = ["ddp", "--dataset", "synthetic", "--lr", "1e6", "--max-steps", "12", "--no-evaluate"]
    out = subprocess.run(
        [sys.executable, "-m", "mgtutorial", *argv, "--runs-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "\nerror: rank " in out.stderr and "LossNotFinite: the loss is" in out.stderr
    assert "done" not in out.stdout


def test_a_command_run_by_another_python_names_the_course_one(monkeypatch, capsys):
    from mgtutorial.workshop import laptop_packages

    def no_torch(command=None):
        raise ModuleNotFoundError("No module named 'torch'")

    monkeypatch.setattr(cli, "build_parser", no_torch)
    monkeypatch.setattr(laptop_packages, "outside_environment", lambda: "this is /usr/bin/python3")
    assert cli.main(["describe"]) == 1
    err = capsys.readouterr().err
    assert "this is /usr/bin/python3: run `.venv/bin/python -m mgtutorial describe`" in err


@pytest.mark.parametrize("command", ["ddp", "pipeline", "hello", "elastic", "check"])
def test_the_ranks_flag_takes_both_spellings_the_documented_one_first(command, capsys):
    field = "nprocs" if command == "check" else "nproc"
    for flag in ("--nproc", "--nprocs"):
        assert getattr(build_parser(command).parse_args([command, flag, "3"]), field) == 3
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    first, second = ("--nprocs", "--nproc") if command == "check" else ("--nproc", "--nprocs")
    assert f"{first} {field.upper()}, {second} {field.upper()}" in text


def test_zero_ranks_is_refused_naming_the_commands_own_flag(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["hello", "--nprocs", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --nproc 0: need at least 1 rank") and "nprocs=" not in err


@pytest.mark.parametrize("command", ["ddp", "check", "data"])
def test_an_unknown_argument_shows_the_commands_own_usage(command, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main([command, *(["cifar10"] if command == "data" else []), "--bogus"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith(f"usage: python -m mgtutorial {command} ")
    assert f"mgtutorial {command}: error: unrecognized arguments: --bogus" in err
    assert "{" not in err.split("\n")[0].replace("{cifar10,digits}", "")  # no list of commands
