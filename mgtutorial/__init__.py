"""mgtutorial: multi-GPU training in PyTorch, taught chapter by chapter (see notebooks/).

The layout (README's "Layout" section has the whole tree):

- ``runtime/``: the engine, which knows no lesson: rank and device (``env``, ``machine``),
  starting ranks (``launcher``, ``run``, ``failure``), the records ranks write (``runlog``), live
  plots (``live``), finding a job's processes (``procs``), ``%%ranks`` (``ranks_magic``,
  ``%load_ext mgtutorial``).
- ``common/``: what every chapter shares: configuration checks, data, models, checkpoints,
  comparisons with a single-process reference.
- one subpackage per strategy: ``ddp`` (chapters 01–03b), ``pipeline`` (04), ``scale`` (05a–05c),
  ``article`` (06a–06b), ``sharding`` (07), ``tensor_parallel`` (08), ``perf`` (09).
- ``exercises/`` (the checkers, one module per notebook) and ``workshop/`` (laptop check, student
  edition).

The public API below is imported on first use (PEP 562), so ``import mgtutorial`` loads neither
torch nor psutil: ``python -m mgtutorial check`` can then report a missing torch as a row.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "load_dataset": "common.data",
    "train_loader": "common.data",
    "load_checkpoint": "common.checkpoint",
    "save_checkpoint": "common.checkpoint",
    "ArticleCNN": "common.models",
    "ArticleMLP": "common.models",
    "cnn_flatten_size": "common.models",
    "DDPConfig": "ddp.trainer",
    "Trainer": "ddp.trainer",
    "describe": "runtime.machine",
    "resolve_backend": "runtime.env",
    "WorkerNotImportable": "runtime.launcher",
    "launch": "runtime.launcher",
    "LogReader": "runtime.runlog",
    "RunLog": "runtime.runlog",
    "RunReader": "runtime.runlog",
    "read_run": "runtime.runlog",
    "LivePlot": "runtime.live",
    "loss_figure": "runtime.live",
    "watch": "runtime.live",
    "Run": "runtime.run",
    "latest_runs": "runtime.run",
    "last_run": "runtime.run",
    "RunResult": "runtime.run",
    "WorkerFailed": "runtime.failure",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    """The public API on first use; subpackages (``mgtutorial.ddp``) import as usual."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mgtutorial' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def load_ipython_extension(ipython) -> None:
    """``%load_ext mgtutorial``: the ``%ranks`` / ``%%ranks`` magics
    (:mod:`mgtutorial.runtime.ranks_magic`), imported only now (they load torch)."""
    from mgtutorial.runtime import ranks_magic

    ranks_magic.load_ipython_extension(ipython)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext mgtutorial``: stops this kernel's pool of ranks."""
    from mgtutorial.runtime import ranks_magic

    ranks_magic.unload_ipython_extension(ipython)
