"""The package rows of the laptop check (mgtutorial.workshop.laptop_packages): a missing, too old
or broken package, or a Python outside the range, is a FAIL row with the command that fixes it; an
import that crashes or hangs Python is tried in a fresh interpreter and named."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata

import pytest
from check_table import check, run_cli
from packaging.requirements import Requirement

from mgtutorial.workshop import laptop_packages


@pytest.mark.timeout(120)
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


def test_an_unknown_python_fails(monkeypatch):
    monkeypatch.setattr(platform, "python_version", lambda: "3.9.18")
    row = laptop_packages.check_python(">=3.10")
    assert (row.status, row.detail) == ("FAIL", "3.9.18, but the course needs >=3.10")


def test_requirements_come_from_pyproject_with_the_test_extra():
    spec, reqs = laptop_packages.requirements()
    names = [r.name for r in reqs]
    assert spec == ">=3.10" and {"torch", "ipywidgets", "nbval", "pytest"} <= set(names)
    assert "playwright" not in names  # the e2e extra is not needed in a workshop


def _fake_package(root, name: str, body: str):
    """A package ``name`` under ``root`` that shadows the installed one when ``root`` is first on
    the path."""
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
def test_a_package_that_does_not_import_is_a_fail_row_with_its_fix_not_a_traceback(
    tmp_path, broken, error, dependents, no_leftovers
):
    kind, message = error.split(": ", 1)
    _fake_package(tmp_path / "shadow", broken, f"raise {kind}({message!r})\n")
    path = os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")])
    out, rows = run_cli(tmp_path, PYTHONPATH=path, MGTUTORIAL_DATA=str(tmp_path))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    status, detail, fix = rows[broken]
    assert (status, detail) == (
        "FAIL",
        f"{metadata.version(broken)} installed, but import {broken} fails: {error}",
    )
    spec = next(str(r) for r in laptop_packages.requirements()[1] if r.name == broken)
    assert f"pip install --force-reinstall '{spec}'" in fix
    fails = [k for k, v in rows.items() if v[0] == "FAIL"]
    assert fails == [k for k in rows if k in (broken, *dependents)], fails
    for name in dependents:
        if name != "torchvision":  # torchvision's own import fails (it imports torch)
            assert rows[name][1].startswith("not run: it needs"), rows[name]
            assert broken in rows[name][1], rows[name]
            assert rows[name][2].startswith("fix the ")
    assert rows["python"][0] == rows["port"][0] == rows["disk"][0] == "pass"


def test_an_import_that_crashes_python_fails_that_module_and_the_rest_untried(
    tmp_path, monkeypatch
):
    _fake_package(tmp_path, "crashes_on_import", "import os\nos._exit(7)\n")
    _fake_package(tmp_path, "fine_module", "")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    assert laptop_packages.import_errors(
        ["fine_module", "no_such_module_here", "crashes_on_import", "json"]
    ) == {
        "no_such_module_here": "ModuleNotFoundError: No module named 'no_such_module_here'",
        "crashes_on_import": "importing it ended Python with exit code 7",
        "json": "not tried (crashes_on_import stopped Python)",
    }


@pytest.mark.timeout(60)
def test_an_import_that_hangs_is_stopped_and_fails(tmp_path, monkeypatch):
    _fake_package(tmp_path, "hangs_on_import", "import time\ntime.sleep(600)\n")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    assert laptop_packages.import_errors(["json", "hangs_on_import"], timeout_s=5) == {
        "hangs_on_import": "importing it took over 5 s"
    }
    assert laptop_packages.import_errors([]) == {}


def test_a_package_that_does_not_import_fails_with_a_reinstall(monkeypatch):
    row = laptop_packages.check_package(Requirement("psutil>=5.9"), "ImportError: boom")
    assert row.status == "FAIL" and row.detail.endswith(
        "installed, but import psutil fails: ImportError: boom"
    )
    assert "pip install --force-reinstall 'psutil>=5.9'" in row.fix


@pytest.mark.parametrize(
    "output", [b"imported json \n", "imported json \n"], ids=["bytes", "str on Windows"]
)
def test_a_timed_out_probe_reads_its_output_as_bytes_or_str(monkeypatch, output):
    def run(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], output=output)

    monkeypatch.setattr(laptop_packages.subprocess, "run", run)
    assert laptop_packages.import_errors(["json", "hangs", "later"], timeout_s=5) == {
        "hangs": "importing it took over 5 s",
        "later": "not tried (hangs stopped Python)",
    }


def test_a_python_other_than_the_course_environment_is_named(monkeypatch, tmp_path):
    venv = tmp_path / ".venv"
    venv.mkdir()
    monkeypatch.setattr(laptop_packages, "course_venv", lambda: venv)
    row = laptop_packages.check_python(">=3.10")
    assert row.status == "WARN" and f"not the course's {venv / 'bin' / 'python'}" in row.detail
    assert ".venv/bin/python -m mgtutorial check" in row.fix
    assert laptop_packages.pip_fix("torch>=2.4").startswith("fix the python row first")
    monkeypatch.setattr(laptop_packages.sys, "prefix", str(venv))
    assert laptop_packages.check_python(">=3.10").status == "pass"
    assert laptop_packages.pip_fix("torch>=2.4").startswith(".venv/bin/python -m pip install")
