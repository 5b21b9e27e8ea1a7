"""mgtutorial: multi-GPU training in PyTorch, taught chapter by chapter (see notebooks/).

The public API, re-exported from the modules that define it. The plotting names (from
:mod:`mgtutorial.live`) and the run handle (from :mod:`mgtutorial.run`) are imported on first use
(PEP 562), so ranks load neither matplotlib nor psutil.
"""

from __future__ import annotations

import importlib

from .data import load_dataset, train_loader
from .checkpoint import load_checkpoint, save_checkpoint
from .ddp import DDPConfig, Trainer
from .env import describe, resolve_backend
from .launch import WorkerNotImportable, launch
from .models import ArticleCNN, ArticleMLP, cnn_flatten_size
from .runlog import LogReader, RunLog, RunReader, read_run

__version__ = "0.1.0"

_LAZY = {"LivePlot": "live", "loss_figure": "live", "watch": "live",
         "Run": "run", "RunResult": "run", "WorkerFailed": "run"}

__all__ = [
    "ArticleCNN", "ArticleMLP", "DDPConfig", "LivePlot", "LogReader", "Run", "RunLog", "RunReader",
    "RunResult", "Trainer", "WorkerFailed", "WorkerNotImportable", "cnn_flatten_size", "describe",
    "launch", "load_checkpoint", "load_dataset", "loss_figure", "read_run", "resolve_backend",
    "save_checkpoint", "train_loader", "watch",
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mgtutorial' has no attribute {name!r}")
