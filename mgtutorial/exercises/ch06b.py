"""Checkers of chapter 06b's exercises (notebooks/06b_article_model_parallel.ipynb): the bytes
``retain_graph=True`` keeps alive for an MLP with Tanh or GELU, and the world size a process
group is told.

The rank-side checker (06b.2) runs the learner's file in the workers of
:mod:`mgtutorial.exercises.ch06_ranks` and reads what the ranks logged or returned.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from mgtutorial.exercises import ch06_ranks
from mgtutorial.exercises._common import (
    ExerciseError,
    RankFailed,
    answered,
    attempt,
    function_from,
    passed,
    require,
    run_ranks,
)
from mgtutorial.pipeline.activations import ActivationMeter

# --- 06b.1: what retain_graph=True keeps, for an MLP with another activation ---------------------

CASES = (
    ((2048, 256, 10), 1, torch.float32, nn.Tanh),
    ((2048, 256, 10), 256, torch.float32, nn.Tanh),
    ((2048, 256, 10), 4, torch.float32, nn.GELU),
    ((64, 32, 16, 8), 5, torch.float32, nn.GELU),
    ((64, 32, 16, 8), 3, torch.float64, nn.GELU),
    ((100, 10), 7, torch.bfloat16, nn.GELU),
)
"""06b.1's configurations (sizes, batch size, dtype, activation between sub-networks), checked in
this order: Tanh instead of the course's ReLU of section 2.3, a larger batch, GELU, deeper, other
dtypes."""

_CASE_HINTS = (
    "redo section 2.3's breakdown for these widths, tensor by tensor: to compute its gradient, "
    "does Tanh need its input or its output, and is that a tensor already counted?",
    "batch 1 passed: what grows with the batch, and by how much per sample?",
    "GELU: which tensor does its backward need, its input or its output (PyTorch's "
    "derivatives.yaml), and is that the tensor the next Linear keeps?",
    "a deeper MLP: what does each further sub-network add?",
    "another dtype: which tensors take the model's dtype, and which keep their own?",
    "bfloat16, and an MLP of one sub-network: no activation at all",
)


def mlp(sizes=(2048, 256, 10), activation=nn.ReLU) -> nn.Sequential:
    """``nn.Linear`` sub-networks ``sizes[0] → sizes[1] → …``, ``activation()`` between them (not
    after the last); with ``nn.ReLU`` it saves what ``ArticleMLP`` (chapter 06b, 2.3) saves."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [nn.Linear(a, b)] + ([activation()] if i < len(sizes) - 2 else [])
    return nn.Sequential(*layers)


def alive_after_step(
    retain_graph: bool,
    batch_size: int,
    sizes=(2048, 256, 10),
    dtype=torch.float32,
    activation=nn.ReLU,
) -> int:
    """Bytes of saved activations still alive after one step of ``mlp(sizes, activation)`` in
    ``dtype`` (:class:`~mgtutorial.pipeline.activations.ActivationMeter`)."""
    torch.manual_seed(0)
    model = mlp(sizes, activation).to(dtype)
    x = torch.randn(batch_size, sizes[0], dtype=dtype)
    y = torch.randint(0, sizes[-1], (batch_size,))
    meter = ActivationMeter(model)
    with meter.saving():
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward(retain_graph=retain_graph)
    return meter.live_bytes


