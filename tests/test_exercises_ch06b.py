"""Exercise 06b.1 (the bytes retain_graph=True keeps, for an MLP with Tanh or GELU): the solution
passes, the starter and each classic wrong answer get their own hint, and no hint prints the
answer. Exercise 06b.2 (the world a group is told, on two nodes): the solution passes, each wrong
value of the four fails with its hint, and no hint names the function or rule that answers it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mgtutorial.common.models import ArticleMLP
from mgtutorial.exercises import ExerciseError, ch06b
from mgtutorial.pipeline.activations import ActivationMeter


def _right(sizes, batch_size, dtype, activation):
    size = torch.empty((), dtype=dtype).element_size()
    hidden = sum(sizes[1:-1])  # GELU keeps its input, the Linear before it its output's input
    extra = hidden if activation is nn.GELU else 0
    return batch_size * (sum(sizes) + extra) * size + batch_size * 8 + size


def _relu_rule(s, b, d, a):  # section 2.3's rule: right for Tanh (saves its output), not for GELU
    return _right(s, b, d, nn.Tanh)


def test_06b1_solution_passes(capsys):
    ch06b.retained_bytes(_right)
    assert capsys.readouterr().out.startswith("✓ 06b.1 retained bytes: your function gives")


@pytest.mark.parametrize(
    "fn, hint",
    [
        # section 2.3's numbers, for the article's MLP only
        (lambda s, b, d, a: b * (1024 + 512 + 256 + 100) * 4 + b * 8 + 4, "redo section 2.3"),
        (_relu_rule, "GELU: which tensor"),  # the ReLU rule applied to GELU
        # GELU's saved input counted, but the Linear's output counted a second time
        (lambda s, b, d, a: _right(s, b, d, a) + b * sum(s[1:-1]) * 4, "too many"),
        (
            lambda s, b, d, a: _right(s, b, d, a) * 4 // torch.empty((), dtype=d).element_size(),
            "another dtype",
        ),  # float32 always
        (lambda s, b, d, a: _right(s, b, d, a) - 4 if d != torch.float64 else 0, "too few"),
        (lambda s, b, d, a: _right(s, b, d, a) if len(s) == 3 else 0, "a deeper MLP"),
        (lambda s, b, d, a: _right(s, b, d, a) if d != torch.bfloat16 else 0, "bfloat16"),
        (lambda s, b, d, a: float(_right(s, b, d, a)), "a whole number of bytes"),
        (lambda s, b, d, a: ..., "not written yet"),
    ],
)
def test_06b1_wrong_functions_get_their_hint(fn, hint):
    with pytest.raises(ExerciseError, match="06b.1") as err:
        ch06b.retained_bytes(fn)
    assert hint in err.value.hint
    for sizes, b, dtype, act in ch06b.CASES:  # no hint gives a measured value (but your own)
        got = ch06b.alive_after_step(True, b, sizes, dtype, act)
        if f"you return {float(got)!r}" in err.value.hint:
            continue
        assert str(got) not in err.value.hint and f"{got:,}" not in err.value.hint


def test_06b1_cases_are_measured_not_assumed():
    for sizes, b, dtype, act in ch06b.CASES:
        assert ch06b.alive_after_step(True, b, sizes, dtype, act) == _right(sizes, b, dtype, act)
    assert ch06b.alive_after_step(False, 256) == 0


def test_06b1_relu_mlp_saves_what_article_mlp_saves():
    for sizes, b, dtype, _ in ch06b.CASES:  # the chapter's model and the exercise's, with ReLU
        torch.manual_seed(0)
        model = ArticleMLP(sizes).to(dtype)
        x, y = torch.randn(b, sizes[0], dtype=dtype), torch.randint(0, sizes[-1], (b,))
        meter = ActivationMeter(model)
        with meter.saving():
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward(retain_graph=True)
        assert meter.live_bytes == ch06b.alive_after_step(True, b, sizes, dtype, nn.ReLU)


JOIN = """
from mgtutorial.runtime import env


def join(part):
    num_gpus, subnets = 4, 3
    world_size = {world}
    rank = {rank}
    stage = {stage}
    same_stage = {same}
    return {{"world_size": world_size, "rank": rank, "stage": stage, "same_stage": same_stage}}
"""
RIGHT_JOIN = {
    "world": "env.world_size()",
    "rank": "env.rank()",
    "stage": "rank % subnets",
    "same": "[r for r in range(world_size) if r % subnets == stage]",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "change, hint",
    [
        ({}, None),
        ({"world": "num_gpus * subnets"}, "how many processes were started"),
        ({"rank": "part"}, "the sub-network index repeats on every node"),
        ({"stage": "rank"}, "which stage does each of node 1's"),
        ({"same": "[rank]"}, "which processes hold a copy"),
        (
            {"same": "[r for r in range(world_size) if r % subnets == stage and r != rank]"},
            "which processes hold a copy",
        ),
    ],
    ids=["right", "world-gpus-x-subnets", "rank-part", "stage-rank", "same-self", "same-others"],
)
def test_06b2(change, hint, tmp_path, capsys, no_leftovers):
    path = tmp_path / "ex06b_world.py"
    path.write_text(JOIN.format(**(RIGHT_JOIN | change)))
    if hint is None:
        ch06b.world_size(str(path))
        assert capsys.readouterr().out.startswith("✓ 06b.2 world size: 6 processes")
        return
    with pytest.raises(ExerciseError, match="06b.2") as err:
        ch06b.world_size(str(path))
    assert hint in err.value.hint
    for leak in ("env.rank", "env.world_size", "RANK", "WORLD_SIZE", "% subnets"):
        assert leak not in err.value.hint  # hints guide; they do not name the answer
