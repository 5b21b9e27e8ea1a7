"""The laptop check for the morning of a workshop: ``python -m mgtutorial check`` (``make check``).

Described in WORKSHOP.md ("The morning check"); it checks what chapter 00
(notebooks/00_setup.ipynb) shows working, in well under 30 s, and prints one row per check::

    check          result  details
    python         pass    3.11.7 (needs >=3.10)
    ranks          FAIL    ...
                   fix:    what to do about it

Checks: the Python version and each required package against pyproject.toml, installed and
importable (:mod:`mgtutorial.workshop.laptop_packages`); then the machine
(:mod:`mgtutorial.workshop.laptop_machine`): CPU cores and memory (psutil), two ranks starting and
all-reducing through :func:`mgtutorial.launch` (``hello``, with a time limit), a free port on
127.0.0.1 and that a taken one is refused, JupyterLab's widget front end
(``@jupyter-widgets/jupyterlab-manager`` in the Jupyter data path), CIFAR-10 on disk
(:func:`mgtutorial.common.data.cifar10_on_disk`; a warning only, the digits need no download),
free disk space where runs are written, and the GPUs torch sees (information only). The exit code
is 1 when any row failed, else 0. Torch, psutil and the course's modules are imported only inside
the checks that need them: with one missing or broken, the table still prints, and those checks
are FAIL rows naming it. This module runs the checks in order and prints the table.
"""

from __future__ import annotations

import dataclasses
import math
import time

from mgtutorial.common.config import Config
from mgtutorial.workshop.laptop_machine import (
    check_cifar10,
    check_disk,
    check_gpu,
    check_machine,
    check_port,
    check_ranks,
    check_widgets,
    ranks_name,
)
from mgtutorial.workshop.laptop_packages import (
    FAIL,
    IMPORTED,
    PASS,
    WARN,
    Row,
    check_package,
    check_python,
    import_errors,
    installed,
    pip_fix,
    requirements,
)

NEEDS = {
    "cores, memory": ("psutil",),
    "ranks": ("torch", "psutil"),
    "CIFAR-10": ("torch",),
    "GPU": ("torch",),
}
"""Check -> the packages it needs: with one of them unusable, the check is a FAIL row naming it."""


@dataclasses.dataclass(kw_only=True)
class CheckConfig(Config):
    """Options of the laptop check (``python -m mgtutorial check --help``); see :meth:`validate`."""

    nprocs: int = 2
    """Ranks the rank check starts (2 as in most chapters; 4 for the 2×2 mesh of chapter 08b)."""
    timeout_s: float = 20.0
    """Seconds the ranks may take, once launched, to all-reduce and finish before the check fails;
    the launch itself (starting processes that import torch: seconds on a first run) is not
    counted, so a slow laptop passes at the default."""
    master_port: int | None = None
    """Port on 127.0.0.1 for the ranks' rendezvous (default: one the operating system picks)."""
    runs_dir: str = "runs"
    """Folder the chapters write their runs to: the disk check fails when no folder can be created
    there, and measures its disk's free space."""
    jupyter_path: list[str] | None = None
    """Jupyter data folders searched for the widget front end (default: Jupyter's data path)."""

    def validate(self, nprocs: int | None = None) -> None:
        """Raise ValueError naming the bad value and its fix; called before any check runs."""
        super().validate(nprocs)
        if isinstance(self.nprocs, bool) or not isinstance(self.nprocs, int) or self.nprocs < 1:
            raise ValueError(
                f"nprocs={self.nprocs}: the rank check needs at least 1 rank (try --nprocs 2)"
            )
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(
                f"timeout_s={self.timeout_s}: give the ranks a number of seconds > 0 "
                "(try --timeout 60)"
            )
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ValueError(
                f"master_port={self.master_port}: a port is between 1 and 65535; or leave "
                "--master-port unset and the operating system picks a free one"
            )


