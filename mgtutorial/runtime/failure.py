"""When a run fails: :class:`WorkerFailed`, and :func:`root_cause`, which names the rank whose
failure started it.

Taught in notebooks/00_setup.ipynb (a failing rank, exercise 00.4) and used by every chapter.

When one rank fails, its peers fail a moment later ("Connection closed by peer"), and which of
them the process machinery notices first is a race. So the decision is made from the files the
ranks wrote (:mod:`mgtutorial.runtime.runlog`): ``rank<r>.error.json`` (written by the rank that
raised, with ``secondary`` set where the error is a peer's consequence), ``rank<r>.result.json``
and the ``Fatal Python error`` line :mod:`faulthandler` prints into ``rank<r>.err`` on a crash.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from mgtutorial.runtime import runlog

FATAL_SIGNALS = {
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Aborted": "SIGABRT",
    "Floating-point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
"""faulthandler's words for a crash -> the signal that caused it."""


class WorkerFailed(RuntimeError):
    """A rank raised (or died); the other ranks were stopped.

    Attributes: ``rank``, ``exc_type`` (the exception's class name, or "ProcessExited"),
    ``message``, ``log_path`` (that rank's ``.err`` file), ``traceback`` (text, "" if none),
    ``exitcode`` (None where unknown; negative: killed by that signal).
    """

    def __init__(self, rank, exc_type, message, log_path, traceback="", exitcode=None):
        self.rank, self.exc_type, self.message = rank, exc_type, message
        self.log_path, self.traceback, self.exitcode = log_path, traceback, exitcode
        where = innermost_frame(traceback)
        super().__init__(
            f"rank {rank} failed with {exc_type}: {message}"
            + (f"\n  at {where}" if where else "")
            + f"\n  rank {rank}'s log: {log_path}\n  the other ranks were stopped."
        )


def innermost_frame(traceback: str) -> str:
    """The last ``File "…", line …, in …`` line of a traceback's text ("" if it has none): where
    the exception was raised."""
    lines = [ln.strip() for ln in traceback.splitlines() if ln.strip().startswith('File "')]
    return lines[-1] if lines else ""


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
        log = runlog.rank_file(run_dir, e["rank"], "err")
        code = exit_codes.get(e["rank"])
        return WorkerFailed(e["rank"], e["type"], e["message"], log, e["traceback"], code)
    fatal = {r: fatal_line(runlog.rank_file(run_dir, r, "err")) for r in silent}
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
        how = f"was killed by signal {FATAL_SIGNALS.get(fatal[rank], '?')} ({fatal[rank]})"
    else:
        how = (
            "was killed by a signal (most likely SIGKILL: the out-of-memory killer and `kill -9` "
            "leave no trace)"
        )
    hint = ""
    if not log.exists():
        hint = (
            "; it died while starting up, before its log existed (its traceback is on the "
            "launching terminal). From a script: is the launching code under "
            '`if __name__ == "__main__":`?'
        )
    message = f"the process {how} without reporting an error{hint}"
    return WorkerFailed(rank, "ProcessExited", message, log, "", code)


def fatal_line(path: Path) -> str:
    """What follows ``Fatal Python error:`` in the log at ``path`` ("" if absent or no log)."""
    try:
        found = re.search(r"Fatal Python error: (.+)", path.read_text(errors="replace"))
    except FileNotFoundError:
        return ""
    return found.group(1).strip() if found else ""
