"""What a :class:`~mgtutorial.runtime.run.Run` sets in TorchElastic's process machinery
(``torch.distributed.elastic.multiprocessing``,
https://pytorch.org/docs/stable/elastic/multiprocessing.html): where each rank's output goes
(:class:`RankFiles`), and TorchElastic's loggers silenced for the life of a run
(:func:`silence_loggers`). Under ``torchrun`` itself: a run folder that a restart continues
(:func:`claim_run_dir`) and a handled error written to the rank's error file
(:func:`record_failure`, https://pytorch.org/docs/stable/elastic/errors.html; notebooks/05b, 05c).

Taught in notebooks/00_setup.ipynb (a run's files). TorchElastic reports every failure with a
traceback of its own, and a :class:`~mgtutorial.runtime.run.Run` names the root cause instead; the
loggers are restored when the last run ends, so that a learner's own ``torchrun`` code in the same
kernel is heard as usual.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from mgtutorial.runtime import runlog

LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")
"""The loggers that report each failure with a traceback of their own."""


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


class _Silence:
    """How many holders want :data:`LOGGERS` silent, and the levels to restore after the last."""

    def __init__(self):
        self.lock = threading.Lock()
        self.holders = 0
        self.saved: dict[str, int] = {}


_SILENCE = _Silence()


def silence_loggers() -> Callable[[], None]:
    """Set :data:`LOGGERS` to CRITICAL until the function returned is called.

    Holders may overlap (several runs at once, from several threads): the first saves the
    loggers' levels, the last release restores them. Each returned function releases once; later
    calls do nothing.
    """
    s = _SILENCE
    with s.lock:
        if s.holders == 0:
            s.saved = {name: logging.getLogger(name).level for name in LOGGERS}
            for name in LOGGERS:
                logging.getLogger(name).setLevel(logging.CRITICAL)
        s.holders += 1
    released = threading.Event()

    def release() -> None:
        with s.lock:
            if released.is_set():
                return
            released.set()
            s.holders -= 1
            if s.holders == 0:
                for name, level in s.saved.items():
                    logging.getLogger(name).setLevel(level)

    return release


def claim_run_dir(run_dir: Path, rank: int) -> None:
    """Create ``run_dir`` for this torchrun job, which a restart of the same job continues.

    The job is told by ``TORCHELASTIC_RUN_ID`` (the same on every node and every restart), not by
    ``TORCHELASTIC_RESTART_COUNT``, which each node's agent counts for itself (05b).

    Raises:
        ValueError: on rank 0, ``run_dir`` holds another job's run.
    """
    job, id_file = os.environ.get("TORCHELASTIC_RUN_ID", ""), run_dir / "torchelastic_run_id"
    ours = job and id_file.exists() and id_file.read_text() == job
    if rank == 0 and (run_dir / "config.json").exists() and not ours:
        raise ValueError(
            f"--run-name {run_dir.name}: {run_dir} already holds an earlier run, whose logs this "
            "one would extend. Pass another --run-name, or delete that folder first."
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        id_file.write_text(job)


def record_failure(exc: BaseException) -> None:
    """Write ``exc`` to this rank's ``TORCHELASTIC_ERROR_FILE``, as ``@record`` does for an
    exception that leaves the entry point, so that the agent's failure report shows it; nothing
    outside torchrun."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
