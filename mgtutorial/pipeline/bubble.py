"""The bubble: the idle fraction of a pipeline step, from the formula, from an ideal step and
measured on a real step's boxes, with a model of the delay between boxes that the formula leaves
out.

Taught in notebooks/04a_pipeline_gpipe.ipynb (section 4: the measured bubble against
(p − 1)/(m + p − 1), on the simulated device and the CPU; exercise 04a.1),
notebooks/04b_pipeline_schedules.ipynb (1F1B, interleaved) and notebooks/04z_appendix_delays.ipynb
(the model with the delay between boxes). The formula is GPipe's
(Huang et al., 2019) and interleaved 1F1B's (Narayanan et al., 2021); the events are those a
:class:`mgtutorial.pipeline.timeline.Timeline` logs (``event``, ``stage``, ``rank``,
``microbatch``, ``start``, ``end``), or those :func:`ideal_events` draws. Pure arithmetic: no
process group, no torch.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Literal


def bubble_formula(num_stages: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of an ideal GPipe/1F1B pipeline on p = ``num_stages`` ranks with m =
    ``n_microbatches``: (p − 1) / (m + p − 1); with v = ``stages_per_rank`` (interleaved 1F1B,
    Narayanan et al., 2021) (p − 1) / (v·m + p − 1)."""
    return (num_stages - 1) / (stages_per_rank * n_microbatches + num_stages - 1)


def bubble_model(
    num_stages: int,
    n_microbatches: int,
    forward_s: float,
    backward_s: float,
    delay_s: float,
    stages_per_rank: int = 1,
) -> float:
    """The formula with a cost between the boxes: every box but the step's first starts
    ``delay_s`` = o late (:func:`box_delays`). The critical path has v·m + p − 1 forwards and as
    many backwards, so the span is (v·m + p − 1)·(f + b + 2·o) − o, and the idle fraction
    1 − v·m·(f + b) / ((v·m + p − 1)·(f + b + 2·o) − o); seconds, f and b one box of one stage.
    With o = 0 it is :func:`bubble_formula`."""
    vm, work = stages_per_rank * n_microbatches, forward_s + backward_s
    span = step_span(num_stages, n_microbatches, forward_s, backward_s, delay_s, stages_per_rank)
    return 1 - vm * work / span


def step_span(
    num_stages: int,
    n_microbatches: int,
    forward_s: float,
    backward_s: float,
    delay_s: float = 0.0,
    stages_per_rank: int = 1,
) -> float:
    """Seconds from a step's first box to its last, when every box on the critical path but the
    first starts ``delay_s`` late: (v·m + p − 1)·(f + b + 2·o) − o, with f, b one box of one
    stage (:func:`bubble_model`)."""
    vm, work = stages_per_rank * n_microbatches, forward_s + backward_s
    return (vm + num_stages - 1) * (work + 2 * delay_s) - delay_s


def box_order(
    schedule: Literal["gpipe", "1f1b"], stage: int, num_stages: int, n_microbatches: int
) -> list[tuple[str, int]]:
    """The boxes ``stage`` runs in one step, in order, as ``(event, microbatch)``: GPipe every
    forward, then every backward; 1F1B p − s forwards of warm-up (p = ``num_stages``, s =
    ``stage``), then one backward and one forward in turn, then the backwards left."""
    m = n_microbatches
    if schedule == "gpipe":
        return [("forward", i) for i in range(m)] + [("backward", i) for i in range(m)]
    warmup = min(num_stages - stage, m)
    order = [("forward", i) for i in range(warmup)]
    for i in range(m):
        order.append(("backward", i))
        if warmup + i < m:
            order.append(("forward", warmup + i))
    return order


def producer(event: str, stage: int, microbatch: int, last_stage: int) -> tuple | None:
    """The box whose end a box waits for, as ``(stage, event, microbatch)``: a forward the previous
    stage's forward (none on stage 0), a backward the next stage's backward, or on the last stage
    its own forward."""
    if event == "forward":
        return (stage - 1, "forward", microbatch) if stage > 0 else None
    if stage < last_stage:
        return (stage + 1, "backward", microbatch)
    return (stage, "forward", microbatch)


def ideal_events(
    schedule: Literal["gpipe", "1f1b"],
    num_stages: int,
    n_microbatches: int,
    forward_s: float = 1.0,
    backward_s: float = 2.0,
) -> list[dict]:
    """One step of ``schedule`` as the formula sees it: :func:`lay_out` of every stage's
    :func:`box_order`. :func:`bubble_measured` of it is :func:`bubble_formula` for either
    schedule."""
    orders = [box_order(schedule, s, num_stages, n_microbatches) for s in range(num_stages)]
    return lay_out(orders, forward_s, backward_s)


