"""Checker of chapter 07's exercise 07a.3 (notebooks/07a_zero_memory.ipynb): ZeRO-1's step with its
gradients clipped by the global norm, reached as ``ex.ch07.zero1_clipped``.

The rank-side worker takes a :class:`~mgtutorial.exercises._common.FileWorkerConfig`: it imports
the learner's step from ``cfg.path`` inside each rank and runs it inside the chapter's own training
loop (:func:`mgtutorial.sharding.model.train`) with :class:`mgtutorial.sharding.zero.ZeRO`'s
buffers, next to the chapter's one-process reference.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mgtutorial.common.compare import counting_mode, max_abs_diff
from mgtutorial.exercises._common import (
    ExerciseError,
    FileWorkerConfig,
    function_from,
    passed,
    require,
    run_ranks,
)
from mgtutorial.runtime import env
from mgtutorial.sharding import model, zero
from mgtutorial.sharding.worker import ShardConfig


def clip(g: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Each row of ``g`` scaled as ``clip_grad_norm_`` scales a gradient: by
    min(1, max_norm / (‖row‖ + 1e-6))."""
    return g * (max_norm / (g.norm(dim=-1, keepdim=True) + 1e-6)).clamp(max=1)


def clipped_reference(cfg: ShardConfig, max_norm: float) -> torch.Tensor:
    """Flat parameters (Ψ,) of one process after ``cfg.steps`` steps of ``clip_grad_norm_`` then
    AdamW."""
    net, one = model.make_model(cfg), env.DistContext.single_process()
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr)

    def step():
        nn.utils.clip_grad_norm_(net.parameters(), max_norm)
        opt.step()

    model.train(net, step, cfg, one, opt.zero_grad)
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def padded(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` (k,) followed by zeros up to ``length`` elements: the layout of ZeRO's flat buffer."""
    return torch.cat([t, t.new_zeros(length - t.numel())])


def clip_step_worker(cfg: FileWorkerConfig) -> dict:
    """Rank-side: ``steps`` steps of the chapter's model with the learner's clipped ZeRO-1 step.

    Per step: max |Δ| between ``shard.grad`` at ``opt.step()`` and each way of clipping
    (:data:`WAYS`) this run's averaged gradients, and the collectives; max |Δ| to one process
    (:func:`clipped_reference`) after the first step and the last.
    """
    step_fn = function_from(cfg.path, cfg.function)
    steps, max_norm = cfg.options["steps"], cfg.options["max_norm"]
    scfg = ShardConfig(steps=steps)
    with env.distributed(cfg.backend) as ctx:
        net = model.make_model(scfg).to(ctx.device)
        z = zero.ZeRO(net, ctx, 1, lr=scfg.lr)
        seen, given, counts, after_first, sizes = [], [], [], [], []

        def shard_grad(*_):
            seen.append(None if z.slice.grad is None else z.slice.grad.detach().cpu().clone())

        z.opt.register_step_pre_hook(shard_grad)

        def step():
            # this rank's gradients, before the learner's step
            given.append(z.flat_grad.detach().clone())
            with counting_mode() as mode:
                step_fn(z.flat, z.flat_grad, z.slice, z.opt, ctx, max_norm)
            counts.append(mode.counts())
            # float32 elements of each all-reduce, read where CommDebugMode counts it
            sizes.append([b_in // 4 for b_in, _ in mode.sizes.get("all_reduce", [])])
            after_first[:] = after_first or [z.flat.detach().cpu().clone()]

        model.train(net, step, scfg, ctx, z.zero_grad)
        n, lo, hi = ctx.world_size, ctx.rank * z.S, (ctx.rank + 1) * z.S
        mean = torch.stack(given)  # (steps, N·S)
        dist.all_reduce(mean)  # outside the counting: summed over ranks
        mean = mean.cpu() / n
        ways = {
            "clipped": clip(mean, max_norm)[:, lo:hi],
            "local": clip(mean[:, lo:hi], max_norm),
            "unclipped": mean[:, lo:hi],
            "before_divide": clip(n * mean, max_norm)[:, lo:hi] / n,
            "no_divide": clip(n * mean, max_norm)[:, lo:hi],
            "sum": n * mean[:, lo:hi],
        }
        none = any(g is None for g in seen)
        got = None if none or len(seen) != steps else torch.stack(seen)
        first = padded(clipped_reference(dataclasses.replace(scfg, steps=1), max_norm), n * z.S)
        diff = (after_first[0] - first).abs()
        return {
            "steps": len(seen),
            "counts": counts,
            "all_reduce_numels": sizes,
            "flat_numel": z.flat.numel(),
            "grad_none": none,
            "norms": mean.norm(dim=-1).tolist(),
            "ways": None
            if got is None
            else {k: (got - w).abs().amax(dim=1).tolist() for k, w in ways.items()},
            "other_diff": torch.cat([diff[:lo], diff[hi:]]).max().item(),
            "final_diff": max_abs_diff(z.flat, padded(clipped_reference(scfg, max_norm), n * z.S)),
        }


WAYS = {
    "local": "rank {r} clipped by its own slice's norm: every rank must scale by the WHOLE "
    "gradient's norm; all-reduce the squared norms of the slices (one number per rank), then take "
    "the square root",
    "unclipped": "shard.grad is the averaged slice, not clipped: the gradient's norm was "
    "{norm:.2f} > max_norm = {max_norm}; scale the slice by min(1, max_norm / (norm + 1e-6)), as "
    "clip_grad_norm_ does",
    "before_divide": "the slice was clipped by the norm of the SUM over ranks, then ÷ N: divide "
    "by ctx.world_size first, then take the norm",
    "no_divide": "shard.grad is the clipped SUM over ranks; here the average's norm ({norm:.2f}) "
    "is under max_norm, so clipping does not hide it: divide by ctx.world_size before the norm",
    "sum": "shard.grad is the SUM over ranks, N× the average: divide by ctx.world_size",
}
"""A way of clipping that a mistake leads to → the hint it gets."""

RIGHT_COUNTS = {"reduce_scatter": 1, "all_reduce": 1, "all_gather": 1}
"""The collectives of one clipped ZeRO-1 step: the gradients reduce-scattered, the squared norm
all-reduced (one number), the parameters all-gathered."""


def mistake(values: dict, max_norm: float) -> str | None:
    """The hint for the first step whose ``shard.grad`` is not the clipped average slice on
    every rank, or None."""
    for k, norm in enumerate(values[0]["norms"]):
        errors = {
            way: max(v["ways"][way][k] for v in values.values()) for way in ("clipped", *WAYS)
        }
        if errors["clipped"] < 1e-5:
            continue
        way = next((w for w in WAYS if errors[w] < 1e-5), None)  # explains every rank
        bad = next(r for r, v in sorted(values.items()) if v["ways"]["clipped"][k] >= 1e-5)
        if way:
            return f"step {k}: " + WAYS[way].format(r=bad, norm=norm, max_norm=max_norm)
        return (
            f"step {k}: rank {bad}'s shard.grad differs from one process's clipped gradient "
            f"slice by {errors['clipped']:.2g}: compare, step by step, the norm you clip by with "
            "the norm of the whole averaged gradient (section 3's step, exercise text)"
        )
    return None


def zero1_clipped(path: str = "ex07_zero.py", max_norm: float = 1.5) -> None:
    """07a.3: ``zero1_clip_step(flat, flat_grad, shard, opt, ctx, max_norm)`` in ``path``: ZeRO-1
    with clipping.

    ``flat`` (N·S,) the padded flat parameters, ``flat_grad`` (N·S,) this rank's gradients,
    ``shard`` the parameter view ``flat[r·S:(r+1)·S]``, ``opt`` AdamW over ``[shard]``, ``ctx``
    the rank's :class:`~mgtutorial.runtime.env.DistContext`, ``max_norm`` the bound on the global
    gradient norm. 4 steps on 2 ranks (the norm is above 1.5 at three, under it at one);
    verifies ``shard.grad`` at every ``opt.step()`` (the average, clipped by the global norm), the
    parameters against one process (``clip_grad_norm_`` + AdamW) and the collectives of each
    step (``CommDebugMode``).
    """
    ex = "07a.3 ZeRO-1 with clipping"
    function_from(path, "zero1_clip_step", ex)  # a missing file or function: before any rank
    cfg = FileWorkerConfig(
        path=str(Path(path).resolve()),
        function="zero1_clip_step",
        options={"steps": 4, "max_norm": max_norm},
    )
    values = run_ranks(ex, clip_step_worker, cfg, 2, timeout_s=30, name=Path(path).stem).values
    for rank, v in sorted(values.items()):
        require(
            v["steps"] == 4,
            ex,
            f"rank {rank} called opt.step() {v['steps']} times in 4 steps: once per step",
        )
        require(
            not v["grad_none"],
            ex,
            f"rank {rank}: shard.grad was None when opt.step() ran, so AdamW stepped "
            "nothing: set it to this rank's slice of the averaged, clipped gradient first",
        )
    hint = mistake(values, max_norm)
    if hint:
        raise ExerciseError(ex, hint)
    for rank, v in sorted(values.items()):
        require(
            v["other_diff"] < 1e-6,
            ex,
            f"rank {rank}: after the first step the parameters outside its slice differ "
            f"from one process by {v['other_diff']:.2g}: all-gather every rank's "
            "updated slice into flat",
        )
        require(
            v["final_diff"] < 1e-5,
            ex,
            f"rank {rank}: after 4 steps the parameters differ from one process by "
            f"{v['final_diff']:.2g}: does every step do the same thing?",
        )
        for step, kinds in enumerate(v["counts"]):
            numels = sorted(v["all_reduce_numels"][step])
            require(
                "reduce_scatter" in kinds or numels[-1:] != [v["flat_numel"]],
                ex,
                f"rank {rank} all-reduced the whole gradient in step {step} and kept a slice: "
                "section 3 counts what that sends against a reduce-scatter; ZeRO-1 needs only "
                "its slice of the sum",
            )
            require(
                kinds == RIGHT_COUNTS,
                ex,
                f"rank {rank} ran {kinds or 'no collectives'} in step {step}: clipped ZeRO-1 "
                "needs one reduction of the gradients (reduce-scatter), one all-reduce of the "
                "squared norm (one number) and one all-gather of the parameters",
            )
            require(
                numels == [1],
                ex,
                f"rank {rank}'s all-reduce in step {step} moved {numels} elements: what must "
                "each rank send for the global norm, against what it already holds after the "
                "reduce-scatter (section 3 counts the bytes)?",
            )
    how = "1 reduce-scatter + 1 all-reduce of the squared norm + 1 all-gather per step"
    binds = [k for k, norm in enumerate(values[0]["norms"]) if norm > max_norm]
    passed(
        ex,
        f"averaged gradient slice clipped by the global norm (it binds at steps {binds}, not at "
        "the others), parameters equal one process (clip_grad_norm_ + AdamW) after 4 steps on 2 "
        f"ranks, {how}",
    )
