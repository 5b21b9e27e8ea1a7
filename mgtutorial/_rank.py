"""The first code that runs inside a rank started by :func:`mgtutorial.launch`.

Taught in notebooks/00_setup.ipynb (what happens when a rank starts). It imports the worker by name,
runs it, and records the outcome in the run directory: ``rank<r>.result.json`` (the return value)
or ``rank<r>.error.json`` (the exception, see :func:`mgtutorial.runlog.write_error`). A thread
watches the launching process, so a rank whose notebook kernel died does not live on.

This module is imported in every rank, so it imports little: no psutil, no
:class:`~mgtutorial.run.Run`, none of the launcher's logging settings.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import sys
import threading
import time
from typing import Any

from . import runlog


def import_ref(ref: str):
    """The object named by ``"package.module:qualified.name"``, imported now."""
    module, _, qualname = ref.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _watch_parent(parent_pid: int) -> None:
    # A rank whose notebook kernel was killed must not live on.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def run_worker(worker_ref: str, cfg) -> Any:
    """Runs in each rank: import the worker, call it, record the result or the error."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
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
