"""Sharding: ZeRO-1/2 written by hand, then FSDP2 ``fully_shard``, each checked against one process.

Taught in notebooks/07_sharding.ipynb. Follows
https://pytorch.org/docs/stable/distributed.optim.html (``ZeroRedundancyOptimizer``) and the ZeRO
paper (Rajbhandari et al., 2020). FSDP2 lives in :mod:`mgtutorial.sharding.fsdp`, memory accounting in
:mod:`mgtutorial.sharding.memory`, checkpoints in :mod:`mgtutorial.sharding.checkpoint`.

One worker, :func:`worker`, runs the checks named in ``cfg.parts`` inside one process group and
returns one dict per part (max abs differences, bytes, counts), so a notebook cell or a test pays
for one launch. Every part trains the same tiny :class:`BlockStack` on the same synthetic batches:
rank r takes the r-th of N equal slices of each global batch, so averaged gradients equal the
gradients of one process on the whole batch. From the shell::

    torchrun --standalone --nproc-per-node 2 -m mgtutorial.sharding.zero zero fsdp counts

(the parts to run as arguments; rank 0 prints the results as JSON).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from mgtutorial import ddp
from mgtutorial.runtime import env
from mgtutorial.sharding import memory as M

PARTS = ("zero", "fsdp", "counts", "mixed", "meta", "save", "load", "bench")
REDUCE = ("avg", "sum_then_divide", "sum")


@dataclass(kw_only=True)
class ShardConfig:
    """Configuration of :func:`worker` (chapter 07)."""

    parts: list[str] = field(default_factory=lambda: ["zero", "fsdp"])
    """Checks to run, in order, from :data:`PARTS`."""
    blocks: int = 2
    """Blocks of the :class:`BlockStack` (each one FSDP unit); the head is the root's."""
    width: int = 10
    """Features of every block (10 rows do not split evenly over 4 ranks: padding shows)."""
    out_features: int = 3
    """Outputs of the head (3 rows: over 4 ranks, the last rank owns none)."""
    batch_size: int = 8
    """Samples per global batch, split evenly over the ranks."""
    steps: int = 3
    """Optimizer steps."""
    lr: float = 0.05
    """AdamW learning rate."""
    seed: int = 0
    """Seed of the model and of the batches (the same on every rank)."""
    reduce: str = "avg"
    """FSDP2 gradient reduction: "avg" (default), "sum_then_divide" (SUM, then ÷ N), "sum" (no ÷ N)."""
    reshard_after_forward: bool | None = True
    """FSDP2: free gathered parameters after forward (True ≈ ZeRO-3), keep them (False ≈ ZeRO-2), None: all but the root's."""
    mesh_device: str = "auto"
    """Device type of the mesh: "auto" (the backend's), "cpu" or "cuda"; must match the backend."""
    checkpoint_dir: str = ""
    """Folder of the "save" / "load" parts (full state dict ``full.pt`` and DCP folder ``dcp/``)."""
    backend: str = "auto"
    """"auto" | "gloo" | "nccl"."""

    def validate(self, world_size: int) -> None:
        """Refuse, before any rank starts, what would fail or silently differ later.

        Raises:
            ValueError: unknown part or reduce mode; batch not divisible by the world size; a mesh
                device type that does not match the backend; save/load without ``checkpoint_dir``.
        """
        bad = [p for p in self.parts if p not in PARTS]
        if bad or self.reduce not in REDUCE:
            raise ValueError(
                f"parts={self.parts} / reduce={self.reduce!r}: use parts from {PARTS}, reduce from {REDUCE}."
            )
        if self.batch_size % world_size:
            raise ValueError(
                f"batch_size={self.batch_size} does not split over world size {world_size}: "
                "each rank must get the same number of samples for the average to equal one "
                f"process's; use a multiple of {world_size}."
            )
        mesh_device_type(env.resolve_backend(self.backend, world_size), self.mesh_device)
        if {"save", "load"} & set(self.parts) and not self.checkpoint_dir:
            raise ValueError("parts 'save'/'load' need checkpoint_dir=<a folder>.")