def lay_out(
    orders: list[list[tuple[str, int]]], forward_s=1.0, backward_s=2.0, scale=None, delay_s=0.0
) -> list[dict]:
    """An ideal step from each stage's order of boxes (``orders[s]``: ``(event, microbatch)``
    pairs, event "forward" or "backward", as :func:`box_order` gives them), as events sorted by
    start: every forward lasts ``forward_s``, every backward ``backward_s``, and a box starts the
    moment its :func:`producer` has ended and its stage is free, plus ``delay_s`` (default 0: no
    cost between boxes; else every box but the step's first starts that late, the delay
    :func:`box_delays` measures and :func:`bubble_model` puts into the formula). Draw it
    with :func:`mgtutorial.pipeline.timeline.gantt`. ``scale[s]`` (default all 1) multiplies stage
    s's boxes: an unbalanced pipeline. Taught in 04a (GPipe; exercise 04a.1: unequal stages, a
    delay per box) and 04b (exercise 04b.3: your own 1F1B order).

    Raises:
        RuntimeError: the orders deadlock (a stage waits for a box that waits for it).
    """
    p = len(orders)
    pending = {s: deque(order) for s, order in enumerate(orders)}
    end, free, evs = {}, [None] * p, []
    while any(pending.values()):
        progressed = False
        for s in range(p):
            while pending[s]:
                event, i = pending[s][0]
                dep = producer(event, s, i, p - 1)
                if dep is not None and dep not in end:
                    break
                ready = [t for t in (end.get(dep), free[s]) if t is not None]
                start = max(ready) + delay_s if ready else 0.0
                length = forward_s if event == "forward" else backward_s
                free[s] = end[s, event, i] = start + length * (1 if scale is None else scale[s])
                box = {"event": event, "stage": s, "rank": s, "microbatch": i, "step": 1}
                evs.append({**box, "start": start, "end": free[s]})
                pending[s].popleft()
                progressed = True
        if not progressed:
            waiting = {s: order[0] for s, order in pending.items() if order}
            raise RuntimeError(f"the orders deadlock: each stage's next box waits ({waiting})")
    return sorted(evs, key=lambda e: e["start"])


def bubble_measured(evs: list[dict], by: str = "stage") -> float:
    """Idle fraction of a step: 1 − (busy time summed over lanes) / (lanes × span of the step).

    A lane is what computes one box at a time: a stage (``by="stage"``), or a rank
    (``by="rank"``, for schedules with several stages per rank). Busy time is the sum of the logged
    boxes, so a pause of the process inside a box counts as busy, and one between boxes as idle.
    """
    lanes = {e[by] for e in evs}
    span = max(e["end"] for e in evs) - min(e["start"] for e in evs)
    busy = sum(e["end"] - e["start"] for e in evs)
    return 1 - busy / (len(lanes) * span)


def step_costs(evs: list[dict], by: str = "stage", stages_per_rank: int = 1) -> dict:
    """Where one step's time goes, from its events, in seconds: ``forward``/``backward``, the mean
    box (one stage's); ``delay``, the mean of :func:`box_delays`; ``span``, first start to last
    end; ``model``, :func:`bubble_model` of these; ``m``; ``p``, the lanes (stages, or ranks with
    ``by="rank"``)."""
    p, m = len({e[by] for e in evs}), len({e["microbatch"] for e in evs})
    f = statistics.fmean(e["end"] - e["start"] for e in evs if e["event"] == "forward")
    b = statistics.fmean(e["end"] - e["start"] for e in evs if e["event"] == "backward")
    o = statistics.fmean(box_delays(evs, by))
    span = max(e["end"] for e in evs) - min(e["start"] for e in evs)
    return {
        "forward": f,
        "backward": b,
        "delay": o,
        "span": span,
        "m": m,
        "p": p,
        "model": bubble_model(p, m, f, b, o, stages_per_rank),
    }


def box_delays(evs: list[dict], by: str = "stage") -> list[float]:
    """How late each box started (s): its start minus the moment it could have started, the later
    of its lane's previous box's end and its :func:`producer`'s end. This is the time between boxes
    that the formula does not see: the hand-off through the backend, the schedule's Python, and
    waiting for a core. The step's first box has no delay and is left out."""
    done = {(e["stage"], e["event"], e["microbatch"]): e["end"] for e in evs}
    last, lane_end, delays = max(e["stage"] for e in evs), {}, []
    for e in sorted(evs, key=lambda e: e["start"]):
        dep = producer(e["event"], e["stage"], e["microbatch"], last)
        ready = [t for t in (lane_end.get(e[by]), done.get(dep)) if t is not None]
        if ready:
            delays.append(e["start"] - max(ready))
        lane_end[e[by]] = e["end"]
    return delays
