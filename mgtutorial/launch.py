"""``launch(worker, cfg, nprocs)``: start ranks from a notebook without blocking it; the one way
every chapter starts processes.

Taught in notebooks/00_setup.ipynb; used by every chapter.
Built on TorchElastic's process machinery (``torch.distributed.elastic.multiprocessing.start_processes``,
https://pytorch.org/docs/stable/elastic/multiprocessing.html), the same code ``torchrun`` uses,
with the *spawn* start method. Each rank gets the torchrun environment (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT), so a worker runs unchanged under
``torchrun``.

What this adds to ``start_processes``:

* checks before any process starts: ``nprocs`` ≥ 1, backend vs hardware, the worker and its config
  importable by a spawned child (not defined in a notebook or ``__main__``), a free port;
* each rank's stdout/stderr in ``<run dir>/rank<r>.out|.err``;
* the *root cause* of a failure: when one rank raises, its peers fail a moment later with
  "Connection closed by peer"; which of them the process machinery notices first is a race. Each
  rank records its own error with a timestamp, and :class:`WorkerFailed` names the rank whose error
  is not a consequence of another's;
* a rank whose worker finished but whose process then died in interpreter teardown counts as
  finished (its result file is the proof), with a warning;
* stop on kernel interrupt, on interpreter exit and when the parent dies; no process left behind.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil
from torch.distributed.elastic.multiprocessing import start_processes
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from . import env, runlog

# TorchElastic logs every failure with a traceback of its own; we report the root cause instead.
for _name in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"):
    logging.getLogger(_name).setLevel(logging.CRITICAL)

_ACTIVE: weakref.WeakSet[Run] = weakref.WeakSet()
_HANDLED_SIGNALS = tuple(
    getattr(signal, s) for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, s)
)


class WorkerNotImportable(ValueError):
    """The worker (or its config class) cannot be imported by a spawned child process."""


class WorkerFailed(RuntimeError):
    """A rank raised (or died). Attributes: rank, exc_type, message, log_path, traceback, exitcode."""

    def __init__(self, rank, exc_type, message, log_path, traceback="", exitcode=None):
        self.rank, self.exc_type, self.message = rank, exc_type, message
        self.log_path, self.traceback, self.exitcode = log_path, traceback, exitcode
        where = _innermost_frame(traceback)
        super().__init__(
            f"rank {rank} failed with {exc_type}: {message}"
            + (f"\n  at {where}" if where else "")
            + f"\n  rank {rank}'s log: {log_path}\n  the other ranks were stopped."
        )


def _innermost_frame(tb: str) -> str:
    lines = [ln.strip() for ln in tb.splitlines() if ln.strip().startswith('File "')]
    return lines[-1] if lines else ""


@dataclass
class RunResult:
    """What a finished run returns.

    Attributes:
        run_dir: the run's directory.
        values: worker return value per rank.
        exit_codes: process exit code per rank.
        last_metrics: last logged record per rank (``{}`` if it logged none).
        duration_s: seconds from launch to the end of the last rank.
    """

    run_dir: Path
    values: dict[int, Any]
    exit_codes: dict[int, int | None]
    last_metrics: dict[int, dict] = field(default_factory=dict)
    duration_s: float = 0.0


class _RankFiles(LogsSpecs):
    """Put rank r's stdout/stderr at ``<run dir>/rank<r>.out|.err`` (flat, easy to find)."""

    def __init__(self, run_dir: Path):
        super().__init__(log_dir=str(run_dir))
        self._dir = run_dir

    @property
    def root_log_dir(self) -> str:
        return str(self._dir)

    def reify(self, envs):
        n = len(envs)
        for r in range(n):
            # TorchElastic's own error file is not needed: ranks write rank<r>.error.json.
            envs[r]["TORCHELASTIC_ERROR_FILE"] = os.devnull
        return LogsDest(
            stdouts={r: str(self._dir / f"rank{r}.out") for r in range(n)},
            stderrs={r: str(self._dir / f"rank{r}.err") for r in range(n)},
            tee_stdouts={},
            tee_stderrs={},
            error_files={r: os.devnull for r in range(n)},
        )


def _watch_parent(parent_pid: int) -> None:
    # A rank whose notebook kernel was killed must not live on.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _entry(worker_ref: str, cfg) -> Any:
    """Runs in each rank: import the worker, call it, record the result or the error."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        worker = _import_ref(worker_ref)
        value = worker(cfg)
        try:
            json.dumps(value)
        except TypeError:
            value = repr(value)
        runlog.write_result(value)
        atexit.register(_exit_now)  # skip C++ teardown once the work is safely recorded
        return value
    except BaseException as exc:
        runlog.write_error(exc)
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        raise


def _exit_now(code: int = 0) -> None:
    """Leave at once, without the interpreter's and C++ libraries' teardown.

    After a worker's result is written, nothing is left to do, but destroying static C++ objects can
    still abort the process (gloo threads: "terminate called without an active exception"),
    which would turn a finished rank into a failed one. Flushes stdout/stderr first.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _import_ref(ref: str):
    module, _, qualname = ref.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


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
        found = _import_ref(f"{module}:{qualname}")
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
    return Run(run_dir, ref, cfg, envs, backend, master_port)


