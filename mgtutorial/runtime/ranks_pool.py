"""The kernel's side of ``%%ranks``: a pool of ranks with a live process group, a channel to each,
and what happens when a cell raises, hangs, is interrupted or kills a rank.

Taught in notebooks/00_setup.ipynb and notebooks/03a_collectives.ipynb. What runs inside the ranks
is :mod:`mgtutorial.runtime.ranks_serve`; the magics are :mod:`mgtutorial.runtime.ranks_magic`.

The pool is a :class:`~mgtutorial.runtime.run.Run` like every job of the course: started by
:func:`mgtutorial.launch` (fork server, backend "auto", a rank per GPU on GPU machines, loopback
only), stopped at interpreter exit, its ranks ending when the kernel dies. Each rank connects
back to a socket on 127.0.0.1 that only this pool listens on (:mod:`multiprocessing.connection`,
an authentication key per pool), so a second kernel has its own pool. No call here waits without
a limit: a cell that does not finish in time (a skipped or mismatched collective) is reported with
where each late rank waits, and the pool is restarted.
"""

from __future__ import annotations

import pickle
import signal
import time
from pathlib import Path

from mgtutorial.runtime import env
from mgtutorial.runtime.launcher import launch
from mgtutorial.runtime.ranks_channel import AUTHKEY_ENV, Channel
from mgtutorial.runtime.ranks_output import DEFAULT_TIMEOUT_S, CellOutcome, RankOutput
from mgtutorial.runtime.ranks_serve import PoolConfig, serve
from mgtutorial.runtime.run import WorkerFailed

START_TIMEOUT_S = 180.0  # the first start imports torch in the fork server
STACK_WAIT_S = 2.0  # for a late rank to say where it waits
INTERRUPT_GRACE_S = 2.0  # for interrupted ranks to stop
AFTER_DEATH_S = 2.0  # for the other ranks to report once one has died


