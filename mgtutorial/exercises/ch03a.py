"""Checkers of chapter 03a's exercises (notebooks/03a_collectives.ipynb): what rank 2 holds after a
reduce-scatter and a ring step on 4 ranks (03a.1), averaging the gradients by hand in one
all-reduce (03a.2), and, from :mod:`mgtutorial.exercises.ch03a_ring_overlap`, a ring all-reduce
from send/recv (03a.3) and computing while an asynchronous all-reduce is in flight (03a.4).

The workers here run the learner's function (from a ``%%writefile`` module, imported by path)
inside the ranks, with ``torch.distributed``'s calls recorded or refused
(:func:`mgtutorial.exercises.ddp_checks.patched`), so that the checkers can count calls and
elements, not only compare values.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mgtutorial import ddp
from mgtutorial.ddp import collectives
from mgtutorial.exercises._common import (
    ExerciseError,
    answered,
    function_from,
    passed,
    require,
    run_ranks,
)
from mgtutorial.exercises.ch03a_ring_overlap import overlap, ring_all_reduce
from mgtutorial.exercises.ddp_checks import (
    NO_ALL_REDUCE_SEEN,
    compare_with_reference,
    load_params,
    patched,
    save_params,
)
from mgtutorial.runtime import env

# --- 03a.1 ----------------------------------------------------------------------------------------


def four_ranks(predicted: dict) -> None:
    """03a.1: ``predicted["reduce_scatter"]`` and ``predicted["send/recv"]`` are the lists rank 2
    holds after those steps of ``collectives.collectives_tour`` on 4 ranks with ``size=8`` (rank r
    starts with ``[10r, …, 10r + 7]``). Launches the tour and compares with rank 2's logged
    tensors."""
    ex = "03a.1 four ranks"
    hints = {
        "reduce_scatter": "rank r keeps piece r (elements 2r and 2r + 1) of the sum over the 4 "
        "ranks",
        "send/recv": "each rank sends to rank + 1, so rank 2 receives from rank 1",
    }
    guesses = {k: answered(predicted.get(k), ex, f'predicted["{k}"]') for k in hints}
    cfg = collectives.TourConfig(size=8, barrier_delay_s=0.0)
    records = run_ranks(ex, collectives.collectives_tour, cfg, 4, name="tour").values[2]
    for key, hint in hints.items():
        held = next(rec["after"] for rec in records if rec["op"].startswith(key))
        try:
            guess = [float(v) for v in guesses[key]]
        except (TypeError, ValueError):
            raise ExerciseError(
                ex, f'predicted["{key}"] is {guesses[key]!r}: give a list of numbers'
            ) from None
        require(
            len(guess) == len(held),
            ex,
            f"after {key} rank 2 does not hold {len(guess)} numbers: {hint}",
        )
        require(guess == held, ex, f"after {key} rank 2 does not hold {guesses[key]}: {hint}")
    passed(
        ex,
        "rank 2 holds piece 2 of the sum after reduce_scatter, and rank 1's tensor after the ring "
        "step",
    )


# --- 03a.2 ----------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class AverageConfig(ddp.DDPConfig):
    """Chapter 02's configuration plus the learner's module, for :func:`average_worker`."""

    path: str = ""
    """Absolute path of the module defining ``average_gradients(model, world_size)``."""


class _LearnerDDP(collectives.FromScratchDDP):
    """:class:`~mgtutorial.ddp.collectives.FromScratchDDP` whose gradient averaging is the
    learner's function; counts all-reduces."""

    def __init__(self, module, ctx, fn):
        super().__init__(module, ctx)
        self.fn = fn
        self.calls_per_step = []

    def average_gradients(self) -> int:
        with patched([], ("all_reduce",)) as calls:
            self.fn(self.module, self.world_size)
        self.calls_per_step.append(len(calls))
        return len(calls)


def average_worker(cfg: AverageConfig) -> dict:
    """03a's ``scratch_worker`` with the learner's ``average_gradients``; saves each rank's
    parameters (:func:`save_params`). Returns ``{"calls_per_step"}`` (all-reduce calls)."""
    fn = function_from(cfg.path, "average_gradients")

    def wrap(model, ctx):
        return _LearnerDDP(model.to(ctx.device), ctx, fn)

    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        model, train_set, test_set, optimizer = ddp.build(cfg, ctx, wrap=wrap)
        collectives.ScratchTrainer(model, train_set, test_set, optimizer, ctx, cfg).train()
        save_params(model.module, ctx.rank)
        return {"calls_per_step": model.calls_per_step}


def average_by_hand(path: str = "ex03a_average.py") -> None:
    """03a.2: ``average_gradients(model, world_size)`` in ``path`` leaves in every ``p.grad`` the
    mean over the ranks, with one all-reduce. Trains 3 steps on 2 ranks; compares both ranks with
    one process on the combined batch and counts the all-reduce calls per step."""
    ex = "03a.2 average by hand"
    function_from(path, "average_gradients", ex)
    cfg = AverageConfig(
        path=str(Path(path).resolve()),
        dataset="synthetic",
        batch_size=8,
        max_steps=3,
        evaluate=False,
    )
    result = run_ranks(ex, average_worker, cfg, 2, name="average")
    compare_with_reference(
        ex,
        load_params(result.run_dir, 2),
        cfg,
        unsynced="if you all-reduced a flat copy of "
        "the gradients, copy the reduced pieces back into the p.grad tensors (g.copy_(...))",
    )
    calls = result.values[0]["calls_per_step"]
    require(any(calls), ex, NO_ALL_REDUCE_SEEN)
    require(
        calls == [1] * cfg.max_steps,
        ex,
        f"the values are right, with {calls} all-reduce calls per step: one "
        f"per parameter tensor; put every gradient in one flat tensor "
        f"(torch.cat of p.grad.flatten()), all-reduce it once, copy it back",
    )
    passed(
        ex,
        "one all-reduce per step, and after 3 steps both ranks equal one process on the combined "
        "batch",
    )


__all__ = ["average_by_hand", "four_ranks", "overlap", "ring_all_reduce"]
