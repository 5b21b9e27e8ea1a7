"""The laptop check (``python -m mgtutorial check``): it passes here, and a broken environment (a
missing or too old package, a taken port, ranks that do not finish, no widget front end) becomes
FAIL rows with their fixes and exit code 1. Asserts on rows and exit codes, never on durations."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from importlib import metadata

import pytest

from mgtutorial.workshop import laptop_check as lc

ROWS = (
    "python",
    "torch",
    "torchvision",
    "jupyterlab",
    "ipywidgets",
    "matplotlib",
    "nbval",
    "cores, memory",
    "port",
    "2 ranks",
    "widgets",
    "CIFAR-10",
    "disk",
    "GPU",
)


def parse(table: str) -> dict[str, tuple[str, str, str]]:
    """The printed table as {check: (result, details, fix)}; columns found from the header line."""
    lines = table.splitlines()
    col = lines[0].index("result")
    rows: dict[str, list[str]] = {}
    last = ""
    for line in lines[1:]:
        name, status, rest = line[:col].strip(), line[col : col + 8].strip(), line[col + 8 :]
        if not name and status == "fix:":
            rows[last][2] = rest
        elif name:
            rows[name], last = [status, rest, ""], name
    return {k: tuple(v) for k, v in rows.items()}


def check(capsys, **options) -> tuple[int, dict]:
    code = lc.main(
        lc.CheckConfig(**{"timeout_s": 60.0, **options})
    )  # a slow machine is not the point here
    return code, parse(capsys.readouterr().out.split("\nchecked in")[0].rsplit("\n", 1)[0])


def _env(**extra):
    e = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    return {**e, "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_cli_exits_0_here_and_a_missing_cifar10_is_only_a_warning(tmp_path, no_leftovers):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mgtutorial",
            "check",
            "--runs-dir",
            str(tmp_path / "runs"),
            "--timeout",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=100,
        env=_env(MGTUTORIAL_DATA=str(tmp_path)),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = parse(out.stdout.split("\nchecked in")[0].rsplit("\n", 1)[0])
    assert set(ROWS) <= set(rows), sorted(rows)
    assert not [k for k, v in rows.items() if v[0] == "FAIL"]
    assert {k: v[0] for k, v in rows.items() if v[0] not in ("pass", "info")}.keys() <= {
        "CIFAR-10",
        "cores, memory",
    }
    assert rows["CIFAR-10"][0] == "WARN" and rows["2 ranks"][0] == "pass"
    assert "python -m mgtutorial data cifar10" in rows["CIFAR-10"][2]
    assert rows["GPU"][0] == "info" and "sum of ranks 1" in rows["2 ranks"][1]
    assert not list((tmp_path / "runs").glob("*")), (
        "the rank check writes its run to a temporary folder"
    )


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_missing_and_too_old_packages_fail_with_a_pip_command(monkeypatch, capsys, no_leftovers):
    real = metadata.version

    def version(name):
        if name == "nbval":
            raise metadata.PackageNotFoundError(name)
        return "2.3.0" if name == "torch" else real(name)

    monkeypatch.setattr(metadata, "version", version)
    code, rows = check(capsys)
    assert code == 1
    assert rows["nbval"][:2] == ("FAIL", "not installed (needs >=0.11)")
    assert (
        "pip install 'nbval>=0.11'" in rows["nbval"][2]
        and "--find-links wheels" in rows["nbval"][2]
    )
    assert rows["torch"][:2] == ("FAIL", "2.3.0 installed, but the course needs >=2.4,<2.15")
    assert "pip install 'torch<2.15,>=2.4'" in rows["torch"][2]
    assert [k for k, v in rows.items() if v[0] == "FAIL"] == ["torch", "nbval"]


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
    row = lc.check_ranks(
        2, timeout_s=0, master_port=None
    )  # the deadline has passed at the first poll
    assert row.status == "FAIL" and row.detail == "not finished after 0 s (the ranks were stopped)"
    assert "firewall" in row.fix and "--timeout 60" in row.fix


def test_bad_nprocs_is_refused_before_any_process_starts():
    row = lc.check_ranks(0, timeout_s=5, master_port=None)
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
        f"{lc.WIDGETS_EXTENSION} is in none of 1 Jupyter data folders"
    )
    assert (
        "pip install 'ipywidgets>=8'" in rows["widgets"][2]
        and "restart JupyterLab" in rows["widgets"][2]
    )
    ext = tmp_path / "labextensions" / lc.WIDGETS_EXTENSION
    ext.mkdir(parents=True)
    (ext / "package.json").write_text("{}")
    assert lc.check_widgets([str(tmp_path / "elsewhere"), str(tmp_path)]) == lc.Row(
        "widgets", "pass", f"{lc.WIDGETS_EXTENSION} in {tmp_path}"
    )


def test_cifar10_on_disk_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("MGTUTORIAL_DATA", str(tmp_path))
    assert lc.check_cifar10().status == "WARN"
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"")
    assert lc.check_cifar10() == lc.Row("CIFAR-10", "pass", f"on disk in {tmp_path}")


def test_too_little_disk_fails_and_names_clean_runs(tmp_path):
    row = lc.check_disk(str(tmp_path / "runs" / "not-yet"), need_gib=1e9)
    assert row.status == "FAIL" and row.detail.endswith(
        f"at {tmp_path} (runs and CIFAR-10 want 1e+09 GiB)"
    )
    assert "make clean-runs" in row.fix


def test_an_unknown_python_fails(monkeypatch):
    monkeypatch.setattr(platform, "python_version", lambda: "3.9.18")
    row = lc.check_python(">=3.10")
    assert (row.status, row.detail) == ("FAIL", "3.9.18, but the course needs >=3.10")


@pytest.mark.slow
def test_a_check_that_breaks_becomes_a_fail_row_and_the_others_still_run(monkeypatch):
    monkeypatch.setattr(lc, "check_gpu", lambda: 1 / 0)
    monkeypatch.setattr(
        lc, "check_ranks", lambda *a: lc.Row("2 ranks", "pass", "not started in this test")
    )
    rows = {r.name: r for r in lc.run_checks(lc.CheckConfig())}
    assert rows["GPU"].status == "FAIL" and "ZeroDivisionError" in rows["GPU"].detail
    assert rows["disk"].status == "pass" and list(rows)[-1] == "GPU"


def test_requirements_come_from_pyproject_with_the_test_extra():
    spec, reqs = lc.requirements()
    names = [r.name for r in reqs]
    assert spec == ">=3.10" and {"torch", "ipywidgets", "nbval", "pytest"} <= set(names)
    assert "playwright" not in names  # the e2e extra is not needed in a workshop


def test_cli_options_are_the_config_fields():
    from mgtutorial.__main__ import _config, build_parser, field_docs

    assert _config(build_parser().parse_args(["check"])) == lc.CheckConfig()
    args = build_parser().parse_args(
        ["check", "--master-port", "5", "--timeout", "3", "--jupyter-path", "a", "b"]
    )
    assert _config(args) == lc.CheckConfig(master_port=5, timeout_s=3.0, jupyter_path=["a", "b"])
    assert set(field_docs(lc.CheckConfig)) == {
        "nprocs",
        "timeout_s",
        "master_port",
        "runs_dir",
        "jupyter_path",
    }


def _fake_package(root, name: str, body: str):
    """A package ``name`` under ``root`` that shadows the installed one when ``root`` is first on the path."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(body)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "broken, error, dependents",
    [
        (
            "torch",
            "ImportError: libtorch_cpu.so: cannot open shared object file",
            ("torchvision", "2 ranks", "CIFAR-10", "GPU"),
        ),
        (
            "psutil",
            "ModuleNotFoundError: No module named 'psutil._psutil_linux'",
            ("cores, memory", "2 ranks"),
        ),
    ],
)
@pytest.mark.slow
def test_a_package_that_does_not_import_is_a_fail_row_with_its_fix_not_a_traceback(
    tmp_path, broken, error, dependents, no_leftovers
):
    kind, message = error.split(": ", 1)
    _fake_package(tmp_path / "shadow", broken, f"raise {kind}({message!r})\n")
    path = os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mgtutorial",
            "check",
            "--runs-dir",
            str(tmp_path / "runs"),
            "--timeout",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=100,
        env=_env(PYTHONPATH=path, MGTUTORIAL_DATA=str(tmp_path)),
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    rows = parse(out.stdout.split("\nchecked in")[0].rsplit("\n", 1)[0])
    status, detail, fix = rows[broken]
    assert (status, detail) == (
        "FAIL",
        f"{metadata.version(broken)} installed, but import {broken} fails: {error}",
    )
    spec = next(str(r) for r in lc.requirements()[1] if r.name == broken)
    assert f"pip install --force-reinstall '{spec}'" in fix
    fails = [k for k, v in rows.items() if v[0] == "FAIL"]
    assert fails == [k for k in rows if k in (broken, *dependents)], fails
    for name in dependents:
        if name != "torchvision":  # torchvision's own import fails (it imports torch)
            assert rows[name][1].startswith("not run: it needs") and broken in rows[name][1], rows[
                name
            ]
            assert rows[name][2].startswith("fix the ")
    assert rows["python"][0] == rows["port"][0] == rows["disk"][0] == "pass"


