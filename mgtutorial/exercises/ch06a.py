"""Checkers of chapter 06a's exercises (notebooks/06a_article_ddp.ipynb): the batch sizes for which
the article's ``view(-1, 4608)`` succeeds, and three rank-side functions that each fix one flaw of
the article's DDP sample (the loader's shares and ``set_epoch``, ``rank = gpu``, the loss printed).

The rank-side checkers run the learner's file in ranks and read what the ranks logged
(``runlog``) or returned; see :mod:`mgtutorial.exercises._common`.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mgtutorial.common.models import cnn_flatten_size
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
from mgtutorial.runtime import env, runlog


def _a(value) -> str:
    """ "a list", "an int": the type of ``value`` with its article."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


IMAGE = (3, 64, 64)
"""06a.1's images: not the sample's 32×32, so that section 1.1's numbers are no answer."""


def view_batch_sizes(predicted) -> None:
    """06a.1: ``predicted`` maps every batch size B in 1…100 for which the sample's ``view(-1, 4608)``
    succeeds on the features of B images of 64×64 (``cnn_flatten_size((3, 64, 64))`` per image) to
    the number of rows (int) it gives; the checker tries each batch size on a real tensor."""
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
        f"({first} → {works[first]} rows, …, {last} → {works[last]} rows), each with the rows predicted",
    )


# --- 06a.2: each rank its own share, a new order every epoch --------------------------------------


def sampler_shares(path: str = "ex06a_loader.py", n_samples: int = 16) -> None:
    """06a.2: ``epoch_ids(cfg)`` in ``path`` logs, per epoch, ``kind="epoch_ids"`` records with the
    sample ids (``ids``: list of ints) this rank trains on. Run on 2 ranks; verified from the records:
    each epoch the ranks' shares are disjoint and cover the ``n_samples`` ids, and every rank's
    order in epoch 1 differs from epoch 0."""
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


@dataclass(kw_only=True)
class RankExerciseConfig:
    """Configuration of :func:`rank_worker`."""

    path: str
    """The learner's file, defining ``global_rank(node_rank, local_rank, gpus_per_node) -> int``."""
    gpus_per_node: int = 2
    """GPUs per simulated node: rank r plays local rank r % gpus_per_node of node r // gpus_per_node."""
    timeout_s: float = 3.0
    """How long the process group waits for ranks that never join."""


def rank_worker(cfg: RankExerciseConfig) -> dict:
    """Join the process group with the rank the learner's ``global_rank`` computes on a simulated node.

    Logs ``kind="rank_claim"`` (claimed_rank, node, local_rank) before joining; returns
    {"claimed_rank", "rank", "world_size"} once a barrier has passed.
    """
    node, local = divmod(env.rank(), cfg.gpus_per_node)
    rank = int(function_from(cfg.path, "global_rank")(node, local, cfg.gpus_per_node))
    runlog.RunLog().write(kind="rank_claim", claimed_rank=rank, node=node, local_rank=local)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=env.world_size(),
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
    )
    try:
        dist.barrier()
        return {"claimed_rank": rank, "rank": dist.get_rank(), "world_size": dist.get_world_size()}
    finally:
        dist.destroy_process_group()


