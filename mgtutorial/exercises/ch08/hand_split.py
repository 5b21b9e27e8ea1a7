"""Checker of exercise 08a.3 (the bias added before g), notebooks/08a_tensor_parallel.ipynb: runs
the learner's forward in the chapter's hand-split MLP on 2 ranks
(:func:`mgtutorial.exercises.ch08.split_mlp.split_mlp_worker`) and reads what each rank measured.
"""

from __future__ import annotations

from mgtutorial.exercises._answers import entry
from mgtutorial.exercises._common import close, passed, require
from mgtutorial.exercises.ch08.split_mlp import run_split

TOL = 1e-5
"""Largest |split − unsplit| taken as equal (float32, a different order of summation)."""

NAMES = ("output", "x.grad", "w1", "b1", "w2", "b2")
"""What 08a.3 compares with the unsplit MLP: the output, the input's gradient, each gradient."""


# --- 08a.3 ---------------------------------------------------------------------------------------


def bias_before_g(path: str = "ex08a_bias.py", predicted: dict | None = None) -> None:
    """08a.3: ``forward(m, x)`` in ``path`` adds ``m.b2`` *before* g; ``predicted`` = {"wrong": the
    set of :data:`NAMES` that then differ from the unsplit MLP, "bias_copies": how many b2 the
    output holds (int)}. Runs the forward in ``HandTPMLP`` on 2 ranks, and the backward of
    ``(out · dy).sum()`` with a fixed ``dy``, and compares."""
    ex = "08a.3 bias before g"
    v = run_split(ex, path)[0]
    require(
        v["output"][0] > TOL,
        ex,
        "your forward gives the unsplit output: it still adds b2 after g; add it "
        "to the partial sum, inside ReduceFromTP.apply(...)",
    )
    got = round(v["bias_copies"])
    require(
        v["partial_sum"] > TOL and close(v["bias_copies"], got, rel=1e-4),
        ex,
        "the output differs from the unsplit one by something other than a multiple of b2: "
        "change only where b2 is added",
    )
    predicted = {} if predicted is None else predicted
    a_set = 'a set of names, e.g. {"output"}'
    wrong = entry(predicted, "wrong", ex, (str, set, frozenset, list, tuple), a_set)
    wrong = {wrong} if isinstance(wrong, str) else wrong  # one name: a set of one
    ok = all(isinstance(name, str) for name in wrong)
    require(ok, ex, f"predicted['wrong'] is {wrong!r}: give {a_set}")
    copies = entry(predicted, "bias_copies", ex, int, "an int")
    unknown = set(wrong) - set(NAMES)
    hint = f"predicted['wrong'] names {sorted(unknown)}: choose among {list(NAMES)}"
    require(not unknown, ex, hint)
    measured = {name for name in NAMES if v[name][0] > TOL}
    require(
        set(wrong) == measured,
        ex,
        f"you predicted {sorted(wrong)} wrong, and the ranks measured otherwise: "
        "follow dy backward from the output through g (section 2's f and g) and ask, for each "
        "gradient, whether anything it is computed from has changed",
    )
    require(
        copies == got,
        ex,
        f"the output does not hold {copies} copies of b2: count who adds b2, and what g does "
        "with what each rank adds",
    )
    passed(
        ex,
        f"with a fixed dy only the output is wrong, by (tp − 1)·b2: it holds {got} copies of b2 "
        "on 2 ranks",
    )
