"""Checkers of chapter 06a's exercises (notebooks/06a_article_ddp.ipynb): the batch sizes for which
the article's ``view(-1, 4608)`` succeeds, and three rank-side functions that each fix one flaw of
the article's DDP sample (the loader's shares and ``set_epoch``, ``rank = gpu``, the loss printed).

The rank-side checkers run the learner's file in ranks (06a.2 with
:func:`~mgtutorial.exercises._common.run_file`, 06a.3 and 06a.4 in the workers of
:mod:`mgtutorial.exercises.ch06_ranks`) and read what the ranks logged (``runlog``) or returned.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from unittest import mock

import torch

from mgtutorial.article import ddp_flaws
from mgtutorial.common.models import cnn_flatten_size
from mgtutorial.exercises import ch06_ranks
from mgtutorial.exercises._common import (
    ExerciseError,
    RankFailed,
    answered,
    attempt,
    close,
    function_from,
    passed,
    require,
    run_file,
    run_ranks,
)
from mgtutorial.runtime import runlog


def _a(value) -> str:
    """ "a list", "an int": the type of ``value`` with its article."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


IMAGE = (3, 64, 64)
"""06a.1's images: not the sample's 32×32, so that section 1.1's numbers are no answer."""


def view_batch_sizes(predicted) -> None:
    """06a.1: ``predicted`` maps every batch size B in 1…100 for which the sample's
    ``view(-1, 4608)`` succeeds on the features of B images of 64×64
    (``cnn_flatten_size((3, 64, 64))`` per image) to the number of rows (int) it gives; the checker
    tries each batch size on a real tensor."""
    ex = "06a.1 batch sizes"
    predicted = answered(predicted, ex, "predicted")
    require(
        isinstance(predicted, dict),
        ex,
        f"`predicted` is {_a(predicted)}: make it a dict {{B: rows}} with one entry per batch "
        "size that reshapes, e.g. {B: ... for B in range(1, 101) if ...}",
    )
    per_image = cnn_flatten_size(IMAGE)
    works = {}
    for b in range(1, 101):
        try:
            works[b] = torch.empty(b, per_image).view(-1, 4608).shape[0]
        except RuntimeError:
            pass
    for b in works:
        require(
            b in predicted,
            ex,
            f"a batch of {b} reshapes without an error, but it is not in your dict: "
            f"view(-1, 4608) only needs B × {per_image} elements to be a multiple of 4608 "
            f"({per_image} features per 64×64 image: cnn_flatten_size((3, 64, 64)))",
        )
    for b in sorted(predicted, key=str):
        require(
            b in works,
            ex,
            f"predicted has a batch of {b!r}, which fails: keep only the B in 1…100 for which "
            f"B × {per_image} % 4608 == 0",
        )
    for b, rows in sorted(works.items()):
        require(
            predicted[b] == rows,
            ex,
            f"a batch of {b} gives {rows} rows, you predicted {predicted[b]!r}: "
            f"rows = B × {per_image} / 4608 (all the elements, 4608 per row)",
        )
    first, last = min(works), max(works)
    passed(
        ex,
        f"view(-1, 4608) succeeds on 64×64 images for exactly {len(works)} batch sizes of 1…100 "
        f"({first} → {works[first]} rows, …, {last} → {works[last]} rows), each with the rows "
        "predicted",
    )


# --- 06a.2: each rank its own share, a new order every epoch --------------------------------------