def global_ranks(path: str = "ex06a_rank.py") -> None:
    """06a.3: ``global_rank(node_rank, local_rank, gpus_per_node)`` in ``path`` returns the global rank.

    Runs 4 ranks as 2 simulated nodes × 2 GPUs, each joining a gloo group with the rank it computes
    (3 s timeout); verified from the logged claims and the ranks' return values, then on the
    tables of 2 nodes × 1 and × 4 GPUs (in this process).
    """
    ex = "06a.3 global ranks"
    fn = function_from(
        path, "global_rank", ex
    )  # a missing file or a syntax error, before any rank starts
    with tempfile.TemporaryDirectory(prefix="ex06a-") as runs:
        try:
            values = run_ranks(
                ex,
                rank_worker,
                RankExerciseConfig(path=str(Path(path).resolve())),
                4,
                timeout_s=60,
                runs_dir=runs,
                name="global-rank",
            ).values
        except RankFailed as failed:
            claims = [
                (r["node"], r["local_rank"], r["claimed_rank"])
                for d in Path(runs).glob("global-rank-*")
                for r in runlog.of_kind(runlog.read_run(d), "rank_claim")
            ]
            require(
                sorted(c for _, _, c in claims) != list(range(4)),
                ex,
                "every rank claimed a correct rank (0 … 3, once each); the machine was too busy "
                f"to meet the {RankExerciseConfig.timeout_s:g} s timeout: run the checker again",
            )
            shown = ", ".join(f"node {n} GPU {g} → {c}" for n, g, c in sorted(claims))
            how = (
                f"waited until its {RankExerciseConfig.timeout_s:g} s timeout"
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
    for rank, v in sorted(values.items()):
        node, local = divmod(rank, RankExerciseConfig.gpus_per_node)
        require(
            v["claimed_rank"] == v["rank"] == rank,
            ex,
            f"the process launched as rank {rank} (node {node}, GPU {local}) claimed rank {v['claimed_rank']}: "
            "ranks count node by node: all of node 0's processes first, then node 1's",
        )
    reads_rank = (
        "compute it from the three arguments (a real worker reads RANK; this function is "
        "checked on tables too)"
    )
    saved = os.environ.get("RANK")
    os.environ["RANK"] = "97"  # a rank no table has: a function that reads RANK returns it
    try:
        for gpus in (1, 4):
            for node in (0, 1):
                for local in range(gpus):
                    try:
                        got = attempt(ex, fn, node, local, gpus)
                    except ExerciseError as e:
                        raise ExerciseError(
                            ex, f"{e.hint}; {reads_rank}" if "RANK" in e.hint else e.hint
                        ) from e
                    want = node * gpus + local
                    require(
                        str(got) != "97",
                        ex,
                        f"global_rank({node}, {local}, {gpus}) returned RANK: {reads_rank}",
                    )
                    require(
                        got == want,
                        ex,
                        f"global_rank({node}, {local}, {gpus}) returned {got}, not {want}: "
                        "use gpus_per_node rather than a fixed number",
                    )
    finally:
        if saved is None:
            os.environ.pop("RANK")
        else:
            os.environ["RANK"] = saved
    passed(
        ex,
        "4 processes on 2 simulated nodes × 2 GPUs joined as ranks 0, 1, 2, 3, and the 2 × 1 "
        "and 2 × 4 tables are right",
    )


# --- 06a.4: the epoch loss, over all ranks -------------------------------------------------------


@dataclass(kw_only=True)
class LossExerciseConfig:
    """Configuration of :func:`loss_worker`."""

    path: str
    """The learner's file, defining ``epoch_loss(losses, ctx) -> float``."""
    seed: int = 0
    """Seed of the model and of each rank's batches."""


def batch_losses(rank: int, seed: int = 0, batch_size: int = 4) -> list[float]:
    """Rank ``rank``'s batch losses for one epoch: ``4 + 2 * rank`` batches (unequal on purpose) of a
    fixed ``Linear(8, 3)``, the same numbers in a rank and in a single process."""
    torch.manual_seed(seed)
    model = nn.Linear(8, 3)
    g = torch.Generator().manual_seed(seed + 1 + rank)
    with torch.no_grad():
        return [
            nn.functional.cross_entropy(
                model(torch.randn(batch_size, 8, generator=g)),
                torch.randint(0, 3, (batch_size,), generator=g),
            ).item()
            for _ in range(4 + 2 * rank)
        ]


def loss_worker(cfg: LossExerciseConfig) -> dict:
    """Call the learner's ``epoch_loss(losses, ctx)`` on this rank's :func:`batch_losses`; log and
    return ``{"losses", "reported"}`` (``kind="epoch_loss"``)."""
    epoch_loss = function_from(cfg.path, "epoch_loss")
    with env.distributed() as ctx, runlog.RunLog() as log:
        losses = batch_losses(ctx.rank, cfg.seed)
        reported = float(epoch_loss(losses, ctx))
        return log.write(kind="epoch_loss", losses=losses, reported=reported)


def global_mean_loss(path: str = "ex06a_loss.py") -> None:
    """06a.4: ``epoch_loss(losses, ctx)`` in ``path`` turns this rank's list of batch losses (floats)
    into the epoch's loss over *all* ranks' batches (a float, the same on every rank).

    Run on 2 ranks with 4 and 6 batches; verified from the logged records against the mean of all
    10 losses computed in this process.
    """
    ex = "06a.4 global mean loss"
    function_from(path, "epoch_loss", ex)
    try:
        result = run_ranks(
            ex,
            loss_worker,
            LossExerciseConfig(path=str(Path(path).resolve())),
            2,
            name="epoch-loss",
        )
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
    own = {r: batch_losses(r) for r in (0, 1)}
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
        f"{len(own[0])} batches and rank 1 {len(own[1])}: the mean of all batches is {reference:.4f}; "
        "all-reduce the sum and the count, then divide",
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
