"""Inside each rank of a ``%%ranks`` pool: join the process group, then run the cells the kernel
sends, one namespace per rank that lives as long as the rank.

Taught in notebooks/00_setup.ipynb (exploring from cells) and notebooks/03a_collectives.ipynb
(the collectives tour). The kernel's side is :mod:`mgtutorial.runtime.ranks_pool`, the magics are
:mod:`mgtutorial.runtime.ranks_magic`.

:func:`serve` is an ordinary worker that :func:`mgtutorial.launch` starts like any other: it joins
the process group with :func:`mgtutorial.runtime.env.distributed`, connects back to the kernel on
127.0.0.1 with :mod:`multiprocessing.connection` (authenticated with a key that only the kernel
and its ranks hold:
https://docs.python.org/3/library/multiprocessing.html#multiprocessing-auth-keys) and serves until
the kernel says stop or goes away. A cell runs with :func:`exec`; the value of its
last expression comes back, as IPython shows it, unless the cell ends with ``;``.

Two threads: the main thread runs cells; a reader thread takes the kernel's messages and answers
two of them at once, even while a cell runs: "where are you waiting?" (the main thread's Python
stack, from :func:`sys._current_frames`) and "interrupt" (SIGINT to the main thread).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import io
import linecache
import os
import pickle
import pprint
import queue
import re
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection

import torch
import torch.distributed as dist

from mgtutorial.runtime import env
from mgtutorial.runtime.ranks_channel import AUTHKEY_ENV

CELL_FILE = "<ranks cell {}>"  # a cell's file name in tracebacks and stacks
MAX_STREAM_CHARS = 50_000  # what a cell printed beyond this is cut (the start is kept)


@dataclass(kw_only=True)
class PoolConfig:
    """What every rank of a ``%%ranks`` pool gets (the channel's key travels in the environment)."""

    port: int
    """The kernel's port on 127.0.0.1, where each rank connects once its process group is up."""
    backend: env.BackendChoice = "auto"
    """The process group's backend: "auto" is NCCL with a GPU per local rank, else gloo."""


def serve(cfg: PoolConfig) -> dict:
    """The worker of a ``%%ranks`` pool: join the process group and serve cells until told to stop.

    Returns ``{"rank": r, "cells": n}`` (cells run). Leaves at once, without the process group's
    teardown, when the kernel's connection closes (the kernel died or was restarted).
    """
    if AUTHKEY_ENV not in os.environ:
        raise RuntimeError(
            "serve() is the worker of a %%ranks pool: RankPool.start launches it with the "
            f"channel's key in {AUTHKEY_ENV}"
        )
    authkey = bytes.fromhex(os.environ.pop(AUTHKEY_ENV))
    with env.distributed(cfg.backend) as ctx:
        conn = Client(("127.0.0.1", cfg.port), authkey=authkey)
        server = CellServer(conn, ctx)
        server.loop()
    return {"rank": ctx.rank, "cells": server.cells}


class CellServer:
    """One rank's end of the channel: its namespace, the cells it runs, the reader thread."""

    def __init__(self, conn: Connection, ctx: env.DistContext):
        self.conn, self.rank, self.cells = conn, ctx.rank, 0
        self.namespace = {
            "__name__": "__main__",
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "local_rank": ctx.local_rank,
            "device": ctx.device,
            "torch": torch,
            "dist": dist,
        }
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.busy: int | None = None  # the cell being run
        self.interrupted = False  # one KeyboardInterrupt per cell, however many SIGINTs arrive
        self.main = threading.get_ident()
        self._send_lock = threading.Lock()
        signal.signal(signal.SIGINT, self._on_sigint)
        self.send(("ready", ctx.rank, os.getpid(), str(ctx.device)))
        threading.Thread(target=self._read, name="ranks-reader", daemon=True).start()

    def send(self, message: tuple) -> None:
        with self._send_lock:
            self.conn.send(message)

    def _on_sigint(self, signum, frame) -> None:
        # The kernel's interrupt reaches a rank twice (the kernel's process group, and the
        # "interrupt" message); between cells it is ignored.
        if self.busy is not None and not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the kernel is gone: nobody is left to serve
            kind = message[0]
            if kind == "stack":
                self.send(("stack", message[1], self.rank, stack_of(self.main)))
            elif kind == "interrupt":
                if self.busy == message[1]:
                    signal.pthread_kill(self.main, signal.SIGINT)
            else:
                self.inbox.put(message)
                if kind == "stop":
                    return

    def loop(self) -> None:
        """Serve the inbox: ``("exec", n, source)``, ``("pull", n, name)``, ``("stop",)``."""
        while True:
            message = self.inbox.get()
            if message[0] == "stop":
                return
            if message[0] == "exec":
                self.send(("done", message[1], self.run_cell(message[1], message[2])))
            elif message[0] == "pull":
                self.send(("value", message[1], *self.pull(message[2])))

    def run_cell(self, cell: int, source: str) -> dict:
        """Run ``source`` (request number ``cell``, its file ``<ranks cell N>`` in tracebacks) in
        this rank's namespace; return what it printed, its value or error.

        Keys: stdout, stderr (str), value (the last expression's ``pprint`` text, or None),
        error (the traceback from the cell's own frames on, or None), error_type.
        """
        self.cells += 1
        filename = CELL_FILE.format(cell)
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        out, err = io.StringIO(), io.StringIO()
        reply = {"value": None, "error": None, "error_type": None}
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                self.interrupted, self.busy = False, cell
                try:
                    value = run_source(source, filename, self.namespace)
                finally:
                    self.busy = None
                if value is not None:
                    self.namespace["_"] = value
                    reply["value"] = shown(value)
        except BaseException as exc:  # KeyboardInterrupt and SystemExit too: the rank lives on
            self.busy = None
            reply["error"], reply["error_type"] = format_error(exc, filename), type(exc).__name__
        reply["stdout"], reply["stderr"] = clip(out.getvalue()), clip(err.getvalue())
        return reply

    def pull(self, name: str) -> tuple[bytes | None, str | None]:
        """This rank's ``name``, tensors moved to the CPU, pickled; or (None, why not)."""
        if name not in self.namespace:
            return None, f"NameError: rank {self.rank} has no variable {name!r}"
        try:
            return pickle.dumps(to_cpu(self.namespace[name])), None
        except Exception as exc:
            return None, f"{type(exc).__name__} on rank {self.rank}: {exc}"


def run_source(source: str, filename: str, namespace: dict):
    """``exec`` the cell in ``namespace``; return its last expression's value (None: none shown).

    As IPython does: a cell whose last statement is an expression shows its value, unless the cell
    ends with ``;``. Raises whatever the cell raises (SyntaxError before anything runs).
    """
    tree = ast.parse(source, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";"):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), namespace)
    return None if last is None else eval(compile(last, filename, "eval"), namespace)


