"""Checker of exercise 02.1 (notebooks/02_ddp.ipynb): what a failing rank does to a 2-rank job on
gloo, predicted, then run (chapter 05b's :func:`~mgtutorial.scale.elastic.elastic_worker`, chapter
02's training with an injected failure). Called as ``ex.ch02.failing_rank`` (re-exported by
:mod:`mgtutorial.exercises.ch02`)."""

from __future__ import annotations

from typing import Callable

from mgtutorial.exercises._common import ExerciseError, answered, attempt, passed, require
from mgtutorial.runtime.launcher import launch
from mgtutorial.runtime.run import WorkerFailed
from mgtutorial.runtime.runlog import read_run
from mgtutorial.scale.elastic import ElasticConfig, elastic_worker

FAILURES = ((1, 5, "raise"), (0, 3, "sigkill"))
"""02.1's failures, as ``(fail_rank, fail_step, fail_how)`` of
:class:`~mgtutorial.scale.elastic.ElasticConfig`, each run on 2 ranks."""


def _failure(ex: str, fail_rank: int, fail_step: int, fail_how: str) -> dict:
    """Run one failure of :data:`FAILURES` on 2 ranks; what its logs and the launcher show."""
    cfg = ElasticConfig(
        dataset="digits",
        epochs=1,
        max_steps=20,
        evaluate=False,
        fail_rank=fail_rank,
        fail_step=fail_step,
        fail_how=fail_how,
    )
    run = launch(elastic_worker, cfg, 2, runs_dir="runs/exercises", name="ex02_fail")
    try:
        run.wait(timeout=120)
    except WorkerFailed as e:
        failed = e
    except TimeoutError:
        run.stop()
        raise ExerciseError(
            ex, "the job did not stop within 120 s: the machine is busy; run again"
        ) from None
    else:
        raise ExerciseError(ex, f"every rank finished although rank {fail_rank} should fail")
    records = read_run(run.run_dir)
    return {
        "named": failed.rank,
        "steps_logged": [
            sum(1 for rec in records if rec["kind"] == "train" and rec["rank"] == r) for r in (0, 1)
        ],
        "python_errors": [r for r in (0, 1) if run.log_path(r, "error.json").exists()],
    }


def _observed(ex: str, fail_rank: int, fail_step: int, fail_how: str, tries: int = 3) -> dict:
    """:func:`_failure`, run again (up to ``tries`` runs) while the other rank recorded no
    exception: it raises in its next all-reduce only if it gets there before the launcher,
    which stops the other ranks as soon as it sees one fail (a SIGTERM leaves no record).
    Measured: about 30 ms from the kill to the other rank's record, against the launcher's
    50 ms poll."""
    for _ in range(tries):
        seen = _failure(ex, fail_rank, fail_step, fail_how)
        if 1 - fail_rank in seen["python_errors"]:
            break
    return seen


def failing_rank(predict: Callable) -> None:
    """02.1: ``predict(fail_rank, fail_step, fail_how) -> dict`` says what happens when, in chapter
    02's training on 2 gloo ranks (:func:`mgtutorial.scale.elastic.elastic_worker`), rank
    ``fail_rank`` fails once it has logged step ``fail_step``, by raising (``"raise"``) or by
    SIGKILL (``"sigkill"``): ``"named"``, the rank :class:`~mgtutorial.WorkerFailed` names;
    ``"steps_logged"``, the steps in rank 0's and rank 1's logs; ``"python_errors"``, the ranks
    that recorded a Python exception (``rank<r>.error.json``), sorted. Asks for every prediction
    of :data:`FAILURES` first, then runs each and compares."""
    ex = "02.1 a failing rank"
    keys = ("named", "steps_logged", "python_errors")
    guesses = []
    for case in FAILURES:
        got = attempt(ex, predict, *case)
        if not isinstance(got, dict):
            raise ExerciseError(ex, f"predict{case} returns {type(got).__name__}: return a dict")
        guesses.append({k: answered(got.get(k), ex, f"predict{case}[{k!r}]") for k in keys})
    errors_seen = []
    for (fail_rank, fail_step, how), guess in zip(FAILURES, guesses):
        seen = _observed(ex, fail_rank, fail_step, how)
        errors_seen.append(seen["python_errors"])
        other, case = 1 - fail_rank, f"predict({fail_rank}, {fail_step}, {how!r})"
        require(
            guess["named"] == seen["named"],
            ex,
            f"{case}: the error does not name rank {guess['named']}. launch names the rank "
            "whose failure started it, not a rank that failed because of it",
        )
        require(
            list(guess["steps_logged"]) == seen["steps_logged"],
            ex,
            f"{case}: the logs do not hold {list(guess['steps_logged'])} steps. Which step was "
            f"rank {other} in when rank {fail_rank} stopped, and can it log a step whose "
            "all-reduces miss a rank?",
        )
        errors = sorted(guess["python_errors"])
        require(
            other in errors or other not in seen["python_errors"],
            ex,
            f"{case}: rank {other} did record an exception. What does gloo do with an all-reduce "
            "whose peer process has exited?",
        )
        require(
            fail_rank in errors or fail_rank not in seen["python_errors"],
            ex,
            f"{case}: rank {fail_rank} did record an exception: how did it fail?",
        )
        require(
            errors == seen["python_errors"],
            ex,
            f"{case}: not every rank in {errors} recorded an exception. Can a process that "
            "SIGKILL ends run an except clause?",
        )
    passed(
        ex,
        "rank 1 raising after step 5, then rank 0 killed after step 3: each time the error named "
        "the failing rank and both ranks' logs stopped at that step; ranks that recorded an "
        f"exception (on gloo): {errors_seen[0]}, then {errors_seen[1]}, as you predicted",
    )