def sampler_shares(path: str = "ex06a_loader.py", n_samples: int = 16) -> None:
    """06a.2: ``epoch_ids(cfg)`` in ``path`` logs, per epoch, ``kind="epoch_ids"`` records with the
    sample ids (``ids``: list of ints) this rank trains on. Run on 2 ranks; verified from the
    records: each epoch the ranks' shares are disjoint and cover the ``n_samples`` ids, and every
    rank's order in epoch 1 differs from epoch 0."""
    ex = "06a.2 sampler shares"
    result = run_file(ex, path, "epoch_ids", 2, options={"n_samples": n_samples})
    ids = {
        (r["rank"], r["epoch"]): r["ids"]
        for r in runlog.of_kind(runlog.read_run(result.run_dir), "epoch_ids")
    }
    for key in ((0, 0), (1, 0), (0, 1), (1, 1)):
        require(
            key in ids,
            ex,
            f"rank {key[0]} logged no epoch_ids record for epoch {key[1]}: keep the "
            "log.write line inside the epoch loop",
        )
    for epoch in (0, 1):
        a, b = ids[0, epoch], ids[1, epoch]
        require(
            a != b,
            ex,
            f"rank 0 and rank 1 drew the same ids in epoch {epoch} ({a[:4]} …): every rank "
            "shuffles the whole data set; give the loader a DistributedSampler "
            "(train_loader(dataset, batch_size, ctx.rank, ctx.world_size))",
        )
        both = sorted(set(a) & set(b))
        require(
            not both,
            ex,
            f"ranks 0 and 1 both train on samples {both} in epoch {epoch}: did you pass "
            "rank and world size to the sampler?",
        )
        missing = sorted(set(range(n_samples)) - set(a) - set(b))
        require(
            not missing,
            ex,
            f"no rank trains on samples {missing} in epoch {epoch}: the shares must "
            f"cover all {n_samples} samples",
        )
    for rank in (0, 1):
        require(
            ids[rank, 0] != ids[rank, 1],
            ex,
            f"rank {rank}'s epoch 1 repeats epoch 0's order {ids[rank, 0][:4]} …: call "
            "loader.sampler.set_epoch(epoch) at the start of every epoch",
        )
    passed(
        ex,
        f"each epoch the 2 ranks' shares are disjoint and cover all {n_samples} samples, and "
        "each rank's order changes from epoch 0 to epoch 1",
    )


# --- 06a.3: the global rank on two nodes --------------------------------------------------------


def global_ranks(path: str = "ex06a_rank.py") -> None:
    """06a.3: ``global_rank(node_rank, local_rank, gpus_per_node)`` in ``path`` returns the global
    rank.

    Runs 4 ranks as 2 simulated nodes × 2 GPUs, each joining a gloo group with the rank it computes
    (3 s timeout, :func:`~mgtutorial.exercises.ch06_ranks.rank_worker`); verified from the logged
    claims and the ranks' return values, then on the tables of 2 nodes × 1 and × 4 GPUs (in this
    process).
    """
    ex = "06a.3 global ranks"
    # a missing file or a syntax error, before any rank starts
    fn = function_from(path, "global_rank", ex)
    cfg = ch06_ranks.RankExerciseConfig(path=str(Path(path).resolve()))
    with tempfile.TemporaryDirectory(prefix="ex06a-") as runs:
        try:
            launched = run_ranks(
                ex, ch06_ranks.rank_worker, cfg, 4, timeout_s=60, runs_dir=runs, name="global-rank"
            )
        except RankFailed as failed:
            claims = [
                (r["node"], r["local_rank"], r["claimed_rank"])
                for r in ch06_ranks.logged(runs, "global-rank", "rank_claim")
            ]
            require(
                sorted(c for _, _, c in claims) != list(range(4)),
                ex,
                "every rank claimed a correct rank (0 … 3, once each); the machine was too busy "
                f"to meet the {cfg.timeout_s:g} s timeout: run the checker again",
            )
            shown = ", ".join(f"node {n} GPU {g} → {c}" for n, g, c in sorted(claims))
            how = (
                f"waited until its {cfg.timeout_s:g} s timeout"
                if "timeout" in failed.hint
                else f"failed with {failed.exc_type}"
            )
            raise ExerciseError(
                ex,
                f"on 2 nodes × 2 GPUs the processes claimed {shown}, and the group "
                f"{how}: ranks must be 0 … 3, once each. A rank "
                "counts the processes of all nodes, not the GPUs of its own node "
                "(the article's rank = gpu)",
            ) from None
    for rank, v in sorted(launched.values.items()):
        node, local = divmod(rank, cfg.gpus_per_node)
        require(
            v["claimed_rank"] == v["rank"] == rank,
            ex,
            f"the process launched as rank {rank} (node {node}, GPU {local}) claimed rank "
            f"{v['claimed_rank']}: ranks count node by node: all of node 0's processes first, "
            "then node 1's",
        )
    reads_rank = (
        "compute it from the three arguments (a real worker reads RANK; this function is "
        "checked on tables too)"
    )
    tables = [(node, local, gpus) for gpus in (1, 4) for node in (0, 1) for local in range(gpus)]
    # a rank no table has: a function that reads RANK returns it
    with mock.patch.dict(os.environ, RANK="97"):
        for node, local, gpus in tables:
            try:
                got = attempt(ex, fn, node, local, gpus)
            except ExerciseError as e:
                hint = f"{e.hint}; {reads_rank}" if "RANK" in e.hint else e.hint
                raise ExerciseError(ex, hint) from e
            call = f"global_rank({node}, {local}, {gpus})"
            require(str(got) != "97", ex, f"{call} returned RANK: {reads_rank}")
            require(
                got == node * gpus + local,
                ex,
                f"{call} returned {got}, not {node * gpus + local}: use gpus_per_node rather "
                "than a fixed number",
            )
    passed(
        ex,
        "4 processes on 2 simulated nodes × 2 GPUs joined as ranks 0, 1, 2, 3, and the 2 × 1 "
        "and 2 × 4 tables are right",
    )