@pytest.mark.slow
def test_import_mgtutorial_and_the_check_command_load_neither_torch_nor_psutil():
    code = """if True:
        import sys, mgtutorial
        from mgtutorial.__main__ import build_parser
        build_parser(check_only=True).parse_args(["check"])
        assert not {"torch", "psutil"} & set(sys.modules), "imported eagerly"
        from mgtutorial import ddp, exercises
        from mgtutorial import launch
        from mgtutorial.runtime import env
        import mgtutorial.runtime.launcher as launcher, mgtutorial.ddp
        assert mgtutorial.launch is launch is launcher.launch and callable(launcher.free_port)
        assert launch.__module__ == "mgtutorial.runtime.launcher", launch
        assert mgtutorial.ddp is ddp and ddp.Trainer is mgtutorial.Trainer
        assert mgtutorial.read_run is mgtutorial.runtime.runlog.read_run
        assert all(getattr(mgtutorial, name) for name in mgtutorial.__all__) and "Trainer" in dir(mgtutorial)
        print(len(mgtutorial.__all__), mgtutorial.__version__)
    """
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, env=_env()
    )
    assert out.returncode == 0 and out.stdout.split() == ["23", "0.1.0"], out.stdout + out.stderr


def test_an_import_that_crashes_python_fails_that_module_and_the_rest_untried(
    tmp_path, monkeypatch
):
    _fake_package(tmp_path, "crashes_on_import", "import os\nos._exit(7)\n")
    _fake_package(tmp_path, "fine_module", "")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    assert lc.import_errors(
        ["fine_module", "no_such_module_here", "crashes_on_import", "json"]
    ) == {
        "no_such_module_here": "ModuleNotFoundError: No module named 'no_such_module_here'",
        "crashes_on_import": "importing it ended Python with exit code 7",
        "json": "not tried (crashes_on_import stopped Python)",
    }


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_an_import_that_hangs_is_stopped_and_fails(tmp_path, monkeypatch):
    _fake_package(tmp_path, "hangs_on_import", "import time\ntime.sleep(600)\n")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    assert lc.import_errors(["json", "hangs_on_import"], timeout_s=5) == {
        "hangs_on_import": "importing it took over 5 s"
    }
    assert lc.import_errors([]) == {}


