"""Checker of exercise 08a.1 (notebooks/08a_tensor_parallel.ipynb): predict the collectives of a
wider split block, and the bytes each one moves, before the chapter's worker counts them.
"""

from __future__ import annotations

from mgtutorial.exercises._answers import entry, is_int
from mgtutorial.exercises._common import answered, passed, require, run_ranks
from mgtutorial.tensor_parallel import config, worker


def counts(predicted: dict) -> None:
    """08a.1: ``predicted`` = {"forward", "backward": all-reduces of the hand-split block (ints),
    "all_reduce_bytes": bytes of each DTensor all-reduce (int), "all_gather_bytes": [bytes in, out]
    of each sequence-parallel all-gather} for ``TPConfig(h=32, n_heads=8, batch=3, seq=4)`` on 2
    ranks.

    Launches the chapter's worker (:func:`mgtutorial.tensor_parallel.worker.worker`) and compares.
    """
    ex = "08a.1 counts and bytes"
    guess = {k: entry(predicted, k, ex, int, "an int") for k in ("forward", "backward")}
    guess["all_reduce_bytes"] = entry(predicted, "all_reduce_bytes", ex, int, "an int")
    pair = entry(predicted, "all_gather_bytes", ex, (list, tuple), "a list [bytes in, bytes out]")
    require(len(pair) == 2, ex, f"predicted['all_gather_bytes'] is {pair!r}: give [in, out]")
    for i, value in enumerate(pair):
        answered(value, ex, f"predicted['all_gather_bytes'][{i}]")
        hint = f"predicted['all_gather_bytes'][{i}] is {value!r}: give an int (bytes)"
        require(is_int(value), ex, hint)
    cfg = config.TPConfig(h=32, n_heads=8, batch=3, seq=4, extras=False)
    v = run_ranks(ex, worker.worker, cfg, 2, name="tp").values[0]
    block, dt, sp = (v[k]["counts"] for k in ("hand_block", "dtensor", "sequence_parallel"))
    for phase in ("forward", "backward"):
        got = block[phase].get("all_reduce", 0)
        require(
            guess[phase] == got,
            ex,
            f"you predicted {guess[phase]} all-reduce(s) in {phase}; the split block issued a "
            "different number: which sublayers does a block hold, and where do their f and g sit "
            "(section 3)?",
        )
    got = {n for n, _ in dt["bytes"]["all_reduce"]}.pop()
    require(
        guess["all_reduce_bytes"] == got,
        ex,
        f"you predicted {guess['all_reduce_bytes']} bytes per all-reduce; the DTensor plan's "
        "all-reduces moved a different number: which tensor does a row-parallel layer "
        "all-reduce, what is its shape, and how wide is float32?",
    )
    got = sp["bytes"]["all_gather"][0]
    require(
        list(pair) == got,
        ex,
        f"you predicted all-gathers of {list(pair)} bytes [in, out]; the sequence-parallel "
        "all-gathers moved other numbers: what part of the sequence does a rank hold before "
        "the all-gather, and after (section 5)?",
    )
    passed(
        ex,
        f"2 + 2 all-reduces of {got[1]} bytes per block; sequence parallelism gathers "
        f"{got[0]} → {got[1]}",
    )
