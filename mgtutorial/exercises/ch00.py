"""Checkers of chapter 00's exercises (notebooks/00_setup.ipynb): the sum of ranks, the default
number of ranks, a worker of your own in a file, and which rank a failure names."""

from __future__ import annotations

from unittest import mock

from .. import env
from ._common import ExerciseError, RankFailed, answered, passed, require, run_file, run_ranks


def rank_sums(predicted: dict) -> None:
    """00.1: ``predicted[n]`` is the all-reduced sum every rank receives from ``env.hello`` on n ranks.

    Launches ``env.hello`` with 3 and 4 ranks (more ranks than cores is fine: they take turns).
    """
    ex = "00.1 rank sums"
    for n in (3, 4):
        guess = answered(predicted.get(n), ex, f"predicted[{n}]")
        got = {rec["rank_sum"] for rec in run_ranks(ex, env.hello, env.HelloConfig(), n, name="hello").values.values()}
        require(got == {guess}, ex, f"with {n} ranks every rank received {got.pop()}, not {guess}: "
                                    f"each rank contributes its own rank, 0 … {n - 1}")
    passed(ex, "3 ranks receive 3 and 4 ranks receive 6, on every rank")


def default_nprocs(predicted: dict) -> None:
    """00.2: ``predicted[g]`` is ``env.default_nprocs()`` on a machine with ``g`` GPUs (g = 0, 1, 2, 8)."""
    ex = "00.2 default ranks"
    for gpus in (0, 1, 2, 8):
        guess = answered(predicted.get(gpus), ex, f"predicted[{gpus}]")
        with mock.patch.object(env, "gpu_count", return_value=gpus):
            truth = env.default_nprocs()
        require(guess == truth, ex, f"with {gpus} GPU(s) the course starts {truth} ranks, not {guess}: "
                                    f"read env.default_nprocs (one rank per GPU needs at least 2 GPUs)")
    passed(ex, "0, 1, 2, 8 GPUs give 2, 2, 2, 8 ranks")


def max_rank(path: str = "ex00_worker.py") -> None:
    """00.3: ``my_hello(cfg)`` in ``path`` returns ``{"rank", "max_rank"}`` with an all-reduced MAX."""
    ex = "00.3 your own worker"
    values = run_file(ex, path, "my_hello", 2).values
    for rank, value in sorted(values.items()):
        require(isinstance(value, dict) and {"rank", "max_rank"} <= set(value), ex,
                f"rank {rank} returned {value!r}: return a dict with 'rank' and 'max_rank'")
        require(value["rank"] == rank, ex, f"rank {rank} reported rank {value['rank']}: use ctx.rank")
        require(value["max_rank"] == len(values) - 1, ex,
                f"rank {rank} reported max_rank {value['max_rank']}, but the largest rank is "
                f"{len(values) - 1}: all-reduce a tensor with op=dist.ReduceOp.MAX")
    passed(ex, "2 ranks ran my_hello from your file and both received max_rank 1")


def failing_rank(path: str = "ex00_fail.py", predicted_rank=...) -> None:
    """00.4: ``worker(cfg)`` in ``path`` raises ``ValueError`` on rank 1 only; predict the rank named."""
    ex = "00.4 a failing rank"
    guess = answered(predicted_rank, ex, "predicted_rank")
    try:
        run_file(ex, path, "worker", 2, timeout_s=30)
    except RankFailed as e:
        require(e.exc_type == "ValueError", ex, f"a rank failed, but not with ValueError: {e.hint}")
        named = e.rank
    else:
        raise ExerciseError(ex, "every rank finished: raise ValueError on rank 1 (if ctx.rank == 1: …)")
    require(named == 1, ex, f"rank {named} failed: only rank 1 should raise")
    require(guess == named, ex, f"the error names rank {named}, you predicted {guess}: launch names the "
                                "rank whose error came first, not the ranks stopped because of it")
    passed(ex, "rank 1 raised ValueError, launch named rank 1, and the other rank was stopped")
