"""Checker of exercise 08a.1 (notebooks/08a_tensor_parallel.ipynb): predict the collectives of a
wider split block, and the bytes each one moves, before the chapter's worker counts them.
"""

from __future__ import annotations

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
    guess = {
        k: answered(predicted.get(k), ex, f'predicted["{k}"]')
        for k in ("forward", "backward", "all_reduce_bytes", "all_gather_bytes")
    }
    cfg = config.TPConfig(h=32, n_heads=8, batch=3, seq=4, extras=False)
    v = run_ranks(ex, worker.worker, cfg, 2, name="tp").values[0]
    block, dt, sp = (v[k]["counts"] for k in ("hand_block", "dtensor", "sequence_parallel"))
    for phase in ("forward", "backward"):
        got = block[phase].get("all_reduce", 0)
        require(
            guess[phase] == got,
            ex,
            f"the split block did not issue {guess[phase]} all-reduces in {phase}: which "
            "sublayers does a block hold, and where do their f and g sit (section 3)?",
        )
    got = {n for n, _ in dt["bytes"]["all_reduce"]}.pop()
    require(
        guess["all_reduce_bytes"] == got,
        ex,
        f"each all-reduce did not move {guess['all_reduce_bytes']} bytes: which tensor "
        "does a row-parallel layer all-reduce, what is its shape, and how wide is float32?",
    )
    got = sp["bytes"]["all_gather"][0]
    require(
        list(guess["all_gather_bytes"]) == got,
        ex,
        f"each all-gather did not take and return {list(guess['all_gather_bytes'])} bytes: "
        "what part of the sequence does a rank hold before the all-gather, and after (section 5)?",
    )
    passed(
        ex,
        f"2 + 2 all-reduces of {got[1]} bytes per block; sequence parallelism gathers "
        f"{got[0]} → {got[1]}",
    )
