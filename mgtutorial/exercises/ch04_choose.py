"""Checker of exercise 04b.2 (notebooks/04b_pipeline_schedules.ipynb): choosing the number of
micro-batches m for a given stage cost and delay between boxes, with the step's span from the
decomposition of notebooks/04z_appendix_delays.ipynb
(:func:`~mgtutorial.pipeline.bubble.step_span`).
Called as ``ex.ch04.choose_m`` (re-exported by :mod:`mgtutorial.exercises.ch04`)."""

from __future__ import annotations

import math

from mgtutorial.exercises._common import ExerciseError, attempt, close, passed, require, withheld
from mgtutorial.pipeline import bubble
from mgtutorial.pipeline.bubble import step_span

WITHHELD = ("step_span", "step_costs", "bubble_model", "lay_out", "ideal_events")
"""What ``bubble`` withholds while the learner's ``best_m`` runs: the span it is to write."""

CHOOSE_CASES = (  # (p, F, B, o, batch): one stage's whole-batch forward, backward; delay per box
    (2, 0.240, 0.480, 0.0, 64),
    (2, 0.240, 0.480, 0.002, 64),
    (4, 0.100, 0.200, 0.005, 48),
    (2, 0.020, 0.040, 0.003, 512),
    (2, 0.0832, 0.1664, 0.002, 60),  # the best real m, 7.9, is nearer 6 but 10 is better
)


def choose_m(best_m) -> None:
    """04b.2: ``best_m(p, F, B, o, batch)`` returns ``(m_real, m, span)``: the best real number
    of micro-batches (where the span's derivative in m is zero; ``math.inf`` when o = 0), the
    micro-batch count m (a divisor of ``batch``: the course refuses unequal micro-batches) whose
    step is shortest, and that step's span in seconds, for a stage whose whole-batch forward and
    backward take F and B seconds (so F/m and B/m per box) and a delay of o seconds before each
    box on the critical path but the first (the decomposition of 04z:
    :func:`~mgtutorial.pipeline.bubble.step_span`).
    Verified: m_real against the closed form, the span against m's own, and m against every
    divisor."""
    ex = "04b.2 choosing m"
    for p, f, b, o, batch in CHOOSE_CASES:
        call = f"best_m(p={p}, F={f}, B={b}, o={o}, batch={batch})"
        with withheld(
            ex, bubble, WITHHELD, "write the span from the slots of the critical path", best_m
        ):
            out = attempt(ex, best_m, p, f, b, o, batch)
        require(
            isinstance(out, tuple) and len(out) == 3,
            ex,
            f"{call} returned {out!r}: return (best real m, m, span in seconds)",
        )
        m_real, m, predicted = out
        exact = math.sqrt((p - 1) * (f + b) / (2 * o)) if o else math.inf
        require(
            m_real == exact if o == 0 else close(m_real, exact, rel=1e-6),
            ex,
            f"{call}: {m_real!r} is not the best real m: "
            + (
                "with o = 0 the span only shrinks as m grows (give math.inf)"
                if o == 0
                else "write the span as a function of m, set its derivative to zero and solve "
                "for m (a closed form, not a search)"
            ),
        )
        require(
            isinstance(m, int) and m >= 1 and batch % m == 0,
            ex,
            f"{call} returned m = {m!r}: give a divisor of the batch (an int)",
        )
        span = {d: step_span(p, d, f / d, b / d, o) for d in range(1, batch + 1) if batch % d == 0}
        require(
            close(predicted, span[m], rel=1e-6),
            ex,
            f"{call}: the span you give for m={m}, {predicted!r}, is not that step's: count the "
            "slots of the critical path and what each costs, delays included",
        )
        best = min(span.values())
        if span[m] <= best * (1 + 1e-9):
            continue
        below = max(d for d in span if d <= exact) if o else batch
        above = min((d for d in span if d > below), default=below)
        why = (
            "with o = 0 the step only shrinks as m grows"
            if o == 0
            else "of the two divisors around the best real m, yours has the longer step: compare "
            "their spans, not their distances to it"
            if m in (below, above)
            else "the delays grow with m while the fill and drain shrink: look next to the best "
            "real m"
        )
        raise ExerciseError(
            ex,
            f"for p={p}, F={f} s, B={b} s, o={o} s, batch {batch}, another divisor of the batch "
            f"gives a shorter step than m={m}: {why}",
        )
    passed(
        ex,
        f"{len(CHOOSE_CASES)} cases: the best real m is the closed form's, each m gives the "
        "shortest step of all the divisors, and its span is that step's",
    )
