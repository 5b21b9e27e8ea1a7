"""Checker of exercise 08b.1 (notebooks/08b_tp_mesh_and_cost.ipynb): write the sequence-parallel
DTensor plan of a Llama-style block (grouped-query attention, gated MLP, torchtitan's module
names) and the heads each rank then holds, reached as ``ex.ch08.block_plan``.

The learner's ``block_plan()`` returns a ``parallelize_module`` plan and ``heads_per_rank(n_heads,
n_kv_heads, tp)`` the query and key/value heads of one rank. The checker looks at both in the
kernel first (every linear named, each split the right way; the heads matching the features a
rank holds), then applies them in 2 ranks (:func:`plan_worker`) to a copy of :class:`GatedBlock`
and compares the output, the input's gradient and every parameter's gradient with the unsplit
block, and counts the collectives of forward and backward with ``CommDebugMode``. Follows
PyTorch's own test/distributed/tensor/parallel/test_tp_examples.py (a Llama block's plan with
``SequenceParallel`` and ``PrepareModuleInput``) and torchtitan's Llama attention
(``n_kv_heads``, ``repeat_kv``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from mgtutorial.common import compare
from mgtutorial.exercises._answers import is_int
from mgtutorial.exercises._common import (
    ExerciseError,
    FileWorkerConfig,
    attempt,
    function_from,
    passed,
    require,
    run_ranks,
)
from mgtutorial.runtime import env
from mgtutorial.tensor_parallel.worker import forward_backward

H, HEADS, KV_HEADS, FFN, BATCH, SEQ = 16, 4, 2, 32, 2, 8
TOL = 1e-5
EX = "08b.1 a plan for a Llama-style block"


class GQAttention(nn.Module):
    """Causal grouped-query attention: ``n_heads`` query heads of ``h / n_heads`` features share
    ``n_kv_heads`` key/value heads, query heads ``j·g … (j + 1)·g − 1`` (``g = n_heads /
    n_kv_heads``) reading key/value head ``j``; ``(b, s, h) → (b, s, h)``, no biases.
    ``forward`` reshapes with ``self.n_heads`` and ``self.n_kv_heads``: after tensor parallelism,
    the heads of this rank."""

    def __init__(self, h: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, h // n_heads
        self.wq = nn.Linear(h, h, bias=False)
        self.wk = nn.Linear(h, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(h, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(h, h, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (
            w(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
            for w in (self.wk, self.wv)
        )
        g = self.n_heads // self.n_kv_heads  # query heads per key/value head
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class GatedMLP(nn.Module):
    """Llama's feed-forward ``w2(silu(w1(x)) · w3(x))``: ``(b, s, h) → (b, s, ffn) → (b, s, h)``,
    no biases."""

    def __init__(self, h: int, ffn: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(h, ffn, bias=False), nn.Linear(h, ffn, bias=False)
        self.w2 = nn.Linear(ffn, h, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GatedBlock(nn.Module):
    """A Llama-style pre-norm block with torchtitan's names: ``x + attention(attention_norm(x))``
    (grouped-query), then ``x + feed_forward(ffn_norm(x))`` (gated); ``(b, s, h)`` in and out."""

    def __init__(
        self, h: int = H, n_heads: int = HEADS, n_kv_heads: int = KV_HEADS, ffn: int = FFN
    ):
        super().__init__()
        self.attention_norm = nn.LayerNorm(h)
        self.attention = GQAttention(h, n_heads, n_kv_heads)
        self.ffn_norm, self.feed_forward = nn.LayerNorm(h), GatedMLP(h, ffn)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROWWISE = ("attention.wo", "feed_forward.w2")
RIGHT = {"all_gather": 2, "reduce_scatter": 2}
"""The collectives of the block under sequence parallelism, in forward and again in backward."""


def _check_plan(ex: str, plan) -> None:
    """Refuse, before any rank starts, a plan that names no module of the block or leaves a linear
    whole, or splits one the wrong way."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor.parallel.style import ParallelStyle

    require(isinstance(plan, dict), ex, f"block_plan() returned {type(plan).__name__}, not a dict")
    names = {name for name, _ in GatedBlock().named_modules() if name}
    for key, style in plan.items():
        require(
            key in names,
            ex,
            f"{key!r} is not a module of the block; its modules: {sorted(names)}",
        )
        require(
            isinstance(style, ParallelStyle),
            ex,
            f"plan[{key!r}] is a {type(style).__name__}, not a parallel style",
        )
    for name in (*COLWISE, *ROWWISE):
        require(
            name in plan,
            ex,
            f"{name} is not in your plan: it would stay whole on every rank, and the heads or "
            "inner features around it are split",
        )
    for name in COLWISE:
        require(
            isinstance(plan[name], ColwiseParallel),
            ex,
            f"{name} is {type(plan[name]).__name__}: what does each rank need from its output, "
            "whole or in part (its own heads; the inner features that silu(w1 x) · w3 x "
            "multiplies elementwise on this rank)?",
        )
    for name in ROWWISE:
        require(
            isinstance(plan[name], RowwiseParallel),
            ex,
            f"{name} is {type(plan[name]).__name__}: what does it receive on each rank, the "
            "whole input or a part of it (heads, inner features), and what must follow?",
        )


