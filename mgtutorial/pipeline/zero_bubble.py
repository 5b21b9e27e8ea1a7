"""Zero-bubble schedules: the backward split into the input's gradient and the weights' gradient.

Taught in notebooks/04b_pipeline_schedules.ipynb (section 2). Follows
https://pytorch.org/docs/stable/distributed.pipelining.html (``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``) and Qi et al., 2024, "Zero Bubble Pipeline Parallelism". A stage's
backward is two actions: **I**, the gradient of its input, which the previous stage waits for, and
**W**, the gradients of its weights, which nobody waits for and which the schedule moves into the
gaps. Each schedule lists its actions per rank (``pipeline_order``); :func:`order_events` lays them
out as an ideal step, each action starting when its rank is free and its input is ready.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from mgtutorial.common.config import Config
from mgtutorial.pipeline import schedules
from mgtutorial.runtime import env

ZeroBubble = Literal[
    "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleInterleaved1F1B"
]


@dataclass(kw_only=True)
class ZeroBubbleConfig(Config):
    """Configuration of :func:`worker`: one step of a zero-bubble schedule (or, to lay it out the
    same way, interleaved 1F1B), two stages per rank."""

    schedule: ZeroBubble = "ScheduleInterleavedZeroBubble"
    """The torch.distributed.pipelining schedule."""
    n_microbatches: int = 4
    """Micro-batches per step (m)."""
    sizes: list[int] = field(default_factory=lambda: [16] * 5)
    """Layer widths of the MLP: four sub-networks, one per stage."""
    backend: env.BackendChoice = "auto"
    """The process group's backend ("auto": NCCL with a GPU per rank, else gloo)."""


def stage_ids(schedule: str, rank: int, world_size: int) -> list[int]:
    """The two stages of ``rank``: r and r + p (interleaved), or r and 2p − 1 − r (the "V" of
    ``ScheduleZBVZeroBubble``, where the last rank holds the middle two stages)."""
    if schedule == "ScheduleZBVZeroBubble":
        return [rank, 2 * world_size - 1 - rank]
    return [rank, rank + world_size]


def worker(cfg: ZeroBubbleConfig) -> dict:
    """One step on 4 stages over ``world_size`` = 2 ranks; returns {"order": rank 0's copy of the
    schedule's actions per rank (as ``"2F0"``, ``"3I1"``, ``"1W3"``: stage, action, micro-batch),
    "max_grad_diff": the largest difference between this rank's gradients and those of the
    unsplit model on the same batch}."""
    from torch.distributed import pipelining

    with env.distributed(cfg.backend, 60) as ctx:
        p, r = ctx.world_size, ctx.rank
        pc = schedules.PipelineConfig(
            sizes=cfg.sizes, batch_size=4 * cfg.n_microbatches, n_microbatches=cfg.n_microbatches
        )
        ids = stage_ids(cfg.schedule, r, p)
        mods = [schedules.build_stage(pc, i, 2 * p).to(ctx.device) for i in ids]
        stages = [pipelining.PipelineStage(mod, i, 2 * p, ctx.device) for mod, i in zip(mods, ids)]
        schedule = getattr(pipelining, cfg.schedule)(
            stages, cfg.n_microbatches, loss_fn=nn.functional.cross_entropy
        )
        x, y = next(schedules.batches(pc))
        first, last = 0 in ids, 2 * p - 1 in ids  # whether this rank feeds inputs or targets
        inputs = (x.to(ctx.device),) if first else ()
        schedule.step(*inputs, **({"target": y.to(ctx.device)} if last else {}))
        model = schedules.initial_mlp(pc)  # the unsplit model, the same batch, on the CPU
        nn.functional.cross_entropy(model(x), y).backward()
        ref = model.split(2 * p)
        diff = max(
            (a.grad.cpu() - b.grad).abs().max().item()
            for mod, i in zip(mods, ids)
            for a, b in zip(mod.parameters(), ref[i].parameters())
        )
        order = {
            k: [str(a) for a in v if a is not None] for k, v in schedule.pipeline_order.items()
        }
        return {"order": order, "max_grad_diff": diff}


def _action(text: str) -> tuple[int, str, int]:
    """``"2I1"`` → (stage 2, "I", micro-batch 1)."""
    kind = next(c for c in text if c.isalpha())
    stage, mb = text.split(kind)
    return int(stage), kind, int(mb)


def order_events(order: dict, num_stages: int, seconds: dict | None = None) -> list[dict]:
    """An ideal step from a schedule's actions per rank (``order``: rank → ``["0F0", …]``): each
    action starts when its rank is free and its input is ready (F after the previous stage's F of
    that micro-batch; I after the next stage's I, or the last stage's own F; W after its own I) and
    lasts ``seconds`` (default F 1, I 1, W 1: a backward, I + W, twice a forward; a whole backward
    B, as interleaved 1F1B's, waits like I and lasts I + W). Events as
    :func:`mgtutorial.pipeline.bubble.bubble_measured` reads them (``event`` "forward", "input",
    "weight"), sorted by start.

    Raises:
        RuntimeError: the order deadlocks.
    """
    seconds = dict(seconds or {"F": 1.0, "I": 1.0, "W": 1.0})
    seconds["B"] = seconds["I"] + seconds["W"]
    names = {"F": "forward", "I": "input", "W": "weight", "B": "backward"}
    pending = {int(rank): [_action(a) for a in acts] for rank, acts in order.items()}
    free, end, evs = dict.fromkeys(pending, 0.0), {}, []
    while any(pending.values()):
        progressed = False
        for rank, acts in pending.items():
            while acts:
                stage, kind, mb = acts[0]
                dep = {
                    "F": (stage - 1, "F", mb) if stage > 0 else None,
                    "I": (stage + 1, "I", mb) if stage < num_stages - 1 else (stage, "F", mb),
                    "B": (stage + 1, "B", mb) if stage < num_stages - 1 else (stage, "F", mb),
                    "W": (stage, "I", mb),
                }[kind]
                if dep is not None and dep not in end:
                    break
                start = max(free[rank], end.get(dep, 0.0))
                free[rank] = end[stage, kind, mb] = start + seconds[kind]
                evs.append(
                    {
                        "event": names[kind],
                        "stage": stage,
                        "rank": rank,
                        "microbatch": mb,
                        "step": 1,
                        "start": start,
                        "end": free[rank],
                    }  # fmt: skip
                )
                acts.pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError("the order deadlocks")
    return sorted(evs, key=lambda e: e["start"])