class Run:
    """Handle on a running job. Created by :func:`launch`.

    Attributes: ``run_dir`` (Path), ``nprocs``, ``backend``, ``master_port``, ``status``
    ("running" | "succeeded" | "failed" | "stopped"), ``started`` (unix s).
    """

    def __init__(self, run_dir: Path, ref: str, cfg, envs: dict, backend: str, master_port: int):
        self.run_dir, self.nprocs, self.backend = run_dir, len(envs), backend
        self.master_port, self.started = master_port, time.time()
        self.status = "running"
        self._result: RunResult | None = None
        self._error: WorkerFailed | None = None
        saved = {s: signal.getsignal(s) for s in _HANDLED_SIGNALS}
        try:
            self._ctx = start_processes(
                name=run_dir.name,
                entrypoint=_entry,
                args={r: (ref, cfg) for r in range(self.nprocs)},
                envs=envs,
                logs_specs=_RankFiles(run_dir),
                start_method="spawn",
            )
        finally:
            # TorchElastic installs handlers that turn Ctrl-C into SignalException; the notebook's
            # KeyboardInterrupt must keep working.
            if threading.current_thread() is threading.main_thread():
                for s, h in saved.items():
                    signal.signal(s, h)
        self.pids: dict[int, int] = self._ctx.pids()
        _ACTIVE.add(self)

    def __repr__(self) -> str:
        return f"<Run {self.run_dir.name} nprocs={self.nprocs} status={self.status}>"

    def log_path(self, rank: int, stream: str = "err") -> Path:
        """Path of rank ``rank``'s ``"out"``, ``"err"`` or ``"jsonl"`` file."""
        return self.run_dir / f"rank{rank}.{stream}"

    def alive(self) -> int:
        """Number of rank processes still running."""
        return sum(1 for pid in self.pids.values() if _is_running(pid))

    def poll(self) -> RunResult | None:
        """Non-blocking: the result if finished (raises :class:`WorkerFailed` if a rank failed), else None."""
        if self.status == "running":
            outcome = self._ctx.wait(0)
            if outcome is None:
                return None
            self._finish(outcome)
        if self.status == "failed":
            raise self._error
        if self.status == "stopped":
            raise RuntimeError(f"run {self.run_dir.name} was stopped before it finished.")
        return self._result

    def wait(self, timeout: float | None = None, period: float = 0.1) -> RunResult:
        """Block until every rank has finished; return a :class:`RunResult`.

        Interrupting (Ctrl-C / the notebook's stop button) stops every rank, then re-raises.

        Raises:
            WorkerFailed: a rank failed (the one whose error started it); the others were stopped.
            TimeoutError: ``timeout`` seconds passed; the ranks keep running (call :meth:`stop`).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while (result := self.poll()) is None:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"run {self.run_dir.name} still running after {timeout} s; "
                        "call run.stop() to end it."
                    )
                time.sleep(period)
        except KeyboardInterrupt:
            self.stop()
            raise
        return result

    def stop(self, timeout: float = 5.0) -> None:
        """End every rank (SIGTERM, then SIGKILL after ``timeout`` s) and any process they started."""
        children = []
        for pid in self.pids.values():
            try:
                children += psutil.Process(pid).children(recursive=True)
            except psutil.Error:
                pass
        self._ctx.close(death_sig=signal.SIGTERM, timeout=int(max(1, timeout)))
        for child in children:
            try:
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(children, timeout=timeout)
        if self.status == "running":
            self.status = "stopped"
        _ACTIVE.discard(self)

    def _finish(self, outcome) -> None:
        procs = self._ctx._pc.processes if self._ctx._pc else []
        exit_codes = {r: p.exitcode for r, p in enumerate(procs)}
        self._ctx.close(death_sig=signal.SIGTERM, timeout=5)
        results = {r: runlog.read_json(self.run_dir / f"rank{r}.result.json") for r in range(self.nprocs)}
        if all(results.values()):
            if outcome.is_failed():
                bad = {r: c for r, c in exit_codes.items() if c not in (0, None)}
                warnings.warn(
                    f"{self.run_dir.name}: every rank finished its work, but rank(s) {bad} then exited "
                    "with a non-zero code during process teardown; results kept. See the .err files.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            self.status = "succeeded"
            last = {}
            for rec in runlog.read_run(self.run_dir):
                last[rec["rank"]] = rec
            self._result = RunResult(
                self.run_dir,
                {r: v["value"] for r, v in results.items()},
                exit_codes,
                last,
                max(v["time"] for v in results.values()) - self.started,
            )
        else:
            self.status = "failed"
            self._error = self._root_cause(outcome, exit_codes)
        _ACTIVE.discard(self)

    def _root_cause(self, outcome, exit_codes) -> WorkerFailed:
        errors = [runlog.read_json(self.run_dir / f"rank{r}.error.json") for r in range(self.nprocs)]
        errors = [e for e in errors if e]
        if errors:
            e = min(errors, key=lambda e: (e["secondary"], e["time"]))
            return WorkerFailed(
                e["rank"], e["type"], e["message"], self.log_path(e["rank"]), e["traceback"],
                exit_codes.get(e["rank"]),
            )
        rank = next(iter(outcome.failures), 0) if outcome.failures else 0
        code = exit_codes.get(rank)
        how = (
            f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
            else f"exited with code {code}"
        )
        log = self.log_path(rank)
        hint = "" if log.exists() else (
            "; it died while starting up, before its log existed (its traceback is on the launching "
            "terminal). From a script: is the launching code under `if __name__ == \"__main__\":`?")
        return WorkerFailed(rank, "ProcessExited", f"the process {how} before reporting an error{hint}",
                            log, "", code)


def _is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@atexit.register
def _stop_all() -> None:
    for run in list(_ACTIVE):
        try:
            run.stop(timeout=2)
        except Exception:
            pass
