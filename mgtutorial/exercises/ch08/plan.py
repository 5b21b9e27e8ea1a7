"""Checker of exercise 08.4 (notebooks/08_tensor_parallel.ipynb): write the sequence-parallel
DTensor plan of a Llama-style block (gated MLP, torchtitan's module names), reached as
``ex.ch08.block_plan``.

The learner's ``block_plan()`` returns a ``parallelize_module`` plan. The checker looks at it in
the kernel first (every linear named, each split the right way), then applies it in 2 ranks
(:func:`plan_worker`) to a copy of :class:`GatedBlock` and compares the output, the input's
gradient and every parameter's gradient with the unsplit block, and counts the collectives of
forward and backward with ``CommDebugMode``. Follows PyTorch's own
test/distributed/tensor/parallel/test_tp_examples.py (a Llama block's plan with
``SequenceParallel`` and ``PrepareModuleInput``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from mgtutorial.common import compare
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
from mgtutorial.tensor_parallel.transformer import Attention
from mgtutorial.tensor_parallel.worker import forward_backward

H, HEADS, FFN, BATCH, SEQ = 16, 4, 32, 2, 8
TOL = 1e-5


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
    """A Llama-style pre-norm block with torchtitan's names: ``x + attention(attention_norm(x))``,
    then ``x + feed_forward(ffn_norm(x))``; ``(b, s, h)`` in and out."""

    def __init__(self, h: int = H, n_heads: int = HEADS, ffn: int = FFN):
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(h), Attention(h, n_heads)
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
    with env.distributed(cfg.backend) as ctx:
        r, tp = ctx.rank, ctx.world_size
        env.seed_everything(0)
        ref = GatedBlock()
        x, dy = torch.randn(BATCH, SEQ, H), torch.randn(BATCH, SEQ, H)
        want, want_dx, _ = forward_backward(ref, x, dy)
        mesh = init_device_mesh(ctx.device.type, (tp,), mesh_dim_names=("tp",))
        block = parallelize_module(copy.deepcopy(ref), mesh, plan_fn())
        block.attention.n_heads //= tp  # this rank's heads, as plans.fix_heads does

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


def block_plan(path: str = "ex08_plan.py") -> None:
    """08.4: ``block_plan()`` in ``path`` returns the ``parallelize_module`` plan that splits
    :class:`GatedBlock` with sequence parallelism: the block's input and output are this rank's
    ``s / tp`` tokens (``Shard(1)``). On 2 ranks the output, the input's gradient and every
    parameter's gradient must equal the unsplit block's, with 2 all-gathers and 2 reduce-scatters
    in forward and again in backward (``CommDebugMode``)."""
    ex = "08.4 a plan for a block"
    plan = attempt(ex, function_from(path, "block_plan", ex))
    _check_plan(ex, plan)
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
        f"your plan splits the Llama-style block on 2 ranks: output and every gradient == the "
        f"unsplit block (max |Δ| < {TOL:.0e}), 2 all-gathers + 2 reduce-scatters in forward and "
        "in backward",
    )
