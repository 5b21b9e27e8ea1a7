"""The laptop check (``python -m mgtutorial check``): it passes here, and a broken environment (a
missing or too old package, a taken port, ranks that do not finish, no widget front end) becomes
FAIL rows with their fixes and exit code 1. Asserts on rows and exit codes, never on durations."""

from __future__ import annotations

import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from check_table import ROWS, check, cli_env, run_cli

from mgtutorial.workshop import laptop_check, laptop_machine
from mgtutorial.workshop.laptop_packages import Row

RANKS_NOT_STARTED = Row("2 ranks", "pass", "not started in this test")


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_cli_exits_0_here_and_a_missing_cifar10_is_only_a_warning(tmp_path, no_leftovers):
    out, rows = run_cli(tmp_path, MGTUTORIAL_DATA=str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert set(ROWS) <= set(rows), sorted(rows)
    assert not [k for k, v in rows.items() if v[0] == "FAIL"]
    warned = {k for k, v in rows.items() if v[0] not in ("pass", "info")}
    assert warned <= {"CIFAR-10", "cores, memory"}
    assert rows["CIFAR-10"][0] == "WARN" and rows["2 ranks"][0] == "pass"
    assert "python -m mgtutorial data cifar10" in rows["CIFAR-10"][2]
    assert rows["GPU"][0] == "info" and "sum of ranks 1" in rows["2 ranks"][1]
    # the rank check writes its run to a temporary folder
    assert not list((tmp_path / "runs").glob("*"))


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_taken_port_fails_the_port_and_the_rank_check(capsys, no_leftovers):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        code, rows = check(capsys, master_port=port)
    assert code == 1
    assert rows["port"][0] == "FAIL" and f"127.0.0.1:{port} is in use" in rows["port"][1]
    assert f"lsof -i :{port}" in rows["port"][2] and "leave --master-port unset" in rows["port"][2]
    assert rows["2 ranks"][0] == "FAIL" and rows["2 ranks"][1].startswith(
        f"not started: master_port={port}"
    )
    assert "leave --master-port unset" in rows["2 ranks"][2]
    assert [k for k, v in rows.items() if v[0] == "FAIL"] == ["port", "2 ranks"]


@pytest.mark.timeout(120)
def test_ranks_that_do_not_finish_in_time_are_stopped_and_fail(no_leftovers):
    # the deadline has passed at the first poll
    row = laptop_machine.check_ranks(2, timeout_s=0, master_port=None)
    assert row.status == "FAIL" and row.detail == "not finished after 0 s (the ranks were stopped)"
    assert "firewall" in row.fix and "--timeout 60" in row.fix


def test_bad_nprocs_is_refused_before_any_process_starts():
    row = laptop_machine.check_ranks(0, timeout_s=5, master_port=None)
    assert (
        row.status == "FAIL"
        and row.detail == "not started: nprocs=0: need at least 1 rank (an int ≥ 1)."
    )


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_missing_widget_front_end_fails_and_a_present_one_passes(tmp_path, capsys, no_leftovers):
    code, rows = check(capsys, jupyter_path=[str(tmp_path)])
    assert code == 1 and [k for k, v in rows.items() if v[0] == "FAIL"] == ["widgets"]
    assert rows["widgets"][1].startswith(
        f"{laptop_machine.WIDGETS_EXTENSION} is in none of 1 Jupyter data folders"
    )
    assert (
        "pip install 'ipywidgets>=8'" in rows["widgets"][2]
        and "restart JupyterLab" in rows["widgets"][2]
    )
    ext = tmp_path / "labextensions" / laptop_machine.WIDGETS_EXTENSION
    ext.mkdir(parents=True)
    (ext / "package.json").write_text("{}")
    assert laptop_machine.check_widgets([str(tmp_path / "elsewhere"), str(tmp_path)]) == Row(
        "widgets", "pass", f"{laptop_machine.WIDGETS_EXTENSION} in {tmp_path}"
    )


def test_cifar10_on_disk_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("MGTUTORIAL_DATA", str(tmp_path))
    assert laptop_machine.check_cifar10().status == "WARN"
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"")
    assert laptop_machine.check_cifar10() == Row("CIFAR-10", "pass", f"on disk in {tmp_path}")