class RankPool:
    """A pool of ranks that runs cells: :meth:`start`, :meth:`run_cell`, :meth:`pull`, :meth:`stop`.

    Attributes: ``runs_dir`` (where each start's run directory goes), ``run`` (the running
    :class:`~mgtutorial.runtime.run.Run`, or None), ``nprocs``, ``pids`` and ``devices`` (rank →
    pid, device), ``cells`` (cells run since the last start), ``started`` (unix s).
    """

    def __init__(self, runs_dir: str | Path = "runs"):
        self.runs_dir, self.run, self.nprocs = runs_dir, None, 0
        self.pids: dict[int, int] = {}
        self.devices: dict[int, str] = {}
        self.cells, self.started = 0, 0.0
        self._channel: Channel | None = None  # a new one at each start
        self._serial = 0  # numbers every request, so that a late answer is never taken for another

    @property
    def up(self) -> bool:
        return self.run is not None

    def start(self, nprocs: int | None = None, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start ``nprocs`` ranks (default: one per GPU with 2 or more GPUs, else 2) with their
        process group up; a running pool is stopped first.

        Raises:
            WorkerFailed: a rank failed while starting (e.g. the process group did not form).
            TimeoutError: not every rank connected within ``timeout_s``; the ranks are stopped.
        """
        self.stop()
        nprocs = nprocs or env.default_nprocs()
        self._channel = channel = Channel()
        try:
            self.run = launch(
                serve,
                PoolConfig(port=channel.port),
                nprocs,
                runs_dir=self.runs_dir,
                name="ranks",
                extra_env={AUTHKEY_ENV: channel.authkey.hex()},
            )
            self.nprocs, self.cells, self.started = nprocs, 0, time.time()
            deadline = time.monotonic() + timeout_s
            while len(channel.conns) < nprocs:
                if self.run.poll() is not None:
                    raise RuntimeError(f"the pool's ranks ended while starting: {self.run.run_dir}")
                if time.monotonic() > deadline:
                    missing = nprocs - len(channel.conns)
                    raise TimeoutError(
                        f"{missing} rank(s) did not start in time: {self.run.run_dir}"
                    )
                channel.accept()
        except BaseException:
            self._kill()
            raise
        finally:
            channel.stop_listening()
        self.pids = {r: pid for r, (pid, _) in channel.ready.items()}
        self.devices = {r: device for r, (_, device) in channel.ready.items()}

    def stop(self) -> None:
        """Let every rank leave its process group and end (killed after 10 s if it cannot)."""
        if self.run is None:
            return
        try:
            if self.run.status == "running":
                for rank in list(self._channel.conns):
                    self._channel.send(rank, ("stop",))
                self.run.wait(timeout=10)
        except (WorkerFailed, TimeoutError, RuntimeError):
            pass
        finally:
            self._kill()

    def _kill(self) -> None:
        if self.run is not None and self.run.status == "running":
            self.run.stop(timeout=2)
        if self._channel is not None:
            self._channel.close()
        self.pids, self.devices, self.run = {}, {}, None

    def _ended_while_idle(self) -> str:
        """How the pool failed between cells ("" if it did not): a rank whose process ended."""
        try:
            if self.run.poll() is None:
                return ""
        except WorkerFailed as exc:
            return f"Since the last cell, rank {exc.rank} died ({_ended(exc)})."
        except RuntimeError:
            pass
        return "Since the last cell, the pool's ranks ended."

    def run_cell(
        self, source: str, ranks: list[int] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> CellOutcome:
        """Run ``source`` on ``ranks`` (default: all); wait at most ``timeout_s`` seconds.

        A rank that raised reports its traceback, the others their outputs. Ranks still running at
        the limit report where they wait, and ranks whose process ended are named; then the pool
        is restarted (``note`` says so: every rank's variables are lost). Interrupting (Ctrl-C)
        interrupts the ranks; those that do not stop within 2 s count as late. A pool that lost a
        rank since the last cell is restarted first.

        Raises:
            ValueError: a rank outside the pool. RuntimeError: the pool is not running.
        """
        if self.run is None:
            raise RuntimeError("the pool is not running: start it first")
        before = self._ended_while_idle()
        if before:
            before += " " + self._restart()
        ranks = sorted(self._channel.conns) if ranks is None else sorted(set(ranks))
        if not ranks or any(r not in self._channel.conns for r in ranks):
            raise ValueError(f"ranks {ranks}: the pool has ranks 0 … {self.nprocs - 1}")
        self._serial += 1
        cell, self.cells = self._serial, self.cells + 1
        outcome = CellOutcome({r: RankOutput(r) for r in ranks}, note=before, timeout_s=timeout_s)
        pending = {r for r in ranks if self._channel.send(r, ("exec", cell, source))}
        for r in set(ranks) - pending:
            _died(outcome.ranks[r])
        with self._channel.whole_messages():
            try:
                self._collect(cell, pending, outcome, time.monotonic() + timeout_s)
            except KeyboardInterrupt:
                outcome.interrupted = True
                for r in pending:
                    self._channel.send(r, ("interrupt", cell))
                try:
                    self._collect(cell, pending, outcome, time.monotonic() + INTERRUPT_GRACE_S)
                except KeyboardInterrupt:
                    pass  # interrupted again: stop waiting
            if pending:
                self._late(cell, pending, outcome)
        if any(out.status in ("timeout", "died") for out in outcome.ranks.values()):
            self._how_they_died(outcome)
            outcome.note = " ".join(filter(None, [before, self._restart()]))
        return outcome

    def _collect(self, cell: int, pending: set[int], outcome: CellOutcome, deadline: float):
        """Take the ranks' answers to ``cell`` until none is pending or ``deadline`` passes; once
        a rank has died, the others get 2 s more at most."""
        for rank, message in self._channel.receive(cell, pending, lambda: deadline):
            if message is None:
                _died(outcome.ranks[rank])
                deadline = min(deadline, time.monotonic() + AFTER_DEATH_S)
            elif message[0] == "done":
                pending.discard(rank)
                _fill(outcome.ranks[rank], message[2])

    def _late(self, cell: int, pending: set[int], outcome: CellOutcome) -> None:
        """Ask the ranks still running where they wait; one that finishes meanwhile is not late."""
        for r in pending:
            self._channel.send(r, ("stack", cell))
        stacks, asked, deadline = {}, set(pending), time.monotonic() + STACK_WAIT_S
        for rank, message in self._channel.receive(cell, asked, lambda: deadline):
            if message is None:
                pending.discard(rank)
                _died(outcome.ranks[rank])
            elif message[0] == "done":
                pending.discard(rank)
                asked.discard(rank)
                _fill(outcome.ranks[rank], message[2])
            elif message[0] == "stack":
                stacks[rank] = message[3]
                asked.discard(rank)
        how = "stop when interrupted" if outcome.interrupted else "finish in time"
        for r in sorted(pending):
            stack = stacks.get(r)
            if stack is None:
                where = "it did not say where it waits (busy in code that holds Python's lock)"
            else:
                where = f"it is waiting in:\n{stack}" if stack else "it was between statements"
            out = outcome.ranks[r]
            out.status = "timeout"
            out.error = f"did not {how} (limit {outcome.timeout_s:g} s); {where}"
        pending.clear()

    def _how_they_died(self, outcome: CellOutcome) -> None:
        """Let the launcher see how a dead rank ended (up to 2 s) and say it in its column."""
        if not any(o.status == "died" for o in outcome.ranks.values()):
            return
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                if self.run.poll() is not None:
                    return
            except WorkerFailed as exc:
                out = outcome.ranks.get(exc.rank)
                if out is not None and out.status == "died":
                    out.error = f"died: {_ended(exc)}"
                return
            except RuntimeError:
                return
            time.sleep(0.1)

    def _restart(self) -> str:
        """Stop the pool's ranks at once and start as many new ones; say what that means."""
        self._kill()
        lost = "every rank's variables from earlier cells are lost"
        try:
            self.start(self.nprocs)
        except Exception as exc:
            return f"The pool was stopped and could not be restarted ({exc}); {lost}."
        return f"The pool was restarted ({self.nprocs} new ranks): {lost}."

    def pull(self, name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
        """Every rank's value of ``name``, in rank order, tensors moved to the CPU.

        Raises:
            NameError: a rank has no variable ``name``. ValueError: a value could not be sent.
            TimeoutError: a rank did not answer within ``timeout_s``. RuntimeError: a rank died,
            or the pool is not running.
        """
        if self.run is None:
            raise RuntimeError("the pool is not running: start it first")
        self._serial += 1
        cell, answers, asked = self._serial, {}, set(self._channel.conns)
        for r in asked:
            self._channel.send(r, ("pull", cell, name))
        deadline = time.monotonic() + timeout_s
        with self._channel.whole_messages():
            for rank, message in self._channel.receive(cell, asked, lambda: deadline):
                if message is None:
                    raise RuntimeError(f"rank {rank}'s process ended; `%ranks restart` anew")
                answers[rank] = message[2:]
                asked.discard(rank)
        if asked:
            raise TimeoutError(f"ranks {sorted(asked)} did not answer within {timeout_s:g} s")
        errors = [why for _, why in answers.values() if why]
        if errors:
            raise (NameError if errors[0].startswith("NameError") else ValueError)(errors[0])
        return [pickle.loads(answers[r][0]) for r in sorted(answers)]


def _died(out: RankOutput) -> None:
    out.status, out.error = "died", "died: its process ended"


def _fill(out: RankOutput, reply: dict) -> None:
    out.stdout, out.stderr, out.value = reply["stdout"], reply["stderr"], reply["value"]
    if reply["error"] is not None:
        out.status, out.error, out.error_type = "error", reply["error"], reply["error_type"]


def _ended(exc: WorkerFailed) -> str:
    code = exc.exitcode
    if code is not None and code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    if code is not None:
        return f"exited with code {code}"
    return exc.message
