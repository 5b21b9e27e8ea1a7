"""The channel between a kernel and the ranks of its ``%%ranks`` pool: one authenticated
connection per rank over 127.0.0.1, and the messages they exchange.

Taught in notebooks/00_setup.ipynb. Used by :mod:`mgtutorial.runtime.ranks_pool` (the kernel's
end) and :mod:`mgtutorial.runtime.ranks_serve` (each rank's end, a
:func:`multiprocessing.connection.Client`). Built on :mod:`multiprocessing.connection`
(https://docs.python.org/3/library/multiprocessing.html#module-multiprocessing.connection): the
kernel listens on a port of 127.0.0.1 only, and a connection counts once it has passed the
challenge of a key that only this pool's ranks hold; a second kernel has its own channel.

Messages, each a tuple; ``n`` numbers the kernel's requests, so that a late answer to one is never
taken for the answer to another:

- kernel → rank: ``("exec", n, source)``, ``("pull", n, name)``, ``("stack", n)``,
  ``("interrupt", n)``, ``("stop",)``;
- rank → kernel: ``("ready", rank, pid, device)`` once, ``("done", n, reply)``,
  ``("value", n, pickled, why_not)``, ``("stack", n, rank, text)``.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import socket
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from typing import Callable, Iterator

AUTHKEY_ENV = "MGTUTORIAL_RANKS_AUTHKEY"  # the key, hex, in each rank's environment


class Channel:
    """The kernel's end: a socket listening on 127.0.0.1, then a connection per rank.

    Attributes: ``port``, ``authkey`` (32 random bytes), ``conns`` and ``ready`` (rank → its
    connection, and the (pid, device) it announced).
    """

    def __init__(self) -> None:
        self.authkey = secrets.token_bytes(32)
        self._server: socket.socket | None = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.port: int = self._server.getsockname()[1]
        self.conns: dict[int, Connection] = {}
        self.ready: dict[int, tuple[int, str]] = {}
        self._interrupted = False

    def accept(self) -> None:
        """Wait up to 0.2 s for one rank to connect and announce itself; a connection that fails
        the key's challenge is closed (it is not one of ours)."""
        try:
            sock, _ = self._server.accept()
        except TimeoutError:
            return
        sock.setblocking(True)
        conn = Connection(sock.detach())
        try:  # what multiprocessing.connection.Listener.accept does, here with a time limit
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
            _, rank, pid, device = conn.recv()
        except Exception:
            conn.close()
            return
        self.conns[rank], self.ready[rank] = conn, (pid, device)

    def stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def send(self, rank: int, message: tuple) -> bool:
        """Send ``message`` to ``rank``; False if its connection is closed."""
        try:
            self.conns[rank].send(message)
            return True
        except (OSError, KeyError):
            return False

    @contextlib.contextmanager
    def whole_messages(self):
        """Within the block, Ctrl-C (SIGINT) is noted and raised as KeyboardInterrupt by
        :meth:`receive` between two messages, never in the middle of one (which would leave the
        rest of it to be read as the next). Outside the main thread, where no signal handler
        runs, nothing changes."""

        def note(signum, frame) -> None:
            self._interrupted = True

        previous = signal.getsignal(signal.SIGINT)
        try:
            signal.signal(signal.SIGINT, note)
        except ValueError:  # not the main thread
            previous = None
        try:
            yield
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def _raise_if_interrupted(self) -> None:
        if self._interrupted:
            self._interrupted = False
            raise KeyboardInterrupt

    def receive(
        self, n: int, ranks: set[int], until: Callable[[], float]
    ) -> Iterator[tuple[int, tuple | None]]:
        """Yield (rank, message) for the answers to request ``n`` from ``ranks``, until
        ``until()`` (a deadline on :func:`time.monotonic`, read again each time) passes or
        ``ranks`` is empty (the caller removes the ranks it is done with); (rank, None) when a
        rank's connection closes (its process ended), which also removes it from ``ranks``.

        Raises:
            KeyboardInterrupt: Ctrl-C within :meth:`whole_messages`, between two messages.
        """
        while ranks and (left := until() - time.monotonic()) > 0:
            self._raise_if_interrupted()
            by_conn = {self.conns[r]: r for r in ranks}
            for conn in wait(list(by_conn), timeout=min(left, 0.5)):
                self._raise_if_interrupted()
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    ranks.discard(by_conn[conn])
                    yield by_conn[conn], None
                    continue
                if message[1] == n:
                    yield by_conn[conn], message

    def close(self) -> None:
        self.stop_listening()
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
