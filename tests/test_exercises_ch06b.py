"""Exercises 06b.1 (the sample's copies kept one model) and 06b.2 (the bytes retain_graph=True
keeps, for any MLP): the solution passes, the starter and each classic wrong answer get their own
hint, and no hint prints the answer."""

from __future__ import annotations

import textwrap

import pytest
import torch

from mgtutorial.exercises import ExerciseError, ch06_ranks, ch06b

STEP = """
import torch
import torch.distributed as dist
from torch import nn


def train_step(model, opt, x, y, ctx):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
{sync}
    opt.step()
    return loss.item()
"""
AVERAGE = """
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= ctx.world_size
"""
ONE_BUCKET = """
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads]) / ctx.world_size
    dist.all_reduce(flat)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
"""


def _step_file(tmp_path, sync: str):
    path = tmp_path / "ex06b_sync.py"
    path.write_text(STEP.format(sync=textwrap.indent(textwrap.dedent(sync), "    ") or "    pass"))
    return str(path)


def test_the_reference_tells_the_wrong_models_apart():
    cfg = ch06_ranks.SyncConfig(path="unused")
    both = ch06b.one_process(cfg, (0, 1))
    for other in (ch06b.one_process(cfg, (0,)), ch06b.one_process(cfg, (0, 1), scale=2)):
        assert max((both[k] - other[k]).abs().max().item() for k in both) > 1e-3
    # the ranks' batches differ, and a rank's batch is the same wherever it is drawn
    x0, x1 = ch06_ranks.sample_batch(cfg, 0, 0)[0], ch06_ranks.sample_batch(cfg, 1, 0)[0]
    assert not torch.equal(x0, x1) and torch.equal(x0, ch06_ranks.sample_batch(cfg, 0, 0)[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sync", [AVERAGE, ONE_BUCKET], ids=["per-parameter", "one-bucket"])
def test_06b1_averaged_gradients_pass(sync, tmp_path, monkeypatch, capsys, no_leftovers):
    monkeypatch.chdir(tmp_path)
    ch06b.one_model(_step_file(tmp_path, sync))
    out = capsys.readouterr().out
    assert out.startswith("✓ 06b.1 one model: 2 ranks on batches of their own kept one model")
    calls = "4 × c10d.allreduce_" if sync is AVERAGE else "1 × c10d.allreduce_"
    assert out.rstrip().endswith(f"one step called {calls}")


WRONG = [
    ("", "the ranks' copies differ"),  # the starter: each copy on its own gradients
    (
        """
     for p in model.parameters():
         dist.all_reduce(p.grad)
     """,
        "summed over the ranks, not averaged",
    ),
    (
        """
     for p in model.parameters():
         p.grad /= ctx.world_size
     """,
        "the ranks' copies differ",
    ),
    (
        """
     total = loss.detach().clone()
     dist.all_reduce(total)
     """,
        "the ranks' copies differ",
    ),
    (
        """
     opt.step()
     for p in model.parameters():
         dist.broadcast(p.data, src=0)
     opt.zero_grad()
     """,
        "what rank 0 trains alone",
    ),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sync, hint", WRONG, ids=["starter", "sum", "no-reduce", "loss", "bcast"])
def test_06b1_wrong_steps_get_their_hint(sync, hint, tmp_path, monkeypatch, no_leftovers):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ExerciseError, match="06b.1") as err:
        ch06b.one_model(_step_file(tmp_path, textwrap.dedent(sync)))
    assert hint in err.value.hint
    assert "all_reduce" not in err.value.hint and "world_size" not in err.value.hint


def _right(sizes, batch_size, dtype):
    size = torch.empty((), dtype=dtype).element_size()
    return batch_size * sum(sizes) * size + batch_size * 8 + size


def test_06b2_solution_passes(capsys):
    ch06b.retained_bytes(_right)
    assert capsys.readouterr().out.startswith("✓ 06b.2 retained bytes: your function gives")


@pytest.mark.parametrize(
    "fn, hint",
    [
        # the starter: section 2.3's numbers, for the article's MLP only
        (lambda s, b, d: b * (1024 + 512 + 256 + 100) * 4 + b * 8 + 4, "redo section 2.3"),
        (lambda s, b, d: b * sum(s) * 4 + b * 8 + 4, "another dtype"),  # float32 always
        (lambda s, b, d: _right(s, b, d) - 4 if d != torch.float64 else 0, "too few"),
        (lambda s, b, d: _right(s, b, d) + b * sum(s[1:-1]) * 4, "too many"),  # ReLU twice
        (lambda s, b, d: _right(s, b, d) if len(s) == 3 else 0, "a deeper MLP"),
        (lambda s, b, d: _right(s, b, d) if d != torch.bfloat16 else 0, "bfloat16"),
        (lambda s, b, d: float(_right(s, b, d)), "a whole number of bytes"),
        (lambda s, b, d: ..., "not written yet"),
    ],
)
def test_06b2_wrong_functions_get_their_hint(fn, hint):
    with pytest.raises(ExerciseError, match="06b.2") as err:
        ch06b.retained_bytes(fn)
    assert hint in err.value.hint
    for sizes, b, dtype in ch06b.CASES:  # no hint gives a measured value (but your own: a float)
        got = ch06b.alive_after_step(True, b, sizes, dtype)
        if f"you return {float(got)!r}" in err.value.hint:
            continue
        assert str(got) not in err.value.hint and f"{got:,}" not in err.value.hint


def test_06b2_cases_are_measured_not_assumed():
    for sizes, b, dtype in ch06b.CASES:
        assert ch06b.alive_after_step(True, b, sizes, dtype) == _right(sizes, b, dtype)
    assert ch06b.alive_after_step(False, 256) == 0
