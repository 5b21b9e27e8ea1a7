"""Chapter 07's checkers on wrong answers: each mistake gets its own hint (tests/test_exercises.py
covers the solutions and the untouched starters). Learner files are written to a temporary
folder."""

from __future__ import annotations

import math
import textwrap
from types import SimpleNamespace

import pytest

from mgtutorial.exercises import ch07
from mgtutorial.exercises._common import ExerciseError
from mgtutorial.sharding import memory

HEADER = (
    "import torch\nimport torch.distributed as dist\n\n\n"
    "def zero1_clip_step(flat, flat_grad, shard, opt, ctx, max_norm):\n"
)
RS = """grad = torch.empty_like(shard)
dist.reduce_scatter_single(grad, flat_grad)
"""
AR = """dist.all_reduce(flat_grad)
n = shard.numel()
grad = flat_grad[ctx.rank * n:(ctx.rank + 1) * n].clone()
"""
CLIP = """sq = grad.pow(2).sum()
dist.all_reduce(sq)
grad = grad * (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1)
"""
LOCAL = """dist.all_reduce(torch.zeros(1))  # the right number of collectives, the wrong norm
grad = grad * (max_norm / (grad.norm() + 1e-6)).clamp(max=1)
"""
DIV = "grad = grad / ctx.world_size\n"
STEP = """shard.grad = grad
opt.step()
dist.all_gather_single(flat, shard.detach().clone())
"""
FULL_NORM = """g = flat_grad.clone()  # the norm from an all-reduce of the whole gradient
dist.all_reduce(g)
grad = grad * (max_norm / ((g / ctx.world_size).norm() + 1e-6)).clamp(max=1)
"""
STEPS = {
    "unclipped": RS + DIV + STEP,
    "local_norm": RS + DIV + LOCAL + STEP,
    "clip_before_divide": RS + CLIP + DIV + STEP,
    "no_divide": RS + CLIP + STEP,
    "no_gather": RS + DIV + CLIP + STEP.replace("dist.all_gather_single", "pass  #"),
    "all_reduce_then_slice": AR + DIV + CLIP + STEP,
    "full_gradient_norm": RS + DIV + FULL_NORM + STEP,
    "full_gradient_norm_imported": "from torch.distributed import all_reduce\n"
    + RS
    + DIV
    + FULL_NORM.replace("dist.all_reduce", "all_reduce")
    + STEP,
}


def test_smallest_ranks_is_the_closed_form():
    psi, limit = 13e9, 8e10
    by_hand = {"zero1": (4 * psi, 12 * psi), "zero2": (2 * psi, 14 * psi), "zero3": (0, 16 * psi)}
    for scheme, (fixed, divided) in by_hand.items():
        expected = math.floor(divided / (limit - fixed)) + 1  # fixed + divided / N < limit
        assert ch07.smallest_ranks(13_000_000_000, scheme) == expected
    assert ch07.smallest_ranks(13_000_000_000, "ddp") is None
    assert memory.memory_per_rank([(13_000_000_000,)], 6, "zero1", "mixed")["total"] < limit


@pytest.mark.parametrize(
    "guess, hint",
    [
        ({"zero1": 5, "zero2": 4, "zero3": 3}, "at N = 5, zero1 still holds 83.2 GB"),
        ({"zero1": 6, "zero2": 5, "zero3": 3}, "zero2 at N = 5 is under 80 GB, and so is"),
        ({"zero1": 6, "zero2": 4, "zero3": 2.5}, "give a number of ranks"),
        ({"zero1": 6, "zero2": 4}, "`predicted['zero3']` is still `None`"),
    ],
)
def test_fits_in_80gb_hints(guess, hint):
    with pytest.raises(ExerciseError, match="^07a.1 80 GB per rank: ") as err:
        ch07.fits_in_80gb(guess)
    assert hint in err.value.hint


