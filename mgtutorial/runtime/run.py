"""The handle on a running job: :class:`Run` (poll, wait, stop), :class:`RunResult`, and
:class:`WorkerFailed` with the *root cause* of a failure.

Taught in notebooks/00_setup.ipynb (a run, its files, its failure) and used by every chapter.
Built on TorchElastic's process machinery (``torch.distributed.elastic.multiprocessing``,
https://pytorch.org/docs/stable/elastic/multiprocessing.html), the code ``torchrun`` uses.

Root cause: when one rank fails, its peers fail a moment later ("Connection closed by peer"), and
which of them the process machinery notices first is a race: :func:`root_cause` decides from the
files the ranks wrote. A rank that finished and then died in interpreter teardown counts as
finished (its result file is the proof), with a warning. Every rank is stopped on kernel
interrupt, on interpreter exit and when the parent dies; no process is left behind.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import re
import signal
import socket
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import start_processes
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from mgtutorial.runtime import runlog
from mgtutorial.runtime._rank import run_worker

# TorchElastic logs every failure with a traceback of its own; we report the root cause instead.
for _name in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"):
    logging.getLogger(_name).setLevel(logging.CRITICAL)

_ACTIVE: weakref.WeakSet[Run] = weakref.WeakSet()
_HANDLED_SIGNALS = tuple(
    getattr(signal, s) for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, s)
)


class RankFiles(LogsSpecs):
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
            stdouts={r: str(runlog.rank_file(self._dir, r, "out")) for r in range(n)},
            stderrs={r: str(runlog.rank_file(self._dir, r, "err")) for r in range(n)},
            tee_stdouts={},
            tee_stderrs={},
            error_files={r: os.devnull for r in range(n)},
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


class Run:
    """Handle on a running job. Created by :func:`mgtutorial.launch`.

    Attributes: ``run_dir`` (Path), ``nprocs``, ``backend`` (resolved: "gloo" | "nccl"),
    ``start_method`` ("forkserver" | "spawn"), ``master_port``, ``status``
    ("running" | "succeeded" | "failed" | "stopped"), ``started`` (unix s), ``pids`` (rank → pid).

    The job's TCPStore (where ranks exchange addresses) lives in this process, on a socket bound to
    127.0.0.1 only; every rank connects to it as a client, as ranks do to torchrun's agent store.
    """

    def __init__(
        self,
        run_dir: Path,
        ref: str,
        cfg,
        envs: dict,
        backend: str,
        *,
        start_method: str,
        listener: socket.socket,
    ):
        self.run_dir, self.nprocs, self.backend = run_dir, len(envs), backend
        self.start_method, self.master_port = start_method, listener.getsockname()[1]
        self.started, self.status = time.time(), "running"
        self._result: RunResult | None = None
        self._error: WorkerFailed | None = None
        # the store takes the listening socket over (and closes it when it is deleted)
        self._store = dist.TCPStore(
            "127.0.0.1",
            self.master_port,
            None,
            True,
            datetime.timedelta(hours=1),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
            use_libuv=True,
        )
        saved = {s: signal.getsignal(s) for s in _HANDLED_SIGNALS}
        try:
            self._ctx = start_processes(
                name=run_dir.name,
                entrypoint=run_worker,
                args={r: (ref, cfg, envs[r]) for r in range(self.nprocs)},
                envs=envs,
                logs_specs=RankFiles(run_dir),
                start_method=start_method,
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
        return runlog.rank_file(self.run_dir, rank, stream)

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

    def wait(self, timeout: float | None = None, period: float = 0.05) -> RunResult:
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
        self._close()

    def _close(self) -> None:
        self._store = None  # closes the store's socket
        _ACTIVE.discard(self)

    def _finish(self, outcome) -> None:
        # exit codes from TorchElastic's public result: 0 for ranks that returned, the code of the
        # failure it saw, None where it saw none (a rank stopped after another had failed)
        exit_codes = {r: 0 if r in outcome.return_values else None for r in range(self.nprocs)}
        exit_codes.update({r: f.exitcode for r, f in outcome.failures.items()})
        self._ctx.close(death_sig=signal.SIGTERM, timeout=5)
        results = {
            r: runlog.read_json(runlog.rank_file(self.run_dir, r, "result.json"))
            for r in range(self.nprocs)
        }
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
            self._error = root_cause(self.run_dir, self.nprocs, exit_codes)
        self._close()


def root_cause(run_dir: Path, nprocs: int, exit_codes: dict[int, int | None]) -> WorkerFailed:
    """The rank whose failure started it all, from the files the ranks left in ``run_dir``.

    In this order: the earliest error that is not a consequence of another rank's
    (``secondary`` False in ``rank<r>.error.json``); else a rank that died without writing an
    error or a result — killed by a signal (a crash in an extension, the kernel's OOM killer,
    SIGKILL) or exiting while it started — preferring one whose exit code was seen, then one whose
    log holds a "Fatal Python error" (:mod:`faulthandler`); else the earliest secondary error.
    ``exit_codes``: rank → exit code where known (negative: killed by that signal).
    """
    errors = {
        r: e
        for r in range(nprocs)
        if (e := runlog.read_json(runlog.rank_file(run_dir, r, "error.json")))
    }
    primary = [e for e in errors.values() if not e["secondary"]]
    silent = [
        r
        for r in range(nprocs)
        if r not in errors and not runlog.rank_file(run_dir, r, "result.json").exists()
    ]
    if primary or (errors and not silent):
        e = min(primary or errors.values(), key=lambda e: e["time"])
        return WorkerFailed(
            e["rank"],
            e["type"],
            e["message"],
            runlog.rank_file(run_dir, e["rank"], "err"),
            e["traceback"],
            exit_codes.get(e["rank"]),
        )
    fatal = {r: _fatal_line(runlog.rank_file(run_dir, r, "err")) for r in silent}
    rank = min(
        silent or [0],
        key=lambda r: (exit_codes.get(r) in (None, -signal.SIGTERM), not fatal.get(r), r),
    )
    code, log = exit_codes.get(rank), runlog.rank_file(run_dir, rank, "err")
    if code is not None and code < 0:
        how = f"was killed by signal {signal.Signals(-code).name}"
    elif code is not None:
        how = f"exited with code {code}"
    elif fatal.get(rank):
        how = f"was killed by signal {_FATAL.get(fatal[rank], '?')} ({fatal[rank]})"
    else:
        how = "was killed by a signal (most likely SIGKILL: the out-of-memory killer and `kill -9` leave no trace)"
    hint = (
        ""
        if log.exists()
        else (
            "; it died while starting up, before its log existed (its traceback is on the launching "
            'terminal). From a script: is the launching code under `if __name__ == "__main__":`?'
        )
    )
    return WorkerFailed(
        rank, "ProcessExited", f"the process {how} without reporting an error{hint}", log, "", code
    )


_FATAL = {
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Aborted": "SIGABRT",
    "Floating-point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}  # faulthandler's words


def _fatal_line(path: Path) -> str:
    try:
        found = re.search(r"Fatal Python error: (.+)", path.read_text(errors="replace"))
    except FileNotFoundError:
        return ""
    return found.group(1).strip() if found else ""


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
