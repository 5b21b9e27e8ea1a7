"""Checkers of chapter 07's exercises (notebooks/07a_zero_memory.ipynb, 07b_fsdp2.ipynb): how many
ranks bring a 13 B model under 80 GB (07a.1), per-rank bytes with padding (07a.2), ZeRO-1's step
with clipping by the global gradient norm (07a.3, in :mod:`mgtutorial.exercises.ch07_zero`), a
per-block ``reshard_after_forward`` policy (07b.1, in :mod:`mgtutorial.exercises.ch07_fsdp`) and
ZeRO-3 by hand for one layer (07b.2, in :mod:`mgtutorial.exercises.ch07_zero3`); all five are
reached as ``ex.ch07.<checker>``.
"""

from __future__ import annotations

from mgtutorial.exercises._common import ExerciseError, answered, passed, require, run_ranks
from mgtutorial.exercises.ch07_fsdp import asked_policy, count_step, policy_worker, reshard_policy
from mgtutorial.exercises.ch07_zero import (
    WAYS,
    clip,
    clip_step_worker,
    clipped_reference,
    zero1_clipped,
)
from mgtutorial.exercises.ch07_zero3 import zero3_layer, zero3_worker
from mgtutorial.sharding import memory, worker

__all__ = [
    "LIMIT",
    "PAD_HINTS",
    "WAYS",
    "asked_policy",
    "clip",
    "clip_step_worker",
    "clipped_reference",
    "count_step",
    "fits_in_80gb",
    "padded_bytes",
    "policy_worker",
    "reshard_policy",
    "smallest_ranks",
    "zero1_clipped",
    "zero3_layer",
    "zero3_worker",
]

LIMIT = 8e10  # 80 GB (10⁹ bytes), model states only


def smallest_ranks(
    params: int, scheme: memory.Scheme, limit: float = LIMIT, precision: memory.Precision = "mixed"
) -> int | None:
    """Smallest N (1 … 4096) at which ``memory_per_rank([(params,)], N, scheme,
    precision)["total"] < limit``; None if there is none (DDP)."""
    for n in range(1, 4097):
        if memory.memory_per_rank([(params,)], n, scheme, precision)["total"] < limit:
            return n
    return None


def gigabytes(params: int, n: int, scheme: memory.Scheme) -> float:
    """GB (10⁹ bytes) per rank of ``scheme`` on ``n`` ranks, the ZeRO paper's mixed precision."""
    return memory.memory_per_rank([(params,)], n, scheme, "mixed")["total"] / 1e9


def fits_in_80gb(predicted: dict) -> None:
    """07a.1: ``predicted[scheme]`` is the smallest N that brings 13 B parameters under 80 GB per
    rank.

    ``scheme`` in "zero1", "zero2", "zero3"; the ZeRO paper's mixed precision (2 + 2 + 12 bytes
    per parameter), model states only. Verified with
    :func:`mgtutorial.sharding.memory.memory_per_rank`.
    """
    ex, psi = "07a.1 80 GB per rank", 13_000_000_000
    for scheme in ("zero1", "zero2", "zero3"):
        guess = answered(predicted.get(scheme), ex, f"predicted[{scheme!r}]")
        truth = smallest_ranks(psi, scheme)
        require(
            isinstance(guess, int) and guess >= 1,
            ex,
            f"predicted[{scheme!r}] = {guess!r}: give a number of ranks (an int ≥ 1)",
        )
        require(
            guess >= truth,
            ex,
            f"at N = {guess}, {scheme} still holds {gigabytes(psi, guess, scheme):.1f} GB per "
            f"rank, not under 80: which of 2Ψ + 2Ψ + 12Ψ does {scheme} divide by N?",
        )
        if guess != truth:
            raise ExerciseError(
                ex,
                f"{scheme} at N = {guess} is under 80 GB, and so is a smaller N: the question "
                "asks for the smallest",
            )
    passed(ex, "ZeRO-1 needs 6 ranks, ZeRO-2 4, ZeRO-3 3 (13 B parameters, 2 + 2 + 12 bytes each)")


# --- 07a.2 ---------------------------------------------------------------------------------------

PAD_HINTS = {
    ("zero2", "params"): "our ZeRO keeps the full parameters as views of one flat buffer: count "
    "every element of that buffer, its padding included (section 2)",
    ("zero2", "grads"): "ZeRO-2 keeps only this rank's slice of the gradients; is Ψ odd or even, "
    "and what does that do to a slice?",
    ("zero2", "optimizer"): "Adam(W) keeps two fp32 states for each element of this rank's slice, "
    "padding included",
    ("zero3", "params"): "FSDP2 stores the same number of rows of each parameter on every rank, "
    "owned or not: what does torch.chunk give the head's rows on 2 ranks?",
    ("zero3", "grads"): "the gradient shards are stored like the parameter shards",
    ("zero3", "optimizer"): "Adam(W) state is made from the local shard without its padding: "
    "count only the rows this rank owns",
}
"""(scheme, part) → the hint when a predicted byte count of that part is wrong."""


def gap_words(value, measured: int) -> str:
    """Which way a predicted byte count misses the measured one (never by how much, which would
    give the answer away)."""
    if not isinstance(value, int):
        return f"{value!r} is not an int"
    return "too few bytes" if value < measured else "too many bytes"


def padded_bytes(predicted: dict) -> None:
    """07a.2: ``predicted[(scheme, rank)] = (params, grads, optimizer)`` bytes, ``width=12`` on 2
    ranks.

    Keys ``("zero2", 0)``, ``("zero3", 0)``, ``("zero3", 1)``. Launches the chapter's worker
    (parts "zero" and "fsdp") and compares every integer with the bytes the ranks measured.
    """
    ex, parts = "07a.2 padding", ("params", "grads", "optimizer")
    keys = (("zero2", 0), ("zero3", 0), ("zero3", 1))
    for key in keys:
        guess = answered(predicted.get(key), ex, f"predicted[{key!r}]")
        require(
            isinstance(guess, (tuple, list)) and len(guess) == 3,
            ex,
            f"predicted[{key!r}] = {guess!r}: give a tuple (params, grads, optimizer) in bytes",
        )
        for i, value in enumerate(guess):
            answered(value, ex, f"predicted[{key!r}][{i}]")
    cfg = worker.ShardConfig(width=12, parts=["zero", "fsdp"])
    values = run_ranks(ex, worker.worker, cfg, 2, name="ex07-padding").values
    for scheme, rank in keys:
        v = values[rank]
        held = (v["zero"]["memory"] | v["fsdp"]["memory"])[scheme]
        for part, value in zip(parts, predicted[(scheme, rank)]):
            require(
                isinstance(value, int) and value == held[part],
                ex,
                f"rank {rank}, {scheme} {part}: {gap_words(value, held[part])}: "
                f"{PAD_HINTS[scheme, part]}",
            )
    passed(
        ex,
        "width 12 on 2 ranks: ZeRO-2 1408/704/1408 B, FSDP2 728/728/1456 B on rank 0 and "
        "728/728/1352 B on rank 1, as measured",
    )