def test_too_little_disk_fails_and_names_clean_runs(tmp_path):
    row = laptop_machine.check_disk(str(tmp_path / "runs" / "not-yet"), need_gib=1e9)
    assert row.status == "FAIL" and row.detail.endswith(
        f"at {tmp_path} (runs and CIFAR-10 want 1e+09 GiB)"
    )
    assert "make clean-runs" in row.fix


def test_a_check_that_breaks_becomes_a_fail_row_and_the_others_still_run(monkeypatch):
    monkeypatch.setattr(laptop_check, "check_gpu", lambda: 1 / 0)
    monkeypatch.setattr(laptop_check, "check_ranks", lambda *a: RANKS_NOT_STARTED)
    rows = {r.name: r for r in laptop_check.run_checks(laptop_check.CheckConfig())}
    assert rows["GPU"].status == "FAIL" and "ZeroDivisionError" in rows["GPU"].detail
    assert rows["disk"].status == "pass" and list(rows)[-1] == "GPU"


def test_cli_options_are_the_config_fields():
    from mgtutorial.__main__ import build_parser
    from mgtutorial.cli_options import config_from, field_docs

    assert config_from(build_parser().parse_args(["check"])) == laptop_check.CheckConfig()
    args = build_parser().parse_args(
        ["check", "--master-port", "5", "--timeout", "3", "--jupyter-path", "a", "b"]
    )
    want = laptop_check.CheckConfig(master_port=5, timeout_s=3.0, jupyter_path=["a", "b"])
    assert config_from(args) == want
    assert set(field_docs(laptop_check.CheckConfig)) == {
        "nprocs",
        "timeout_s",
        "master_port",
        "runs_dir",
        "jupyter_path",
    }


def test_import_mgtutorial_and_the_check_command_load_neither_torch_nor_psutil():
    code = """if True:
        import sys, mgtutorial
        from mgtutorial.__main__ import build_parser
        build_parser("check").parse_args(["check"])
        assert not {"torch", "psutil"} & set(sys.modules), "imported eagerly"
        from mgtutorial import ddp, exercises
        from mgtutorial import launch
        from mgtutorial.runtime import env
        import mgtutorial.runtime.launcher as launcher, mgtutorial.ddp
        assert mgtutorial.launch is launch is launcher.launch and callable(launcher.free_port)
        assert launch.__module__ == "mgtutorial.runtime.launcher", launch
        assert mgtutorial.ddp is ddp and ddp.Trainer is mgtutorial.Trainer
        assert mgtutorial.read_run is mgtutorial.runtime.runlog.read_run
        assert all(getattr(mgtutorial, name) for name in mgtutorial.__all__)
        assert "Trainer" in dir(mgtutorial)
        print(len(mgtutorial.__all__), mgtutorial.__version__)
    """
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, env=cli_env()
    )
    assert out.returncode == 0 and out.stdout.split() == ["25", "0.1.0"], out.stdout + out.stderr


def test_a_check_whose_import_fails_names_the_package_and_its_install(monkeypatch):
    def gpu():
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(laptop_check, "check_gpu", gpu)
    monkeypatch.setattr(laptop_check, "check_ranks", lambda *a: RANKS_NOT_STARTED)
    row = {r.name: r for r in laptop_check.run_checks(laptop_check.CheckConfig())}["GPU"]
    assert (row.status, row.detail) == (
        "FAIL",
        "not run: ModuleNotFoundError: No module named 'torch'",
    )
    assert "pip install 'torch<2.15,>=2.4'" in row.fix


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--master-port", "70000"], "master_port=70000: a port is between 1 and 65535"),
        (["--master-port", "-1"], "master_port=-1: a port is between 1 and 65535"),
        (["--nprocs", "0"], "nprocs=0: the rank check needs at least 1 rank (try --nprocs 2)"),
        (["--timeout", "nan"], "timeout_s=nan: give the ranks a number of seconds > 0"),
        (["--timeout", "0"], "timeout_s=0.0: give the ranks a number of seconds > 0"),
    ],
)
def test_bad_options_are_usage_errors_before_any_check(argv, message, capsys):
    from mgtutorial.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["check", *argv])
    out = capsys.readouterr()
    assert exit_.value.code == 2 and f"python -m mgtutorial check: error: {message}" in out.err
    assert out.out == "" and "usage:" in out.err and "instructor" not in out.err
    with pytest.raises(ValueError, match=message.split(":")[0]):
        laptop_check.main(laptop_check.CheckConfig(**_fields(argv)))