def mesh_device_type(backend: str, mesh_device: str = "auto") -> str:
    """The device type for ``init_device_mesh`` that matches ``backend``: gloo → "cpu", nccl → "cuda".

    A gloo group with a "cuda" mesh (or NCCL with "cpu") fails deep inside the first collective or
    crashes (pytorch#132471); this says so first. Raises ValueError on a mismatch.
    """
    expected = "cuda" if backend == "nccl" else "cpu"
    if mesh_device not in ("auto", expected):
        raise ValueError(
            f"mesh_device={mesh_device!r} does not match backend {backend!r}, whose tensors "
            f"live on {expected!r}: use mesh_device='auto' (or {expected!r})."
        )
    return expected


class Block(nn.Module):
    """``x + tanh(Linear(x))``: shapes (B, width) → (B, width)."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class BlockStack(nn.Module):
    """``blocks`` :class:`Block` s then a ``Linear(width, out_features)`` head: (B, width) → (B, out)."""

    def __init__(self, blocks: int = 2, width: int = 10, out_features: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, out_features)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model(cfg: ShardConfig, blocks: int | None = None) -> BlockStack:
    """The seeded model of ``cfg`` (identical on every rank and in the reference)."""
    torch.manual_seed(cfg.seed)
    return BlockStack(cfg.blocks if blocks is None else blocks, cfg.width, cfg.out_features)


def batch(cfg: ShardConfig, step: int, rank: int = 0, world_size: int = 1):
    """Rank ``rank``'s slice of global batch ``step``: X (B/N, width), y (B/N, out_features)."""
    g = torch.Generator().manual_seed(1000 * cfg.seed + step)
    x, y = (
        torch.randn(cfg.batch_size, cfg.width, generator=g),
        torch.randn(cfg.batch_size, cfg.out_features, generator=g),
    )
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def train(model, step_fn, cfg: ShardConfig, ctx, zero_grad) -> list[float]:
    """``cfg.steps`` steps of MSE on this rank's slices; gradients stay after the last step (to measure)."""
    losses = []
    for step in range(cfg.steps):
        zero_grad()
        x, y = (t.to(ctx.device) for t in batch(cfg, step, ctx.rank, ctx.world_size))
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        step_fn()
        losses.append(loss.item())
    return losses


def reference(cfg: ShardConfig) -> tuple[BlockStack, list[float]]:
    """One process, AdamW on the whole batch: the model every parallel run must equal, and its losses."""
    model = make_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    ctx = env.DistContext.single_process()
    return model, train(model, opt.step, cfg, ctx, opt.zero_grad)


def max_diff(a: dict, b: dict) -> float:
    """Largest |a − b| over two state dicts with the same keys (DTensors compared in full)."""
    full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu()
    return max((full(a[k]) - full(b[k])).abs().max().item() for k in b)


