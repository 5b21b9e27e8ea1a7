"""The handle on a running job: :class:`Run` (poll, wait, stop), :class:`RunResult`, and
:class:`WorkerFailed` with the *root cause* of a failure.

Taught in notebooks/00_setup.ipynb (a run, its files, its failure) and used by every chapter.
Built on TorchElastic's process machinery (``torch.distributed.elastic.multiprocessing``,
https://pytorch.org/docs/stable/elastic/multiprocessing.html), the code ``torchrun`` uses.

Root cause: when one rank raises, its peers fail a moment later with "Connection closed by peer";
which of them the process machinery notices first is a race. Each rank records its own error with
a timestamp, and :class:`WorkerFailed` names the rank whose error is not a consequence of another's.
A rank whose worker finished but whose process then died in interpreter teardown counts as finished
(its result file is the proof), with a warning. Every rank is stopped on kernel interrupt, on
interpreter exit and when the parent dies; no process is left behind.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from torch.distributed.elastic.multiprocessing import start_processes
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from . import runlog
from ._rank import run_worker

# TorchElastic logs every failure with a traceback of its own; we report the root cause instead.
for _name in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"):
    logging.getLogger(_name).setLevel(logging.CRITICAL)

_ACTIVE: weakref.WeakSet[Run] = weakref.WeakSet()
_HANDLED_SIGNALS = tuple(
    getattr(signal, s) for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, s)
)


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
                entrypoint=run_worker,
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
