"""FSDP2 (``fully_shard``) on the chapter's block stack: parity with one process and DDP, DTensor
placements, collectives counted, gathered bytes per block, mixed precision, meta-device init.

Taught in notebooks/07b_fsdp2.ipynb, sections 1–4. Follows
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html,
https://pytorch.org/tutorials/intermediate/FSDP_tutorial.html and
https://pytorch.org/docs/stable/distributed.tensor.html (DTensor, ``CommDebugMode``).
The parts here run inside :func:`mgtutorial.sharding.worker.worker`; each takes ``(cfg, ctx)``
and returns a dict of numbers.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from mgtutorial import ddp
from mgtutorial.common.compare import collective_counts, max_abs_diff
from mgtutorial.runtime import env
from mgtutorial.sharding import memory
from mgtutorial.sharding.model import batch, make_model, reference, train

Reduce = Literal["avg", "sum_then_divide", "sum"]
"""How FSDP2 reduces gradients: "avg" (its default), "sum_then_divide" (SUM on the wire, then
÷ N), "sum" (no ÷ N: what pytorch#162338 reported FSDP2 doing on gloo)."""
REDUCE = get_args(Reduce)
MeshDevice = Literal["auto", "cpu", "cuda"]
"""The device type of the mesh: "auto" (the backend's), "cpu" or "cuda"."""


def mesh_device_type(backend: str, mesh_device: MeshDevice = "auto") -> str:
    """The device type for ``init_device_mesh`` that matches ``backend``: gloo → "cpu",
    nccl → "cuda".

    A gloo group with a "cuda" mesh (or NCCL with "cpu") fails deep inside the first collective
    or crashes (pytorch#132471); this says so first. Raises ValueError on a mismatch.
    """
    expected = "cuda" if backend == "nccl" else "cpu"
    if mesh_device not in ("auto", expected):
        raise ValueError(
            f"mesh_device={mesh_device!r} does not match backend {backend!r}, whose tensors "
            f"live on {expected!r}: use mesh_device='auto' (or {expected!r})."
        )
    return expected


def apply_fsdp(
    model: nn.Module,
    mesh,
    reshard_after_forward: bool | None = True,
    mp_policy=None,
    reduce: Reduce = "avg",
) -> nn.Module:
    """``fully_shard`` each block, then the root (which then owns only the head); returns ``model``.

    ``reduce`` sets how gradients are averaged (see :data:`Reduce`); "sum" skips the ÷ N, which
    is what pytorch#162338 reported FSDP2 doing on gloo.
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


def mesh_for(cfg, ctx):
    """The 1-D device mesh of all ``ctx.world_size`` ranks, its device type matching the backend."""
    return init_device_mesh(mesh_device_type(ctx.backend, cfg.mesh_device), (ctx.world_size,))


def env_mean(values: list[float], ctx) -> list[float]:
    """Each value averaged over the ranks (the loss of the whole batch, from each rank's slice)."""
    return [env.global_mean(v, ctx) for v in values]


def first_grads(cfg, ctx, mesh) -> dict:
    """Per :data:`REDUCE` mode, max |Δ| of FSDP2's first gradients to one process's gradients on
    the whole batch (``vs_mean``) and to N times them (``vs_sum``)."""
    one = make_model(cfg)
    x, y = batch(cfg, 0)
    nn.functional.mse_loss(one(x), y).backward()  # gradients of one process on the whole batch
    mean = {k: p.grad for k, p in one.named_parameters()}
    grads = {}
    for mode in REDUCE:
        model = apply_fsdp(make_model(cfg).to(ctx.device), mesh, reduce=mode)
        xr, yr = (t.to(ctx.device) for t in batch(cfg, 0, ctx.rank, ctx.world_size))
        nn.functional.mse_loss(model(xr), yr).backward()
        g = {k: p.grad for k, p in model.named_parameters()}
        grads[mode] = {
            "vs_mean": max_abs_diff(g, mean),
            "vs_sum": max_abs_diff(g, {k: ctx.world_size * v for k, v in mean.items()}),
        }
    return grads


def part_fsdp(cfg, ctx) -> dict:
    """FSDP2 vs one process and vs DDP; DTensor placements; first gradients under each reduce mode.

    Also trains with ``reduce="sum"`` (gradients N× too large): AdamW divides by √v, which scales
    the same way, so those parameters still match one process; only the gradient check shows it.
    """
    mesh, (ref_model, ref_losses) = mesh_for(cfg, ctx), reference(cfg)

    def build_and_train():
        model = apply_fsdp(
            make_model(cfg).to(ctx.device), mesh, cfg.reshard_after_forward, reduce=cfg.reduce
        )
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        return model, opt, train(model, opt.step, cfg, ctx, opt.zero_grad)

    (model, opt, losses), allocator = memory.allocator_bytes(build_and_train)
    placements = {
        k: [str(p.placements), list(p.to_local().shape), type(p).__name__]
        for k, p in model.named_parameters()
    }
    summed = apply_fsdp(make_model(cfg).to(ctx.device), mesh, reduce="sum")  # the bug, on purpose
    sopt = torch.optim.AdamW(summed.parameters(), lr=cfg.lr)
    train(summed, sopt.step, cfg, ctx, sopt.zero_grad)
    ddp_model = ddp.apply_ddp(make_model(cfg), ctx)
    dopt = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr)
    train(ddp_model, dopt.step, cfg, ctx, dopt.zero_grad)
    loss_gap = max(abs(a - b) for a, b in zip(env_mean(losses, ctx), ref_losses))
    return {
        "placements": placements,
        "first_grads": first_grads(cfg, ctx, mesh),
        "memory": {"zero3": memory.measure(model.parameters(), [opt])},
        "allocator": {"zero3": allocator},
        "sum_params_vs_one_process": max_abs_diff(summed.state_dict(), ref_model.state_dict()),
        "max_diff": {
            "fsdp_vs_one_process": max_abs_diff(model.state_dict(), ref_model.state_dict()),
            "fsdp_vs_ddp": max_abs_diff(model.state_dict(), ddp_model.module.state_dict()),
            "loss_vs_one_process": loss_gap,
        },
    }


def unsharded_bytes(model: nn.Module) -> int:
    """Bytes of parameters currently gathered (plain tensors; sharded ones are DTensors)."""
    return sum(
        p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor)
    )


