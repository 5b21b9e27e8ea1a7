"""``launch(worker, cfg, nprocs)``: start ranks from a notebook without blocking it; the one way
every chapter starts processes.

Taught in notebooks/00_setup.ipynb; used by every chapter. Built on TorchElastic's process
machinery (``torch.distributed.elastic.multiprocessing.start_processes``,
https://pytorch.org/docs/stable/elastic/multiprocessing.html), the same code ``torchrun`` uses,
with the *forkserver* start method (``multiprocessing.set_forkserver_preload``,
https://docs.python.org/3/library/multiprocessing.html#contexts-and-start-methods): the server
imports torch once (:data:`FORKSERVER_PRELOAD`), never course or learner modules, and every rank
is forked from it; *spawn* is the option and the fallback. Each rank gets the launcher's current
environment plus the torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT), so a worker runs unchanged under ``torchrun``.

Checks before any process starts: ``nprocs`` ≥ 1, backend vs hardware, the worker and its config
importable by a child (not defined in a notebook or ``__main__``), the config's own ``validate``, a
free port. The running job is a :class:`~mgtutorial.runtime.run.Run` (its own module, with
:class:`~mgtutorial.runtime.run.RunResult`); a failure raises
:class:`~mgtutorial.runtime.failure.WorkerFailed`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import multiprocessing
import multiprocessing.forkserver
import os
import secrets
import socket
import sys
import time
import typing
from pathlib import Path
from typing import Callable, get_args

from mgtutorial.common.config import check_types, check_writable_folder
from mgtutorial.runtime import _rank, env, procs, runlog
from mgtutorial.runtime._rank import import_ref
from mgtutorial.runtime.run import Run, StartMethod

START_METHOD_ENV = "MGTUTORIAL_START_METHOD"


class WorkerNotImportable(ValueError):
    """The worker (or its config class) cannot be imported by a spawned child process."""


def _ref_of(obj, what: str) -> str:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    hint = (
        f"Move {what} {qualname or obj!r} into a .py file (e.g. a module of mgtutorial/ or your "
        "own my_worker.py next to the notebook) and import it from there: worker processes "
        "(forked from a clean fork server, or spawned) can only run code they can import; a "
        "function defined in a notebook cell or in __main__ lives in the parent's memory only."
    )
    if module in (None, "__main__", "builtins") or qualname is None or "<locals>" in qualname:
        raise WorkerNotImportable(f"{what} {qualname or obj!r} is defined in {module!r}. {hint}")
    try:
        found = import_ref(f"{module}:{qualname}")
    except (ImportError, AttributeError) as exc:
        raise WorkerNotImportable(f"{what} {module}.{qualname} cannot be imported ({exc}). {hint}")
    if found is not obj:
        raise WorkerNotImportable(
            f"{what} {module}.{qualname} is not what that name imports. {hint}"
        )
    return f"{module}:{qualname}"


def _refuse_in_spawned_child() -> None:
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "launch() was called while a spawned rank was starting up: the rank re-imported the "
            "main script and reached the launching code again. Put that code under "
            '`if __name__ == "__main__":` in your script.'
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_config(
    worker: Callable, cfg, nprocs: int, backend: env.BackendChoice
) -> tuple[str, env.Backend]:
    """Everything :func:`launch` checks before starting a process; returns (worker ref, backend).

    Raises:
        ValueError: ``nprocs`` < 1, or backend vs hardware (see
            :func:`mgtutorial.runtime.env.resolve_backend`).
        WorkerNotImportable: worker or config class not importable by a child.
        TypeError: config not a dataclass instance, not the class the worker's first parameter is
            annotated with (None included), a field of the wrong type, or not JSON-serialisable.
        ValueError: whatever ``cfg.validate(nprocs)`` raises, if the config defines it.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r}: need at least 1 rank (an int ≥ 1).")
    chosen = env.resolve_backend(backend, nprocs)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file and not os.path.exists(main_file):
        raise RuntimeError(
            f"spawned ranks re-run the main script, and {main_file!r} is not a file (a script fed "
            "on standard input?). Save it as a .py file and run that, or use python -c or a "
            "notebook."
        )
    ref = _ref_of(worker, "worker")
    _check_worker_takes(worker, cfg)
    if cfg is not None:
        if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
            raise TypeError(f"cfg must be a dataclass instance, got {type(cfg).__name__}.")
        _ref_of(type(cfg), "config class")
        try:
            json.dumps(dataclasses.asdict(cfg))
        except TypeError as exc:
            raise TypeError(f"cfg {type(cfg).__name__} is not JSON-serialisable: {exc}") from None
        check_types(cfg)  # epochs=2.5 where an int is needed, before the config's own checks
        if callable(getattr(cfg, "validate", None)):
            cfg.validate(nprocs)  # the config's own checks (e.g. divisibility), before any process
    return ref, chosen


