"""Checkers of exercises 08.2 (Megatron's f and g written by hand) and 08.3 (the bias added before
g), notebooks/08_tensor_parallel.ipynb. Both run the learner's pieces in the chapter's hand-split
MLP on 2 ranks (:func:`mgtutorial.exercises.ch08.split_mlp.split_mlp_worker`) and read what each
rank measured.
"""

from __future__ import annotations

import torch

from mgtutorial.exercises._common import answered, close, import_file, passed, require
from mgtutorial.exercises.ch08.split_mlp import run_split

TOL = 1e-5
"""Largest |split − unsplit| taken as equal (float32, a different order of summation)."""

NAMES = ("output", "x.grad", "w1", "b1", "w2", "b2")
"""What 08.3 compares with the unsplit MLP: the output, the input's gradient, each gradient."""


# --- 08.2 ---------------------------------------------------------------------------------------


def f_and_g(path: str = "ex08_fg.py") -> None:
    """08.2: ``CopyToTP`` (f) and ``ReduceFromTP`` (g) in ``path``, ``torch.autograd.Function``s
    called as ``f.apply(x, group)``. Run in ``HandTPMLP`` on 2 ranks, built on an explicit group;
    the output, the input's gradient and every parameter's gradient must equal the unsplit MLP's,
    with one all-reduce in forward and one in backward, each given that group."""
    ex = "08.2 f and g"
    for cls in ("CopyToTP", "ReduceFromTP"):
        fn = getattr(import_file(path, ex), cls, None)
        require(
            isinstance(fn, type) and issubclass(fn, torch.autograd.Function),
            ex,
            f"{path} defines no torch.autograd.Function `{cls}`",
        )
    for rank, v in sorted(run_split(ex, path, "fg").items()):
        _output(ex, rank, v)
        _weight_gradients(ex, rank, v)
        _input_gradient(ex, rank, v)
        _group_and_counts(ex, rank, v)
    passed(
        ex,
        "your f and g split the MLP exactly: output and all gradients == unsplit, 1 all-reduce "
        "each way on the given group",
    )


def _output(ex: str, rank: int, v: dict) -> None:
    out = v["output"][0]
    if out > TOL:
        require(
            v["partial_sum"] > TOL,
            ex,
            f"rank {rank}'s output is its own partial sum: ReduceFromTP "
            "(g) must add the partial outputs of all ranks in forward (dist.all_reduce)",
        )
        require(
            False,
            ex,
            f"rank {rank}'s output differs from the unsplit MLP's by up to {out:.2g}: "
            "CopyToTP's forward must return x unchanged, ReduceFromTP's forward must sum "
            "(all-reduce) once",
        )


def _weight_gradients(ex: str, rank: int, v: dict) -> None:
    for name in ("w2", "b1", "w1"):
        diff, k = v[name]
        if close(k, 2, rel=1e-3):
            why = (
                "ReduceFromTP's backward must be the identity (every rank already holds the "
                "whole gradient of the output)"
            )
        else:
            why = "check what ReduceFromTP's backward returns"
        require(
            diff <= TOL,
            ex,
            f"output right, but rank {rank}'s gradient of {name} is {k:.2g}× the unsplit one's: "
            + why,
        )


def _input_gradient(ex: str, rank: int, v: dict) -> None:
    dx, k_dx = v["x.grad"]
    if v["local_dx"] <= TOL:
        why = (
            "only this rank's share: CopyToTP (f) must add the shares of all ranks in backward "
            "(dist.all_reduce)"
        )
    elif close(k_dx, 0.5, rel=1e-3):
        why = (
            f"{k_dx:.2g}× the unsplit one's: did you average? f sums the ranks' shares "
            "(all_reduce's default op, SUM), with no division by the world size"
        )
    else:
        why = (
            "not the sum of the ranks' shares: CopyToTP (f) must all-reduce the gradient in "
            "backward"
        )
    require(
        dx <= TOL,
        ex,
        f"output and weight gradients right, but rank {rank}'s gradient of the input x is " + why,
    )


def _group_and_counts(ex: str, rank: int, v: dict) -> None:
    require(
        v["other_group"] == 0,
        ex,
        f"right results, but {v['other_group']} all-reduce(s) of rank {rank} "
        "did not get the group passed to apply: pass it on, dist.all_reduce(t, group=group); "
        "without it they run on all ranks, and on a 2-D mesh (section 6) the TP group is only "
        "some of them",
    )
    for phase, calls in v["counts"].items():
        require(
            calls == {"all_reduce": 1},
            ex,
            f"right results, but rank {rank} issued {calls or 'no collectives'} "
            f"in {phase}: Megatron's f and g need exactly one all-reduce each way",
        )


# --- 08.3 ---------------------------------------------------------------------------------------


def bias_before_g(path: str = "ex08_bias.py", predicted: dict | None = None) -> None:
    """08.3: ``forward(m, x)`` in ``path`` adds ``m.b2`` *before* g; ``predicted`` = {"wrong": the
    set of :data:`NAMES` that then differ from the unsplit MLP, "bias_copies": how many b2 the
    output holds (int)}. Runs the forward in ``HandTPMLP`` on 2 ranks, and the backward of
    ``(out · dy).sum()`` with a fixed ``dy``, and compares."""
    ex = "08.3 bias before g"
    v = run_split(ex, path, "forward")[0]
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
    predicted = predicted or {}
    wrong, copies = (
        answered(predicted.get(k), ex, f'predicted["{k}"]') for k in ("wrong", "bias_copies")
    )
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