def part_counts(cfg, ctx) -> list[dict]:
    """Per (blocks, reshard_after_forward): the collectives of one step counted with
    ``CommDebugMode`` next to :func:`predicted_collectives`, and the gathered bytes inside each
    block's forward (``alive_bytes``).

    On a GPU also ``peak_cuda_bytes`` (``torch.cuda.max_memory_allocated`` over the step; None on
    CPU, which has no allocator counter).
    """
    mesh, rows, cuda = mesh_for(cfg, ctx), [], ctx.device.type == "cuda"
    for blocks in (1, 2, 3):
        for raf in (True, None, False):
            model = apply_fsdp(make_model(cfg, blocks).to(ctx.device), mesh, raf)
            alive = []
            for b in model.blocks:  # inside each block's forward, how much is gathered
                b.lin.register_forward_hook(lambda *_: alive.append(unsharded_bytes(model)))
            x, y = (t.to(ctx.device) for t in batch(cfg, 0, ctx.rank, ctx.world_size))
            if cuda:
                torch.cuda.reset_peak_memory_stats(ctx.device)
            with CommDebugMode() as fwd:
                loss = nn.functional.mse_loss(model(x), y)
            with CommDebugMode() as bwd:
                loss.backward()
            peak = torch.cuda.max_memory_allocated(ctx.device) if cuda else None
            f, b = collective_counts(fwd), collective_counts(bwd)
            counted = {
                "all_gather_forward": f.get("all_gather", 0),
                "all_gather_backward": b.get("all_gather", 0),
                "reduce_scatter": f.get("reduce_scatter", 0) + b.get("reduce_scatter", 0),
            }
            rows.append(
                {
                    "blocks": blocks,
                    "reshard_after_forward": raf,
                    "alive_bytes": alive,
                    "peak_cuda_bytes": peak,
                    "predicted": predicted_collectives(blocks, raf),
                    "counted": counted,
                }
            )
    return rows


def part_mixed(cfg, ctx) -> dict:
    """``MixedPrecisionPolicy(bf16 params, fp32 reduce)``: dtypes inside forward, bytes held at
    rest, loss gap to fp32.

    ``memory`` (after the last step) is what FSDP2 keeps between steps: fp32 parameter and
    gradient shards and fp32 Adam(W) state, i.e. the "fp32" zero3 row of
    :func:`mgtutorial.sharding.memory.memory_per_rank`.
    """
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = apply_fsdp(make_model(cfg).to(ctx.device), mesh_for(cfg, ctx), mp_policy=policy)
    seen = {}

    def dtypes(m, inp, out):
        seen.update(input=str(inp[0].dtype), weight=str(m.weight.dtype), output=str(out.dtype))

    model.blocks[0].lin.register_forward_hook(dtypes)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    losses = env_mean(train(model, opt.step, cfg, ctx, opt.zero_grad), ctx)
    p = model.blocks[0].lin.weight
    _, ref_losses = reference(cfg)
    return {
        "inside_forward": seen,
        "sharded_param": str(p.dtype),
        "sharded_grad": str(p.grad.dtype),
        "memory": memory.measure(model.parameters(), [opt]),
        "losses": losses,
        "fp32_losses": ref_losses,
        "max_loss_gap": max(abs(a - b) for a, b in zip(losses, ref_losses)),
    }


def part_meta(cfg, ctx) -> dict:
    """Build on ``meta``, shard, ``to_empty``, initialise: only shards ever get storage.

    Seeds ``cfg.seed + rank`` on a CPU mesh (no DTensor RNG tracker: each rank draws its shard
    from its own generator) and ``cfg.seed`` on CUDA (DTensor's ``OffsetBasedRNGTracker`` syncs
    rank 0's state).
    """
    with torch.device("meta"):
        model = make_model(cfg)
    before = {"device": str(next(model.parameters()).device), "bytes": 0}
    apply_fsdp(model, mesh_for(cfg, ctx))
    model.to_empty(device=ctx.device)
    # On a CPU mesh each rank draws its shard from its own generator (the same seed would repeat
    # rows across ranks); on CUDA, DTensor's RNG tracker wants one seed and gives each shard its
    # own offset.
    torch.manual_seed(cfg.seed + (ctx.rank if ctx.device.type == "cpu" else 0))
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    shapes = [p.shape for p in model.parameters()]
    bound = {k: 1 / p.shape[1] ** 0.5 for k, p in model.named_parameters() if k.endswith("weight")}
    full = {k: model.get_parameter(k).full_tensor() for k in bound}
    return {
        "before": before,
        "params_bytes": memory.held_bytes(model.parameters()),
        "formula": memory.memory_per_rank(shapes, ctx.world_size, "zero3")["params"],
        "within_init_bound": all(bool(full[k].abs().max() <= b) for k, b in bound.items()),
        "distinct_rows": all(
            len({tuple(r.tolist()) for r in full[k]}) == full[k].shape[0] for k in full
        ),
    }
