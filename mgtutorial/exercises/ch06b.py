"""Checkers of chapter 06b's exercises (notebooks/06b_article_model_parallel.ipynb): bringing the
article's copies together, the bytes ``retain_graph=True`` keeps alive, stages whose parameters add
up to one model, and the world size a process group is told.

The rank-side checkers (06b.1, 06b.3) run the learner's file in the workers of
:mod:`mgtutorial.exercises.ch06_ranks` and read what the ranks logged or returned.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from mgtutorial.article import model_parallel_flaws
from mgtutorial.common.models import ArticleMLP
from mgtutorial.exercises import ch06_ranks
from mgtutorial.exercises._common import (
    ExerciseError,
    RankFailed,
    answered,
    close,
    function_from,
    passed,
    require,
    run_ranks,
)
from mgtutorial.pipeline.activations import ActivationMeter
from mgtutorial.runtime import runlog

# --- 06b.1: the copies, brought together ---------------------------------------------------------


def copies_together(path: str = "ex06b_sync.py", steps: int = 4) -> None:
    """06b.1: ``sync_gradients(model, ctx)`` in ``path`` runs in each rank of
    :func:`~mgtutorial.exercises.ch06_ranks.sync_worker` between ``backward()`` and the optimizer
    step.

    Verified from the records of 2 ranks: the checksums are equal at the start and after every
    step, and the final weights equal one model trained in this process on both ranks' batches at
    once (``torch.testing.assert_close``).
    """
    ex = "06b.1 copies together"
    function_from(path, "sync_gradients", ex)
    cfg = ch06_ranks.SyncConfig(path=str(Path(path).resolve()), steps=steps)
    result = run_ranks(ex, ch06_ranks.sync_worker, cfg, 2, name="article-sync")
    records = runlog.read_run(result.run_dir)
    start = {r["rank"]: r["checksum"] for r in runlog.of_kind(records, "article_start")}
    require(
        start[0] == start[1], ex, "the copies start from different weights: keep the seed as it is"
    )
    sums = {(r["rank"], r["step"]): r["checksum"] for r in runlog.of_kind(records, "article")}
    for step in range(1, steps + 1):
        a, b = sums[0, step], sums[1, step]
        require(
            close(a, b, rel=1e-9),
            ex,
            f"after step {step} the copies' checksums differ ({a:.6f} on rank 0, {b:.6f} on "
            "rank 1): each copy stepped with its own gradients; all-reduce every p.grad and "
            "divide by the world size",
        )
    # on the CPU, whichever device the ranks trained on (NCCL saves CUDA tensors); the reference is
    # a CPU model, so the comparison has a tolerance
    final = torch.load(result.run_dir / "rank0-model.pt", map_location="cpu", weights_only=True)
    art = model_parallel_flaws.ArticleConfig(steps=steps)
    reference = model_parallel_flaws.combined_batch_reference
    if not _close_dicts(final, reference(art, 2)):
        if _close_dicts(final, reference(art, 1)):  # rank 0's batches alone
            raise ExerciseError(
                ex,
                "the copies stay equal, but they follow rank 0's gradients alone (a broadcast?): "
                "use the mean of both ranks' gradients, not one rank's (all-reduce, then "
                "divide by ctx.world_size)",
            )
        raise ExerciseError(
            ex,
            "the copies stay equal, but differ from one model trained on both ranks' "
            "batches at once: did you divide the all-reduced gradients by ctx.world_size? "
            "(a sum of 2 gradients is a step twice as large)",
        )
    passed(
        ex,
        f"both copies start equal, stay equal for {steps} steps, and end equal to one model "
        "trained on both ranks' batches",
    )


def _close_dicts(got: dict, want: dict) -> bool:
    """``torch.testing.assert_close`` (fp32 after a few steps, CPU or GPU) as a bool."""
    try:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        return True
    except AssertionError:
        return False


# --- 06b.2: what retain_graph=True keeps ---------------------------------------------------------

SIZES = (2048, 256, 10)
"""The layer sizes of 06b.2's MLP: not the article's, so that section 2.3's numbers are no
answer."""


def alive_after_step(retain_graph: bool, batch_size: int, sizes: tuple[int, ...] = SIZES) -> int:
    """Bytes of saved activations still alive after one step of ``ArticleMLP(sizes)``
    (:class:`~mgtutorial.pipeline.activations.ActivationMeter`)."""
    torch.manual_seed(0)
    model = ArticleMLP(sizes=sizes)
    x, y = torch.randn(batch_size, sizes[0]), torch.randint(0, sizes[-1], (batch_size,))
    meter = ActivationMeter(model)
    with meter.saving():
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward(retain_graph=retain_graph)
    return meter.live_bytes


def retained_bytes(predicted: dict) -> None:
    """06b.2: ``predicted[B]`` is the number of bytes (int) of saved activations alive after one
    step with ``retain_graph=True`` of ``ArticleMLP(sizes=(2048, 256, 10))`` at batch size B
    (B = 1, 256); the checker measures each."""
    ex = "06b.2 retained bytes"
    require(
        isinstance(predicted, dict),
        ex,
        f"`predicted` is a {type(predicted).__name__}, not a dict: make it a dict "
        "{1: bytes, 256: bytes}, batch size → number of bytes",
    )
    for b in (1, 256):
        guess = answered(predicted.get(b), ex, f"predicted[{b}]")
        whole = isinstance(guess, float) and guess.is_integer()
        require(
            isinstance(guess, int) and not isinstance(guess, bool),
            ex,
            f"predicted[{b}] is {guess!r} ({type(guess).__name__}): give a whole number of bytes "
            f"(an int{f', e.g. int({guess!r})' if whole else ''})",
        )
        got = alive_after_step(True, b)
        require(
            guess == got,
            ex,
            f"at batch {b} your {guess:,} bytes is not what the meter measures after the step "
            f"({'too many' if guess > got else 'too few'}): redo section 2.3's breakdown for "
            "this MLP's widths, tensor by tensor (what each layer saves, the loss's own tensors, "
            "their dtypes)",
        )
    require(alive_after_step(False, 256) == 0, ex, "a plain backward() left activations alive")
    passed(
        ex,
        f"the bytes retain_graph=True keeps alive in ArticleMLP(sizes={SIZES}) at batch 1 and 256 "
        "are as predicted (and 0 without it)",
    )


# --- 06b.3: the world a process group is told, on two nodes --------------------------------------


def world_size(path: str = "ex06b_world.py", nodes: int = 2, subnets: int = 3) -> None:
    """06b.3: ``join(part)`` in ``path`` returns ``{"world_size", "rank", "stage", "same_stage"}``
    for the process started for sub-network ``part`` (0 … subnets − 1) on its node; ``same_stage``
    lists the ranks whose gradients for that stage must be averaged (the two nodes are two
    pipeline replicas).

    Runs ``nodes × subnets`` processes (2 simulated nodes × 3, a 3 s timeout), each joining a gloo
    group with the world size and rank it returns
    (:func:`~mgtutorial.exercises.ch06_ranks.world_worker`); verified from the logged claims and
    the ranks' return values: the world is the 6 processes, each rank is the one the process was
    started as, each runs stage rank % subnets, and names every rank of that stage as its peers.
    """
    ex = "06b.3 world size"
    function_from(path, "join", ex)  # a missing file or a syntax error, before any rank starts
    nprocs = nodes * subnets
    cfg = ch06_ranks.WorldConfig(path=str(Path(path).resolve()), subnets=subnets)
    with tempfile.TemporaryDirectory(prefix="ex06b-") as runs:
        try:
            values = run_ranks(
                ex, ch06_ranks.world_worker, cfg, nprocs, timeout_s=60, runs_dir=runs, name="world"
            ).values
        except RankFailed as failed:
            claims = sorted(
                (r["node"], r["part"], r["world_size"], r["rank"])
                for r in ch06_ranks.logged(runs, "world", "world_claim")
            )
            if len(claims) < nprocs:  # join itself failed in a rank
                raise
            worlds = sorted({c[2] for c in claims})
            require(
                worlds == [nprocs],
                ex,
                f"the {nprocs} processes ({nodes} nodes × {subnets} sub-networks) told the group "
                f"a world of {', '.join(map(str, worlds))} and waited for ranks that never came: "
                "the world is the processes actually started, not num_gpus × subnets (the "
                "article's flaw 2.2); read WORLD_SIZE (env.world_size())",
            )
            require(
                sorted(r for *_, r in claims) != list(range(nprocs)),
                ex,
                f"every rank claimed a correct rank (0 … {nprocs - 1}, once each, in a world of "
                f"{nprocs}); the machine was too busy to meet the {cfg.timeout_s:g} s timeout: "
                "run the checker again",
            )
            shown = ", ".join(f"node {n} part {p} → {r}" for n, p, _, r in claims)
            why = (
                ": rank = part, the sub-network index, repeats node 0's ranks on node 1"
                if all(p == r for _, p, _, r in claims)
                else ""
            )
            raise ExerciseError(
                ex,
                f"the processes claimed ranks {shown}, and the group failed ({failed.exc_type}): "
                f"ranks must be 0 … {nprocs - 1}, once each{why}; read RANK (env.rank())",
            ) from None
    for rank, v in sorted(values.items()):
        node, part = divmod(rank, subnets)
        require(
            v["rank"] == rank,
            ex,
            f"the process started as rank {rank} (node {node}, part {part}) claimed "
            f"rank {v['rank']}: read RANK (env.rank()) rather than computing it",
        )
        require(
            v["stage"] == rank % subnets,
            ex,
            f"rank {rank} (node {node}) runs stage {v['stage']}, but there are only {subnets} "
            "sub-networks: node 1 runs the same three as node 0, so stage = rank % subnets, a "
            "separate number from the rank",
        )
        peers = [r for r in range(nprocs) if r % subnets == rank % subnets]
        require(
            sorted(v.get("same_stage") or []) == peers,
            ex,
            f"rank {rank} returned same_stage={v.get('same_stage')!r}: the two nodes run the same "
            "stages, so they are two pipelines of one model, and each stage's gradients must be "
            "averaged over every rank that runs that stage (all of them, itself included), or the "
            "replicas drift apart as in 2.1",
        )
    stages = ", ".join(str(v["stage"]) for _, v in sorted(values.items()))
    passed(
        ex,
        f"{nprocs} processes on {nodes} simulated nodes joined a world of {nprocs} as ranks 0 … "
        f"{nprocs - 1}, running stages {stages}, each naming the ranks whose gradients for its "
        "stage must be averaged",
    )
