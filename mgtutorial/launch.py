"""``launch(worker, cfg, nprocs)``: start ranks from a notebook without blocking it; the one way
every chapter starts processes.

Taught in notebooks/00_setup.ipynb; used by every chapter.
Built on TorchElastic's process machinery (``torch.distributed.elastic.multiprocessing.start_processes``,
https://pytorch.org/docs/stable/elastic/multiprocessing.html), the same code ``torchrun`` uses,
with the *spawn* start method. Each rank gets the torchrun environment (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT), so a worker runs unchanged under
``torchrun``.

Checks before any process starts: ``nprocs`` ≥ 1, backend vs hardware, the worker and its config
importable by a child (not defined in a notebook or ``__main__``), the config's own ``validate``, a
free port. The running job is a :class:`~mgtutorial.run.Run` (its own module, with
:class:`~mgtutorial.run.RunResult` and :class:`~mgtutorial.run.WorkerFailed`, re-exported here).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from . import env, runlog
from ._rank import import_ref

_FROM_RUN = ("Run", "RunResult", "WorkerFailed")


def __getattr__(name: str):
    # Run and friends live in mgtutorial.run, imported on first use: a rank imports this module
    # (through the package) but never needs psutil or the launcher's logging settings.
    if name in _FROM_RUN:
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class WorkerNotImportable(ValueError):
    """The worker (or its config class) cannot be imported by a spawned child process."""


def _ref_of(obj, what: str) -> str:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    hint = (
        f"Move {what} {qualname or obj!r} into a .py file (e.g. a module of mgtutorial/ or your own "
        "my_worker.py next to the notebook) and import it from there: worker processes are started "
        "with 'spawn' and can only run code they can import; a function defined in a notebook cell "
        "or in __main__ lives in the parent's memory only."
    )
    if module in (None, "__main__", "builtins") or qualname is None or "<locals>" in qualname:
        raise WorkerNotImportable(f"{what} {qualname or obj!r} is defined in {module!r}. {hint}")
    try:
        found = import_ref(f"{module}:{qualname}")
    except (ImportError, AttributeError) as exc:
        raise WorkerNotImportable(f"{what} {module}.{qualname} cannot be imported ({exc}). {hint}")
    if found is not obj:
        raise WorkerNotImportable(f"{what} {module}.{qualname} is not what that name imports. {hint}")
    return f"{module}:{qualname}"


def _refuse_in_spawned_child() -> None:
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "launch() was called while a spawned rank was starting up: the rank re-imported the main "
            "script and reached the launching code again. Put that code under "
            "`if __name__ == \"__main__\":` in your script."
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _check_port(port: int, host: str = "127.0.0.1") -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ValueError(
                f"master_port={port} on {host} is already in use ({exc.strerror}): another job or "
                "process holds it. Pass master_port=None to let the launcher pick a free port, or "
                "stop the process using it."
            ) from None


def _loopback_ifname() -> str:
    """Name of the network interface that holds 127.0.0.1 ("lo" on Linux, "lo0" on macOS)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(getattr(a, "address", None) == "127.0.0.1" for a in addrs):
            return name
    return "lo"


def check_config(worker: Callable, cfg, nprocs: int, backend: str) -> tuple[str, str]:
    """Everything :func:`launch` checks before starting a process; returns (worker ref, backend).

    Raises:
        ValueError: ``nprocs`` < 1, or backend vs hardware (see :func:`mgtutorial.env.resolve_backend`).
        WorkerNotImportable: worker or config class not importable by a child.
        TypeError: config not a dataclass instance or not JSON-serialisable.
        ValueError: whatever ``cfg.validate(nprocs)`` raises, if the config defines it.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r}: need at least 1 rank (an int ≥ 1).")
    chosen = env.resolve_backend(backend, nprocs)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file and not os.path.exists(main_file):
        raise RuntimeError(
            f"spawned ranks re-run the main script, and {main_file!r} is not a file (a script fed "
            "on standard input?). Save it as a .py file and run that, or use python -c / a notebook."
        )
    ref = _ref_of(worker, "worker")
    if cfg is not None:
        if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
            raise TypeError(f"cfg must be a dataclass instance, got {type(cfg).__name__}.")
        _ref_of(type(cfg), "config class")
        try:
            json.dumps(dataclasses.asdict(cfg))
        except TypeError as exc:
            raise TypeError(f"cfg {type(cfg).__name__} is not JSON-serialisable: {exc}") from None
        if callable(getattr(cfg, "validate", None)):
            cfg.validate(nprocs)  # the config's own checks (e.g. divisibility), before any process
    return ref, chosen


def launch(
    worker: Callable,
    cfg=None,
    nprocs: int = 2,
    *,
    backend: str | None = None,
    runs_dir: str | os.PathLike = "runs",
    name: str | None = None,
    master_port: int | None = None,
    threads_per_rank: int | None = None,
    extra_env: dict[str, str] | None = None,
) -> Run:
    """Start ``nprocs`` ranks running ``worker(cfg)``; return at once with a :class:`Run` handle.

    Args:
        worker: a module-level function taking one config object.
        cfg: a JSON-serialisable dataclass instance (written to ``<run dir>/config.json``).
        nprocs: number of ranks (world size), ≥ 1.
        backend: "auto" | "gloo" | "nccl"; default ``cfg.backend`` if it has one, else "auto".
            Checked against the hardware here; the ranks resolve it the same way.
        runs_dir: parent folder of the run directory ``<runs_dir>/<name>-<time>-<id>``.
        name: prefix of the run directory (default: the worker's module name).
        master_port: rendezvous TCP port on 127.0.0.1 (default: a free one).
        threads_per_rank: ``OMP_NUM_THREADS`` per rank (default: inherited, else 1).
        extra_env: more environment variables for every rank.

    Raises:
        ValueError, WorkerNotImportable, TypeError: see :func:`check_config`; a taken ``master_port``.
    """
    if backend and getattr(cfg, "backend", backend) != backend:
        raise ValueError(f"backend={backend!r} but cfg.backend={cfg.backend!r}: the ranks use the config's; "
                         "set it there (or pass the same value).")
    backend = backend or getattr(cfg, "backend", None) or "auto"
    _refuse_in_spawned_child()
    ref, _ = check_config(worker, cfg, nprocs, backend)
    if master_port is None:
        master_port = free_port()
    else:
        _check_port(master_port)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_name = f"{name or ref.split(':')[0].rsplit('.', 1)[-1]}-{stamp}-{secrets.token_hex(2)}"
    run_dir = Path(runs_dir).resolve() / run_name
    run_dir.mkdir(parents=True, exist_ok=False)
    runlog.write_config(run_dir, ref, nprocs, backend, cfg)
    base = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": "0",
        "TORCHELASTIC_RUN_ID": run_name,
        runlog.RUN_DIR_ENV: str(run_dir),
        "OMP_NUM_THREADS": str(threads_per_rank or os.environ.get("OMP_NUM_THREADS", "1")),
        "PYTHONUNBUFFERED": "1",
    }
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        base["GLOO_SOCKET_IFNAME"] = _loopback_ifname()
    base.update(extra_env or {})
    envs = {r: {**base, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nprocs)}
    from .run import Run

    return Run(run_dir, ref, cfg, envs, backend, master_port)
