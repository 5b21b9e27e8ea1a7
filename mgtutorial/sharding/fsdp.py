"""FSDP2 (``fully_shard``) on the chapter's block stack: parity with one process and DDP, DTensor
placements, collectives counted, gathered bytes per block, mixed precision, meta-device init.

Taught in notebooks/07_sharding.ipynb. Follows
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html,
https://pytorch.org/tutorials/intermediate/FSDP_tutorial.html and
https://pytorch.org/docs/stable/distributed.tensor.html (DTensor, ``CommDebugMode``).
The parts here run inside :func:`mgtutorial.sharding.zero.worker`; each takes ``(cfg, ctx)`` and returns
a dict of numbers.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from mgtutorial import ddp
from mgtutorial.runtime import env
from mgtutorial.sharding import memory as M
from mgtutorial.sharding import zero as S


def apply_fsdp(
    model: nn.Module,
    mesh,
    reshard_after_forward: bool | None = True,
    mp_policy=None,
    reduce: str = "avg",
) -> nn.Module:
    """``fully_shard`` each block, then the root (which then owns only the head); returns ``model``.

    ``reduce`` sets how gradients are averaged (see :data:`mgtutorial.sharding.zero.REDUCE`); "sum" skips the ÷ N, which is
    what pytorch#162338 reported FSDP2 doing on gloo.
    """
    kw = dict(
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy or MixedPrecisionPolicy(),
    )
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule) and reduce != "avg":
            m.set_force_sum_reduction_for_comms(True)  # SUM on the wire, then ÷ the divide factor
            if reduce == "sum":
                m.set_gradient_divide_factor(1.0)
    return model


def predicted_collectives(blocks: int, reshard_after_forward: bool | None) -> dict[str, int]:
    """FSDP2 collectives per step with ``blocks`` sharded blocks + a root (one unit each).

    Forward all-gathers every unit once. Backward all-gathers again every unit that was resharded
    after forward: all of them for True, none for False, and for None (``fully_shard``'s default)
    every block but not the root, whose parameters stay gathered for the backward that follows at
    once. Each unit's gradients are reduce-scattered once.
    """
    again = {True: blocks + 1, None: blocks, False: 0}[reshard_after_forward]
    return {
        "all_gather_forward": blocks + 1,
        "all_gather_backward": again,
        "reduce_scatter": blocks + 1,
    }


def _count(mode: CommDebugMode, word: str) -> int:
    return sum(v for k, v in mode.get_comm_counts().items() if word in str(k))


def mesh_for(cfg, ctx):
    """The 1-D device mesh of all ``ctx.world_size`` ranks, its device type matching the backend."""
    return init_device_mesh(S.mesh_device_type(ctx.backend, cfg.mesh_device), (ctx.world_size,))


def part_fsdp(cfg, ctx) -> dict:
    """FSDP2 vs one process and vs DDP; DTensor placements; first gradients under each reduce mode.

    Also trains with ``reduce="sum"`` (gradients N× too large): AdamW divides by √v, which scales
    the same way, so those parameters still match one process; only the gradient check shows it.
    """
    mesh, ref_model, ref_losses = mesh_for(cfg, ctx), *S.reference(cfg)
    one = S.make_model(cfg)
    x, y = S.batch(cfg, 0)
    nn.functional.mse_loss(one(x), y).backward()  # gradients of one process on the whole batch
    grads = {}
    for mode in S.REDUCE:
        model = apply_fsdp(S.make_model(cfg).to(ctx.device), mesh, reduce=mode)
        xr, yr = (t.to(ctx.device) for t in S.batch(cfg, 0, ctx.rank, ctx.world_size))
        nn.functional.mse_loss(model(xr), yr).backward()
        g = {k: p.grad for k, p in model.named_parameters()}
        grads[mode] = {
            "vs_mean": S.max_diff(g, {k: p.grad for k, p in one.named_parameters()}),
            "vs_sum": S.max_diff(
                g, {k: ctx.world_size * p.grad for k, p in one.named_parameters()}
            ),
        }
    model = apply_fsdp(
        S.make_model(cfg).to(ctx.device), mesh, cfg.reshard_after_forward, reduce=cfg.reduce
    )
    placements = {
        k: [str(p.placements), list(p.to_local().shape), type(p).__name__]
        for k, p in model.named_parameters()
    }
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    losses = S.train(model, opt.step, cfg, ctx, opt.zero_grad)
    summed = apply_fsdp(S.make_model(cfg).to(ctx.device), mesh, reduce="sum")  # the bug, on purpose
    sopt = torch.optim.AdamW(summed.parameters(), lr=cfg.lr)
    S.train(summed, sopt.step, cfg, ctx, sopt.zero_grad)
    ddp_model = ddp.apply_ddp(S.make_model(cfg), ctx)
    dopt = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr)
    S.train(ddp_model, dopt.step, cfg, ctx, dopt.zero_grad)
    return {
        "placements": placements,
        "first_grads": grads,
        "memory": {"zero3": M.measure(model.parameters(), [opt])},
        "sum_params_vs_one_process": S.max_diff(summed.state_dict(), ref_model.state_dict()),
        "max_diff": {
            "fsdp_vs_one_process": S.max_diff(model.state_dict(), ref_model.state_dict()),
            "fsdp_vs_ddp": S.max_diff(model.state_dict(), ddp_model.module.state_dict()),
            "loss_vs_one_process": max(
                abs(a - b) for a, b in zip(env_mean(losses, ctx), ref_losses)
            ),
        },
    }


def env_mean(values: list[float], ctx) -> list[float]:
    """Each value averaged over the ranks (the loss of the whole batch, from each rank's slice)."""
    return [env.global_mean(v, ctx) for v in values]


def unsharded_bytes(model: nn.Module) -> int:
    """Bytes of parameters currently gathered (plain tensors; sharded ones are DTensors)."""
    return sum(
        p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor)
    )


def part_counts(cfg, ctx) -> list[dict]:
    """Collectives counted with CommDebugMode, and gathered bytes inside each block, per (blocks, reshard).

    On a GPU also ``peak_cuda_bytes`` (``torch.cuda.max_memory_allocated`` over the step; None on CPU,
    which has no allocator counter).
    """
    mesh, rows, cuda = mesh_for(cfg, ctx), [], ctx.device.type == "cuda"
    for blocks in (1, 2, 3):
        for raf in (True, None, False):
            model = apply_fsdp(S.make_model(cfg, blocks).to(ctx.device), mesh, raf)
            alive = []
            for b in model.blocks:  # inside each block's forward, how much is gathered
                b.lin.register_forward_hook(lambda *_: alive.append(unsharded_bytes(model)))
            x, y = (t.to(ctx.device) for t in S.batch(cfg, 0, ctx.rank, ctx.world_size))
            if cuda:
                torch.cuda.reset_peak_memory_stats(ctx.device)
            with CommDebugMode() as fwd:
                loss = nn.functional.mse_loss(model(x), y)
            with CommDebugMode() as bwd:
                loss.backward()
            peak = torch.cuda.max_memory_allocated(ctx.device) if cuda else None
            rows.append(
                {
                    "blocks": blocks,
                    "reshard_after_forward": raf,
                    "alive_bytes": alive,
                    "peak_cuda_bytes": peak,
                    "predicted": predicted_collectives(blocks, raf),
                    "counted": {
                        "all_gather_forward": _count(fwd, "allgather"),
                        "all_gather_backward": _count(bwd, "allgather"),
                        "reduce_scatter": _count(fwd, "reduce_scatter")
                        + _count(bwd, "reduce_scatter"),
                    },
                }
            )
    return rows


def part_mixed(cfg, ctx) -> dict:
    """MixedPrecisionPolicy(bf16 params, fp32 reduce): dtypes inside forward, bytes held at rest, loss gap to fp32.

    ``memory`` (after the last step) is what FSDP2 keeps between steps: fp32 parameter and gradient
    shards and fp32 Adam(W) state, i.e. the "fp32" zero3 row of :func:`mgtutorial.sharding.memory.memory_per_rank`.
    """
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = apply_fsdp(S.make_model(cfg).to(ctx.device), mesh_for(cfg, ctx), mp_policy=policy)
    seen = {}
    model.blocks[0].lin.register_forward_hook(
        lambda m, inp, out: seen.update(
            input=str(inp[0].dtype), weight=str(m.weight.dtype), output=str(out.dtype)
        )
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    losses = env_mean(S.train(model, opt.step, cfg, ctx, opt.zero_grad), ctx)
    p = model.blocks[0].lin.weight
    _, ref_losses = S.reference(cfg)
    return {
        "inside_forward": seen,
        "sharded_param": str(p.dtype),
        "sharded_grad": str(p.grad.dtype),
        "memory": M.measure(model.parameters(), [opt]),
        "losses": losses,
        "fp32_losses": ref_losses,
        "max_loss_gap": max(abs(a - b) for a, b in zip(losses, ref_losses)),
    }


def part_meta(cfg, ctx) -> dict:
    """Build on ``meta``, shard, ``to_empty``, initialise: only shards ever get storage.

    Seeds ``cfg.seed + rank`` on a CPU mesh (no DTensor RNG tracker: each rank draws its shard from its
    own generator) and ``cfg.seed`` on CUDA (DTensor's ``OffsetBasedRNGTracker`` syncs rank 0's state).
    """
    with torch.device("meta"):
        model = S.make_model(cfg)
    before = {"device": str(next(model.parameters()).device), "bytes": 0}
    apply_fsdp(model, mesh_for(cfg, ctx))
    model.to_empty(device=ctx.device)
    # On a CPU mesh each rank draws its shard from its own generator (the same seed would repeat rows
    # across ranks); on CUDA, DTensor's RNG tracker wants one seed and gives each shard its own offset.
    torch.manual_seed(cfg.seed + (ctx.rank if ctx.device.type == "cpu" else 0))
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    shapes = [p.shape for p in model.parameters()]
    bound = {k: 1 / p.shape[1] ** 0.5 for k, p in model.named_parameters() if k.endswith("weight")}
    full = {k: model.get_parameter(k).full_tensor() for k in bound}
    return {
        "before": before,
        "params_bytes": M.held_bytes(model.parameters()),
        "formula": M.memory_per_rank(shapes, ctx.world_size, "zero3")["params"],
        "within_init_bound": all(bool(full[k].abs().max() <= b) for k, b in bound.items()),
        "distinct_rows": all(
            len({tuple(r.tolist()) for r in full[k]}) == full[k].shape[0] for k in full
        ),
    }


BENCH = {
    "ddp": "ddp",
    "zero1": "zero1",
    "zero2": "zero2",
    "fsdp_reshard": "zero3",
    "fsdp_keep": "zero3",
}
"""Benchmarked set-ups → the :data:`mgtutorial.sharding.memory.SCHEMES` entry that predicts their bytes."""


def part_bench(cfg, ctx) -> dict:
    """Each set-up of :data:`BENCH`: bytes held after ``cfg.steps`` steps and mean seconds per step.

    One untimed warm-up step first. Used by benchmarks/sharding.py (not asserted on in tests).
    """
    import dataclasses
    import time

    out = {}
    for name in BENCH:
        model = S.make_model(cfg).to(ctx.device)
        if name.startswith("fsdp"):
            model = apply_fsdp(model, mesh_for(cfg, ctx), name == "fsdp_reshard")
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
            step, zero_grad, opts = opt.step, opt.zero_grad, [opt]
        elif name.startswith("zero"):
            z = S.ZeRO(model, ctx, int(name[-1]), lr=cfg.lr)
            step, zero_grad, opts = z.step, z.zero_grad, [z.opt]
        else:
            model = ddp.apply_ddp(model, ctx, gradient_as_bucket_view=True)
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
            step, zero_grad, opts = opt.step, lambda: opt.zero_grad(set_to_none=False), [opt]
        S.train(model, step, dataclasses.replace(cfg, steps=1), ctx, zero_grad)  # warm-up
        t0 = time.perf_counter()
        S.train(model, step, cfg, ctx, zero_grad)
        out[name] = {
            "step_s": (time.perf_counter() - t0) / cfg.steps,
            "bytes": M.measure(model.parameters(), opts),
        }
    return out
