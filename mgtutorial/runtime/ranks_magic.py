"""``%%ranks``: run a notebook cell on every rank of a live process group and see each rank's
output side by side; ``%ranks`` starts, stops, inspects the pool and pulls values into the kernel.

Taught in notebooks/00_setup.ipynb (when to explore with ``%%ranks``, and when to write a worker
in a file for :func:`mgtutorial.launch` or ``torchrun``) and notebooks/03a_collectives.ipynb (the
collectives tour). Loaded with ``%load_ext mgtutorial``. Built on IPython's magics
(https://ipython.readthedocs.io/en/stable/config/custommagics.html); the ranks are a
:class:`~mgtutorial.runtime.ranks_pool.RankPool`, each cell's result a
:class:`~mgtutorial.runtime.ranks_output.CellOutcome`::

    %%ranks [RANKS] [--timeout S] [--no-raise]   the cell on every rank, or on RANKS ("0" or "0,2")
    %ranks start [N]     a fresh pool of N ranks (default: a rank per GPU with 2 or more, else 2)
    %ranks stop | restart | status
    values = %ranks pull NAME    every rank's NAME, as a list in rank order, tensors on the CPU

Each rank's namespace starts with ``rank``, ``world_size``, ``local_rank``, ``device``, ``torch``
and ``dist``, and keeps what the cells define. A cell is plain Python (no magics inside).
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from mgtutorial.runtime.ranks_output import DEFAULT_TIMEOUT_S
from mgtutorial.runtime.ranks_pool import RankPool

USAGE = (
    "%%ranks [RANKS] [--timeout S] [--no-raise]  (a cell magic), or "
    "%ranks start [N] | stop | restart | status | pull NAME"
)


class RanksFailed(RuntimeError):
    """A ``%%ranks`` cell failed on some rank: it raised, did not finish in time, or died.

    The rank's column above the error says how; the message names the ranks. IPython shows only
    the message (``_render_traceback_``), not the kernel's side of the call.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{message}\nusage: {USAGE}")


def _cell_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="%%ranks", add_help=False)
    parser.add_argument("ranks", nargs="?", default="all", help='"all", "0" or "0,2"')
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds")
    parser.add_argument("--no-raise", action="store_true", help="show a failure, raise nothing")
    return parser


def parse_ranks(text: str) -> list[int] | None:
    """``"all"`` → None (every rank); ``"0,2"`` → [0, 2].

    Raises:
        UsageError: not "all" nor comma-separated ranks ≥ 0.
    """
    if text == "all":
        return None
    try:
        ranks = [int(part) for part in text.split(",")]
    except ValueError:
        ranks = [-1]
    if any(r < 0 for r in ranks):
        raise UsageError(f'ranks {text!r}: write "all", a rank ("0") or ranks ("0,2")')
    return ranks


@magics_class
class RanksMagics(Magics):
    """The ``%ranks`` / ``%%ranks`` magics of one kernel, with that kernel's own pool of ranks."""

    def __init__(self, shell, pool: RankPool | None = None):
        super().__init__(shell)
        self.pool = pool or RankPool()

    @line_cell_magic
    def ranks(self, line: str, cell: str | None = None):
        """Run the cell on every rank (``%%ranks``), or manage the pool (``%ranks start 2``).

        ``%%ranks [RANKS] [--timeout S] [--no-raise]``: RANKS is "all" (default), "0" or "0,2";
        ``--timeout`` is the cell's limit in seconds (default 5); a failure (a rank raised, did
        not finish in time, or died) is shown in its rank's column and raises
        :class:`RanksFailed`, unless ``--no-raise``. Late or dead ranks restart the pool.

        ``%ranks start [N]``, ``stop``, ``restart``, ``status`` (also ``%ranks`` alone) and
        ``pull NAME`` (returns every rank's NAME as a list, tensors moved to the CPU).
        """
        if cell is None:
            return self._command(line.split())
        args = _cell_parser().parse_args(shlex.split(line))
        if not args.timeout > 0:
            raise UsageError(f"--timeout {args.timeout:g}: the limit must be > 0 seconds")
        if not self.pool.up:
            self._start(None)
        try:
            outcome = self.pool.run_cell(cell, parse_ranks(args.ranks), args.timeout)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if not outcome.empty:
            display(outcome)
        if outcome.interrupted:
            raise KeyboardInterrupt
        if outcome.failed and not args.no_raise:
            raise RanksFailed(f"{outcome.summary()} (see the columns above)")

    def _command(self, words: list[str]):
        command, rest = (words[0], words[1:]) if words else ("status", [])
        if command == "start" and len(rest) <= 1:
            if rest and not rest[0].isdigit():
                raise UsageError(f"%ranks start {rest[0]}: N is a number of ranks ≥ 1")
            self._start(int(rest[0]) if rest else None)
        elif command == "restart" and not rest:
            self._start(self.pool.nprocs or None)
        elif command == "stop" and not rest:
            self.pool.stop()
            print("the pool is stopped")
        elif command == "status" and not rest:
            print(self.status())
        elif command == "pull" and len(rest) == 1:
            if not self.pool.up:
                raise UsageError("no pool is running: nothing to pull")
            return self.pool.pull(rest[0])
        else:
            raise UsageError(f"%ranks {' '.join(words)}: usage: {USAGE}")

    def _start(self, nprocs: int | None) -> None:
        if nprocs is not None and nprocs < 1:
            raise UsageError("a pool needs at least 1 rank")
        self.pool.start(nprocs)
        devices = ", ".join(self.pool.devices[r] for r in sorted(self.pool.devices))
        print(f"{self.pool.nprocs} ranks ready (backend {self.pool.run.backend}; {devices})")

    def status(self) -> str:
        """The pool in a few lines: ranks, backend, age, cells run, pids, devices, log folder."""
        pool = self.pool
        if not pool.up:
            return "no pool is running: `%ranks start N` or the first `%%ranks` cell starts one"
        logs = pool.run.run_dir
        if logs.is_relative_to(Path.cwd()):
            logs = logs.relative_to(Path.cwd())
        lines = [
            f"{pool.nprocs} ranks, backend {pool.run.backend}, up {time.time() - pool.started:.0f}"
            f" s, {pool.cells} cell(s) run; rank logs in {logs}"
        ]
        lines += [f"  rank {r}: pid {pool.pids[r]}, {pool.devices[r]}" for r in sorted(pool.pids)]
        return "\n".join(lines)


def load_ipython_extension(ipython) -> None:
    """Register ``%ranks`` / ``%%ranks`` in ``ipython`` (what ``%load_ext mgtutorial`` calls)."""
    ipython.register_magics(RanksMagics(ipython))


def unload_ipython_extension(ipython) -> None:
    """Stop the pool (``%unload_ext mgtutorial``)."""
    magics = ipython.magics_manager.registry.get(RanksMagics.__name__)
    if magics is not None:
        magics.pool.stop()
