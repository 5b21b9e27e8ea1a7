"""Checkers of chapter 05c's exercises (notebooks/05c_hangs_and_debugging.ipynb): a collective
only one rank calls, found with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, and what a rank that skips the
last collective looks like with and without DETAIL.
"""

from __future__ import annotations

import re

from mgtutorial.exercises._common import (
    ExerciseError,
    RankFailed,
    answered,
    passed,
    require,
    run_file,
)
from mgtutorial.exercises.ch05b import wait_failure
from mgtutorial.runtime.launcher import launch
from mgtutorial.scale import hangs
from mgtutorial.scale.output import short


def _fingerprint(message: str) -> str:
    """What a DETAIL mismatch error says of the failing rank's own call (the peer's side is garbled:
    the peer is inside DETAIL's own check by then)."""
    own = r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+),? ?"
    own += r"OpType=(\w+)"
    if not (m := re.search(own, message)):
        return ""
    return (
        f"rank {m[1]} was calling {m[3]} as its collective #{m[2]} while its peer called another "
        "one (a BARRIER is env.distributed's, when the worker returns)"
    )


def rank_zero_metric(path: str = "ex05c_metric.py") -> None:
    """05c.1: ``worker(cfg)`` in ``path`` returns, on rank 0, ``[(step, mean over ranks of
    rank + step)]`` for steps 0 and 2 of 4, and ``[]`` on the other ranks.

    Runs 2 ranks with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` and a 3-s collective timeout
    (``cfg.options["timeout_s"]``); compares with the means computed here.
    """
    ex, detail = "05c.1 a metric only rank 0 logs", {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    try:
        run = run_file(
            ex, path, "worker", 2, options={"timeout_s": 3}, timeout_s=60, extra_env=detail
        )
    except RankFailed as e:
        seen = _fingerprint(e.hint) or short(e.hint)[:300]
        raise ExerciseError(
            ex,
            f"DETAIL stopped the job: {seen}. Every rank must call the same "
            "collectives in the same order: which ones does rank 1 make in your loop?",
        ) from None
    values, want = run.values, [[step, (0 + step + 1 + step) / 2] for step in (0, 2)]
    got = [[int(s), float(m)] for s, m in values[0]] if isinstance(values[0], list) else values[0]
    require(
        got == want,
        ex,
        f"rank 0 returned {values[0]!r}: it logs (step, mean) at steps 0 and 2, and the mean is "
        "the all-reduced sum divided by the world size",
    )
    require(
        values[1] == [],
        ex,
        f"rank 1 returned {values[1]!r}: only rank 0 logs (returns [] elsewhere)",
    )
    passed(
        ex, "under DETAIL both ranks made the same all-reduces; rank 0 logged the means 0.5 and 2.5"
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
