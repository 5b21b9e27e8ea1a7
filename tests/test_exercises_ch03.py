"""The pieces of chapter 03's checkers that need no ranks: the patched collectives, the hint for
a sum instead of a mean, and Join's one-process reference (mgtutorial/exercises/ch03a.py, ch03b.py).
Both ways on the notebooks' solutions and starters: tests/test_exercises.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mgtutorial import ddp, env
from mgtutorial.exercises import ExerciseError
from mgtutorial.exercises.ch03a import compare_with_reference, patched
from mgtutorial.exercises.ch03b import JoinConfig, join_model, join_reference, uneven_batches


def test_patched_refuses_and_restores():
    original = dist.all_reduce
    with patched([], (), ("all_reduce",)):
        with pytest.raises(RuntimeError, match="dist.all_reduce is not allowed"):
            dist.all_reduce(torch.zeros(1))
    assert dist.all_reduce is original


def test_patched_records_before_calling_through():
    original, seen = dist.broadcast, []
    dist.broadcast = lambda tensor, *a, **k: "work"  # stands in for a process group
    try:
        with patched(seen, ("broadcast",)):
            assert dist.broadcast(torch.zeros(3, dtype=torch.float16), 0) == "work"
    finally:
        dist.broadcast = original
    assert seen == [["broadcast", "float16", 3, "work"]]


CFG = ddp.DDPConfig(dataset="synthetic", batch_size=8, max_steps=2, evaluate=False)


def _displaced(scale: float) -> dict:
    """The reference's parameters moved ``scale`` times as far from the initial ones."""
    init = ddp.build(CFG, env.DistContext(0, 0, 1, "none", torch.device("cpu"), False))[0].state_dict()
    ref = ddp.combined_batch_reference(CFG, 2).state_dict()
    return {k: init[k] + scale * (ref[k] - init[k]) for k in ref}


def test_compare_with_reference_passes_the_reference_and_names_a_sum():
    assert compare_with_reference("9.9 x", [_displaced(1.0)] * 2, CFG) < 1e-6
    with pytest.raises(ExerciseError, match="moved 2.0× as far .* divide by the world size"):
        compare_with_reference("9.9 x", [_displaced(2.0)] * 2, CFG)
    with pytest.raises(ExerciseError, match="rank 0's and rank 1's parameters differ"):
        compare_with_reference("9.9 x", [_displaced(1.0), _displaced(0.5)], CFG)


def test_join_reference_on_one_rank_is_plain_sgd():
    cfg = JoinConfig(path="unused")
    model = join_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    batches = uneven_batches(cfg, 0, 1)
    assert len(batches) == cfg.batches + cfg.extra  # one rank is the last rank
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    torch.testing.assert_close(join_reference(cfg, 1), model.state_dict())


def test_uneven_batches_give_the_last_rank_more():
    cfg = JoinConfig(path="unused")
    assert [len(uneven_batches(cfg, r, 2)) for r in range(2)] == [cfg.batches, cfg.batches + cfg.extra]
