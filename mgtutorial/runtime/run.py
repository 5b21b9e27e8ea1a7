"""The handle on a running job: :class:`Run` (poll, wait, stop) and :class:`RunResult`; a failed
run raises :class:`~mgtutorial.runtime.failure.WorkerFailed` naming its root cause
(:mod:`mgtutorial.runtime.failure`).

Taught in notebooks/00_setup.ipynb (a run, its files, its failure) and used by every chapter.
Built on TorchElastic's process machinery (``torch.distributed.elastic.multiprocessing``,
https://pytorch.org/docs/stable/elastic/multiprocessing.html), the code ``torchrun`` uses.

A run lives until it ends or is stopped, whether or not anyone keeps its handle: this module holds
every unfinished run (a notebook line ``launch(...)`` whose result is dropped still trains), and
:func:`latest_runs` finds the handles again. A rank that finished and then died in interpreter
teardown counts as finished (its result file is the proof), with a warning. Every rank is stopped
on kernel interrupt, on interpreter exit (saying so on stderr) and when the parent dies; no process
is left behind. TorchElastic's own loggers, which print a traceback of
their own for every failure, are silenced while a run is active and restored when the last one
ends (:func:`mgtutorial.runtime.torchelastic.silence_loggers`).
"""

from __future__ import annotations

import atexit
import collections
import datetime
import signal
import socket
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import start_processes
from torch.distributed.elastic.multiprocessing.api import RunProcsResult

from mgtutorial.runtime import procs, runlog
from mgtutorial.runtime._rank import run_worker
from mgtutorial.runtime.env import Backend
from mgtutorial.runtime.failure import WorkerFailed, root_cause
from mgtutorial.runtime.torchelastic import RankFiles, silence_loggers

StartMethod = Literal["forkserver", "spawn"]
"""How ranks start: forked from a server that has imported torch, or each a fresh interpreter."""
Status = Literal["running", "succeeded", "failed", "stopped"]
"""Where a run stands (``Run.status``)."""

_ACTIVE: set[Run] = set()
"""The unfinished runs of this process, held strongly: a run whose handle nobody keeps must not be
garbage-collected (its store and processes would go with it)."""
_LAUNCHED: collections.deque[Run] = collections.deque(maxlen=50)
"""The latest runs of this process, oldest first (:func:`latest_runs`)."""
_HANDLED_SIGNALS = tuple(
    getattr(signal, s) for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, s)
)


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
        backend: Backend,
        *,
        start_method: StartMethod,
        listener: socket.socket,
    ):
        self.run_dir, self.nprocs, self.backend = run_dir, len(envs), backend
        self.start_method, self.master_port = start_method, listener.getsockname()[1]
        self.started = time.time()
        self.status: Status = "running"
        self._result: RunResult | None = None
        self._error: WorkerFailed | None = None
        self._silent_since: float | None = None  # when poll() first saw a rank exit unreported
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
        # TorchElastic's loggers are silent until the run ends or stops (or is garbage-collected);
        # the finalizer releases them exactly once
        self._release_loggers = weakref.finalize(self, silence_loggers())
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
        except BaseException:
            self._close()
            raise
        finally:
            # TorchElastic installs handlers that turn Ctrl-C into SignalException; the notebook's
            # KeyboardInterrupt must keep working.
            if threading.current_thread() is threading.main_thread():
                for s, h in saved.items():
                    signal.signal(s, h)
        self.pids: dict[int, int] = self._ctx.pids()
        _ACTIVE.add(self)
        _LAUNCHED.append(self)

    def __repr__(self) -> str:
        return f"<Run {self.run_dir.name} nprocs={self.nprocs} status={self.status}>"

    def log_path(self, rank: int, stream: str = "err") -> Path:
        """Path of rank ``rank``'s ``"out"``, ``"err"`` or ``"jsonl"`` file."""
        return runlog.rank_file(self.run_dir, rank, stream)

    def alive(self) -> int:
        """Number of rank processes still running."""
        return sum(1 for pid in self.pids.values() if procs.is_running(pid))

    def poll(self) -> RunResult | None:
        """Non-blocking: the result if finished, else None.

        Raises:
            WorkerFailed: a rank failed. RuntimeError: the run was stopped before it finished.
        """
        if self.status == "running":
            outcome = self._ctx.wait(0)
            if outcome is None:
                if all(procs.is_running(pid) for pid in self.pids.values()):
                    return None
                # a rank has exited, yet TorchElastic reports neither its return value nor a
                # failure. A failure's report comes a moment later (the fork server reaps the
                # rank, then sends its exit status): wait for it 2 s. Past that, the rank ended
                # on KeyboardInterrupt (a SIGINT: the notebook's interrupt reaches the kernel's
                # process group), which torch.multiprocessing turns into exit code 0 and no
                # return value, a run that would never finish. The others are stopped; its
                # rank<r>.error.json names the interrupt.
                self._silent_since = self._silent_since or time.monotonic()
                if time.monotonic() - self._silent_since < 2.0:
                    return None
                outcome = RunProcsResult()
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
        """End every rank (SIGTERM, then SIGKILL after ``timeout`` s) and every process they
        started."""
        children = procs.descendants_of(self.pids.values())
        self._ctx.close(death_sig=signal.SIGTERM, timeout=int(max(1, timeout)))
        procs.kill(children, timeout)
        if self.status == "running":
            self.status = "stopped"
        self._close()

    def _close(self) -> None:
        self._store = None  # closes the store's socket
        _ACTIVE.discard(self)
        self._release_loggers()  # as they were, once no run is left

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
                    f"{self.run_dir.name}: every rank finished its work, but rank(s) {bad} then "
                    "exited with a non-zero code during process teardown; results kept. See the "
                    ".err files.",
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


def latest_runs(n: int = 5) -> list[Run]:
    """The ``n`` latest runs launched from this process, newest first, each with its ``status``
    brought up to date (a finished run is collected here, its failure kept for ``wait``/``poll``).
    ``latest_runs(1)[0]`` is the handle of the last launch, even one whose result was not kept.
    """
    runs = list(_LAUNCHED)[::-1][:n]
    for run in runs:
        try:
            run.poll()
        except Exception:  # a failed or stopped run: its status says so, wait() raises it again
            pass
    return runs


def last_run() -> Run:
    """The latest run launched from this process (see :func:`latest_runs`).

    Raises:
        LookupError: nothing was launched from this process yet.
    """
    if not _LAUNCHED:
        raise LookupError("no run was launched from this process yet: call launch(...) first.")
    return _LAUNCHED[-1]


@atexit.register
def _stop_all() -> None:
    for run in list(_ACTIVE):
        try:
            if run.status == "running" and run._ctx.wait(0) is None:
                print(
                    f"stopping run {run.run_dir.name}: still running as this process exits "
                    "(keep launch()'s result and call its wait() to wait for it).",
                    file=sys.stderr,
                )
            run.stop(timeout=2)
        except Exception:
            pass
