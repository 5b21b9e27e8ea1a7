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


def heads_per_rank(n_heads, n_kv_heads, tp):
    return HEADS
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
    src = PLAN.replace("CHANGE", change).replace("HEADS", RIGHT_HEADS)
    (tmp_path / "ex08b_plan.py").write_text(src)
    if hint is None:
        ch08.block_plan()
        assert "2 all-gathers + 2 reduce-scatters" in capsys.readouterr().out
        return
    with pytest.raises(ExerciseError, match="^08b.1 a plan for a Llama-style block: ") as err:
        ch08.block_plan()
    assert hint in err.value.hint, err.value.hint


RIGHT_HEADS = "n_heads // tp, n_kv_heads // tp"
HEADS_VARIANTS = {  # heads_per_rank's body → the hint; refused in the kernel, before any rank
    '"2", "1"': "returned ('2', '1'), not a pair of ints",
    "n_heads / tp, n_kv_heads / tp": "not a pair of ints",
    "n_heads // tp, n_kv_heads": "gives 2 key/value heads: wk and wv are split too",
    "n_heads, n_kv_heads": "gives 4 query heads",
    "2, 1": "heads_per_rank(8, 2, 2) gives 2 query heads",
    "n_heads // tp": "not a pair",
}


@pytest.mark.parametrize("body", sorted(HEADS_VARIANTS))
def test_block_plan_refuses_wrong_heads(body, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ex08b_plan.py").write_text(PLAN.replace("CHANGE", "pass").replace("HEADS", body))
    with pytest.raises(ExerciseError, match="^08b.1 a plan for a Llama-style block: ") as err:
        ch08.block_plan()
    assert HEADS_VARIANTS[body] in err.value.hint, err.value.hint


SP = """import torch
import torch.distributed as dist


def gather(x, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def scatter(x, group):
    parts = [p.contiguous() for p in x.chunk(dist.get_world_size(group), dim=1)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


def all_reduce_chunk(x, group):
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()


def identity(x, group):
    return x


def my_tokens(x, group):
    return x.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()


class GatherFromSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return GATHER_FORWARD(x, group)

    @staticmethod
    def backward(ctx, grad):
        return GATHER_BACKWARD(grad, ctx.group), None


class ScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return SCATTER_FORWARD(x, group)

    @staticmethod
    def backward(ctx, grad):
        return SCATTER_BACKWARD(grad, ctx.group), None
"""
RIGHT_SP = ("gather", "scatter", "scatter", "gather")
SP_VARIANTS = {  # (gather forward, gather backward, scatter forward, scatter backward), the hint
    "identities": (("identity",) * 4, "your output is this rank's partial sum alone"),
    "gather_backward_keeps_own_tokens": (
        ("gather", "my_tokens", "scatter", "gather"),
        "look at GatherFromSeq's backward",
    ),
    "scatter_backward_identity": (
        ("gather", "scatter", "scatter", "identity"),
        "your pair fails in forward or backward",
    ),
    "all_reduce_then_chunk": (
        ("gather", "scatter", "all_reduce_chunk", "gather"),
        "right results, but forward ran {'all_gather': 1, 'all_reduce': 1}",
    ),
}


def _sp_source(ops) -> str:
    src = SP
    for key, op in zip(
        ("GATHER_FORWARD", "GATHER_BACKWARD", "SCATTER_FORWARD", "SCATTER_BACKWARD"), ops
    ):
        src = src.replace(key, op)
    return src


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", [None, *SP_VARIANTS])
def test_sequence_pair_variants(variant, tmp_path, capsys, no_leftovers):
    ops, hint = SP_VARIANTS.get(variant, (RIGHT_SP, None))
    path = tmp_path / "ex08a_sp.py"
    path.write_text(_sp_source(ops))
    if hint is None:
        ch08.sequence_pair(str(path))
        assert "== one process and == DTensor's split" in capsys.readouterr().out
        return
    with pytest.raises(ExerciseError, match="^08a.2 the sequence-parallel pair: ") as err:
        ch08.sequence_pair(str(path))
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
    path = tmp_path / "ex08a_bias.py"
    path.write_text(BIAS)
    for predicted, hint in [
        ({"wrong": {"output", "b2"}, "bias_copies": 2}, "the ranks measured otherwise"),
        ({"wrong": {"output"}, "bias_copies": 1}, "does not hold 1 copies of b2"),
        ({"wrong": {"bias"}, "bias_copies": 2}, "choose among"),
    ]:
        with pytest.raises(ExerciseError, match="^08a.3 bias before g: ") as err:
            ch08.bias_before_g(str(path), predicted)
        assert hint in err.value.hint, err.value.hint


RIGHT_COUNTS = {
    "forward": 2,
    "backward": 2,
    "all_reduce_bytes": 1536,
    "all_gather_bytes": [768, 1536],
}
COUNTS_VARIANTS = [  # a wrong prediction for TPConfig(h=32, n_heads=8, batch=3, seq=4), the hint
    (
        {"forward": 1},
        "you predicted 1 all-reduce(s) in forward; the split block issued a different number",
    ),
    ({"all_reduce_bytes": 768}, "you predicted 768 bytes per all-reduce; the DTensor plan's"),
    ({"all_gather_bytes": [1536, 1536]}, "you predicted all-gathers of [1536, 1536] bytes"),
]


RIGHT_LOSS = {
    "all_reduce_bytes": [[1536, 1536], [48, 48], [48, 48], [48, 48], [1536, 1536]],
    "local_logit_bytes": 960,
    "full_logit_bytes": 1920,
}
LOSS_VARIANTS = [  # a wrong prediction for h=32, b=3, s=4, vocabulary 40, the hint
    (  # the embedding's output and the head's input gradient taken as logits, (b, s, V)
        {"all_reduce_bytes": [[1920, 1920], [48, 48], [48, 48], [48, 48], [1920, 1920]]},
        "you predicted [1920, 1920] bytes for all-reduce 1 of 5",
    ),
    (  # h in place of V
        {"local_logit_bytes": 768, "full_logit_bytes": 1536},
        "you predicted local_logit_bytes = 768; the ranks hold a different number",
    ),
    (
        {"all_reduce_bytes": [[1536, 1536], [48, 48], [48, 48], [48, 48]]},
        "you predicted 4 all-reduces",
    ),
    (
        {"all_reduce_bytes": [[1536, 1536], [1536, 1536], [48, 48], [48, 48], [48, 48]]},
        "you predicted [1536, 1536] bytes for all-reduce 2 of 5",
    ),
    ({"local_logit_bytes": 1536}, "you predicted local_logit_bytes = 1536"),
    ({"full_logit_bytes": 960}, "the whole logits are not sharded"),  # b·s·V / tp · 4
    ({"full_logit_bytes": 480}, "a number of logits, not of bytes"),  # b·s·V, no 4 bytes
    ({"local_logit_bytes": 240}, "a number of logits, not of bytes"),  # b·s·V / tp
]


PREDICTIONS = {  # exercise: (checker, the right prediction, [(a wrong change, its hint)])
    "08a.1 counts and bytes": (ch08.counts, RIGHT_COUNTS, COUNTS_VARIANTS),
    "08b.2 the bytes of loss parallelism": (ch08.loss_bytes, RIGHT_LOSS, LOSS_VARIANTS),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("exercise", sorted(PREDICTIONS))
def test_predictions_pass_when_right_and_name_each_wrong_one(exercise, capsys, no_leftovers):
    check, right, variants = PREDICTIONS[exercise]
    check(right)
    assert f"✓ {exercise}: " in capsys.readouterr().out
    for wrong, hint in variants:
        with pytest.raises(ExerciseError, match=f"^{exercise}: ") as err:
            check({**right, **wrong})
        assert hint in err.value.hint, err.value.hint


def test_loss_bytes_refuses_a_malformed_list_before_any_rank():
    with pytest.raises(ExerciseError, match="one pair of ints per all-reduce"):
        ch08.loss_bytes({**RIGHT_LOSS, "all_reduce_bytes": [[..., ...]]})


# Malformed predictions, refused before any rank starts: (a change to the right one, the hint)
MALFORMED = {
    "08a.1 counts and bytes": (
        ch08.counts,
        RIGHT_COUNTS,
        [
            ({"forward": "2"}, "`predicted['forward']` is '2' (str): give an int"),
            ({"all_reduce_bytes": 1536.0}, "is 1536.0 (float): give an int"),
            ({"backward": True}, "is True (bool): give an int"),
            ({"all_gather_bytes": 768}, "give a list [bytes in, bytes out]"),
            ({"all_gather_bytes": [768]}, "give [in, out]"),
            ({"all_gather_bytes": [768, ...]}, "`predicted['all_gather_bytes'][1]` is still `...`"),
            ({"all_gather_bytes": ["768", 1536]}, "[0] is '768': give an int"),
        ],
    ),
    "08b.2 the bytes of loss parallelism": (
        ch08.loss_bytes,
        RIGHT_LOSS,
        [
            ({"local_logit_bytes": "960"}, "`predicted['local_logit_bytes']` is '960' (str)"),
            ({"full_logit_bytes": 1920.0}, "is 1920.0 (float): give an int"),
            ({"all_reduce_bytes": [["1536", 1536]]}, "one pair of ints per all-reduce"),
            ({"all_reduce_bytes": 1536}, "give a list of [in, out] pairs"),
        ],
    ),
}


@pytest.mark.parametrize("exercise", sorted(MALFORMED))
def test_predictions_of_the_wrong_type_or_left_out_are_named_before_any_rank(exercise):
    check, right, variants = MALFORMED[exercise]
    for key in right:  # a key left out is missing, not None
        left_out = {k: v for k, v in right.items() if k != key}
        with pytest.raises(ExerciseError, match=f"^{exercise}: ") as err:
            check(left_out)
        assert f"`predicted[{key!r}]` is missing: add the key" in err.value.hint, err.value.hint
    for wrong, hint in variants:
        with pytest.raises(ExerciseError, match=f"^{exercise}: ") as err:
            check({**right, **wrong})
        assert hint in err.value.hint, err.value.hint
    with pytest.raises(ExerciseError, match="`predicted` is not a dict"):
        check([right])


@pytest.mark.timeout(300)
def test_bias_before_g_takes_one_name_and_names_a_malformed_prediction(
    tmp_path, capsys, no_leftovers
):
    path = tmp_path / "ex08a_bias.py"
    path.write_text(BIAS)
    ch08.bias_before_g(str(path), {"wrong": "output", "bias_copies": 2})  # a set of one
    assert "✓ 08a.3 bias before g: " in capsys.readouterr().out
    for predicted, hint in [
        ({"wrong": 1, "bias_copies": 2}, 'is 1 (int): give a set of names, e.g. {"output"}'),
        ({"wrong": [["output"]], "bias_copies": 2}, 'give a set of names, e.g. {"output"}'),
        ({"wrong": {"output"}, "bias_copies": "2"}, "`predicted['bias_copies']` is '2' (str)"),
        ({"wrong": {"output"}}, "`predicted['bias_copies']` is missing: add the key"),
    ]:
        with pytest.raises(ExerciseError, match="^08a.3 bias before g: ") as err:
            ch08.bias_before_g(str(path), predicted)
        assert hint in err.value.hint, err.value.hint


def test_block_plan_statement_names_the_checks_in_the_order_they_run(tmp_path, monkeypatch):
    """The starter (an empty plan, every head kept) fails on the plan first, as 08b.1 says."""
    import json
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    starter = PLAN.replace("    plan = {", "    plan = {}\n    _ = {").replace("CHANGE", "pass")
    (tmp_path / "ex08b_plan.py").write_text(starter.replace("HEADS", "n_heads, n_kv_heads"))
    with pytest.raises(ExerciseError, match="is not in your plan"):
        ch08.block_plan()
    nb = Path(__file__).parents[1] / "notebooks" / "08b_tp_mesh_and_cost.ipynb"
    cells = json.loads(nb.read_text())["cells"]
    text = next("".join(c["source"]) for c in cells if "### Exercise 08b.1" in "".join(c["source"]))
    text = " ".join(text.split())
    assert text.index("first reads your plan") < text.index("then tries `heads_per_rank`"), text
