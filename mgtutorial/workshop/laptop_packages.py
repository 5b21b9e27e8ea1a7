"""The package rows of the laptop check (:mod:`mgtutorial.workshop.laptop_check`,
``python -m mgtutorial check``), and the :class:`Row` every check returns.

Described in WORKSHOP.md ("The morning check"). The Python version and each required package against
pyproject.toml (the test extra included: nbval runs the notebooks): installed, in its version range,
and, for those in :data:`IMPORTED`, importable, tried in a fresh interpreter since a broken install
can crash it. Needs neither torch nor psutil; packaging, else pip's own copy of it. Version rules
follow https://packaging.python.org/en/latest/specifications/version-specifiers/.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as metadata
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Literal, get_args

Status = Literal["pass", "WARN", "FAIL", "info"]
"""A row's result: passed, a warning (the course still runs), failed, or information only."""
PASS, WARN, FAIL, INFO = get_args(Status)
EXTRAS = ("test",)
"""The optional dependencies a workshop needs (nbval); e2e's browser driver is not one."""
IMPORTED = ("torch", "torchvision", "ipywidgets", "matplotlib", "psutil")
"""The packages whose import is tried too (each package's name is its module's)."""


@dataclasses.dataclass
class Row:
    """One check's outcome: ``name``, ``status``, ``detail`` (what was found) and ``fix`` (what to
    do, shown for a failure or a warning)."""

    name: str
    status: Status
    detail: str
    fix: str = ""


def course_venv() -> Path:
    """The course's own environment: ``.venv`` beside pyproject.toml (``make`` creates it)."""
    return Path(__file__).resolve().parents[2] / ".venv"


def outside_environment() -> str:
    """Why this interpreter is not where the course installs its packages ("" when it is): another
    Python while the course's ``.venv`` exists, or, with no ``.venv``, the system's own Python
    (neither a virtual environment nor conda), into which pip would install gigabytes."""
    venv = course_venv()
    if venv.is_dir():
        if Path(sys.prefix).resolve() == venv.resolve():
            return ""
        return f"this is {sys.executable}, not the course's {venv / 'bin' / 'python'}"
    if sys.prefix == sys.base_prefix and not os.environ.get("CONDA_PREFIX"):
        return f"{sys.executable} is the system's Python, not a virtual environment"
    return ""


def import_failed(exc: ImportError, argv: list[str]) -> str:
    """What ``python -m mgtutorial <argv>`` prints when torch or psutil cannot be imported: where
    the diagnosis is, or, in a bare ``python``, the course's interpreter to run instead."""
    if outside := outside_environment():
        return (
            f"error: {type(exc).__name__}: {exc}\n{outside}: run `.venv/bin/python -m "
            f"mgtutorial {' '.join(argv)}` (`make check` makes .venv on first use)."
        )
    return (
        f"error: {type(exc).__name__}: {exc}\n`make check` (or `.venv/bin/python -m "
        "mgtutorial check`) lists what is missing or broken and the command that fixes it."
    )


def pip_fix(spec: str, reinstall: bool = False) -> str:
    """The install command a fix line prints, online and from a wheel folder: for the course's
    ``.venv`` when it exists, else for this interpreter; none when this interpreter is not the
    course's environment (:func:`outside_environment`: the python row says what to run)."""
    if outside_environment():
        return "fix the python row first: the course's packages go into .venv, not here"
    venv = course_venv()
    python = ".venv/bin/python" if venv.is_dir() else Path(sys.executable).name
    again = "--force-reinstall " * reinstall
    offline = "(offline: add --no-index --find-links wheels)"
    return f"{python} -m pip install {again}'{spec}'  {offline}"


def _packaging():
    """packaging's ``(Requirement, SpecifierSet)``; pip's own copy where packaging is not
    installed."""
    try:
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.specifiers import SpecifierSet
    return Requirement, SpecifierSet