# --- 06a.4: the epoch loss, over all ranks -------------------------------------------------------


def global_mean_loss(path: str = "ex06a_loss.py") -> None:
    """06a.4: ``epoch_loss(losses, ctx)`` in ``path`` turns this rank's list of batch losses
    (floats) into the epoch's loss over *all* ranks' batches (a float, the same on every rank).

    Run on 2 ranks with 4 and 6 batches (:func:`~mgtutorial.exercises.ch06_ranks.loss_worker`);
    verified from the logged records against the mean of all 10 losses computed in this process.
    """
    ex = "06a.4 global mean loss"
    function_from(path, "epoch_loss", ex)
    cfg = ch06_ranks.LossExerciseConfig(path=str(Path(path).resolve()))
    try:
        result = run_ranks(ex, ch06_ranks.loss_worker, cfg, 2, name="epoch-loss")
    except RankFailed as failed:
        if "device type cpu" in failed.hint.lower():  # NCCL (backend "auto" with a GPU per rank)
            raise ExerciseError(
                ex,
                f"{failed.hint}: NCCL all-reduces CUDA tensors only; create the tensor "
                "on ctx.device (torch.tensor(..., device=ctx.device))",
            ) from None
        raise
    got = {
        r["rank"]: r["reported"]
        for r in runlog.of_kind(runlog.read_run(result.run_dir), "epoch_loss")
    }
    own = {r: ddp_flaws.batch_losses(r) for r in (0, 1)}
    reference = sum(own[0] + own[1]) / len(own[0] + own[1])  # one process, every batch
    if not close(got[0], got[1], rel=1e-6):
        which = (
            " (each rank's own sum, as the article prints)"
            if all(close(got[r], sum(own[r])) for r in (0, 1))
            else ""
        )
        raise ExerciseError(
            ex,
            f"rank 0 reports {got[0]:.4f} and rank 1 {got[1]:.4f}{which}: each rank sees "
            "only its own batches; all-reduce the sum and the count of the losses",
        )
    means = (sum(own[0]) / len(own[0]) + sum(own[1]) / len(own[1])) / 2
    require(
        not close(got[0], means, rel=1e-5),
        ex,
        f"both ranks report {got[0]:.4f}, the mean of the two ranks' means, but rank 0 has "
        f"{len(own[0])} batches and rank 1 {len(own[1])}: the mean of all batches is "
        f"{reference:.4f}; all-reduce the sum and the count, then divide",
    )
    require(
        close(got[0], reference, rel=1e-5),
        ex,
        f"both ranks report {got[0]:.4f}, but the mean of all {len(own[0] + own[1])} batch losses "
        f"(one process) is {reference:.4f}: divide the all-reduced sum by the all-reduced count",
    )
    passed(
        ex,
        f"both ranks report the mean of all {len(own[0] + own[1])} batch losses ({len(own[0])} on "
        f"rank 0, {len(own[1])} on rank 1), equal to the one-process reference",
    )