def _check_worker_takes(worker: Callable, cfg) -> None:
    """Refuse ``cfg`` when the worker's first parameter is annotated with a config dataclass and
    ``cfg`` is not an instance of it (``None`` included)."""
    params = list(inspect.signature(worker).parameters.values())
    try:
        hint = typing.get_type_hints(worker).get(params[0].name) if params else None
    except Exception:  # an annotation that cannot be resolved here: nothing to compare with
        return
    if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)) or isinstance(cfg, hint):
        return
    name, want = f"{worker.__module__}.{worker.__qualname__}", hint.__name__
    if cfg is None:
        raise TypeError(
            f"cfg=None: worker {name} takes a {want}. Pass {want}() for its defaults (from "
            f"{hint.__module__}), or {want}(field=value, ...) to change some."
        )
    raise TypeError(
        f"cfg is a {type(cfg).__name__}, but worker {name} takes a {want} (from "
        f"{hint.__module__}): pass {want}(...), or launch the worker that takes this config."
    )


def launch(
    worker: Callable,
    cfg=None,
    nprocs: int = 2,
    *,
    backend: env.BackendChoice | None = None,
    runs_dir: str | os.PathLike = "runs",
    name: str | None = None,
    master_port: int | None = None,
    threads_per_rank: int | None = None,
    extra_env: dict[str, str] | None = None,
    start_method: StartMethod | None = None,
) -> Run:
    """Start ``nprocs`` ranks running ``worker(cfg)``; return at once with a :class:`Run` handle.

    Args:
        worker: a module-level function taking one config object.
        cfg: a JSON-serialisable dataclass instance (written to ``<run dir>/config.json``).
        nprocs: number of ranks (world size), ≥ 1.
        backend: "auto" | "gloo" | "nccl"; default ``cfg.backend`` if it has one, else "auto".
            Checked against the hardware here; the ranks get the resolved one
            (``MGTUTORIAL_BACKEND``, which :func:`mgtutorial.runtime.env.distributed` reads for
            "auto"), and so does ``Run.backend``.
        runs_dir: parent folder of the run directory ``<runs_dir>/<name>-<time>-<id>``.
        name: prefix of the run directory (default: the worker's module name).
        master_port: the job's TCPStore port on 127.0.0.1 (default: one the OS picks).
        threads_per_rank: ``OMP_NUM_THREADS`` per rank (default: inherited, else 1).
        extra_env: more environment variables for every rank.
        start_method: "forkserver" (default where the platform has it: ranks are forked from a
            server that has imported torch, so only the first launch pays for that) or "spawn"
            (a fresh interpreter per rank); default ``$MGTUTORIAL_START_METHOD`` if set.

    Raises:
        ValueError, WorkerNotImportable, TypeError: see :func:`check_config`; a ``runs_dir``
            that cannot be written; a taken ``master_port``; an unknown ``start_method``; more
            than :data:`FORKSERVER_MAX_RANKS` ranks from the fork server.
    """
    if backend and getattr(cfg, "backend", backend) != backend:
        raise ValueError(
            f"backend={backend!r} but cfg.backend={cfg.backend!r}: the ranks use the config's; "
            "set it there (or pass the same value)."
        )
    backend = backend or getattr(cfg, "backend", None) or "auto"
    _refuse_in_spawned_child()
    ref, chosen = check_config(worker, cfg, nprocs, backend)
    check_writable_folder(runs_dir, "runs_dir (--runs-dir)")
    method = _start_method(start_method)
    if method == "forkserver" and nprocs > FORKSERVER_MAX_RANKS:
        raise ValueError(
            f"nprocs={nprocs}: the fork server starts at most {FORKSERVER_MAX_RANKS} ranks "
            "(each is sent every rank's result pipe, and one message carries at most ~250 file "
            "descriptors): use fewer ranks, or start_method='spawn' "
            f"({START_METHOD_ENV}=spawn)."
        )
    listener = _listen(master_port)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_name = f"{name or ref.split(':')[0].rsplit('.', 1)[-1]}-{stamp}-{secrets.token_hex(2)}"
    run_dir = Path(runs_dir).resolve() / run_name
    run_dir.mkdir(parents=True, exist_ok=False)
    runlog.write_config(run_dir, ref, nprocs, chosen, cfg)
    base = {
        **os.environ,  # the parent's environment *now*, not when the fork server started
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(listener.getsockname()[1]),
        # the store is ours (see Run): every rank is a client
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": "0",
        runlog.RUN_DIR_ENV: str(run_dir),
        env.BACKEND_ENV: chosen,
        "OMP_NUM_THREADS": str(threads_per_rank or os.environ.get("OMP_NUM_THREADS", "1")),
        "PYTHONUNBUFFERED": "1",
        _rank.LAUNCHER_PID_ENV: str(os.getpid()),
    }
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        base["GLOO_SOCKET_IFNAME"] = procs.loopback_ifname()
    base.update(extra_env or {})
    envs = {r: {**base, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nprocs)}
    return Run(run_dir, ref, cfg, envs, chosen, start_method=method, listener=listener)