def test_a_package_that_does_not_import_fails_with_a_reinstall(monkeypatch):
    from mgtutorial.workshop.laptop_packages import _packaging

    row = lc.check_package(_packaging()[0]("psutil>=5.9"), "ImportError: boom")
    assert row.status == "FAIL" and row.detail.endswith(
        "installed, but import psutil fails: ImportError: boom"
    )
    assert "pip install --force-reinstall 'psutil>=5.9'" in row.fix


@pytest.mark.slow
def test_a_check_whose_import_fails_names_the_package_and_its_install(monkeypatch):
    def gpu():
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(lc, "check_gpu", gpu)
    monkeypatch.setattr(
        lc, "check_ranks", lambda *a: lc.Row("2 ranks", "pass", "not started in this test")
    )
    row = {r.name: r for r in lc.run_checks(lc.CheckConfig())}["GPU"]
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
        lc.main(lc.CheckConfig(**dict(lc.CheckConfig().__dict__, **_fields(argv))))


def _fields(argv: list[str]) -> dict:
    from mgtutorial.__main__ import _config, build_parser

    return _config(build_parser(check_only=True).parse_args(["check", *argv])).__dict__


@pytest.mark.timeout(120)
def test_one_rank_is_singular(no_leftovers):
    row = lc.check_ranks(1, timeout_s=60, master_port=None)
    assert (row.name, row.status) == ("1 rank", "pass") and "sum of ranks 0" in row.detail


