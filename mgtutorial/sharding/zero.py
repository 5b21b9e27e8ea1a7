"""ZeRO-1 and ZeRO-2 written by hand, checked against one process, DDP and torch's
``ZeroRedundancyOptimizer``.

Taught in notebooks/07a_zero_memory.ipynb, section 3. Follows
https://pytorch.org/docs/stable/distributed.optim.html (``ZeroRedundancyOptimizer``) and the ZeRO
paper (Rajbhandari et al., 2020). The model, batches and reference are in
:mod:`mgtutorial.sharding.model`; :func:`part_zero` runs inside
:func:`mgtutorial.sharding.worker.worker`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from mgtutorial import ddp
from mgtutorial.common.compare import max_abs_diff
from mgtutorial.sharding import memory
from mgtutorial.sharding.model import batch, make_model, reference, train


class ZeRO:
    """ZeRO by hand: every rank keeps AdamW state for its 1/N slice of one flat parameter
    buffer.

    The parameters (and, for stage 1, the gradients) are views of flat buffers of N·S elements,
    S = ⌈Ψ/N⌉ (zero padding at the end). :meth:`step` reduce-scatters the gradients (rank r gets
    the sum of slice r over all ranks, the same bytes as half an all-reduce), divides by N, steps
    AdamW on its slice and all-gathers the updated slices back into the parameters. Stage 1 keeps
    the full gradients; stage 2 keeps only its slice of them.
    """

    def __init__(self, model: nn.Module, ctx, stage: int = 1, **adamw):
        self.params = list(model.parameters())
        self.ctx, self.stage = ctx, stage
        psi, n = sum(p.numel() for p in self.params), ctx.world_size
        self.S = -(-psi // n)
        self.flat = torch.zeros(n * self.S, device=ctx.device)
        self._views(self.flat, lambda p, v: setattr(p, "data", v.copy_(p.data)))
        lo, hi = ctx.rank * self.S, (ctx.rank + 1) * self.S
        self.slice = nn.Parameter(self.flat[lo:hi])  # a view, not a copy
        self.opt = torch.optim.AdamW([self.slice], **adamw)

    def _views(self, buffer, assign):
        offset = 0
        for p in self.params:
            assign(p, buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def zero_grad(self):
        self.flat_grad = torch.zeros_like(self.flat)  # gradients accumulate into views of it
        self._views(self.flat_grad, lambda p, v: setattr(p, "grad", v))

    def reduce_gradients(self) -> torch.Tensor:
        """This rank's slice (S elements) of the gradients, summed over ranks by a
        reduce-scatter, ÷ N."""
        shard = torch.empty(self.S, device=self.ctx.device)
        dist.reduce_scatter_single(shard, self.flat_grad, op=dist.ReduceOp.SUM)
        return shard.div_(self.ctx.world_size)

    def step(self):
        self.slice.grad = self.reduce_gradients()
        self.opt.step()
        dist.all_gather_single(self.flat, self.slice.detach().clone())
        if self.stage == 1:
            # ZeRO-1 keeps the full gradients; the reduced slice was temporary
            self.slice.grad = None
        else:
            self.flat_grad = None  # ZeRO-2 keeps only its slice of the gradients
            for p in self.params:
                p.grad = None


def backend_collectives(fn) -> list[str]:
    """The backend's own collective events (``gloo:…``, ``nccl:…``) that ``fn()`` records under
    ``torch.profiler``, in order: what actually ran on the wire, whatever the Python call was
    named (on gloo a ``reduce_scatter_single`` runs as ``gloo:all_reduce`` plus a local copy)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    return [e.name for e in events if e.name.split(":")[0] in ("gloo", "nccl")]


