"""What every exercise checker shares: the pass line, the error with its hint, loading the learner's
code (a function from a cell, or a module written with ``%%writefile``) and running it in ranks.

Conventions (tested in tests/test_exercises.py):

* A checker prints exactly one line ``✓ <exercise>: <what was verified>`` and returns ``None``, or
  raises :class:`ExerciseError` whose message names what is wrong and where to look.
* Learner code runs *inside* the checker: any exception it raises becomes an :class:`ExerciseError`
  naming the function and the original error (chained, so the traceback is still there).
* Rank-side learner code lives in a small module next to the notebook; a checker's worker imports
  it *by path* inside each rank (:func:`import_file`), so nothing depends on ``sys.path``.

Taught in: every chapter's "Exercises" section (notebooks/*.ipynb); the editions are made by
:mod:`mgtutorial.workshop.edition`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable
from unittest import mock

from mgtutorial.common.config import Config
from mgtutorial.runtime.env import BackendChoice

PASS = "✓"


class ExerciseError(AssertionError):
    """The answer to an exercise is not right yet.

    ``str(err)`` is ``"<exercise>: <hint>"``; ``err.exercise`` and ``err.hint`` hold the two parts.
    A subclass of ``AssertionError``, so a checker reads like a test that failed.
    """

    def __init__(self, exercise: str, hint: str):
        super().__init__(f"{exercise}: {hint}")
        self.exercise, self.hint = exercise, hint

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the hint alone. The checker's own source, which the traceback would
        print around the failing line, holds the expected answer."""
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


class RankFailed(ExerciseError):
    """A rank failed while a checker ran the learner's code; ``rank`` and ``exc_type`` say which
    and how."""

    def __init__(self, exercise: str, hint: str, rank: int, exc_type: str):
        super().__init__(exercise, hint)
        self.rank, self.exc_type = rank, exc_type


def passed(exercise: str, verified: str) -> None:
    """Print the one stable pass line of ``exercise``: ``✓ <exercise>: <verified>``."""
    print(f"{PASS} {exercise}: {verified}", flush=True)


def require(condition: Any, exercise: str, hint: str) -> None:
    """Raise :class:`ExerciseError` with ``hint`` unless ``condition`` is true."""
    if not condition:
        raise ExerciseError(exercise, hint)


def answered(value: Any, exercise: str, name: str = "answer") -> Any:
    """Return ``value``; raise if the learner left it at the starter's ``...`` (or ``None``)."""
    if value is ... or value is None:
        shown = "..." if value is ... else repr(value)
        raise ExerciseError(exercise, f"`{name}` is still `{shown}`: replace it with your answer")
    return value


def close(a: float, b: float, rel: float = 1e-6, abs_: float = 1e-9) -> bool:
    """``math.isclose`` that is False (not an error) for non-numbers."""
    try:
        return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=abs_)
    except (TypeError, ValueError):
        return False


def attempt(exercise: str, fn: Callable, *args, **kwargs) -> Any:
    """Call the learner's ``fn(*args, **kwargs)``; any exception becomes an :class:`ExerciseError`.

    ``NotImplementedError`` (or a function still returning ``...``) reads "not written yet".
    """
    name = getattr(fn, "__name__", repr(fn))
    try:
        out = fn(*args, **kwargs)
    except NotImplementedError as e:
        raise ExerciseError(
            exercise, f"`{name}` is not written yet ({e or 'NotImplementedError'})"
        ) from e
    except ExerciseError:
        raise
    except Exception as e:  # the learner's bug: keep it chained, name it in one line
        raise ExerciseError(exercise, f"`{name}` raised {type(e).__name__}: {e}") from e
    if out is ...:
        raise ExerciseError(exercise, f"`{name}` returned `...`: its body is not written yet")
    return out


@contextlib.contextmanager
def withheld(
    exercise: str, module: ModuleType, names: tuple[str, ...], why: str, fn: Callable | None = None
):
    """While the block runs (the learner's function, called by a checker), each ``module.name``
    of ``names`` raises :class:`ExerciseError` saying it is withheld and ``why``: a function that
    computes the answer (the simulator, the reference order) cannot stand in for a derivation.
    So do the names in the learner's ``fn``'s module (a notebook's globals) bound to the same
    functions (``from module import name``). The checker's own references, imported by name
    into the checker's module, are untouched."""
    short = module.__name__.rsplit(".", 1)[-1]

    def refuse(name):
        def refused(*args, **kwargs):
            raise ExerciseError(
                exercise, f"{short}.{name} is withheld while the checker runs your function: {why}"
            )

        return refused

    learner = getattr(fn, "__globals__", {})
    with contextlib.ExitStack() as stack:
        for name in names:
            original = getattr(module, name)
            stack.enter_context(mock.patch.object(module, name, refuse(name)))
            aliases = [k for k, v in learner.items() if v is original]
            for key in aliases:  # only these keys, set back one by one: the rest is left alone
                learner[key] = refuse(name)
                stack.callback(learner.__setitem__, key, original)
        yield