def plan_worker(cfg: FileWorkerConfig) -> dict:
    """Rank-side: the learner's plan applied to a copy of :class:`GatedBlock` over a 1-D mesh of
    all ranks; the input and output are this rank's ``s / tp`` tokens. Returns the collectives of
    forward and backward and the largest differences to the unsplit block (output, input gradient,
    the norms' gradients, the linears' gradients), or ``error`` when the plan fails in the rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    plan_fn = function_from(cfg.path, "block_plan")
    heads_fn = function_from(cfg.path, "heads_per_rank")
    with env.distributed(cfg.backend) as ctx:
        r, tp = ctx.rank, ctx.world_size
        env.seed_everything(0)
        ref = GatedBlock()
        x, dy = torch.randn(BATCH, SEQ, H), torch.randn(BATCH, SEQ, H)
        want, want_dx, _ = forward_backward(ref, x, dy)
        mesh = init_device_mesh(ctx.device.type, (tp,), mesh_dim_names=("tp",))
        block = parallelize_module(copy.deepcopy(ref), mesh, plan_fn())
        attn = block.attention  # this rank's heads, as plans.fix_heads sets them
        attn.n_heads, attn.n_kv_heads = heads_fn(HEADS, KV_HEADS, tp)

        def part(t):  # this rank's s / tp tokens
            return t.chunk(tp, dim=1)[r]

        try:
            out, dx, counts = forward_backward(block, part(x), part(dy))
        except Exception as e:  # the learner's plan: report it, do not fail the rank
            return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        if hasattr(out, "full_tensor"):
            return {"error": "the block returned a DTensor, not this rank's tokens"}
        diffs = {
            "output": compare.max_abs_diff(out, part(want)) if out.shape == part(want).shape else 1,
            "x.grad": compare.max_abs_diff(dx, part(want_dx)) if dx.shape == part(x).shape else 1,
        }
        for name, p in block.named_parameters():
            diffs[name] = compare.max_abs_diff(p.grad, ref.get_parameter(name).grad)
        return {"counts": counts, "diffs": diffs, "output_shape": list(out.shape)}


HEAD_CASES = {(4, 2, 2): (2, 1), (8, 2, 2): (4, 1), (8, 4, 4): (2, 1), (8, 8, 4): (2, 2)}
"""(n_heads, n_kv_heads, tp) → the (query, key/value) heads of one rank."""


def _check_heads(ex: str, fn) -> None:
    """Refuse, before any rank starts, a ``heads_per_rank`` that does not match the features a
    rank holds after ``ColwiseParallel`` on wq, wk and wv."""
    for (n_heads, n_kv, tp), want in HEAD_CASES.items():
        got = attempt(ex, fn, n_heads, n_kv, tp)
        call = f"heads_per_rank({n_heads}, {n_kv}, {tp})"
        require(
            isinstance(got, (tuple, list)) and len(got) == 2 and all(map(is_int, got)),
            ex,
            f"{call} returned {got!r}, not a pair of ints (query heads, key/value heads)",
        )
        require(
            got[0] == want[0],
            ex,
            f"{call} gives {got[0]} query heads: after the split each rank holds 1/{tp} of wq's "
            "output features; how many whole heads is that?",
        )
        require(
            got[1] == want[1],
            ex,
            f"{call} gives {got[1]} key/value heads: wk and wv are split too, so each rank "
            "holds 1/tp of their output features; how many key/value heads is that?",
        )


def block_plan(path: str = "ex08b_plan.py") -> None:
    """08b.1: ``block_plan()`` in ``path`` returns the ``parallelize_module`` plan that splits
    :class:`GatedBlock` with sequence parallelism: the block's input and output are this rank's
    ``s / tp`` tokens (``Shard(1)``); ``heads_per_rank(n_heads, n_kv_heads, tp)`` returns the
    (query, key/value) heads of one rank (checked on :data:`HEAD_CASES`). On 2 ranks the output,
    the input's gradient and every parameter's gradient must equal the unsplit block's, with 2
    all-gathers and 2 reduce-scatters in forward and again in backward (``CommDebugMode``)."""
    ex = EX
    plan = attempt(ex, function_from(path, "block_plan", ex))
    _check_plan(ex, plan)
    _check_heads(ex, function_from(path, "heads_per_rank", ex))
    cfg = FileWorkerConfig(path=str(Path(path).resolve()), function="block_plan", backend="gloo")
    values = run_ranks(ex, plan_worker, cfg, 2, timeout_s=60, name=Path(path).stem).values
    for rank, v in sorted(values.items()):
        if "error" in v:
            raise ExerciseError(
                ex,
                f"rank {rank}: your plan fails in forward or backward ({v['error']}): what "
                "layout does each module get its input in, and return its output in? The block "
                "receives and returns this rank's s / tp tokens",
            )
        d = v["diffs"]
        require(
            d["output"] < TOL and d["x.grad"] < TOL,
            ex,
            f"rank {rank}: the output or the input's gradient differs from the unsplit block's "
            f"(output shape {v['output_shape']}): the block must return this rank's s / tp "
            "tokens, so the row-parallel layers reduce-scatter onto the sequence",
        )
        wrong = sorted(k for k, diff in d.items() if diff >= TOL and "norm" in k)
        require(
            not wrong,
            ex,
            f"rank {rank}: output right, but the gradients of {wrong} are only this rank's "
            "tokens' share: a norm that runs on sequence shards must know it (its parameters "
            "then become DTensors whose gradients are summed over the ranks)",
        )
        wrong = sorted(k for k, diff in d.items() if diff >= TOL)
        require(
            not wrong, ex, f"rank {rank}: the gradients of {wrong} differ from the unsplit block's"
        )
        for phase in ("forward", "backward"):
            got = v["counts"][phase]
            require(
                "all_reduce" not in got,
                ex,
                f"rank {rank}: right results, but {phase} ran {got}: a projection received a "
                "plain tensor and took it as replicated, so its input's gradient is all-reduced; "
                "keep DTensors from PrepareModuleInput to the projections",
            )
            require(
                got == RIGHT,
                ex,
                f"rank {rank}: right results, but {phase} ran {got}: gather the tokens once at "
                "the entrance of attention and of feed_forward, not once per projection",
            )
    passed(
        ex,
        "your plan and heads split the grouped-query block on 2 ranks: output and every "
        f"gradient == the unsplit block (max |Δ| < {TOL:.0e}), 2 all-gathers + 2 reduce-scatters "
        "in forward and in backward",
    )
