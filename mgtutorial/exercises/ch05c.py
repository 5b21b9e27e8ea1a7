"""Checkers of chapter 05c's exercises (notebooks/05c_hangs_and_debugging.ipynb): an early stop
that hangs the job, diagnosed from ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s error and fixed, and what a
rank that skips the last collective looks like with and without DETAIL.
"""

from __future__ import annotations

import os
import re

from mgtutorial.exercises._common import (
    ExerciseError,
    RankFailed,
    answered,
    close,
    passed,
    require,
    run_file,
)
from mgtutorial.exercises.ch05b import wait_failure
from mgtutorial.runtime.launcher import launch
from mgtutorial.scale import hangs
from mgtutorial.scale.output import short


def _fingerprint(message: str) -> str:
    """What a DETAIL mismatch error says of the failing rank's own call: its operation, sequence
    number and tensor shape (the peer's side can be garbled: the peer may be inside DETAIL's own
    check by then)."""
    own = r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+),? ?"
    own += r"OpType=(\w+)(?:, TensorShape=(\[[\d, ]*\]))?"
    if not (m := re.search(own, message)):
        return ""
    shape = f" of shape {m[4]}" if m[4] else ""
    peer = re.search(
        r"but Rank (\d+) is running collective: CollectiveFingerPrint\(Sequence"
        r"Number=(\d+),? ?OpType=(\w+)(?:, TensorShape=(\[[\d, ]*\]))?",
        message,
    )
    theirs = f"{peer[3]}" + (f" of shape {peer[4]}" if peer and peer[4] else "") if peer else ""
    barrier = "BARRIER" in (m[3], peer and peer[3])
    return (
        f"rank {m[1]} was calling {m[3]}{shape} as its collective #{m[2]} (counting from 0) while "
        f"its peer called {theirs or 'another one'}"
        + (" (a BARRIER is env.distributed's, when the worker returns)" if barrier else "")
    )


THRESHOLD = 0.8
"""05c.1's early stopping: training stops after the first step at which every rank's own loss is
below this."""
MAX_STEPS = 10


LAYOUT_ENV = "MGTUTORIAL_05C_LOSSES"
"""The variable that picks the losses of :func:`batch_loss` in the ranks ("0" unless set)."""
_LAYOUTS = {"0": (1.8, 4.2), "1": (3.0, 1.2)}  # each rank's loss at step 0; then / (step + 1)


def batch_loss(rank: int, step: int, layout: str | None = None) -> float:
    """05c.1's stand-in for a training step: the loss of rank ``rank``'s own batch at ``step``.
    Each rank trains on other data, so the ranks' losses differ; which rank's falls faster depends
    on the ``layout`` (default: the environment's :data:`LAYOUT_ENV`, else "0"), so that a stop
    that trusts one rank's own loss passes in one layout at most."""
    layout = layout or os.environ.get(LAYOUT_ENV, "0")
    return _LAYOUTS[layout][rank] / (step + 1)


def mean_loss(step: int, layout: str = "0", world_size: int = 2) -> float:
    """The mean of :func:`batch_loss` over ``world_size`` ranks at ``step``."""
    return sum(batch_loss(r, step, layout) for r in range(world_size)) / world_size


def early_stop_reference(layout: str = "0", world_size: int = 2) -> list[tuple[int, float]]:
    """Rank 0's log of 05c.1 done right: ``(step, mean loss over ranks)`` for every step trained,
    up to and including the first at which every rank's own loss is below :data:`THRESHOLD`."""
    log = []
    for step in range(MAX_STEPS):
        log.append((step, mean_loss(step, layout, world_size)))
        if max(batch_loss(r, step, layout) for r in range(world_size)) < THRESHOLD:
            break
    return log


def _early_stop_run(ex: str, path: str, layout: str):
    """Run 05c.1's worker on 2 gloo ranks under DETAIL with the losses of ``layout``; a DETAIL
    error becomes a hint built from its fingerprints."""
    extra = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", LAYOUT_ENV: layout}
    try:
        return run_file(
            ex, path, "worker", 2, options={"timeout_s": 3}, timeout_s=60, extra_env=extra
        )
    except RankFailed as e:
        seen = _fingerprint(e.hint) or short(e.hint)[:300]
        raise ExerciseError(
            ex,
            f"DETAIL stopped the job: {seen}. Which line of the worker makes that call, and why "
            "did one rank reach it while the other was still elsewhere?",
        ) from None


