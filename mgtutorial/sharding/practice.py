"""FSDP2 as people run it: a step's timeline with and without explicit forward prefetching
(:mod:`mgtutorial.sharding.prefetch`); gradient accumulation without a reduce-scatter per
micro-batch (``set_requires_gradient_sync``) and without an all-gather per micro-batch
(``set_reshard_after_backward``: parameters kept gathered between micro-batches); HSDP on a 2-D
mesh (replicate × shard); every collective counted and every result compared with one process.

Taught in notebooks/07b_fsdp2.ipynb, section 7. Follows
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html (``set_requires_gradient_sync``
and ``set_reshard_after_backward``, as torch's test_fully_shard_training.py accumulates;
a 2-D mesh makes ``fully_shard`` hybrid: ``(Replicate(), Shard(0))``) and torchtitan's use of both.
:func:`part_practice` runs inside :func:`mgtutorial.sharding.worker.worker` on 4 ranks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from mgtutorial.common.compare import collective_counts, max_abs_diff
from mgtutorial.sharding.fsdp import apply_fsdp, mesh_device_type, mesh_for
from mgtutorial.sharding.model import batch, make_model, reference
from mgtutorial.sharding.prefetch import step_timeline


def accumulate_step(
    model, opt, x, y, micro: int, sync_each: bool, reshard_each: bool = True
) -> dict[str, int]:
    """One optimizer step over ``micro`` micro-batches of this rank's ``(x, y)``; the loss of each
    is divided by ``micro``, so the accumulated gradient is the mean. With ``sync_each=False``
    only the last backward reduces gradients (``set_requires_gradient_sync``); the others keep
    them unsharded and local. With ``reshard_each=False`` only the last backward reshards the
    parameters (``set_reshard_after_backward``): the next micro-batch's forward finds them
    gathered. Returns the step's collectives (``CommDebugMode``)."""
    with CommDebugMode() as comm:
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            model.set_requires_gradient_sync(sync_each or i == micro - 1)
            model.set_reshard_after_backward(reshard_each or i == micro - 1)
            (nn.functional.mse_loss(model(xm), ym) / micro).backward()
        opt.step()
        opt.zero_grad()
    return collective_counts(comm)


def train_accumulating(
    cfg, ctx, model, micro: int, sync_each: bool, reshard_each: bool = True
) -> list[dict]:
    """``cfg.steps`` steps of :func:`accumulate_step` with AdamW; each step's counts."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    counts = []
    for step in range(cfg.steps):
        x, y = (t.to(ctx.device) for t in batch(cfg, step, ctx.rank, ctx.world_size))
        counts.append(accumulate_step(model, opt, x, y, micro, sync_each, reshard_each))
    return counts


def hsdp_mesh(cfg, ctx):
    """A ``(replicate, shard)`` mesh of 2 × (N / 2) ranks: ranks (0, 1) and (2, 3) each hold one
    sharded copy; ranks (0, 2) and (1, 3) hold the same shard and all-reduce its gradients."""
    kind = mesh_device_type(ctx.backend, cfg.mesh_device)
    return init_device_mesh(kind, (2, ctx.world_size // 2), mesh_dim_names=("replicate", "shard"))


def part_practice(cfg, ctx) -> dict:
    """Accumulation over 2 micro-batches: with a reduce-scatter per micro-batch, only in the last
    one, and also without resharding after the first backward ("keep_gathered"); HSDP on a
    2 × (N / 2) mesh: collectives per step (the last step's) and max |Δ| to one process. Needs an
    even world size of at least 4."""
    ref, _ = reference(cfg)
    out = {"blocks": cfg.blocks}
    out["timeline"] = {k: step_timeline(cfg, ctx, k) for k in ("implicit", "prefetch", "async")}
    variants = {
        "sync_each": (True, True),
        "sync_last": (False, True),
        "keep_gathered": (False, False),
    }
    for name, (sync_each, reshard_each) in variants.items():
        model = apply_fsdp(make_model(cfg).to(ctx.device), mesh_for(cfg, ctx))
        counts = train_accumulating(cfg, ctx, model, 2, sync_each, reshard_each)
        out[name] = {
            "counts": counts[-1],
            "max_diff": max_abs_diff(model.state_dict(), ref.state_dict()),
        }
    mesh = hsdp_mesh(cfg, ctx)
    model = make_model(cfg).to(ctx.device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    counts = train_accumulating(cfg, ctx, model, 1, True)
    placements = {k: str(p.placements) for k, p in model.named_parameters()}
    out["hsdp"] = {
        "counts": counts[-1],
        "placements": placements["blocks.0.lin.weight"],
        "local_shape": list(model.blocks[0].lin.weight.to_local().shape),
        "max_diff": max_abs_diff(model.state_dict(), ref.state_dict()),
    }
    return out
