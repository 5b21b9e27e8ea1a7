"""The machine rows of the laptop check (:mod:`mgtutorial.workshop.laptop_check`, ``python -m
mgtutorial check``): cores and memory, a free port, two ranks all-reducing, JupyterLab's widget
front end, CIFAR-10 on disk, free disk space, and the GPUs torch sees.

Described in WORKSHOP.md ("The morning check"); each check returns one
:class:`~mgtutorial.workshop.laptop_packages.Row` whose ``fix`` says what to do. Torch, psutil and
the course's modules are imported inside the checks that need them, so that a missing one fails
its rows only.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from mgtutorial.workshop.laptop_packages import FAIL, INFO, PASS, WARN, Row, pip_fix

WIDGETS_EXTENSION = "@jupyter-widgets/jupyterlab-manager"
GiB = 2**30


def check_machine() -> Row:
    """Cores and memory: fewer than 2 cores or under 2 GiB available is a warning (the ranks take
    turns)."""
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
    """``port`` (or one the OS picks for 127.0.0.1:0) is free, and binding it a second time is
    refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        try:
            held.bind(("127.0.0.1", port or 0))
        except OSError as exc:
            return Row(
                "port",
                FAIL,
                f"127.0.0.1:{port} is in use ({exc.strerror})",
                "leave --master-port unset (launch picks a free port itself), or stop what holds "
                f"it (lsof -i :{port}; on Windows netstat -ano | findstr {port})",
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


def ranks_name(nprocs: int) -> str:
    return f"{nprocs} rank{'s' * (nprocs != 1)}"


def check_ranks(nprocs: int, timeout_s: float, master_port: int | None) -> Row:
    """Start ``nprocs`` ranks of :func:`mgtutorial.hello` (each all-reduces its rank) and check
    every rank got 0 + 1 + … + (nprocs − 1) within ``timeout_s`` seconds."""
    from mgtutorial.hello import HelloConfig, hello
    from mgtutorial.runtime.failure import WorkerFailed
    from mgtutorial.runtime.launcher import launch

    name, start = ranks_name(nprocs), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mgtutorial-check-") as runs:
        try:
            run = launch(
                hello, HelloConfig(), nprocs, runs_dir=runs, name="check", master_port=master_port
            )
        except ValueError as exc:
            # refused before any process started; the message ends with its fix
            first, _, rest = str(exc).partition(". ")
            if master_port is not None and "in use" in first:
                rest = (
                    "leave --master-port unset (launch picks a free port itself), or stop what "
                    "holds the port"
                )
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
                "read the message; GLOO_SOCKET_IFNAME=lo (lo0 on macOS) if it names a network "
                "interface",
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
    """The widget front end: ``labextensions/@jupyter-widgets/jupyterlab-manager`` in a Jupyter
    data folder (``jupyter_path``, default: Jupyter's data path)."""
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
    """CIFAR-10 in :func:`mgtutorial.common.data.data_root` (``$MGTUTORIAL_DATA``); missing is
    only a warning."""
    from mgtutorial.common import data

    root = data.data_root()
    if data.cifar10_on_disk(root):
        return Row("CIFAR-10", PASS, f"on disk in {root}")
    return Row(
        "CIFAR-10",
        WARN,
        f"not in {root}; the chapters use the bundled digits instead",
        "optional, before the workshop (170 MB): .venv/bin/python -m mgtutorial data cifar10",
    )


def check_disk(runs_dir: str, need_gib: float = 1.0) -> Row:
    """That ``runs_dir`` (or its nearest existing parent) takes a new folder, and the free space on
    its disk: under ``need_gib`` GiB is a warning, under a quarter of it a failure."""
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
    try:  # a folder made and removed: os.access says yes to root, and /proc takes none
        os.rmdir(tempfile.mkdtemp(prefix=".mgtutorial-check-", dir=where))
    except OSError as exc:
        return Row(
            "disk",
            FAIL,
            f"--runs-dir {runs_dir}: no folder can be created in {where} ({exc.strerror})",
            "give --runs-dir a folder you can write (the default, runs, is the course folder's), "
            "or run the course from a folder you own",
        )
    free = shutil.disk_usage(where).free / GiB
    detail = f"{free:.1f} GiB free at {where}"
    if free < need_gib:
        return Row(
            "disk",
            FAIL if free < need_gib / 4 else WARN,
            detail + f" (runs and CIFAR-10 want {need_gib:g} GiB)",
            "free some space; make clean-runs deletes old runs",
        )
    return Row("disk", PASS, detail)


def check_gpu() -> Row:
    """Information only: the CUDA GPUs torch sees and the backend "auto" picks for the default
    ranks."""
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