def _fields(argv: list[str]) -> dict:
    from mgtutorial.__main__ import build_parser
    from mgtutorial.cli_options import config_from

    return config_from(build_parser("check").parse_args(["check", *argv])).__dict__


@pytest.mark.timeout(120)
def test_one_rank_is_singular(no_leftovers):
    row = laptop_machine.check_ranks(1, timeout_s=60, master_port=None)
    assert (row.name, row.status) == ("1 rank", "pass") and "sum of ranks 0" in row.detail


def test_runs_dir_naming_a_file_fails_the_disk_row(tmp_path):
    (tmp_path / "runs").write_text("")
    for where in (tmp_path / "runs", tmp_path / "runs" / "below"):
        assert laptop_machine.check_disk(str(where)) == Row(
            "disk",
            "FAIL",
            f"{tmp_path / 'runs'} is a file, not a folder",
            "give --runs-dir a folder (or move the file)",
        )


def test_help_says_each_default_once(capsys):
    from mgtutorial.__main__ import main

    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "(default: one the operating system picks)." in text
        and "(default: Jupyter's data path)." in text
    )
    assert "(default: None)" not in text and text.count("(default:") == 5


def test_unknown_requirements_or_a_broken_probe_are_fail_rows_not_tracebacks(monkeypatch):
    def not_installed():
        raise metadata.PackageNotFoundError("mgtutorial")

    monkeypatch.setattr(laptop_check, "check_ranks", lambda *a: RANKS_NOT_STARTED)
    monkeypatch.setattr(laptop_check, "requirements", not_installed)
    rows = {r.name: r for r in laptop_check.run_checks(laptop_check.CheckConfig())}
    assert (rows["python"].status, rows["python"].detail) == (
        "FAIL",
        "the required packages are unknown: PackageNotFoundError: "
        "No package metadata was found for mgtutorial",
    )
    assert (
        "pip install -e ." in rows["python"].fix
        and rows["disk"].status == "pass"
        and list(rows)[-1] == "GPU"
    )

    monkeypatch.undo()
    monkeypatch.setattr(laptop_check, "check_ranks", lambda *a: RANKS_NOT_STARTED)
    monkeypatch.setattr(laptop_check, "import_errors", lambda names: [][0])
    rows = {r.name: r for r in laptop_check.run_checks(laptop_check.CheckConfig())}
    assert rows["torch"].status == "FAIL" and rows["torch"].detail.endswith(
        "import torch fails: the import probe failed: IndexError: list index out of range"
    )
    assert rows["GPU"] == Row(
        "GPU",
        "FAIL",
        "not run: it needs torch (see above)",
        "fix the torch row first, then run the check again",
    )


@pytest.mark.parametrize(
    "nprocs, error, match",
    [
        (True, TypeError, "nprocs=True is a bool: it must be an int"),
        (2.0, TypeError, "nprocs=2.0 is a float: it must be an int"),
        (0, ValueError, "nprocs=0: the rank check needs at least 1 rank"),
    ],
)
def test_nprocs_that_is_not_a_positive_int_is_refused(nprocs, error, match):
    with pytest.raises(error, match=match):
        laptop_check.CheckConfig(nprocs=nprocs).validate()


@pytest.mark.skipif(sys.platform != "linux", reason="/proc takes no new folder on Linux")
def test_a_runs_dir_that_cannot_be_created_is_named_not_the_free_space():
    row = laptop_machine.check_disk("/proc/nope")  # refused even to root, whom os.access lets by
    assert row.status == "FAIL" and row.detail.startswith(
        "--runs-dir /proc/nope: no folder can be created in /proc ("
    )
    assert "GiB" not in row.detail and "--runs-dir a folder you can write" in row.fix


def test_the_timeout_says_it_does_not_count_the_ranks_launch(capsys):
    from mgtutorial.__main__ import main

    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Seconds the ranks may take, once launched," in text and "is not counted" in text
    workshop = (Path(__file__).resolve().parents[1] / "WORKSHOP.md").read_text()
    row = next(r for r in workshop.splitlines() if r.startswith("| `2 ranks` |"))
    assert "of their launch (the launch itself" in row and "is not counted" in row
