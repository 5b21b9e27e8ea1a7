"""Chapter 07's checkers on wrong answers: each mistake gets its own hint (tests/test_exercises.py
covers the solutions and the untouched starters). Learner files are written to a temporary folder."""

from __future__ import annotations

import math
import textwrap

import pytest

from mgtutorial import sharding_memory as M
from mgtutorial.exercises import ch07
from mgtutorial.exercises._common import ExerciseError

HEADER = "import torch\nimport torch.distributed as dist\n\n\ndef zero1_step(flat, flat_grad, shard, opt, ctx):\n"
STEPS = {
    "sum": """grad = torch.empty_like(shard)
dist.reduce_scatter_tensor(grad, flat_grad)
shard.grad = grad
opt.step()
dist.all_gather_into_tensor(flat, shard.detach().clone())""",
    "no_gather": """grad = torch.empty_like(shard)
dist.reduce_scatter_tensor(grad, flat_grad)
shard.grad = grad / ctx.world_size
opt.step()""",
    "own_slice_all_reduced": """n = shard.numel()
g = flat_grad[ctx.rank * n:(ctx.rank + 1) * n].clone()
dist.all_reduce(g)
shard.grad = g / ctx.world_size
opt.step()
dist.all_gather_into_tensor(flat, shard.detach().clone())""",
    "all_reduce_then_slice": """dist.all_reduce(flat_grad)
n = shard.numel()
shard.grad = flat_grad[ctx.rank * n:(ctx.rank + 1) * n] / ctx.world_size
opt.step()
dist.all_gather_into_tensor(flat, shard.detach().clone())""",
}


def test_smallest_ranks_is_the_closed_form():
    psi, limit = 13e9, 8e10
    by_hand = {"zero1": (4 * psi, 12 * psi), "zero2": (2 * psi, 14 * psi), "zero3": (0, 16 * psi)}
    for scheme, (fixed, divided) in by_hand.items():
        expected = math.floor(divided / (limit - fixed)) + 1  # fixed + divided / N < limit
        assert ch07.smallest_ranks(13_000_000_000, scheme) == expected
    assert ch07.smallest_ranks(13_000_000_000, "ddp") is None
    assert M.memory_per_rank([(13_000_000_000,)], 6, "zero1", "mixed")["total"] < limit


@pytest.mark.parametrize("guess, hint", [
    ({"zero1": 5, "zero2": 4, "zero3": 3}, "at N = 5, zero1 still holds 83.2 GB"),
    ({"zero1": 6, "zero2": 5, "zero3": 3}, "zero2 is already under 80 GB at N = 4"),
    ({"zero1": 6, "zero2": 4, "zero3": 2.5}, "give a number of ranks"),
    ({"zero1": 6, "zero2": 4}, "`predicted['zero3']` is still `None`"),
])
def test_fits_in_80gb_hints(guess, hint):
    with pytest.raises(ExerciseError, match="^07.1 80 GB per rank: ") as err:
        ch07.fits_in_80gb(guess)
    assert hint in err.value.hint


def test_padded_bytes_refuses_a_malformed_answer_before_launching():
    with pytest.raises(ExerciseError, match=r"give a tuple \(params, grads, optimizer\)"):
        ch07.padded_bytes({("zero2", 0): 1408})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant, hint", [
    ("sum", "the SUM over ranks"),
    ("no_gather", "outside its slice"),
    ("own_slice_all_reduced", "differs from one process's gradient slice"),
    ("all_reduce_then_slice", None),
])
def test_zero1_step_variants(variant, hint, tmp_path, capsys, no_leftovers, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ex07_zero.py").write_text(HEADER + textwrap.indent(STEPS[variant], "    ") + "\n")
    if hint is None:  # a correct ZeRO-1 that pays 1.5× the bytes: passes, and says so
        ch07.zero1_step()
        assert "1 all-reduce + 1 all-gather per step (1.5×" in capsys.readouterr().out
        return
    with pytest.raises(ExerciseError, match="^07.3 ZeRO-1 by hand: ") as err:
        ch07.zero1_step()
    assert hint in err.value.hint


@pytest.mark.timeout(300)
def test_reshard_policy_without_the_root(tmp_path, no_leftovers, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ex07_fsdp.py").write_text(textwrap.dedent("""
        from torch.distributed.fsdp import fully_shard

        def shard_model(model, mesh):
            for block in model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=False)
    """))
    with pytest.raises(ExerciseError, match="head.weight is not sharded"):
        ch07.reshard_policy(predicted={b: (b + 1, b - 1, b + 1) for b in (1, 2, 3)})
