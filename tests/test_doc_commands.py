"""Every shell command of README.md and WORKSHOP.md works as written: each one is either run here,
in a temporary copy of the project (with short settings where a command trains), and must exit 0,
or listed in NOT_RUN with the reason (a server that runs until stopped, the test suite itself, a
download). A command added to either file fails the first test until it is put in one list."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mgtutorial.runtime import procs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "WORKSHOP.md")
PROGRAMS = ("make", "python", "python3", "ls", "touch", "cp", "conda", "jupyter", "pytest")
"""A line of a fenced block, or an inline code span, is a command when it starts with one of
these, with ``.venv/bin/<program>`` or with ``VARIABLE=value`` before one of them."""

RUN = {
    "make demo": {"DEMO_ARGS": "--epochs 1 --max-steps 3 --no-evaluate"},
    ".venv/bin/torchrun --standalone --nproc-per-node 2 -m mgtutorial ddp --epochs 3": {
        "append": "--max-steps 3 --no-evaluate"
    },
    "make check": {},
    "make student": {},
    "make test-notebook NB=00": {"PYTEST_ARGS": "--collect-only -q"},
    "make clean-runs": {},
    "make gpu-check GPU_CHECK_ARGS=--list": {},
    ".venv/bin/python -m mgtutorial --help": {},
    ".venv/bin/python -m mgtutorial ddp --help": {},
    ".venv/bin/python -m mgtutorial describe": {},
    ".venv/bin/python scripts/workshop_table.py": {},
}
"""Commands run here, in this order, each with its short settings: environment variables, or
``append`` (options added at the end). ``make test-notebook NB=00`` only collects the notebook's
cells (its file selection runs; the cells run under nbval in ``make test`` itself)."""

SAME_AS_MAKE_CHECK = "the command `make check` runs (test_make_targets_run_the_commands_they_name)"
SERVER = "starts JupyterLab, which runs until stopped (tests/e2e starts it and drives it)"
SUITE = "the test suite that runs this test"
NOT_RUN = {
    "make lab": SERVER,
    "make lab NOTEBOOKS=student": SERVER,
    ".venv/bin/jupyter lab --notebook-dir=student": SERVER,
    "jupyter lab --notebook-dir=notebooks": SERVER + ", in a conda environment",
    "make test": SUITE,
    "PYTEST_WORKERS=0 make test": SUITE,
    "make test-fast": SUITE + " (its fast part)",
    "make coverage": SUITE + ", measured",
    "pytest tests notebooks --nbval-lax": SUITE + ", in a conda environment",
    "make book": "tests/e2e/test_book.py builds both books and reads them in Chromium",
    "make gpu-check": "tests/test_gpu_check.py runs it (on CPU every item is skipped)",
    "cp gpu-check/report.* benchmarks/results/gpu-check-<machine>/": "<machine> is a name to fill",
    ".venv/bin/python -m mgtutorial data cifar10": "downloads 170 MB (its failures are tested "
    "offline in tests/test_bad_input.py)",
    ".venv/bin/python -m mgtutorial check --master-port N": "N is a port to fill in",
    ".venv/bin/python -m mgtutorial check": SAME_AS_MAKE_CHECK,
    "conda env create -f environment.yml && conda activate mgtutorial": "needs conda",
    "ls -l": "names the tool a file size was measured with",
}
WHEELS = "needs the wheel folder, made on a machine with internet (WORKSHOP.md)"
for _command in (
    "python3 -m pip download -d wheels --index-url https://download.pytorch.org/whl/cpu "
    '--extra-index-url https://pypi.org/simple ".[test,e2e]" pip "setuptools>=77"',
    "python3 -m pip download -d wheels-mac --only-binary=:all: --platform macosx_14_0_arm64 "
    "--python-version 3.11 --implementation cp --abi cp311 --index-url "
    'https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple ".[test,e2e]" '
    'pip "setuptools>=77"',
    "ls wheels | grep '^torch-.*+cpu'",
    "ls wheels | grep -c '^nvidia' || true",
    "python3 -m venv .venv",
    ".venv/bin/python -m pip install --no-index --find-links wheels --upgrade pip",
    '.venv/bin/python -m pip install --no-index --find-links wheels -e ".[test,e2e]"',
    "touch .venv/.installed",
    "PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/wheels make check",
):
    NOT_RUN[_command] = WHEELS


def _is_command(text: str) -> bool:
    words = text.split()
    while words and re.fullmatch(r"[A-Z_]+=\S+", words[0]):  # VARIABLE=value before the program
        words = words[1:]
    if not words:
        return False
    program = words[0].removeprefix(".venv/bin/")
    return (program in PROGRAMS or words[0].startswith(".venv/bin/")) and (
        len(words) > 1 or words[0] != text
    )


def commands(name: str) -> list[str]:
    """The shell commands of ``name``: the command lines of its fenced blocks without a language
    (continuation lines joined, comments dropped) and its inline code spans that are commands."""
    found, fence, block = [], None, []
    for line in (ROOT / name).read_text().splitlines():
        if line.startswith("```"):
            if fence is None:
                fence, block = line[3:].strip(), []
                continue
            if fence in ("", "bash", "sh"):
                text = "\n".join(block).replace("\\\n", " ")
                for cmd in text.splitlines():
                    cmd = " ".join(cmd.split("  #")[0].split())
                    if _is_command(cmd):
                        found.append(cmd)
            fence = None
            continue
        if fence is not None:
            block.append(line)
            continue
        found += [span for span in re.findall(r"`([^`]+)`", line) if _is_command(span)]
    return list(dict.fromkeys(found))


def test_every_command_is_run_or_has_a_reason():
    found = {c for name in DOCS for c in commands(name)}
    unclassified = sorted(found - RUN.keys() - NOT_RUN.keys())
    assert not unclassified, f"add these to RUN or NOT_RUN: {unclassified}"
    stale = sorted((RUN.keys() | NOT_RUN.keys()) - found)
    assert not stale, f"no longer in README.md or WORKSHOP.md: {stale}"


def test_no_command_names_a_bare_python():
    for name in DOCS:
        for cmd in commands(name):
            if cmd.startswith(("python ", "python3 ")):
                assert NOT_RUN.get(cmd) == WHEELS, (
                    f"{name}: {cmd!r} runs a Python other than .venv's"
                )
            assert "python -m mgtutorial" not in cmd.replace(".venv/bin/python", ""), cmd


def test_make_targets_run_the_commands_they_name():
    """``make check`` is ``.venv/bin/python -m mgtutorial check``, which is therefore run once."""
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[-1] == ".venv/bin/python -m mgtutorial check", out


def _copy_project(dest: Path) -> None:
    """The tracked and untracked (not ignored) files, with their times, and the environment."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    venv = (ROOT / ".venv").resolve()
    (dest / ".venv").symlink_to(venv)
    stamp = (venv / ".installed").stat().st_mtime
    os.utime(dest / "pyproject.toml", (stamp - 60, stamp - 60))  # make installs nothing


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_commands_work_as_written(tmp_path, no_leftovers):
    if not (ROOT / ".venv" / ".installed").exists():
        pytest.skip("no installed .venv beside the project (make lab installs it)")
    project = tmp_path / "project"
    _copy_project(project)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "MGTUTORIAL_"))}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH"):
        env.pop(var, None)
    # the copy's package, in the ranks torchrun starts too (a fresh clone's editable install)
    env.update(PYTHONPATH=str(project), OMP_NUM_THREADS="1")
    env["MGTUTORIAL_DATA"] = str(tmp_path / "data")  # digits: nothing is downloaded
    for cmd, short in RUN.items():
        extra = {k: v for k, v in short.items() if k != "append"}
        line = f"{cmd} {short['append']}" if "append" in short else cmd
        out = subprocess.run(
            ["bash", "-c", line],
            cwd=project,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, f"{line!r} exited {out.returncode}:\n{out.stderr[-3000:]}"
        if cmd == "make demo":
            (run_dir,) = (project / "runs").iterdir()
            assert (run_dir / "loss.png").exists() and "final test accuracy" not in out.stderr
        if cmd == "make test-notebook NB=00":
            assert "00_setup.ipynb::Cell 0" in out.stdout, out.stdout[-2000:]
        if cmd == "make clean-runs":
            assert not (project / "runs").exists()
    assert (project / "student" / "00_setup.ipynb").exists()
    assert not procs.torchrun_processes()
