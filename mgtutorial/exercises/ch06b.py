"""Checkers of chapter 06b's exercises (notebooks/06b_article_model_parallel.ipynb): bringing the
article's copies together, the bytes ``retain_graph=True`` keeps alive, stages whose parameters add
up to one model, and the world size a process group is told.

The rank-side checkers run the learner's file in ranks and read what the ranks logged or returned;
see :mod:`mgtutorial.exercises._common`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import model_parallel as MP
from .. import env, runlog
from ..models import ArticleMLP, count_parameters
from ..timeline import ActivationMeter
from ._common import ExerciseError, RankFailed, answered, attempt, close, function_from, passed, require, run_file, run_ranks


# --- 06b.1: the copies, brought together ---------------------------------------------------------

@dataclass(kw_only=True)
class SyncConfig:
    """Configuration of :func:`sync_worker`."""

    path: str
    """The learner's file, defining ``sync_gradients(model, ctx)``."""
    steps: int = 4
    """Optimizer steps (data, seed and learning rate as ``MP.ArticleConfig``'s)."""


def sync_worker(cfg: SyncConfig) -> dict:
    """``MP.article_worker`` with one line added: the learner's ``sync_gradients(model, ctx)``
    between ``backward()`` and the optimizer step. Logs the same ``article_start``/``article``
    records and saves ``rank<r>-model.pt``."""
    sync_gradients = function_from(cfg.path, "sync_gradients")
    art = MP.ArticleConfig(steps=cfg.steps)
    with env.distributed() as ctx, runlog.RunLog() as log:
        env.seed_everything(art.seed)
        model = ArticleMLP().to(ctx.device)
        opt = torch.optim.SGD(model.parameters(), lr=art.lr)
        log.write(kind="article_start", checksum=MP.checksum(model))
        for step, (x, y) in enumerate(MP.article_batches(art, ctx.rank), start=1):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device)).backward()
            sync_gradients(model, ctx)  # the line the article lacks
            opt.step()
            log.write(kind="article", step=step, checksum=MP.checksum(model))
        torch.save(model.state_dict(), runlog.run_dir() / f"rank{ctx.rank}-model.pt")
        return {"rank": ctx.rank}


def copies_together(path: str = "ex06b_sync.py", steps: int = 4) -> None:
    """06b.1: ``sync_gradients(model, ctx)`` in ``path`` runs in each rank of :func:`sync_worker`
    between ``backward()`` and the optimizer step.

    Verified from the records of 2 ranks: the checksums are equal at the start and after every step,
    and the final weights equal one model trained in this process on both ranks' batches at once
    (``torch.testing.assert_close``).
    """
    ex = "06b.1 copies together"
    function_from(path, "sync_gradients", ex)
    result = run_ranks(ex, sync_worker, SyncConfig(path=str(Path(path).resolve()), steps=steps), 2,
                       name="article-sync")
    records = runlog.read_run(result.run_dir)
    start = {r["rank"]: r["checksum"] for r in runlog.of_kind(records, "article_start")}
    require(start[0] == start[1], ex, "the copies start from different weights: keep the seed as it is")
    sums = {(r["rank"], r["step"]): r["checksum"] for r in runlog.of_kind(records, "article")}
    for step in range(1, steps + 1):
        a, b = sums[0, step], sums[1, step]
        require(close(a, b, rel=1e-9), ex,
                f"after step {step} the copies' checksums differ ({a:.6f} on rank 0, {b:.6f} on rank 1): "
                "each copy stepped with its own gradients; all-reduce every p.grad and divide by the world size")
    final = torch.load(result.run_dir / "rank0-model.pt", weights_only=True)
    try:
        torch.testing.assert_close(final, MP.combined_batch_reference(MP.ArticleConfig(steps=steps), 2),
                                   rtol=1e-4, atol=1e-6)
    except AssertionError:
        raise ExerciseError(ex, "the copies stay equal, but differ from one model trained on both ranks' "
                                "batches at once: did you divide the all-reduced gradients by ctx.world_size? "
                                "(a sum of 2 gradients is a step twice as large)") from None
    passed(ex, f"both copies start equal, stay equal for {steps} steps, and end equal to one model "
               "trained on both ranks' batches")


# --- 06b.2: what retain_graph=True keeps ---------------------------------------------------------

def alive_after_step(retain_graph: bool, batch_size: int) -> int:
    """Bytes of saved activations still alive after one step of the article's MLP (ActivationMeter)."""
    torch.manual_seed(0)
    model, x, y = ArticleMLP(), torch.randn(batch_size, 1024), torch.randint(0, 100, (batch_size,))
    meter = ActivationMeter(model)
    with meter.saving():
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward(retain_graph=retain_graph)
    return meter.live_bytes