def _requirements() -> tuple[str, list, Row | None]:
    """``(requires-python, requirements, None)``, or ``("", [], a FAIL row)`` when they are
    unknown (no pyproject.toml here and mgtutorial not installed: PackageNotFoundError, …)."""
    try:
        spec, reqs = requirements()
    except Exception as exc:
        why = f"the required packages are unknown: {type(exc).__name__}: {exc}"[:240]
        fix = (
            "run the check in the course folder (beside pyproject.toml), or pip install -e . there"
        )
        return "", [], Row("python", FAIL, why, fix)
    return spec, reqs, None


def _row(name: str, check, missing: list[str], reqs: list) -> Row:
    """The row of one check; one that cannot run (``missing`` packages) or breaks is a FAIL row
    that says why, so that it does not hide the others."""
    if missing:
        why = f"not run: it needs {' and '.join(missing)} (see above)"
        return Row(name, FAIL, why, f"fix the {missing[0]} row first, then run the check again")
    try:
        return check()
    except ImportError as exc:  # a module the check imports is missing or broken
        top = (exc.name or "").split(".")[0]
        spec = next((str(r) for r in reqs if r.name == top), top)
        fix = pip_fix(spec) if top else "install what it names"
        return Row(name, FAIL, f"not run: {type(exc).__name__}: {exc}"[:240], fix)
    except Exception as exc:
        why = f"the check itself failed: {type(exc).__name__}: {exc}"
        return Row(name, FAIL, why, "show this line to the instructor")


def run_checks(cfg: CheckConfig) -> list[Row]:
    """Every check, in the order the table shows them. Raises nothing: a check that breaks is a
    FAIL row, and so is one whose package (:data:`NEEDS`) is missing or does not import, naming
    it."""
    spec, reqs, first = _requirements()
    probed = [r.name for r in reqs if r.name in IMPORTED and installed(r.name)]
    try:
        errors = import_errors(probed)
    except Exception as exc:  # the probe interpreter could not even start
        errors = dict.fromkeys(
            probed, f"the import probe failed: {type(exc).__name__}: {exc}"[:200]
        )
    unusable = {
        r.name for r in reqs if r.name in IMPORTED and (r.name in errors or not installed(r.name))
    }
    checks = [
        ("python", lambda: first or check_python(spec)),
        *[(r.name, lambda r=r: check_package(r, errors.get(r.name, ""))) for r in reqs],
        ("cores, memory", check_machine),
        ("port", lambda: check_port(cfg.master_port)),
        ("ranks", lambda: check_ranks(cfg.nprocs, cfg.timeout_s, cfg.master_port)),
        ("widgets", lambda: check_widgets(cfg.jupyter_path)),
        ("CIFAR-10", check_cifar10),
        ("disk", lambda: check_disk(cfg.runs_dir)),
        ("GPU", check_gpu),
    ]
    return [
        _row(
            ranks_name(cfg.nprocs) if key == "ranks" else key,
            check,
            [p for p in NEEDS.get(key, ()) if p in unusable],
            reqs,
        )
        for key, check in checks
    ]


def format_table(rows: list[Row]) -> str:
    """The rows as a text table, each failure and warning followed by its ``fix:`` line, then a
    count."""
    width = max(len(r.name) for r in rows) + 2
    lines = [f"{'check':<{width}}result  details"]
    for r in rows:
        lines.append(f"{r.name:<{width}}{r.status:<8}{r.detail}")
        if r.fix and r.status in (FAIL, WARN):
            lines.append(f"{'':<{width}}{'fix:':<8}{r.fix}")
    n = {s: sum(r.status == s for r in rows) for s in (PASS, WARN, FAIL)}
    lines.append(f"{n[PASS]} passed, {n[WARN]} warning{'s' * (n[WARN] != 1)}, {n[FAIL]} failed")
    return "\n".join(lines)


def main(cfg: CheckConfig) -> int:
    """Print the table; return 1 if any check failed, else 0 (warnings do not fail).

    Raises:
        ValueError: a bad ``cfg`` (:meth:`CheckConfig.validate`), before any check runs.
    """
    cfg.validate()
    start = time.monotonic()
    rows = run_checks(cfg)
    print(format_table(rows))
    print(f"checked in {time.monotonic() - start:.1f} s")
    return 1 if any(r.status == FAIL for r in rows) else 0
