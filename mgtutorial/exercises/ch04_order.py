"""Checker of exercise 04b.3 (notebooks/04b_pipeline_schedules.ipynb): the 1F1B order of boxes on
each stage, written by the learner and laid out with the chapter's own simulator
(:func:`mgtutorial.pipeline.bubble.lay_out`). Called as ``ex.ch04.one_f_one_b``.

The classic wrong answers each get their own hint, none of which prints the expected order:
GPipe's order given for 1F1B, a warm-up one forward too short (the orders deadlock, or a stage
waits where it could compute) or too long (a stage holds more micro-batches than it needs).
"""

from __future__ import annotations

from mgtutorial.exercises._common import ExerciseError, attempt, passed, require
from mgtutorial.pipeline.bubble import box_order, bubble_formula, bubble_measured, lay_out

ORDER_CASES = ((2, 4), (4, 8), (3, 6))
"""(p stages, m micro-batches) the learner's order is checked on."""


def _warmup(order: list) -> int:
    """Forwards before the first backward."""
    return next((k for k, (event, _) in enumerate(order) if event == "backward"), len(order))


def held_at_peak(order: list) -> int:
    """The most micro-batches whose forward has run and whose backward has not, along ``order``:
    the activations a stage holds at its peak, in micro-batches."""
    held = peak = 0
    for event, _ in order:
        held += 1 if event == "forward" else -1
        peak = max(peak, held)
    return peak


def _well_formed(ex: str, order, s: int, p: int, m: int) -> list[tuple[str, int]]:
    call = f"order(stage={s}, p={p}, m={m})"
    require(isinstance(order, (list, tuple)), ex, f"{call} returned {type(order).__name__}")
    boxes = [tuple(b) if isinstance(b, (list, tuple)) else b for b in order]
    want = sorted((e, i) for e in ("backward", "forward") for i in range(m))
    require(
        all(isinstance(b, tuple) and len(b) == 2 for b in boxes) and sorted(boxes) == want,
        ex,
        f"{call} must hold each micro-batch's ('forward', i) and ('backward', i) once, "
        f"i = 0 … {m - 1}, and nothing else",
    )
    for i in range(m):
        require(
            boxes.index(("forward", i)) < boxes.index(("backward", i)),
            ex,
            f"{call}: micro-batch {i}'s backward comes before its forward (a stage starts its "
            "backwards only after its warm-up forwards: count them again)",
        )
    return boxes


def one_f_one_b(order_fn) -> None:
    """04b.3: ``order_fn(stage, p, m)`` returns the boxes stage ``stage`` of ``p`` runs in one 1F1B
    step with ``m`` micro-batches, in order, as ``("forward", i)`` / ``("backward", i)`` pairs.

    Verified for each case of :data:`ORDER_CASES` and each stage against
    :func:`~mgtutorial.pipeline.bubble.box_order`; a wrong order is laid out with
    :func:`~mgtutorial.pipeline.bubble.lay_out` to say what it costs (a deadlock, a larger bubble,
    more micro-batches held).
    """
    ex = "04b.3 the 1F1B order"
    for p, m in ORDER_CASES:
        orders = [_well_formed(ex, attempt(ex, order_fn, s, p, m), s, p, m) for s in range(p)]
        right = [box_order("1f1b", s, p, m) for s in range(p)]
        if orders == right:
            continue
        wrong = next(s for s in range(p) if orders[s] != right[s])
        where = f"p={p}, m={m}, stage {wrong}"
        if all(o == box_order("gpipe", s, p, m) for s, o in enumerate(orders)):
            raise ExerciseError(
                ex,
                f"{where}: that is GPipe's order, every forward before any backward, so each "
                "stage holds all m micro-batches; 1F1B starts a micro-batch's backward as soon as "
                "it can and then alternates",
            )
        try:
            evs = lay_out(orders)
        except RuntimeError:
            raise ExerciseError(
                ex,
                f"p={p}, m={m}: laid out with bubble.lay_out, your orders deadlock: some stage "
                "starts waiting for a backward before it has run the forwards that backward needs "
                "(count the warm-up forwards of each stage again)",
            ) from None
        got, ideal = bubble_measured(evs), bubble_formula(p, m)
        cost = f"laid out with bubble.lay_out, your orders leave a bubble of {got:.3f}"
        cost += ", more than the formula's" if got > ideal + 1e-9 else ", the formula's"
        if _warmup(orders[wrong]) < _warmup(right[wrong]):
            raise ExerciseError(
                ex,
                f"{where}: {cost}; this stage's warm-up is too short: it waits for a backward "
                "while it could run a forward",
            )
        if _warmup(orders[wrong]) > _warmup(right[wrong]):
            raise ExerciseError(
                ex,
                f"{where}: {cost}, {'and' if got > ideal + 1e-9 else 'but'} your warm-up makes "
                "this stage hold "
                f"{held_at_peak(orders[wrong])} micro-batches at its peak, more than that bubble "
                "needs (the formula's bubble with fewer held is the point of 1F1B)",
            )
        raise ExerciseError(
            ex,
            f"{where}: {cost}; after the warm-up, 1F1B alternates one backward and one forward "
            "until the forwards run out, and this stage's order does not",
        )
    passed(
        ex,
        f"{len(ORDER_CASES)} cases (p, m) = {ORDER_CASES}: every stage's order is 1F1B's; laid "
        "out, it leaves the formula's bubble",
    )
