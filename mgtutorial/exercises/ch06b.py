"""Checkers of chapter 06b's exercises (notebooks/06b_article_model_parallel.ipynb): what the
article's sample holds, sends and reduces, the bytes ``retain_graph=True`` keeps alive, and the
world size a process group is told.

The rank-side checker (06b.3) runs the learner's file in the workers of
:mod:`mgtutorial.exercises.ch06_ranks` and reads what the ranks logged or returned.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from mgtutorial.common.compare import c10d_counting_mode
from mgtutorial.common.models import ArticleMLP, count_parameters
from mgtutorial.exercises import ch06_ranks
from mgtutorial.exercises._common import (
    ExerciseError,
    RankFailed,
    answered,
    function_from,
    passed,
    require,
    run_ranks,
)
from mgtutorial.pipeline.activations import ActivationMeter
from mgtutorial.runtime import env

# --- 06b.1: the sample, reviewed ------------------------------------------------------------------

SIZES = (2048, 256, 10)
"""The layer sizes of 06b.1's and 06b.2's MLP: not the article's, so that sections 2.1 and 2.3's
numbers are no answer."""


def sample_measured(sizes: tuple[int, ...] = SIZES, steps: int = 3, batch_size: int = 8) -> dict:
    """The sample's loop (✗ 2.2 fixed) with ``ArticleMLP(sizes)``: one process per sub-network, each
    building the whole model from the same seed and training it on batches of its own for
    ``steps`` steps, its loop under :func:`~mgtutorial.common.compare.c10d_counting_mode`. The
    processes share nothing, so they run one after the other here. Returns ``parameters`` (all
    processes together), ``sent`` and ``collectives`` (c10d operations of one process's step:
    sends, every other op) and ``copies_equal`` (every process's weights equal after the
    steps)."""
    processes, states, counts = len(sizes) - 1, [], {}
    for part in range(processes):
        env.seed_everything(0)  # the same seed in every process
        model = ArticleMLP(sizes=sizes)  # ✗ 2.1 the whole model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1000 + part)  # each process's own batches
        for _ in range(steps):
            x = torch.randn(batch_size, sizes[0], generator=g)
            y = torch.randint(0, sizes[-1], (batch_size,), generator=g)
            with c10d_counting_mode() as mode:
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            counts = mode.counts
        states.append((count_parameters(model), model.state_dict()))
    sends = sum(n for op, n in counts.items() if "send" in op)
    return {
        "parameters": sum(n for n, _ in states),
        "sent": sends,
        "collectives": sum(n for op, n in counts.items() if "send" not in op and "recv" not in op),
        "copies_equal": all(
            all(torch.equal(s[k], states[0][1][k]) for k in s) for _, s in states[1:]
        ),
    }


def sample_reviewed(predicted: dict) -> None:
    """06b.1: what the sample's loop does (✗ 2.2 fixed) with ``ArticleMLP(sizes=(2048, 256, 10))``
    (two sub-networks, so two processes), for 3 steps: ``predicted["parameters"]``, the
    parameters both processes hold together (int); ``predicted["sent"]`` and
    ``predicted["collectives"]``, the tensors one process sends to the other and the collectives
    it calls in one step (ints); ``predicted["copies_equal"]``, whether the two processes' weights
    are still equal after the 3 steps (bool). The checker measures each
    (:func:`sample_measured`)."""
    ex = "06b.1 the sample, reviewed"
    require(
        isinstance(predicted, dict),
        ex,
        f"`predicted` is a {type(predicted).__name__}, not a dict: make it a dict with the keys "
        "'parameters', 'sent', 'collectives' and 'copies_equal'",
    )
    guess = {k: answered(predicted.get(k), ex, f"predicted[{k!r}]") for k in _KINDS}
    for k, kind in _KINDS.items():
        require(
            isinstance(guess[k], kind) and (kind is bool or not isinstance(guess[k], bool)),
            ex,
            f"predicted[{k!r}] is {guess[k]!r}: give "
            + ("True or False" if kind is bool else "a whole number (an int)"),
        )
    got = sample_measured()
    one = count_parameters(ArticleMLP(sizes=SIZES))
    own = {count_parameters(sub) for sub in ArticleMLP(sizes=SIZES).subnets}
    if guess["parameters"] != got["parameters"]:
        why = {
            one: "that is one model's parameters, as if the processes shared one model",
            **{
                n: "that is one sub-network's parameters, what a split would give a process"
                for n in own
            },
        }.get(guess["parameters"], "it is not what the processes hold")
        raise ExerciseError(
            ex,
            f"predicted['parameters']: {why}. Read ✗ 2.1's line: what does each process build? "
            "Count that (count_parameters) for every process the sample starts",
        )
    require(
        guess["sent"] == got["sent"],
        ex,
        "predicted['sent']: an activation forward and a gradient back is what a split MLP sends "
        "(section 2.4's positive control); find the line of the sample's loop that would send a "
        "tensor to the other process",
    )
    require(
        guess["collectives"] == got["collectives"],
        ex,
        "predicted['collectives']: an all-reduce per parameter after backward() is what DDP adds "
        "(chapter 02); which line of the sample's loop calls a collective?",
    )
    require(
        guess["copies_equal"] == got["copies_equal"],
        ex,
        "predicted['copies_equal']: both processes start from the same seed; then what does each "
        "train on, and what would make their steps equal? (✗ 2.1; compare with section 2.4)",
    )
    passed(
        ex,
        f"the parameters the sample's processes hold, what one step sends and reduces, and "
        f"whether its copies agree after 3 steps are as predicted for ArticleMLP(sizes={SIZES})",
    )


_KINDS = {"parameters": int, "sent": int, "collectives": int, "copies_equal": bool}


# --- 06b.2: what retain_graph=True keeps ---------------------------------------------------------


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
            "sub-networks: node 1 runs the same three as node 0; which stage does its first rank "
            "run? The stage is a separate number from the rank",
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