def shown(value) -> str:
    """A value as the cell shows it: ``pprint`` text (dicts in their own order)."""
    try:
        return pprint.pformat(value, sort_dicts=False)
    except Exception as exc:
        return f"<{type(value).__name__}: repr failed with {type(exc).__name__}: {exc}>"


def clip(text: str, limit: int = MAX_STREAM_CHARS) -> str:
    """``text``, cut after ``limit`` characters with a line that says how much was left out."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n… ({len(text) - limit} more characters not shown)\n"


def format_error(exc: BaseException, filename: str) -> str:
    """The traceback of ``exc`` from the cell's first frame on, without this module's frames (the
    serving loop, the interrupt handler), library paths shortened as in :func:`short_path`."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    report = traceback.TracebackException(type(exc), exc, tb)
    report.stack = traceback.StackSummary.from_list(
        [frame for frame in report.stack if frame.filename != __file__]
    )
    return re.sub(r'File "[^"\n]*site-packages/', 'File "', "".join(report.format()))


def short_path(path: str) -> str:
    """A library file's path from its package on (``torch/distributed/distributed_c10d.py``):
    where the library is installed differs between machines and says nothing about the error."""
    return path.rsplit("site-packages/", 1)[-1]


def stack_of(thread_id: int) -> str:
    """Where the thread ``thread_id`` is now, from the running cell's frame inwards ("" if it is
    running no cell), one frame per entry as in a traceback, library paths shortened."""
    frame = sys._current_frames().get(thread_id)
    frames = traceback.extract_stack(frame) if frame is not None else []
    prefix = CELL_FILE.split("{")[0]
    start = next((i for i, f in enumerate(frames) if f.filename.startswith(prefix)), None)
    if start is None:
        return ""
    return "".join(
        f'  File "{short_path(f.filename)}", line {f.lineno}, in {f.name}\n'
        + (f"    {f.line.strip()}\n" if f.line else "")
        for f in frames[start:]
    )


def to_cpu(obj):
    """``obj`` with every tensor in it (in lists, tuples, dicts, modules) detached and on the CPU;
    a DTensor becomes this rank's local shard."""
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "to_local", None)
        return (local() if callable(local) else obj).detach().cpu()
    if isinstance(obj, torch.nn.Module):
        return copy.deepcopy(obj).cpu()
    if isinstance(obj, dict):
        return type(obj)((k, to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(to_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
