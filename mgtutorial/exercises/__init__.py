"""The exercise checkers of every chapter, one module per notebook (``ch00`` … ``ch10b``).

In a notebook::

    from mgtutorial import exercises as ex
    ex.ch00.sum_of_ranks(predicted)      # prints "✓ 00.1 …" or raises ExerciseError with a hint

Each chapter module holds one small function per exercise (and the workers those launch); the
shared pieces (:class:`ExerciseError`, the pass line, loading a learner's module by path, running
ranks) are in :mod:`mgtutorial.exercises._common`. The committed notebooks are the instructor
edition (solutions between ``# BEGIN SOLUTION`` / ``# END SOLUTION``); ``make student`` writes the
student edition with :mod:`mgtutorial.workshop.edition`. Chapter modules are imported on first use
(PEP 562), so ``import mgtutorial.exercises`` is cheap.
"""

from __future__ import annotations

import importlib

from mgtutorial.exercises._common import PASS, ExerciseError, RankFailed, passed

CHAPTERS = (
    "ch00",
    "ch01",
    "ch02",
    "ch03a",
    "ch03b",
    "ch03c",
    "ch04",
    "ch05a",
    "ch05b",
    "ch05c",
    "ch06a",
    "ch06b",
    "ch07",
    "ch08",
    "ch09",
    "ch10a",
    "ch10b",
)

__all__ = ["PASS", "CHAPTERS", "ExerciseError", "RankFailed", "passed", *CHAPTERS]


def __getattr__(name: str):
    if name in CHAPTERS:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'mgtutorial.exercises' has no attribute {name!r}")