def attempt_by_hand(exercise: str, packages: tuple[str, ...], fn: Callable, *args) -> Any:
    """:func:`attempt`, refusing an answer that calls into ``packages`` (dotted names under
    ``mgtutorial``, e.g. ``"perf"``): the exercise asks the learner to work the quantity out, not
    to ask the library that computes it. A profile hook (``sys.setprofile``) records every Python
    function entered during the call, however it was imported (this module's own excepted).

    Raises:
        ExerciseError: the learner's code entered a function of one of ``packages`` (named).
    """
    root = Path(__file__).resolve().parents[1]
    dirs = tuple(str(root.joinpath(*p.split("."))) for p in packages)
    entered: list[str] = []

    def hook(frame, event, _arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(dirs) and not name.endswith("_common.py"):
            entered.append(f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}")

    before = sys.getprofile()
    sys.setprofile(hook)
    try:
        out = attempt(exercise, fn, *args)
    finally:
        sys.setprofile(before)
    if entered:
        raise ExerciseError(
            exercise,
            f"`{getattr(fn, '__name__', fn)}` calls {entered[0]} (mgtutorial."
            f"{' or mgtutorial.'.join(packages)}): this exercise asks you to work it out "
            "yourself, with arithmetic and the rules the chapter states",
        )
    return out


def import_file(path: str | Path, exercise: str = "exercise") -> ModuleType:
    """Import the module at ``path`` afresh (never a cached copy), under a unique module name.

    Raises:
        ExerciseError: the file is missing (run its ``%%writefile`` cell first) or does not import
            (the error's type, message and line are named).
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise ExerciseError(
            exercise,
            f"no file {path.name} in {path.parent.name}/: run the %%writefile cell above first",
        )
    name = f"_mgtutorial_exercise_{path.stem}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ExerciseError(
            exercise, f"{path.name} does not import: {type(e).__name__}: {e}"
        ) from e
    return module


def function_from(path: str | Path, name: str, exercise: str = "exercise") -> Callable:
    """The function ``name`` of the module file at ``path`` (see :func:`import_file`)."""
    fn = getattr(import_file(path, exercise), name, None)
    if not callable(fn):
        raise ExerciseError(exercise, f"{Path(path).name} defines no function `{name}`")
    return fn


def run_ranks(
    exercise: str, worker: Callable, cfg, nprocs: int = 2, timeout_s: float = 60.0, **launch_kw
):
    """Launch ``worker(cfg)`` on ``nprocs`` ranks and wait; a failing rank becomes an ExerciseError.

    Returns the :class:`mgtutorial.runtime.run.RunResult`. Runs go to ``runs/exercises`` unless
    ``runs_dir`` is given.

    Raises:
        RankFailed: a rank failed; the hint names the rank, its error and the line it came from.
        ExerciseError: the ranks did not finish within ``timeout_s`` (they are stopped first).
    """
    from mgtutorial.runtime.failure import WorkerFailed, innermost_frame
    from mgtutorial.runtime.launcher import launch

    launch_kw.setdefault("runs_dir", "runs/exercises")
    run = launch(worker, cfg, nprocs, **launch_kw)
    try:
        return run.wait(timeout=timeout_s)
    except WorkerFailed as e:
        where = innermost_frame(e.traceback)
        raise RankFailed(
            exercise,
            f"rank {e.rank} failed with {e.exc_type}: {e.message}"
            + (f" (at {where})" if where else ""),
            e.rank,
            e.exc_type,
        ) from None
    except TimeoutError:
        run.stop()
        raise ExerciseError(
            exercise,
            f"the ranks did not finish within {timeout_s:g} s: does every "
            f"rank call the same collectives in the same order?",
        ) from None


@dataclass
class FileWorkerConfig(Config):
    """What :func:`file_worker` runs in each rank: ``<function>(cfg)`` of the module at ``path``."""

    path: str
    """Absolute path of the learner's module (written with ``%%writefile``)."""
    function: str
    """Name of the module-level function each rank calls with this config."""
    backend: BackendChoice = "auto"
    """Process-group backend for ``env.distributed(cfg.backend)`` in the learner's function:
    "auto", "gloo" or "nccl"."""
    options: dict = field(default_factory=dict)
    """Exercise-specific settings the learner's function may read (``cfg.options[...]``)."""


def file_worker(cfg: FileWorkerConfig):
    """Rank-side: import the learner's module by path and return ``<function>(cfg)``."""
    return function_from(cfg.path, cfg.function)(cfg)


def run_file(
    exercise: str,
    path: str | Path,
    function: str,
    nprocs: int = 2,
    *,
    options: dict | None = None,
    timeout_s: float = 60.0,
    **launch_kw,
):
    """Run the learner's ``function`` from the file ``path`` on ``nprocs`` ranks; return the
    RunResult.

    The file is imported in the notebook kernel first, so its top-level code runs there too; a
    missing file, a syntax error or a missing function is reported before any rank starts. A
    failing rank becomes an :class:`ExerciseError` (see :func:`run_ranks`).
    """
    function_from(path, function, exercise)
    cfg = FileWorkerConfig(path=str(Path(path).resolve()), function=function, options=options or {})
    launch_kw.setdefault("name", Path(path).stem)
    return run_ranks(exercise, file_worker, cfg, nprocs, timeout_s, **launch_kw)
