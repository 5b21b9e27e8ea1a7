"""Chapter 08's checkers on wrong answers: each mistake gets its own hint (tests/test_exercises.py
covers the solutions and the untouched starters). Learner files are written to a temporary
folder."""

from __future__ import annotations

import pytest

from mgtutorial.exercises import ch08
from mgtutorial.exercises._common import ExerciseError

PLAN = """from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


def block_plan():
    gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(**gather),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(**gather),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    CHANGE
    return plan
"""
VARIANTS = {
    "w3_missing": ('del plan["feed_forward.w3"]', "feed_forward.w3 is not in your plan"),
    "w3_rowwise": (
        'plan["feed_forward.w3"] = RowwiseParallel()',
        "feed_forward.w3 is RowwiseParallel: what does each rank need from its output",
    ),
    "w2_colwise": (
        'plan["feed_forward.w2"] = ColwiseParallel()',
        "feed_forward.w2 is ColwiseParallel: what does it receive on each rank",
    ),
    "old_names": ('plan["mlp.w1"] = plan.pop("feed_forward.w1")', "'mlp.w1' is not a module"),
    "wo_replicated": (
        'plan["attention.wo"] = RowwiseParallel()',
        "rank 0: your plan fails in forward or backward",
    ),
    "norms_local": (
        'del plan["attention_norm"], plan["ffn_norm"]',
        "are only this rank's tokens' share",
    ),
    "local_output": (
        'plan["feed_forward"] = PrepareModuleInput(**gather, use_local_output=True)',
        "a projection received a plain tensor",
    ),
    "no_prepare": ('del plan["attention"], plan["feed_forward"]', "right results, but forward ran"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", [None, *VARIANTS])
def test_block_plan_variants(variant, tmp_path, capsys, no_leftovers, monkeypatch):
    monkeypatch.chdir(tmp_path)
    change, hint = VARIANTS.get(variant, ("pass", None))
    (tmp_path / "ex08_plan.py").write_text(PLAN.replace("CHANGE", change))
    if hint is None:
        ch08.block_plan()
        assert "2 all-gathers + 2 reduce-scatters" in capsys.readouterr().out
        return
    with pytest.raises(ExerciseError, match="^08.4 a plan for a block: ") as err:
        ch08.block_plan()
    assert hint in err.value.hint, err.value.hint


FG = """import torch
import torch.distributed as dist


class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=F_GROUP)
        F_AVERAGE
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        G_BACKWARD
        return grad, None
"""
FG_VARIANTS = {  # (F_GROUP, F_AVERAGE, G_BACKWARD), the hint
    "f_averages": (("ctx.group", "grad = grad / 2", "pass"), "did you average?"),
    "g_backward_reduces": (
        ("ctx.group", "pass", "grad = grad.clone(); dist.all_reduce(grad, group=ctx.group)"),
        "ReduceFromTP's backward must be the identity",
    ),
    "no_group": (("None", "pass", "pass"), "did not get the group passed to apply"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", sorted(FG_VARIANTS))
def test_f_and_g_hints_name_the_mistake(variant, tmp_path, no_leftovers):
    (f_group, f_average, g_backward), hint = FG_VARIANTS[variant]
    src = FG.replace("F_GROUP", f_group).replace("F_AVERAGE", f_average)
    path = tmp_path / "ex08_fg.py"
    path.write_text(src.replace("G_BACKWARD", g_backward))
    with pytest.raises(ExerciseError, match="^08.2 f and g: ") as err:
        ch08.f_and_g(str(path))
    assert hint in err.value.hint, err.value.hint


BIAS = """from mgtutorial.tensor_parallel.fg import CopyToTP, ReduceFromTP
from torch.nn import functional as F


def forward(m, x):
    x = CopyToTP.apply(x, m.group)
    partial = F.linear(F.gelu(F.linear(x, m.w1, m.b1)), m.w2)
    return ReduceFromTP.apply(partial + m.b2, m.group)
"""


@pytest.mark.timeout(300)
def test_bias_before_g_hints_for_the_prediction(tmp_path, no_leftovers):
    path = tmp_path / "ex08_bias.py"
    path.write_text(BIAS)
    for predicted, hint in [
        ({"wrong": {"output", "b2"}, "bias_copies": 2}, "the ranks measured otherwise"),
        ({"wrong": {"output"}, "bias_copies": 1}, "does not hold 1 copies of b2"),
        ({"wrong": {"bias"}, "bias_copies": 2}, "choose among"),
    ]:
        with pytest.raises(ExerciseError, match="^08.3 bias before g: ") as err:
            ch08.bias_before_g(str(path), predicted)
        assert hint in err.value.hint, err.value.hint
