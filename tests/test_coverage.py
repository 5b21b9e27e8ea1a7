"""``make coverage`` counts the lines that only a rank runs: with the ``[tool.coverage.run]``
settings of pyproject.toml, a function called only inside ranks shows as executed, whether the
ranks were forked from the launcher's fork server, spawned, or started by ``torchrun``.

A small module in a temporary folder plays the package: measured with pyproject.toml's settings
plus ``--source`` naming it; the report is coverage.py's JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RANK_ONLY = """
from dataclasses import dataclass


@dataclass(kw_only=True)
class Cfg:
    n: int = 1


def forked(cfg):
    return cfg.n * 2


def spawned(cfg):
    return cfg.n * 3


def under_torchrun():
    return 4


if __name__ == "__main__":
    under_torchrun()
"""

DRIVER = """
import subprocess, sys
from pathlib import Path

import rank_only
from mgtutorial import launch

if __name__ == "__main__":
    for fn, method in ((rank_only.forked, "forkserver"), (rank_only.spawned, "spawn")):
        run = launch(fn, rank_only.Cfg(), 2, runs_dir="runs", start_method=method)
        print(run.wait(timeout=120).values)
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", rank_only.__file__]
    subprocess.run(command, check=True, timeout=120)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lines_run_only_in_ranks_are_counted(tmp_path, no_leftovers):
    pytest.importorskip("coverage", minversion="7.10")
    (tmp_path / "rank_only.py").write_text(RANK_ONLY)
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "COVERAGE_FILE": str(tmp_path / ".coverage"),
    }
    env.pop("COVERAGE_PROCESS_CONFIG", None)  # under make coverage: measure this, not the package
    coverage = [sys.executable, "-m", "coverage"]
    rc = ["--rcfile", str(ROOT / "pyproject.toml")]
    run = [*coverage, "run", *rc, "--source", "rank_only", "driver.py"]
    subprocess.run(run, cwd=tmp_path, env=env, check=True, timeout=280)
    subprocess.run([*coverage, "combine", *rc], cwd=tmp_path, env=env, check=True)
    subprocess.run([*coverage, "json", *rc, "-o", "cov.json"], cwd=tmp_path, env=env, check=True)
    report = json.loads((tmp_path / "cov.json").read_text())["files"]
    functions = next(f for name, f in report.items() if name.endswith("rank_only.py"))["functions"]
    for name in ("forked", "spawned", "under_torchrun"):
        got = functions[name]["summary"]
        assert got["covered_lines"] == got["num_statements"] == 1, f"{name}: {got}"


KERNEL_ONLY = """
def in_kernel():
    return 5
"""


def _notebook(source: str) -> str:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source)]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    return nbformat.writes(nb)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("by_request", [True, False], ids=["shutdown-request", "nbval-kill"])
def test_lines_run_only_in_a_notebook_kernel_are_counted(tmp_path, no_leftovers, by_request):
    """With the root conftest's hook, a line that only a notebook cell runs counts under coverage;
    without it (nbval's kill: the negative control), the kernel's measurer never saves."""
    pytest.importorskip("coverage", minversion="7.10")
    (tmp_path / "kernel_only.py").write_text(KERNEL_ONLY)
    (tmp_path / "nb.ipynb").write_text(_notebook("import kernel_only\nkernel_only.in_kernel()"))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "COVERAGE_FILE": str(tmp_path / ".coverage"),
    }
    env.pop("COVERAGE_PROCESS_CONFIG", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    coverage = [sys.executable, "-m", "coverage"]
    rc = ["--rcfile", str(ROOT / "pyproject.toml")]
    plugin = ["-p", "conftest"] if by_request else []  # the root conftest.py, as a plugin
    pytest_args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *plugin]
    pytest_args += ["--rootdir", str(tmp_path), "--nbval-lax", "nb.ipynb"]
    run = [*coverage, "run", *rc, "--source", "kernel_only", *pytest_args]
    subprocess.run(run, cwd=tmp_path, env=env, check=True, timeout=280)
    subprocess.run([*coverage, "combine", *rc], cwd=tmp_path, env=env, check=True)
    # with no line measured at all, coverage json says "No data to report" and writes nothing
    subprocess.run([*coverage, "json", *rc, "-o", "cov.json"], cwd=tmp_path, env=env)
    cov_json = tmp_path / "cov.json"
    report = json.loads(cov_json.read_text())["files"] if cov_json.exists() else {}
    measured = [f for name, f in report.items() if name.endswith("kernel_only.py")]
    covered = measured[0]["functions"]["in_kernel"]["summary"]["covered_lines"] if measured else 0
    assert covered == (1 if by_request else 0), f"by_request={by_request}: {covered} line(s)"
