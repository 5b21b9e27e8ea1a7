"""Checker of exercise 04b.3 (notebooks/04b_pipeline_schedules.ipynb): the 1F1B order of boxes on
each stage, written by the learner for any p and m, m < p and m = 1 included, compared with what
torch's own ``Schedule1F1B`` step loop runs
(:func:`mgtutorial.pipeline.library_order.recorded_order`), and a wrong order laid out with the
chapter's simulator (:func:`mgtutorial.pipeline.bubble.lay_out`) to say what it costs. Called as
``ex.ch04.one_f_one_b``.

A wrong order is rejected at the first box where it departs from torch's, named by its position
and the learner's own box; the classic wrong answers each get their own hint, none of which prints
the expected order: GPipe's order given for 1F1B, a warm-up that ignores m < p (boxes of
micro-batches that do not exist), one forward too short (the orders deadlock, or a stage waits
where it could compute) or too long (a stage holds more micro-batches than it needs).
"""

from __future__ import annotations

from mgtutorial.exercises._common import ExerciseError, attempt, passed, require, withheld
from mgtutorial.pipeline import bubble as bubble_module
from mgtutorial.pipeline import library_order
from mgtutorial.pipeline.bubble import box_order, bubble_formula, bubble_measured, lay_out
from mgtutorial.pipeline.library_order import recorded_order

ORDER_CASES = ((2, 4), (4, 8), (3, 5), (5, 7), (1, 3), (4, 2), (5, 3), (3, 1))
"""(p stages, m micro-batches) the learner's order is checked on: the lesson runs p = 2 only; the
last three have fewer micro-batches than stages (m < p), the last a single one."""
WHY = "build the order from what each stage must wait for"


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
        f"i = 0 … {m - 1}, and nothing else"
        + (
            f" (here there are fewer micro-batches than stages, m < p: how many forwards can "
            f"stage {s}'s warm-up run?)"
            if m < p
            else ""
        ),
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

    Verified for each case of :data:`ORDER_CASES` (m < p and m = 1 among them) and each stage
    against the boxes torch's ``Schedule1F1B`` step loop runs
    (:func:`~mgtutorial.pipeline.library_order.recorded_order`); the first wrong box is named by
    its position, and the orders are laid out with :func:`~mgtutorial.pipeline.bubble.lay_out` to
    say what they cost (a deadlock, a larger bubble, more micro-batches held).
    """
    ex = "04b.3 the 1F1B order"
    for p, m in ORDER_CASES:
        with (
            withheld(ex, bubble_module, ("box_order", "ideal_events"), WHY, order_fn),
            withheld(ex, library_order, ("recorded_order",), WHY, order_fn),
        ):
            answers = [attempt(ex, order_fn, s, p, m) for s in range(p)]
        orders = [_well_formed(ex, answer, s, p, m) for s, answer in enumerate(answers)]
        right = [recorded_order("1f1b", s, p, m) for s in range(p)]
        require(
            right == [box_order("1f1b", s, p, m) for s in range(p)],
            ex,
            f"p={p}, m={m}: torch's Schedule1F1B no longer runs bubble.box_order's order: the "
            "checker is broken",
        )
        laid_out = bubble_measured(lay_out(right))
        require(
            abs(laid_out - bubble_formula(p, m)) < 1e-9,
            ex,
            f"p={p}, m={m}: 1F1B laid out leaves {laid_out}, not the formula's bubble: the "
            "checker is broken",
        )
        if orders == right:
            continue
        wrong = next(s for s in range(p) if orders[s] != right[s])
        k = next(k for k, (a, b) in enumerate(zip(orders[wrong], right[wrong])) if a != b)
        where = (
            f"p={p}, m={m}, stage {wrong}: your box {k} (counting from 0), "
            f"{orders[wrong][k]!r}, is not the one Schedule1F1B's step loop runs there"
        )
        raise ExerciseError(ex, f"{where}; {_diagnosis(orders, right, wrong, p, m)}")
    passed(
        ex,
        f"{len(ORDER_CASES)} pipelines, {sum(p for p, _ in ORDER_CASES)} stages, m < p and "
        "m = 1 among them: every stage's order is the one torch's Schedule1F1B runs; laid out, "
        "it leaves the formula's bubble",
    )


def _diagnosis(orders: list, right: list, wrong: int, p: int, m: int) -> str:
    """What the wrong ``orders`` cost, laid out with :func:`lay_out`, without the right order."""
    if all(o == box_order("gpipe", s, p, m) for s, o in enumerate(orders)):
        return (
            "that is GPipe's order on every stage, every forward before any backward, so each "
            "stage holds all m micro-batches; 1F1B starts a micro-batch's backward as soon as it "
            "can and then alternates"
        )
    try:
        evs = lay_out(orders)
    except RuntimeError:
        return (
            "laid out with bubble.lay_out, your orders deadlock: some stage starts waiting for a "
            "backward before it has run the forwards that backward needs (count the warm-up "
            "forwards of each stage again)"
        )
    got, ideal = bubble_measured(evs), bubble_formula(p, m)
    more = got > ideal + 1e-9
    cost = f"laid out with bubble.lay_out, your orders leave a bubble of {got:.3f}"
    cost += ", more than the formula's" if more else ", the formula's"
    if _warmup(orders[wrong]) < _warmup(right[wrong]):
        return (
            f"{cost}; this stage's warm-up is too short: it waits for a backward while it "
            "could run a forward"
        )
    if _warmup(orders[wrong]) > _warmup(right[wrong]):
        return (
            f"{cost}, {'and' if more else 'but'} your warm-up makes this stage hold "
            f"{held_at_peak(orders[wrong])} micro-batches at its peak, more than that bubble "
            "needs (the formula's bubble with fewer held is the point of 1F1B)"
        )
    return (
        f"{cost}; after the warm-up, 1F1B alternates one backward and one forward until the "
        "forwards run out, and this stage's order does not"
    )
