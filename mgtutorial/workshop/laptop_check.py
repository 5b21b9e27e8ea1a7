"""The laptop check for the morning of a workshop: ``python -m mgtutorial check`` (``make check``).

Described in WORKSHOP.md ("The morning check"); it checks what chapter 00 (notebooks/00_setup.ipynb)
shows working, in well under 30 s, and prints one row per check::

    check          result  details
    python         pass    3.11.7 (needs >=3.10)
    ranks          FAIL    ...
                   fix:    what to do about it

Checks: the Python version and each required package against pyproject.toml, installed and
importable (:mod:`mgtutorial.workshop.laptop_packages`), CPU cores and memory (psutil), two ranks starting and
all-reducing through :func:`mgtutorial.launch` (``hello``, with a time limit), a free port on
127.0.0.1 and that a taken one is refused, JupyterLab's widget front end
(``@jupyter-widgets/jupyterlab-manager`` in the Jupyter data path), CIFAR-10 on disk
(:func:`mgtutorial.common.data.cifar10_on_disk`; a warning only, the digits need no download), free disk
space where runs are written, and the GPUs torch sees (information only). The exit code is 1 when
any row failed, else 0. Torch, psutil and the course's modules are imported only inside the checks
that need them: with one missing or broken, the table still prints, and those checks are FAIL rows
naming it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from mgtutorial.workshop.laptop_packages import (
    FAIL,
    IMPORTED,
    INFO,
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

WIDGETS_EXTENSION = "@jupyter-widgets/jupyterlab-manager"
GiB = 2**30
NEEDS = {
    "cores, memory": ("psutil",),
    "ranks": ("torch", "psutil"),
    "CIFAR-10": ("torch",),
    "GPU": ("torch",),
}


@dataclasses.dataclass(kw_only=True)
class CheckConfig:
    """Options of the laptop check (``python -m mgtutorial check --help``); see :meth:`validate`."""

    nprocs: int = 2
    """Ranks the rank check starts (2 as in most chapters; 4 for the 2×2 meshes of chapter 08)."""
    timeout_s: float = 20.0
    """Seconds the ranks may take to start, all-reduce and finish before the check fails."""
    master_port: int | None = None
    """Port on 127.0.0.1 for the ranks' rendezvous (default: one the operating system picks)."""
    runs_dir: str = "runs"
    """Folder whose disk the free-space check measures (where the chapters write their runs)."""
    jupyter_path: list[str] | None = None
    """Jupyter data folders searched for the widget front end (default: Jupyter's data path)."""

    def validate(self) -> None:
        """Raise ValueError naming the bad value and its fix; called before any check runs."""
        if isinstance(self.nprocs, bool) or not isinstance(self.nprocs, int) or self.nprocs < 1:
            raise ValueError(
                f"nprocs={self.nprocs}: the rank check needs at least 1 rank (try --nprocs 2)"
            )
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(
                f"timeout_s={self.timeout_s}: give the ranks a number of seconds > 0 (try --timeout 60)"
            )
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ValueError(
                f"master_port={self.master_port}: a port is between 1 and 65535; or leave "
                "--master-port unset and the operating system picks a free one"
            )


def check_machine() -> Row:
    """Cores and memory: fewer than 2 cores or under 2 GiB available is a warning (ranks take turns)."""
    import psutil

    cores, mem = psutil.cpu_count(logical=True) or 1, psutil.virtual_memory()
    detail = (
        f"{cores} logical cores ({psutil.cpu_count(logical=False) or '?'} physical), "
        f"{mem.total / GiB:.1f} GiB memory, {mem.available / GiB:.1f} GiB available"
    )
    if cores < 2 or mem.available < 2 * GiB:
        return Row(
            "cores, memory",
            WARN,
            detail,
            "close other programs; two ranks and JupyterLab need about "
            "2 GiB, and with one core the ranks take turns (slower, still correct)",
        )
    return Row("cores, memory", PASS, detail)


