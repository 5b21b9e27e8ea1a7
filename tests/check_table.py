"""Helpers of the laptop check's tests (tests/test_laptop_check.py, tests/test_laptop_packages.py):
read the printed table back, run the check in this process or as ``python -m mgtutorial check``."""

from __future__ import annotations

import os
import subprocess
import sys

from mgtutorial.workshop import laptop_check

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
"""Rows the table has on a working machine (among others)."""


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
    """Run the check in this process with ``options``; (exit code, the table's rows)."""
    # a generous time limit: a slow machine is not the point here
    code = laptop_check.main(laptop_check.CheckConfig(**{"timeout_s": 60.0, **options}))
    return code, parse(capsys.readouterr().out.split("\nchecked in")[0].rsplit("\n", 1)[0])


def cli_env(**extra) -> dict[str, str]:
    """This environment without the variables of a rank, one thread per rank, plus ``extra``."""
    e = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    return {**e, "OMP_NUM_THREADS": "1", **extra}


def run_cli(tmp_path, **extra_env) -> tuple[subprocess.CompletedProcess, dict]:
    """``python -m mgtutorial check`` with its runs under ``tmp_path``; (the process, its rows)."""
    argv = ["check", "--runs-dir", str(tmp_path / "runs"), "--timeout", "60"]
    out = subprocess.run(
        [sys.executable, "-m", "mgtutorial", *argv],
        capture_output=True,
        text=True,
        timeout=100,
        env=cli_env(**extra_env),
    )
    table = out.stdout.split("\nchecked in")[0].rsplit("\n", 1)[0]
    return out, parse(table) if table.startswith("check") else {}