def test_runs_dir_naming_a_file_fails_the_disk_row(tmp_path):
    (tmp_path / "runs").write_text("")
    for where in (tmp_path / "runs", tmp_path / "runs" / "below"):
        assert lc.check_disk(str(where)) == lc.Row(
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


@pytest.mark.parametrize(
    "output", [b"imported json \n", "imported json \n"], ids=["bytes", "str on Windows"]
)
def test_a_timed_out_probe_reads_its_output_as_bytes_or_str(monkeypatch, output):
    from mgtutorial.workshop import laptop_packages

    def run(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], output=output)

    monkeypatch.setattr(laptop_packages.subprocess, "run", run)
    assert lc.import_errors(["json", "hangs", "later"], timeout_s=5) == {
        "hangs": "importing it took over 5 s",
        "later": "not tried (hangs stopped Python)",
    }


def test_unknown_requirements_or_a_broken_probe_are_fail_rows_not_tracebacks(monkeypatch):
    def not_installed():
        raise metadata.PackageNotFoundError("mgtutorial")

    monkeypatch.setattr(
        lc, "check_ranks", lambda *a: lc.Row("2 ranks", "pass", "not started in this test")
    )
    monkeypatch.setattr(lc, "requirements", not_installed)
    rows = {r.name: r for r in lc.run_checks(lc.CheckConfig())}
    assert (rows["python"].status, rows["python"].detail) == (
        "FAIL",
        "the required packages are unknown: PackageNotFoundError: No package metadata was found for mgtutorial",
    )
    assert (
        "pip install -e ." in rows["python"].fix
        and rows["disk"].status == "pass"
        and list(rows)[-1] == "GPU"
    )

    monkeypatch.undo()
    monkeypatch.setattr(
        lc, "check_ranks", lambda *a: lc.Row("2 ranks", "pass", "not started in this test")
    )
    monkeypatch.setattr(lc, "import_errors", lambda names: [][0])
    rows = {r.name: r for r in lc.run_checks(lc.CheckConfig())}
    assert rows["torch"].status == "FAIL" and rows["torch"].detail.endswith(
        "import torch fails: the import probe failed: IndexError: list index out of range"
    )
    assert rows["GPU"] == lc.Row(
        "GPU",
        "FAIL",
        "not run: it needs torch (see above)",
        "fix the torch row first, then run the check again",
    )


@pytest.mark.parametrize("nprocs", [True, 2.0, 0])
def test_nprocs_that_is_not_a_positive_int_is_refused(nprocs):
    with pytest.raises(ValueError, match=rf"nprocs={nprocs}: the rank check needs at least 1 rank"):
        lc.CheckConfig(nprocs=nprocs).validate()