def check_port(port: int | None) -> Row:
    """``port`` (or one the OS picks for 127.0.0.1:0) is free, and binding it a second time is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        try:
            held.bind(("127.0.0.1", port or 0))
        except OSError as exc:
            return Row(
                "port",
                FAIL,
                f"127.0.0.1:{port} is in use ({exc.strerror})",
                f"leave --master-port unset (launch picks a free port itself), or stop what holds it "
                f"(lsof -i :{port}; on Windows netstat -ano | findstr {port})",
            )
        held.listen(1)
        taken = held.getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", taken))
            except OSError:
                return Row(
                    "port",
                    PASS,
                    f"127.0.0.1:{taken} is free; binding it again while held is refused",
                )
    return Row(
        "port",
        FAIL,
        f"127.0.0.1:{taken} could be bound twice: a taken port would not be noticed",
        "a security tool or sandbox shares ports; run the course outside it",
    )


def _ranks_name(nprocs: int) -> str:
    return f"{nprocs} rank{'s' * (nprocs != 1)}"


def check_ranks(nprocs: int, timeout_s: float, master_port: int | None) -> Row:
    """Start ``nprocs`` ranks of :func:`mgtutorial.hello` (each all-reduces its rank) and check
    every rank got 0 + 1 + … + (nprocs − 1) within ``timeout_s`` seconds."""
    from mgtutorial.hello import HelloConfig, hello
    from mgtutorial.runtime.launcher import launch
    from mgtutorial.runtime.run import WorkerFailed

    name, start = _ranks_name(nprocs), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mgtutorial-check-") as runs:
        try:
            run = launch(
                hello, HelloConfig(), nprocs, runs_dir=runs, name="check", master_port=master_port
            )
        except (
            ValueError
        ) as exc:  # refused before any process started; the message ends with its fix
            first, _, rest = str(exc).partition(". ")
            if master_port is not None and "in use" in first:
                rest = "leave --master-port unset (launch picks a free port itself), or stop what holds the port"
            return Row(name, FAIL, f"not started: {first}", rest or "see the message")
        try:
            result = run.wait(timeout=timeout_s)
        except TimeoutError:
            run.stop()
            return Row(
                name,
                FAIL,
                f"not finished after {timeout_s:g} s (the ranks were stopped)",
                "allow python through the firewall for local connections (macOS/Windows ask once); "
                "close other programs, or retry with --timeout 60",
            )
        except WorkerFailed as exc:
            return Row(
                name,
                FAIL,
                f"rank {exc.rank} failed: {exc.exc_type}: {exc.message}"[:200],
                "read the message; GLOO_SOCKET_IFNAME=lo (lo0 on macOS) if it names a network interface",
            )
    sums = sorted({v["rank_sum"] for v in result.values.values()})
    want = nprocs * (nprocs - 1) // 2
    if sums != [want] or sorted(result.values) != list(range(nprocs)):
        return Row(
            name,
            FAIL,
            f"the all-reduced sums are {sums}, expected [{want}]",
            "reinstall torch (its gloo backend misbehaves): " + pip_fix("torch"),
        )
    backend = next(iter(result.values.values()))["backend"]
    return Row(
        name,
        PASS,
        f"started and all-reduced ({backend}, sum of ranks {want}) "
        f"in {time.monotonic() - start:.1f} s",
    )


def check_widgets(jupyter_path: list[str] | None) -> Row:
    """The widget front end: ``labextensions/@jupyter-widgets/jupyterlab-manager`` in a Jupyter data folder."""
    fix = f"{pip_fix('ipywidgets>=8')}; it brings jupyterlab_widgets; then restart JupyterLab"
    if jupyter_path is None:
        try:
            from jupyter_core.paths import jupyter_path as data_path
        except ImportError:
            return Row(
                "widgets",
                FAIL,
                "jupyter_core is missing (JupyterLab is not installed)",
                pip_fix("jupyterlab>=4"),
            )
        jupyter_path = data_path()
    found = [
        d
        for d in jupyter_path
        if (Path(d) / "labextensions" / WIDGETS_EXTENSION / "package.json").exists()
    ]
    if found:
        return Row("widgets", PASS, f"{WIDGETS_EXTENSION} in {found[0]}")
    return Row(
        "widgets",
        FAIL,
        f"{WIDGETS_EXTENSION} is in none of {len(jupyter_path)} Jupyter data folders "
        "(live plots and progress bars would show as text)",
        fix,
    )


def check_cifar10() -> Row:
    """CIFAR-10 in :func:`mgtutorial.common.data.data_root` (``$MGTUTORIAL_DATA``); missing is only a warning."""
    from mgtutorial.common import data

    root = data.data_root()
    if data.cifar10_on_disk(root):
        return Row("CIFAR-10", PASS, f"on disk in {root}")
    return Row(
        "CIFAR-10",
        WARN,
        f"not in {root}; the chapters use the bundled digits instead",
        "optional, before the workshop (170 MB): python -m mgtutorial data cifar10",
    )


def check_disk(runs_dir: str, need_gib: float = 1.0) -> Row:
    """Free space on the disk of ``runs_dir`` (or its nearest existing parent), and that it is writable."""
    where = Path(runs_dir).resolve()
    while not where.exists():
        where = where.parent
    if not where.is_dir():
        return Row(
            "disk",
            FAIL,
            f"{where} is a file, not a folder",
            "give --runs-dir a folder (or move the file)",
        )
    free = shutil.disk_usage(where).free / GiB
    detail = f"{free:.1f} GiB free at {where}"
    if not os.access(where, os.W_OK):
        return Row("disk", FAIL, detail + ", not writable", "run the course from a folder you own")
    if free < need_gib:
        return Row(
            "disk",
            FAIL if free < need_gib / 4 else WARN,
            detail + f" (runs and CIFAR-10 want {need_gib:g} GiB)",
            "free some space; make clean-runs deletes old runs",
        )
    return Row("disk", PASS, detail)


def check_gpu() -> Row:
    """Information only: the CUDA GPUs torch sees and the backend "auto" picks for the default ranks."""
    import torch

    from mgtutorial.runtime import env

    n = env.gpu_count()
    if n:
        names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(n)}))
        return Row(
            "GPU",
            INFO,
            f"{n} × {names}; backend auto → {env.resolve_backend('auto', env.default_nprocs())}",
        )
    mps = getattr(torch.backends, "mps", None)
    extra = (
        " (an Apple GPU is present; the course does not use it)"
        if mps and mps.is_available()
        else ""
    )
    return Row("GPU", INFO, f"no CUDA GPU: the course runs on CPUs with gloo{extra}")


def run_checks(cfg: CheckConfig) -> list[Row]:
    """Every check, in the order the table shows them. Raises nothing: a check that breaks is a FAIL row,
    and so is one whose package (:data:`NEEDS`) is missing or does not import, naming it."""
    try:
        spec, reqs = requirements()
    except (
        Exception
    ) as exc:  # no pyproject.toml here and mgtutorial not installed (PackageNotFoundError), …
        spec, reqs = "", []
        first = Row(
            "python",
            FAIL,
            f"the required packages are unknown: {type(exc).__name__}: {exc}"[:240],
            "run the check in the course folder (beside pyproject.toml), or pip install -e . there",
        )
    else:
        first = None
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
    rows = []
    for key, check in checks:
        name = _ranks_name(cfg.nprocs) if key == "ranks" else key
        missing = [p for p in NEEDS.get(key, ()) if p in unusable]
        try:
            rows.append(
                Row(
                    name,
                    FAIL,
                    f"not run: it needs {' and '.join(missing)} (see above)",
                    f"fix the {missing[0]} row first, then run the check again",
                )
                if missing
                else check()
            )
        except ImportError as exc:  # a module the check imports is missing or broken
            top = (exc.name or "").split(".")[0]
            rows.append(
                Row(
                    name,
                    FAIL,
                    f"not run: {type(exc).__name__}: {exc}"[:240],
                    pip_fix(next((str(r) for r in reqs if r.name == top), top))
                    if top
                    else "install what it names",
                )
            )
        except Exception as exc:  # one broken check must not hide the others
            rows.append(
                Row(
                    name,
                    FAIL,
                    f"the check itself failed: {type(exc).__name__}: {exc}",
                    "show this line to the instructor",
                )
            )
    return rows


def format_table(rows: list[Row]) -> str:
    """The rows as a text table, each failure and warning followed by its ``fix:`` line, then a count."""
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
    """Print the table; return 1 if any check failed, else 0 (warnings do not fail). Raises ValueError
    for a bad ``cfg`` (:meth:`CheckConfig.validate`) before any check runs."""
    cfg.validate()
    start = time.monotonic()
    rows = run_checks(cfg)
    print(format_table(rows))
    print(f"checked in {time.monotonic() - start:.1f} s")
    return 1 if any(r.status == FAIL for r in rows) else 0