def test_padded_bytes_refuses_a_malformed_answer_before_launching():
    with pytest.raises(ExerciseError, match=r"give a tuple \(params, grads, optimizer\)"):
        ch07.padded_bytes({("zero2", 0): 1408})


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "variant, hint",
    [
        ("unclipped", "step 0: shard.grad is the averaged slice, not clipped"),
        ("local_norm", "step 0: rank 0 clipped by its own slice's norm"),
        ("clip_before_divide", "clipped by the norm of the SUM over ranks, then ÷ N"),
        ("no_divide", "step 3: shard.grad is the clipped SUM over ranks"),
        ("no_gather", "outside its slice"),
        ("all_reduce_then_slice", "all-reduced the whole gradient in step 0"),
        ("full_gradient_norm", "moved [254] elements"),  # N·S of the flat gradient
        ("full_gradient_norm_imported", "moved [254] elements"),  # seen whatever the import
    ],
)
def test_zero1_clipped_variants(variant, hint, tmp_path, capsys, no_leftovers, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ex07_zero.py").write_text(HEADER + textwrap.indent(STEPS[variant], "    "))
    with pytest.raises(ExerciseError, match="^07a.3 ZeRO-1 with clipping: ") as err:
        ch07.zero1_clipped()
    assert hint in err.value.hint


def test_padded_bytes_names_the_gap_not_the_measured_value(monkeypatch):
    measured = {"params": 1408, "grads": 704, "optimizer": 1408}
    monkeypatch.setattr(
        ch07,
        "run_ranks",
        lambda *a, **k: SimpleNamespace(
            values={
                0: {
                    "zero": {"memory": {"zero2": measured}},
                    "fsdp": {"memory": {"zero3": measured}},
                },
                1: {"zero": {"memory": {}}, "fsdp": {"memory": {"zero3": measured}}},
            }
        ),
    )
    guess = {
        ("zero2", 0): (1404, 704, 1408),
        ("zero3", 0): (1408, 704, 1408),
        ("zero3", 1): (1408, 704, 1408),
    }
    with pytest.raises(ExerciseError, match="^07a.2 padding: ") as err:
        ch07.padded_bytes(guess)
    assert (
        "zero2 params: too few bytes: " in err.value.hint
        and "1,408" not in err.value.hint
        and "1408" not in err.value.hint
    )


@pytest.mark.timeout(300)
def test_reshard_policy_without_the_root(tmp_path, no_leftovers, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ex07_fsdp.py").write_text(
        textwrap.dedent("""
        from torch.distributed.fsdp import fully_shard

        def shard_model(model, mesh):
            for block in model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=False)
    """)
    )
    with pytest.raises(ExerciseError, match="head.weight is not sharded"):
        ch07.reshard_policy(predicted={b: (b + 1, b - 1, b + 1) for b in (1, 2, 3)})


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "body, hint",
    [
        (
            """last = len(model.blocks) - 1
for i, block in enumerate(model.blocks):
    # the FIRST block kept: the same counts
    fully_shard(block, mesh=mesh, reshard_after_forward=i > 0)
fully_shard(model, mesh=mesh)""",
            "with B = 2 blocks, after forward block 0 is still gathered and block 1 was freed: "
            "keep only the LAST block",
        ),
        (
            """last = len(model.blocks) - 1
for i, block in enumerate(model.blocks):
    fully_shard(block, reshard_after_forward=i < last)  # no mesh=: fully_shard makes its own
fully_shard(model)""",
            "is sharded over a mesh fully_shard made itself, not the one given: pass mesh=mesh",
        ),
    ],
)
def test_reshard_policy_state_and_mesh(body, hint, tmp_path, no_leftovers, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ex07_fsdp.py").write_text(
        "from torch.distributed.fsdp import fully_shard\n\n\n"
        "def shard_model(model, mesh):\n" + textwrap.indent(body, "    ") + "\n"
    )
    with pytest.raises(ExerciseError, match="^07b.1 reshard policy: ") as err:
        ch07.reshard_policy(predicted={b: (b + 1, b - 1, b + 1) for b in (1, 2, 3)})
    assert hint in err.value.hint


ZERO3 = """import torch
import torch.distributed as dist


def gather(shard):
    full = shard.new_empty(dist.get_world_size() * shard.shape[0], shard.shape[1])
    dist.all_gather_single(full, shard.detach().contiguous())
    return full


class Zero3Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard):
        full = gather(shard)
        ctx.save_for_backward(x, SAVED)
        return x @ full.T

    @staticmethod
    def backward(ctx, dy):
        x, kept = ctx.saved_tensors[:2]
        n, r = dist.get_world_size(), dist.get_rank()
        full = GATHERED
        dw = dy.T @ x
        REDUCE
        return DX, dshard
"""
RS = (
    "dshard = dw.new_empty(dw.shape[0] // n, dw.shape[1]); "
    "dist.reduce_scatter_single(dshard, dw.contiguous()); "
)
ZERO3_PARTS = {
    "SAVED": "shard",
    "GATHERED": "gather(kept)",
    "REDUCE": RS + "dshard = dshard / n",
    "DX": "dy @ full",
}
ZERO3_VARIANTS = {
    "sum": ({"REDUCE": RS}, "the SUM of the ranks' gradients"),
    "local": (
        {"REDUCE": "dshard = dw.chunk(n)[r] / 1"},
        "this rank's own gradient of its rows",
    ),
    "other_rows": (
        {"REDUCE": "dist.all_reduce(dw); dshard = dw.chunk(n)[1 - r] / n"},
        "another rank's rows",
    ),
    "dx_from_shard": (
        {"DX": "dy[:, r * kept.shape[0]:(r + 1) * kept.shape[0]] @ kept"},
        "the input's gradient is not",
    ),
    "kept_w": (
        {"SAVED": "full", "GATHERED": "kept"},
        "kept the gathered W from forward to backward",
    ),
    "w_stashed_on_ctx": (
        {"SAVED": "shard); ctx.full = (full"},
        "kept the gathered W from forward to backward",
    ),
    "w_saved_as_a_view": (
        {"SAVED": "shard, full.T"},
        "kept the gathered W from forward to backward",
    ),
    "all_reduce": (
        {"REDUCE": "dist.all_reduce(dw); dshard = dw.chunk(n)[r] / n"},
        "all-reduced in backward: every rank then receives the whole gradient",
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", [None, *ZERO3_VARIANTS])
def test_zero3_layer_variants(variant, tmp_path, capsys, no_leftovers, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parts, hint = (
        (ZERO3_PARTS, None)
        if variant is None
        else (ZERO3_PARTS | ZERO3_VARIANTS[variant][0], ZERO3_VARIANTS[variant][1])
    )
    source = ZERO3
    for key, code in parts.items():
        source = source.replace(key, code)
    (tmp_path / "ex07_zero3.py").write_text(source)
    if hint is None:
        ch07.zero3_layer()
        assert "equals one process" in capsys.readouterr().out
        return
    with pytest.raises(ExerciseError, match="^07b.2 ZeRO-3 by hand: ") as err:
        ch07.zero3_layer()
    assert hint in err.value.hint
