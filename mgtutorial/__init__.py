"""mgtutorial: multi-GPU training in PyTorch, taught chapter by chapter (see notebooks/).

The public API, re-exported from the modules that define it. Names are imported on first use
(PEP 562), so a rank that only needs ``mgtutorial.ddp`` does not pay for matplotlib.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "load_dataset": "data", "train_loader": "data",
    "DDPConfig": "ddp", "Trainer": "ddp", "load_checkpoint": "ddp", "save_checkpoint": "ddp",
    "describe": "env", "resolve_backend": "env",
    "Run": "launch", "RunResult": "launch", "WorkerFailed": "launch", "WorkerNotImportable": "launch",
    "launch": "launch",
    "LivePlot": "live", "loss_figure": "live", "watch": "live",
    "ArticleCNN": "models", "ArticleMLP": "models", "cnn_flatten_size": "models",
    "LogReader": "runlog", "RunLog": "runlog", "RunReader": "runlog", "read_run": "runlog",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mgtutorial' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