# What the fork server imports once, so that ranks forked from it start with torch loaded: torch and
# the libraries a rank needs, never course or learner modules (those a rank imports itself, fresh).
FORKSERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing.api",
    "torch.nn.parallel",
    "torch._dynamo",  # DistributedDataParallel imports it when a model is wrapped: seconds per rank
    "torch.utils.data",
    "sklearn.datasets",
    "sklearn.model_selection",
)


FORKSERVER_MAX_RANKS = 124
"""The most ranks one forkserver launch starts on Linux (torch 2.14.1's ``start_processes`` sends
each rank the result queues of all; 125 fail in ``sendmsg``, measured)."""


def _start_method(requested: StartMethod | None) -> StartMethod:
    method = (
        requested
        or os.environ.get(START_METHOD_ENV)
        or ("forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn")
    )
    if method not in get_args(StartMethod):
        raise ValueError(f"start_method={method!r} is not 'forkserver' or 'spawn'.")
    if method == "forkserver":
        # takes effect when the server starts (the first forkserver launch of this process)
        multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return method


def start_fork_server() -> bool:
    """Start the fork server now and return at once: it imports :data:`FORKSERVER_PRELOAD` (seconds)
    while the caller goes on, and the first :func:`launch` finds it ready. Optional (that launch
    starts it otherwise); does nothing where ranks are spawned. Returns whether one was started or
    runs. Follows ``multiprocessing.forkserver.ensure_running``
    (https://docs.python.org/3/library/multiprocessing.html#multiprocessing.set_forkserver_preload).
    """
    if _start_method(None) != "forkserver":
        return False
    multiprocessing.forkserver.ensure_running()
    return True


def _listen(port: int | None) -> socket.socket:
    """A TCP socket listening on 127.0.0.1 only, at ``port`` (None: one the OS picks)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", port or 0))
    except OSError as exc:
        s.close()
        raise ValueError(
            f"master_port={port} on 127.0.0.1 is already in use ({exc.strerror}): another job or "
            "process holds it. Pass master_port=None to let the launcher pick a free port, or "
            "stop the process using it."
        ) from None
    s.listen(256)
    return s