def retained_bytes(fn) -> None:
    """06b.1: ``fn(sizes, batch_size, dtype, activation)`` returns the bytes (int) of saved
    activations alive after one step with ``retain_graph=True`` of ``mlp(sizes, activation)`` in
    ``dtype`` (input in ``dtype``, int64 targets, cross-entropy loss; ``activation`` is
    ``nn.Tanh`` or ``nn.GELU``); the checker measures each of :data:`CASES`."""
    ex = "06b.1 retained bytes"
    for (sizes, b, dtype, act), advice in zip(CASES, _CASE_HINTS):
        guess = answered(attempt(ex, fn, sizes, b, dtype, act), ex, "the return value")
        what = (
            f"sizes={sizes} with {act.__name__} in {str(dtype).removeprefix('torch.')} at batch {b}"
        )
        whole = isinstance(guess, float) and guess.is_integer()
        require(
            isinstance(guess, int) and not isinstance(guess, bool),
            ex,
            f"for {what} you return {guess!r} ({type(guess).__name__}): return a whole number of "
            f"bytes (an int{f', e.g. int({guess!r})' if whole else ''})",
        )
        got = alive_after_step(True, b, sizes, dtype, act)
        require(
            guess == got,
            ex,
            f"for {what} your {guess:,} bytes is {'too many' if guess > got else 'too few'} "
            f"for what the meter measures after the step: {advice}",
        )
    require(alive_after_step(False, 256) == 0, ex, "a plain backward() left activations alive")
    passed(
        ex,
        f"your function gives the bytes retain_graph=True keeps alive for {len(CASES)} MLPs "
        "(Tanh and GELU, batch sizes, depths, dtypes), as measured (and a plain backward() "
        "keeps 0)",
    )


# --- 06b.2: the world a process group is told, on two nodes --------------------------------------


def world_size(path: str = "ex06b_world.py", nodes: int = 2, subnets: int = 3) -> None:
    """06b.2: ``join(part)`` in ``path`` returns ``{"world_size", "rank", "stage", "same_stage"}``
    for the process started for sub-network ``part`` (0 … subnets − 1) on its node; ``same_stage``
    lists the ranks whose gradients for that stage must be averaged (the two nodes are two
    pipeline replicas).

    Runs ``nodes × subnets`` processes (2 simulated nodes × 3, a 3 s timeout), each joining a gloo
    group with the world size and rank it returns
    (:func:`~mgtutorial.exercises.ch06_ranks.world_worker`); verified from the logged claims and
    the ranks' return values: the world is the 6 processes, each rank is the one the process was
    started as, each runs stage rank % subnets, and names every rank of that stage as its peers.
    """
    ex = "06b.2 world size"
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
                "how many processes were started, on all nodes together, and what does the "
                "launcher tell each process about them (chapter 05a)?",
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
                ": the sub-network index repeats on every node"
                if all(p == r for _, p, _, r in claims)
                else ""
            )
            raise ExerciseError(
                ex,
                f"the processes claimed ranks {shown}, and the group failed ({failed.exc_type}): "
                f"a group needs ranks 0 … {nprocs - 1}, once each{why}; which number, unique "
                "across nodes, does the launcher give each process (chapter 05a)?",
            ) from None
    for rank, v in sorted(values.items()):
        node, part = divmod(rank, subnets)
        require(
            v["rank"] == rank,
            ex,
            f"the process started as rank {rank} (node {node}, part {part}) claimed "
            f"rank {v['rank']}: does your computation know how the launcher numbered the "
            "processes, or can it ask (chapter 05a)?",
        )
        require(
            v["stage"] == rank % subnets,
            ex,
            f"rank {rank} (node {node}) runs stage {v['stage']}, and there are {subnets} "
            "sub-networks, each run once on every node: which stage does each of node 1's "
            "ranks run, and how does that follow from its rank?",
        )
        peers = [r for r in range(nprocs) if r % subnets == rank % subnets]
        require(
            sorted(v.get("same_stage") or []) == peers,
            ex,
            f"rank {rank} returned same_stage={v.get('same_stage')!r}: which processes hold a "
            "copy of the parameters this rank trains, and must agree with it on their gradients "
            "at every step so that the copies do not drift apart as in 2.1?",
        )
    stages = ", ".join(str(v["stage"]) for _, v in sorted(values.items()))
    passed(
        ex,
        f"{nprocs} processes on {nodes} simulated nodes joined a world of {nprocs} as ranks 0 … "
        f"{nprocs - 1}, running stages {stages}, each naming the ranks whose gradients for its "
        "stage must be averaged",
    )