def retained_bytes(predicted: dict) -> None:
    """06b.2: ``predicted[B]`` is the number of bytes (int) of saved activations alive after one step
    with ``retain_graph=True`` at batch size B (B = 1, 256); the checker measures each."""
    ex = "06b.2 retained bytes"
    for b in (1, 256):
        guess = answered(predicted.get(b), ex, f"predicted[{b}]")
        got = alive_after_step(True, b)
        require(guess == got, ex,
                f"at batch {b} the meter measures {got:,} bytes alive after the step, you predicted "
                f"{guess:,}: count B × (1024 + 512 + 256 + 100) float32 values (each layer's input and "
                "the log-softmax, 4 bytes each), B int64 targets (8 bytes) and the loss's 4-byte scalar"
                if isinstance(guess, int) else f"predicted[{b}] is {guess!r}: give a number of bytes (int)")
    require(alive_after_step(False, 256) == 0, ex, "a plain backward() left activations alive")
    passed(ex, "the bytes retain_graph=True keeps alive at batch 1 and 256 are as predicted "
               "(and 0 without it)")


# --- 06b.3: stages that add up to one model ------------------------------------------------------

def _best_largest(sizes: list[int], num_stages: int) -> int:
    """The smallest possible largest stage when consecutive blocks of ``sizes`` form ``num_stages`` stages."""
    best = None
    for cuts in itertools.combinations(range(1, len(sizes)), num_stages - 1):
        bounds = (0, *cuts, len(sizes))
        largest = max(sum(sizes[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
        best = largest if best is None else min(best, largest)
    return best


def stage_split(split_stages) -> None:
    """06b.3: ``split_stages(model, num_stages)`` returns ``num_stages`` modules (the stages) of an
    ``ArticleMLP``, applied in order.

    Verified for 1, 2, 3 stages: every parameter of the model in exactly one stage (the stages'
    counts add up to the model's), stage by stage the same output as the model, and the largest
    stage as small as a split into consecutive sub-networks allows.
    """
    ex = "06b.3 stages"
    for n in (1, 2, 3):
        model = ArticleMLP()
        stages = list(attempt(ex, split_stages, model, n))
        require(len(stages) == n, ex, f"split_stages(model, {n}) returned {len(stages)} stages, not {n}")
        counts = [count_parameters(s) for s in stages]
        whole = count_parameters(model)
        require(sum(counts) == whole, ex,
                f"your {n} stages hold {sum(counts):,} parameters together, the model {whole:,}"
                + (": every stage is the whole model (the article's flaw 2.1); give each stage its own "
                   "consecutive sub-networks (model.subnets[a:b])" if counts == [whole] * n else
                   ": every parameter belongs to exactly one stage"))
        owned = [id(p) for s in stages for p in s.parameters()]
        require(sorted(owned) == sorted(id(p) for p in model.parameters()), ex,
                "the stages hold new parameters: reuse the model's sub-networks, do not build new layers")
        x = torch.randn(3, model.sizes[0])
        h = x
        for s in stages:
            h = s(h)
        require(torch.equal(h, model(x)), ex, f"with {n} stages, the stages applied in order do not compute "
                                              "the model's output: keep the sub-networks in their order")
        sizes = [count_parameters(s) for s in model.subnets]
        best = _best_largest(sizes, n)
        require(max(counts) == best, ex,
                f"with {n} stages the largest holds {max(counts):,} parameters {counts}, but a split of "
                f"consecutive sub-networks can keep every stage at {best:,} or less: balance the "
                "parameters, not the number of sub-networks")
    passed(ex, "1, 2 and 3 stages hold every parameter once, compute the model's output, and the "
               "largest stage is as small as it can be")


# --- 06b.4: the world a process group is told ----------------------------------------------------

def world_size(path: str = "ex06b_world.py", nprocs: int = 3) -> None:
    """06b.4: ``join(cfg)`` in ``path`` joins a gloo group (3 s timeout) and returns
    ``{"rank", "world_size", "stage"}``; run on 3 processes (one per sub-network)."""
    ex = "06b.4 world size"
    try:
        values = run_file(ex, path, "join", nprocs, timeout_s=60).values
    except RankFailed as failed:
        if "timeout" not in failed.hint:
            raise
        raise ExerciseError(ex, f"the {nprocs} processes waited until the timeout for ranks that never came "
                                f"({failed.exc_type}): the world is the processes actually started, not "
                                "num_gpus × subnets (the article's flaw 2.2); read WORLD_SIZE "
                                "(env.world_size())") from None
    for rank, v in sorted(values.items()):
        require(isinstance(v, dict) and {"rank", "world_size", "stage"} <= set(v), ex,
                f"rank {rank} returned {v!r}: return a dict with 'rank', 'world_size' and 'stage'")
        require(v["world_size"] == nprocs and v["rank"] == rank, ex,
                f"the process started as rank {rank} joined as rank {v['rank']} of {v['world_size']}")
        require(v["stage"] == rank, ex, f"rank {rank} runs stage {v['stage']}: one stage per rank, stage = rank")
    passed(ex, f"{nprocs} processes joined a world of {nprocs}, ranks 0 … {nprocs - 1}, one stage each")