def first_slice_diff(cfg, ctx) -> float:
    """Max |Δ| between ZeRO's reduced gradient slice at step 1 and that slice of one process's
    gradients on the whole batch."""
    model, one = make_model(cfg).to(ctx.device), make_model(cfg)
    z = ZeRO(model, ctx, 1, lr=cfg.lr)
    z.zero_grad()
    x, y = (t.to(ctx.device) for t in batch(cfg, 0, ctx.rank, ctx.world_size))
    nn.functional.mse_loss(model(x), y).backward()
    x1, y1 = batch(cfg, 0)
    nn.functional.mse_loss(one(x1), y1).backward()  # one process, whole batch
    flat = torch.cat([p.grad.reshape(-1) for p in one.parameters()])
    flat = torch.cat([flat, flat.new_zeros(ctx.world_size * z.S - flat.numel())])
    return max_abs_diff(z.reduce_gradients(), flat[ctx.rank * z.S : (ctx.rank + 1) * z.S])


def wire(cfg, ctx) -> dict[str, list[str]]:
    """The backend collectives of one step (backward + optimizer step) of ZeRO-1 by hand and of
    DDP, from :func:`backend_collectives`; a fresh model each, not the ones compared."""
    x, y = (t.to(ctx.device) for t in batch(cfg, 0, ctx.rank, ctx.world_size))
    model = make_model(cfg).to(ctx.device)
    z = ZeRO(model, ctx, 1, lr=cfg.lr)
    z.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    zero_step = backend_collectives(lambda: (loss.backward(), z.step()))
    ddp_model = ddp.apply_ddp(make_model(cfg), ctx)
    opt = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr)
    loss = nn.functional.mse_loss(ddp_model(x), y)
    return {"zero1": zero_step, "ddp": backend_collectives(lambda: (loss.backward(), opt.step()))}


def part_zero(cfg, ctx) -> dict:
    """ZeRO-1 and ZeRO-2 by hand, ``ZeroRedundancyOptimizer`` and DDP vs one process.

    Returns ``{"max_diff": {set-up: max |Δ| of the parameters to one process, …,
    "zero1_vs_zero_redundancy": …}, "memory": {set-up: bytes held (see
    :func:`mgtutorial.sharding.memory.measure`)}, "allocator": {"zero1": the allocator's net and
    peak bytes over building and training, :func:`~mgtutorial.sharding.memory.allocator_bytes`},
    "first_grad_diff": …, "wire": :func:`wire`}``.
    """
    ref, _ = reference(cfg)
    out, final = {"max_diff": {}, "memory": {}}, {}
    out["allocator"] = {}
    for stage in (1, 2):

        def build_and_train(stage=stage):
            model = make_model(cfg).to(ctx.device)
            z = ZeRO(model, ctx, stage, lr=cfg.lr)
            train(model, z.step, cfg, ctx, z.zero_grad)
            return model, z

        (model, z), out["allocator"][f"zero{stage}"] = memory.allocator_bytes(build_and_train)
        final[f"zero{stage}"] = model.state_dict()
        out["memory"][f"zero{stage}"] = memory.measure(model.parameters(), [z.opt])
    out["wire"] = wire(cfg, ctx)
    optimizers = {
        "ddp": lambda ps: torch.optim.AdamW(ps, lr=cfg.lr),
        "zero_redundancy": lambda ps: ZeroRedundancyOptimizer(
            ps, optimizer_class=torch.optim.AdamW, lr=cfg.lr
        ),
    }
    for name, make_opt in optimizers.items():
        # gradient_as_bucket_view: the gradients are views of DDP's buckets (counted once)
        model = ddp.apply_ddp(make_model(cfg), ctx, gradient_as_bucket_view=True)
        opt = make_opt(model.parameters())
        train(model, opt.step, cfg, ctx, lambda: opt.zero_grad(set_to_none=False))
        final[name] = model.module.state_dict()
        inner = opt.optim if name == "zero_redundancy" else opt
        out["memory"][name] = memory.measure(model.parameters(), [inner])
    out["max_diff"] = {name: max_abs_diff(sd, ref.state_dict()) for name, sd in final.items()}
    out["first_grad_diff"] = first_slice_diff(cfg, ctx)
    out["max_diff"]["zero1_vs_zero_redundancy"] = max_abs_diff(
        final["zero1"], final["zero_redundancy"]
    )
    return out