def requirements() -> tuple[str, list]:
    """``(requires-python, [packaging Requirement, …])``: the project's dependencies and
    :data:`EXTRAS`, from pyproject.toml beside the package when there is one (Python ≥ 3.11), else
    from the installed distribution's metadata."""
    Requirement = _packaging()[0]

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib

        project = tomllib.loads(pyproject.read_text())["project"]
        specs = project["dependencies"] + [
            s for x in EXTRAS for s in project["optional-dependencies"].get(x, [])
        ]
        return project["requires-python"], [Requirement(s) for s in specs]
    except (ImportError, OSError, KeyError):
        reqs = [Requirement(s) for s in metadata.requires("mgtutorial") or []]
        keep = [
            r
            for r in reqs
            if r.marker is None or any(r.marker.evaluate({"extra": x}) for x in EXTRAS)
        ]
        return metadata.metadata("mgtutorial")["Requires-Python"] or "", keep


def check_python(spec: str) -> Row:
    """This interpreter's version against ``spec`` (pyproject's requires-python, e.g. ">=3.10");
    a warning when it is not the course's environment (:func:`outside_environment`)."""
    SpecifierSet = _packaging()[1]
    version = platform.python_version()
    if SpecifierSet(spec).contains(version):
        if outside := outside_environment():
            return Row(
                "python",
                WARN,
                f"{version} (needs {spec}), but {outside}: the rows below check this one",
                "run `make check`, or `.venv/bin/python -m mgtutorial check` once `make lab` "
                "has made .venv; install nothing into this interpreter",
            )
        return Row("python", PASS, f"{version} (needs {spec}) at {sys.executable}")
    return Row(
        "python",
        FAIL,
        f"{version}, but the course needs {spec}",
        f"install Python {spec} (python.org or conda), then make lab",
    )


_PROBE = """import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        print("imported", name, flush=True)
    except BaseException as exc:
        print("imported", name, f"{type(exc).__name__}: {exc}".splitlines()[0], flush=True)
"""


def import_errors(names: list[str], timeout_s: float = 120.0) -> dict[str, str]:
    """``{name: why}`` for each module of ``names`` that does not import, tried one after another
    in a fresh interpreter (``sys.executable``): a raised exception, or the interpreter crashing or
    hanging (over ``timeout_s`` seconds for all: a first import of torch from a cold disk, or on a
    busy machine, takes tens of seconds, so only an import that hangs reaches it)."""
    if not names:
        return {}
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE, *names],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        stdout, end = out.stdout, f"importing it ended Python with exit code {out.returncode}"
    except subprocess.TimeoutExpired as exc:
        # run() has killed it; what it kept is bytes (str on Windows)
        kept = exc.stdout or ""
        stdout = kept.decode(errors="replace") if isinstance(kept, bytes) else kept
        end = f"importing it took over {timeout_s:g} s"
    done = dict(
        (line.split(" ", 2)[1:] + [""])[:2]
        for line in stdout.splitlines()
        if line.startswith("imported ")
    )
    untried = [n for n in names if n not in done]  # the first one stopped the interpreter
    errors = {n: why for n, why in done.items() if why}
    for n in untried:
        errors[n] = end if n == untried[0] else f"not tried ({untried[0]} stopped Python)"
    return errors


def check_package(req, import_error: str = "") -> Row:
    """One required package: installed (``importlib.metadata.version``), within its version
    range, and, given ``import_error`` (from :func:`import_errors`), importable."""
    # lower bounds first, as pyproject.toml writes them (packaging sorts them as text)
    want = ",".join(sorted(map(str, req.specifier), key=lambda s: s[0] == "<")) or "any version"
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return Row(req.name, FAIL, f"not installed (needs {want})", pip_fix(str(req)))
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        return Row(
            req.name, FAIL, f"{version} installed, but the course needs {want}", pip_fix(str(req))
        )
    if import_error:
        return Row(
            req.name,
            FAIL,
            f"{version} installed, but import {req.name} fails: {import_error}"[:240],
            pip_fix(str(req), reinstall=True),
        )
    return Row(req.name, PASS, f"{version} (needs {want})")


def installed(name: str) -> bool:
    """True if the distribution ``name`` is installed (it has metadata)."""
    try:
        return bool(metadata.version(name))
    except metadata.PackageNotFoundError:
        return False