def _check_early_stop(ex: str, run, layout: str) -> int:
    """Compare one run of 05c.1 with :func:`early_stop_reference`; return the last step."""
    want, where = early_stop_reference(layout), f"with the checker's losses no. {layout}"
    for rank in range(2):
        value = run.values[rank]
        require(
            isinstance(value, dict) and {"log", "steps"} <= set(value),
            ex,
            f"rank {rank} returned {value!r}: return a dict with 'log' and 'steps'",
        )
    log = [(int(s), float(m)) for s, m in run.values[0]["log"]]
    require(run.values[1]["log"] == [], ex, "rank 1 logged: only rank 0 logs (its 'log' is [])")
    require(
        [s for s, _ in log] == list(range(len(log)))
        and all(close(m, mean_loss(s, layout), 1e-5) for s, m in log),
        ex,
        f"{where}, rank 0 logged {log}: one (step, mean loss over ranks) per step, from step 0",
    )
    require(log, ex, "rank 0 logged nothing: it logs (step, mean) for every step trained")
    last = log[-1][0]
    require(
        len(log) <= len(want),
        ex,
        f"{where}, rank 0 logged up to step {last}, but every rank's own loss was below "
        f"{THRESHOLD} at an earlier step: stop after the first step where they all are, on "
        "every rank",
    )
    require(
        len(log) == len(want),
        ex,
        f"{where}, the job stopped after step {last}, where some rank's own loss was not yet "
        f"below {THRESHOLD}: stop only once every rank's own loss is below it, on every rank at "
        "the same step",
    )
    steps = [run.values[rank]["steps"] for rank in range(2)]
    require(
        steps == [2 * len(want)] * 2,
        ex,
        f"the ranks returned 'steps' {steps}: the steps trained, summed over the ranks",
    )
    return last


def early_stop(path: str = "ex05c_early_stop.py") -> None:
    """05c.1: ``worker(cfg)`` in ``path`` trains at most :data:`MAX_STEPS` steps with the losses of
    :func:`batch_loss`, stops every rank after the first step at which every rank's own loss is
    below :data:`THRESHOLD`, and returns ``{"log": [(step, mean)] on rank 0 ([] elsewhere), "steps":
    the steps trained, summed over ranks}``.

    Runs it twice on 2 gloo ranks with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` and a 3-s collective
    timeout (``cfg.options["timeout_s"]``), each run stopped after 60 s whatever happens: with the
    losses of layout "0" (rank 1's fall slower) and of layout "1" (rank 0's do). Compares each with
    :func:`early_stop_reference`, computed here.
    """
    ex = "05c.1 an early stop that hangs"
    lasts = [_check_early_stop(ex, _early_stop_run(ex, path, lay), lay) for lay in _LAYOUTS]
    passed(
        ex,
        f"under DETAIL both ranks made the same collectives and stopped together after step "
        f"{lasts[0]} and, with other losses, after step {lasts[1]}: the first at which every "
        f"rank's own loss was below {THRESHOLD}",
    )


WHAT_ENDED = {"timeout": "its collective timeout", "peer gone": "its peer closing the connection"}


def last_step_skipped(predicted: dict) -> None:
    """05c.2: predictions for ``HangConfig(skip_step=2)`` (rank 1 skips the last all-reduce, then
    works alone 6 s) with a 2-s timeout: ``predicted["failing_rank"]`` and
    ``predicted["ended_by"]`` (the rank the launcher names, without DETAIL, and what ended its
    wait: ``"timeout"``, its collective timeout, or ``"peer gone"``, its peer closing the
    connection, told from the backend's own error) and ``predicted["detail_names_rank"]`` (the rank
    DETAIL's error says is missing).

    Runs both jobs at once and reads the launcher's errors.
    """
    ex = "05c.2 the last step skipped"
    keys = ("failing_rank", "ended_by", "detail_names_rank")
    guess = {k: answered(predicted.get(k, ...), ex, f"predicted[{k!r}]") for k in keys}
    cfg = hangs.HangConfig(skip_step=2, timeout_s=2, rank_work_s=6, backend="gloo")
    jobs = {"ex05c-last": {}, "ex05c-last-detail": {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}}
    runs = [
        launch(hangs.hang_worker, cfg, 2, runs_dir="runs/exercises", name=name, extra_env=extra)
        for name, extra in jobs.items()
    ]
    hint = "its 2-s timeout should end it long before; the machine may be busy, run it again"
    try:
        plain, detail = [wait_failure(ex, run, 60, hint) for run in runs]
    finally:
        for run in runs:  # both, whatever happened
            run.stop()
    require(
        plain is not None and detail is not None,
        ex,
        "a job finished without an error: is HangConfig unchanged in mgtutorial.scale.hangs?",
    )
    missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", detail.message)
    require(missing, ex, f"DETAIL reported something unexpected: {short(detail.message)[:200]}")
    named = int(missing[1].split(",")[0])
    backend = plain.message.split(" s): ", 1)[-1]  # the backend's own error, quoted by hang_worker
    ended = "timeout" if "Timed out" in backend else "peer gone"
    require(
        guess["failing_rank"] == plain.rank,
        ex,
        f"the launcher did not name rank {guess['failing_rank']}: read what each rank does at "
        "step 2 and after its loop in hang_worker",
    )
    require(
        guess["ended_by"] in ("timeout", "peer gone"),
        ex,
        f"predicted['ended_by'] is {guess['ended_by']!r}: answer 'timeout' or 'peer gone'",
    )
    require(
        guess["ended_by"] == ended,
        ex,
        f"rank {plain.rank}'s wait was not ended by {guess['ended_by']!r}: what was its peer "
        "doing meanwhile, and for how long?",
    )
    require(
        guess["detail_names_rank"] == named,
        ex,
        f"DETAIL's error does not name rank {guess['detail_names_rank']} as missing: read what "
        "DETAIL checks before each collective (section 2)",
    )
    passed(
        ex,
        f"rank {plain.rank} failed, its wait ended by {WHAT_ENDED[ended]}, and DETAIL named rank "
        f"{named} as the one that never arrived",
    )
