"""The first code that runs inside a rank started by :func:`mgtutorial.launch`.

Taught in notebooks/00_setup.ipynb (what happens when a rank starts). It imports the worker by
name, runs it (importing it here, in the rank, so the rank runs the module's current source), and
records the outcome in the run directory: ``rank<r>.result.json`` (the return value) or
``rank<r>.error.json`` (the exception, see :func:`mgtutorial.runtime.runlog.write_error`). A
thread watches the launching process, so a rank whose notebook kernel died does not live on.

This module is imported in every rank, so it imports little: no psutil, no
:class:`~mgtutorial.runtime.run.Run`, none of TorchElastic's logging settings.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import json
import os
import sys
import threading
import time
from typing import Any

from mgtutorial.runtime import runlog

LAUNCHER_PID_ENV = "MGTUTORIAL_LAUNCHER_PID"


def import_ref(ref: str):
    """The object named by ``"package.module:qualified.name"``, imported now."""
    module, _, qualname = ref.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _watch_parent(parent_pid: int, launcher_pid: int | None) -> None:
    # A rank whose notebook kernel was killed must not live on. Its parent is the kernel (spawn) or
    # the fork server, which exits when the kernel does (forkserver): watch both.
    while True:
        time.sleep(1.0)
        try:
            if launcher_pid:
                os.kill(launcher_pid, 0)
        except ProcessLookupError:
            os._exit(1)
        if os.getppid() != parent_pid:
            os._exit(1)


def run_worker(worker_ref: str, cfg, environ: dict[str, str] | None = None) -> Any:
    """Runs in each rank: import the worker, call it, record the result or the error.

    ``environ`` becomes this process's whole environment: a rank forked from the fork server
    starts with the server's environment (from the first launch); the learner's is the one
    :func:`mgtutorial.launch` saw now. A crash in C code (SIGSEGV, SIGBUS, …) prints the Python
    stack to this rank's ``.err`` file (:mod:`faulthandler`).
    """
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    faulthandler.enable()
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    threading.Thread(
        target=_watch_parent, args=(os.getppid(), int(launcher) if launcher else None), daemon=True
    ).start()
    importlib.invalidate_caches()  # files created since the fork server started are found
    try:
        worker = import_ref(worker_ref)
        value = worker(cfg)
        try:
            json.dumps(value)
        except TypeError:
            value = repr(value)
        runlog.write_result(value)
        atexit.register(exit_now)  # skip C++ teardown once the work is safely recorded
        return value
    except BaseException as exc:
        runlog.write_error(exc)
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        raise


def exit_now(code: int = 0) -> None:
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
