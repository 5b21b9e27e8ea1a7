"""mgtutorial: multi-GPU training in PyTorch, taught chapter by chapter (see notebooks/).

The public API, re-exported from the modules that define it. Every name is imported on first use
(PEP 562), so ``import mgtutorial`` loads neither torch nor psutil: ``python -m mgtutorial check``
can then report a missing or broken torch as a row instead of a traceback, and ranks load only what
their worker needs. Submodules work as usual (``from mgtutorial import ddp``, ``import mgtutorial.ddp``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "load_dataset": "data", "train_loader": "data",
    "load_checkpoint": "checkpoint", "save_checkpoint": "checkpoint",
    "DDPConfig": "ddp", "Trainer": "ddp",
    "describe": "env", "resolve_backend": "env",
    "WorkerNotImportable": "launch", "launch": "launch",
    "ArticleCNN": "models", "ArticleMLP": "models", "cnn_flatten_size": "models",
    "LogReader": "runlog", "RunLog": "runlog", "RunReader": "runlog", "read_run": "runlog",
    "LivePlot": "live", "loss_figure": "live", "watch": "live",
    "Run": "run", "RunResult": "run", "WorkerFailed": "run",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # a submodule, e.g. mgtutorial.env
    raise AttributeError(f"module 'mgtutorial' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """Keeps ``mgtutorial.launch`` the function: importing the submodule ``mgtutorial.launch`` makes
    Python set the package's attribute ``launch`` to that module, which would hide the function."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}" and name in _LAZY:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