class ZeRO:
    """ZeRO by hand: every rank keeps AdamW state for its 1/N slice of one flat parameter buffer.

    The parameters (and, for stage 1, the gradients) are views of flat buffers of N·S elements,
    S = ⌈Ψ/N⌉ (zero padding at the end). :meth:`step` reduce-scatters the gradients (rank r gets
    the sum of slice r over all ranks, the same bytes as half an all-reduce), divides by N, steps
    AdamW on its slice and all-gathers the updated slices back into the parameters. Stage 1 keeps
    the full gradients; stage 2 keeps only its slice of them.
    """

    def __init__(self, model: nn.Module, ctx, stage: int = 1, **adamw):
        self.params, self.ctx, self.stage = list(model.parameters()), ctx, stage
        psi, n = sum(p.numel() for p in self.params), ctx.world_size
        self.S = -(-psi // n)
        self.flat = torch.zeros(n * self.S, device=ctx.device)
        self._views(self.flat, lambda p, v: setattr(p, "data", v.copy_(p.data)))
        self.slice = nn.Parameter(
            self.flat[ctx.rank * self.S : (ctx.rank + 1) * self.S]
        )  # a view, not a copy
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
        """This rank's slice (S elements) of the gradients, summed over ranks by a reduce-scatter, ÷ N."""
        shard = torch.empty(self.S, device=self.ctx.device)
        dist.reduce_scatter_tensor(shard, self.flat_grad, op=dist.ReduceOp.SUM)
        return shard.div_(self.ctx.world_size)

    def step(self):
        self.slice.grad = self.reduce_gradients()
        self.opt.step()
        dist.all_gather_into_tensor(self.flat, self.slice.detach().clone())
        if self.stage == 1:
            self.slice.grad = (
                None  # ZeRO-1 keeps the full gradients; the reduced slice was temporary
            )
        else:
            self.flat_grad = None  # ZeRO-2 keeps only its slice of the gradients
            for p in self.params:
                p.grad = None


def _first_slice_diff(cfg, ctx) -> float:
    """Max |Δ| between ZeRO's reduced gradient slice at step 1 and that slice of one process's gradients."""
    model, one = make_model(cfg).to(ctx.device), make_model(cfg)
    z = ZeRO(model, ctx, 1, lr=cfg.lr)
    z.zero_grad()
    x, y = (t.to(ctx.device) for t in batch(cfg, 0, ctx.rank, ctx.world_size))
    nn.functional.mse_loss(model(x), y).backward()
    x1, y1 = batch(cfg, 0)
    nn.functional.mse_loss(one(x1), y1).backward()  # one process, whole batch
    flat = torch.cat([p.grad.reshape(-1) for p in one.parameters()])
    flat = torch.cat([flat, flat.new_zeros(ctx.world_size * z.S - flat.numel())])
    return (
        (z.reduce_gradients().cpu() - flat[ctx.rank * z.S : (ctx.rank + 1) * z.S])
        .abs()
        .max()
        .item()
    )


def part_zero(cfg, ctx) -> dict:
    """ZeRO-1 and ZeRO-2 by hand, ZeroRedundancyOptimizer and DDP vs one process; bytes held by each."""
    ref, _ = reference(cfg)
    out, final = {"max_diff": {}, "memory": {}}, {}
    for stage in (1, 2):
        model = make_model(cfg).to(ctx.device)
        z = ZeRO(model, ctx, stage, lr=cfg.lr)
        train(model, z.step, cfg, ctx, z.zero_grad)
        final[f"zero{stage}"] = model.state_dict()
        out["memory"][f"zero{stage}"] = M.measure(model.parameters(), [z.opt])
    for name, make_opt in (
        ("ddp", lambda ps: torch.optim.AdamW(ps, lr=cfg.lr)),
        (
            "zero_redundancy",
            lambda ps: ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.AdamW, lr=cfg.lr),
        ),
    ):
        model = ddp.apply_ddp(
            make_model(cfg), ctx, gradient_as_bucket_view=True
        )  # grads = bucket views
        opt = make_opt(model.parameters())
        train(model, opt.step, cfg, ctx, lambda: opt.zero_grad(set_to_none=False))
        final[name] = model.module.state_dict()
        out["memory"][name] = M.measure(
            model.parameters(), [opt.optim if name == "zero_redundancy" else opt]
        )
    out["max_diff"] = {name: max_diff(sd, ref.state_dict()) for name, sd in final.items()}
    out["first_grad_diff"] = _first_slice_diff(cfg, ctx)
    out["max_diff"]["zero1_vs_zero_redundancy"] = max_diff(final["zero1"], final["zero_redundancy"])
    return out


def worker(cfg: ShardConfig) -> dict:
    """Run ``cfg.parts`` in order in one process group.

    Returns ``{"world_size": N, "part_s": {part: seconds it took}, part: result, ...}`` (JSON numbers).
    """
    from mgtutorial.sharding import checkpoint as C
    from mgtutorial.sharding import fsdp as F

    run = {
        "zero": part_zero,
        "fsdp": F.part_fsdp,
        "counts": F.part_counts,
        "mixed": F.part_mixed,
        "meta": F.part_meta,
        "save": C.part_save,
        "load": C.part_load,
        "bench": F.part_bench,
    }
    out: dict = {"part_s": {}}
    with env.distributed(cfg.backend) as ctx:
        for part in cfg.parts:
            t0 = time.perf_counter()
            out[part] = run[part](cfg, ctx)
            out["part_s"][part] = time.perf_counter() - t0
        return {"world_size": ctx.world_size, **out}


if __name__ == "__main__":
    import json
    import sys

    result = worker(ShardConfig(parts=sys.argv[1:] or ["zero", "fsdp"]))
    if env.rank() == 0:
        print(json.dumps(result, indent=1))
