"""Chapter 07's worker: one process group that runs the checks named in ``cfg.parts`` and returns
one dict per part (max abs differences, bytes, counts), so a notebook cell or a test pays for one
launch.

Taught in notebooks/07a_zero_memory.ipynb and notebooks/07b_fsdp2.ipynb. The parts live with their
idea: ZeRO by hand in :mod:`mgtutorial.sharding.zero`, FSDP2 in :mod:`mgtutorial.sharding.fsdp`,
checkpoints in :mod:`mgtutorial.sharding.checkpoint`; "bench" (every set-up side by side, for
benchmarks/sharding.py) is here. From the shell::

    torchrun --standalone --nproc-per-node 2 -m mgtutorial.sharding.worker zero fsdp counts

(the parts to run as arguments; rank 0 prints the results as JSON).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from mgtutorial import ddp
from mgtutorial.common.config import Config
from mgtutorial.runtime import env
from mgtutorial.sharding import checkpoint, fsdp, memory, practice, zero
from mgtutorial.sharding.model import make_model, train

Part = Literal["zero", "fsdp", "counts", "mixed", "meta", "save", "load", "practice", "bench"]
"""A check :func:`worker` can run (see :data:`PARTS` for the function behind each)."""


@dataclass(kw_only=True)
class ShardConfig(Config):
    """Configuration of :func:`worker` (chapter 07)."""

    parts: list[Part] = field(default_factory=lambda: ["zero", "fsdp"])
    """Checks to run, in order (see :data:`Part`)."""
    blocks: int = 2
    """Blocks of the :class:`~mgtutorial.sharding.model.BlockStack` (each one FSDP unit); the
    head is the root's."""
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
    reduce: fsdp.Reduce = "avg"
    """FSDP2 gradient reduction: "avg" (default), "sum_then_divide" (SUM, then ÷ N), "sum"
    (no ÷ N)."""
    reshard_after_forward: bool | None = True
    """FSDP2: free gathered parameters after forward (True ≈ ZeRO-3), keep them (False ≈
    ZeRO-2), None: all but the root's."""
    mesh_device: fsdp.MeshDevice = "auto"
    """Device type of the mesh: "auto" (the backend's), "cpu" or "cuda"; must match the backend."""
    checkpoint_dir: str = ""
    """Folder of the "save" / "load" parts (full state dict ``full.pt`` and DCP folder ``dcp/``)."""
    backend: env.BackendChoice = "auto"
    """"auto" | "gloo" | "nccl"."""

    def validate(self, nprocs: int) -> None:
        """Refuse, before any rank starts, what would fail or silently differ later.

        Raises:
            ValueError: unknown part or reduce mode; batch not divisible by the world size; a
                mesh device type that does not match the backend; save/load without
                ``checkpoint_dir``.
        """
        super().validate(nprocs)  # parts, reduce, mesh_device, backend: among their choices
        if self.batch_size % nprocs:
            raise ValueError(
                f"batch_size={self.batch_size} does not split over world size {nprocs}: "
                "each rank must get the same number of samples for the average to equal one "
                f"process's; use a multiple of {nprocs}."
            )
        fsdp.mesh_device_type(env.resolve_backend(self.backend, nprocs), self.mesh_device)
        if {"save", "load"} & set(self.parts) and not self.checkpoint_dir:
            raise ValueError("parts 'save'/'load' need checkpoint_dir=<a folder>.")
        if "practice" in self.parts and (nprocs < 4 or nprocs % 2):
            raise ValueError(
                f"part 'practice' builds a 2 × (N / 2) HSDP mesh: it needs an even world size of "
                f"at least 4, not {nprocs}; launch it on 4 ranks."
            )


BENCH = {
    "ddp": "ddp",
    "zero1": "zero1",
    "zero2": "zero2",
    "fsdp_reshard": "zero3",
    "fsdp_keep": "zero3",
}
"""Benchmarked set-ups → the :data:`mgtutorial.sharding.memory.SCHEMES` entry that predicts
their bytes."""


def part_bench(cfg: ShardConfig, ctx) -> dict:
    """Each set-up of :data:`BENCH`: bytes held after ``cfg.steps`` steps and mean seconds per
    step, ``{name: {"step_s", "bytes"}}``.

    One untimed warm-up step first. Used by benchmarks/sharding.py (not asserted on in tests).
    """
    out = {}
    for name in BENCH:
        model = make_model(cfg).to(ctx.device)
        if name.startswith("fsdp"):
            model = fsdp.apply_fsdp(model, fsdp.mesh_for(cfg, ctx), name == "fsdp_reshard")
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
            step, zero_grad, opts = opt.step, opt.zero_grad, [opt]
        elif name.startswith("zero"):
            z = zero.ZeRO(model, ctx, int(name[-1]), lr=cfg.lr)
            step, zero_grad, opts = z.step, z.zero_grad, [z.opt]
        else:
            model = ddp.apply_ddp(model, ctx, gradient_as_bucket_view=True)
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
            step, zero_grad, opts = opt.step, lambda: opt.zero_grad(set_to_none=False), [opt]
        train(model, step, dataclasses.replace(cfg, steps=1), ctx, zero_grad)  # warm-up
        t0 = time.perf_counter()
        train(model, step, cfg, ctx, zero_grad)
        out[name] = {
            "step_s": (time.perf_counter() - t0) / cfg.steps,
            "bytes": memory.measure(model.parameters(), opts),
        }
    return out


PARTS = {
    "zero": zero.part_zero,
    "fsdp": fsdp.part_fsdp,
    "counts": fsdp.part_counts,
    "mixed": fsdp.part_mixed,
    "meta": fsdp.part_meta,
    "save": checkpoint.part_save,
    "load": checkpoint.part_load,
    "practice": practice.part_practice,
    "bench": part_bench,
}
"""Each :data:`Part` → the function ``(cfg, ctx) -> result`` that runs it."""


def worker(cfg: ShardConfig) -> dict:
    """Run ``cfg.parts`` in order in one process group.

    Returns ``{"world_size": N, "part_s": {part: seconds it took}, part: result, ...}`` (JSON
    numbers).
    """
    out: dict = {"part_s": {}}
    with env.distributed(cfg.backend) as ctx:
        for part in cfg.parts:
            t0 = time.perf_counter()
            out[part] = PARTS[part](cfg, ctx)
            out["part_s"][part] = time.perf_counter() - t0
        return {"world_size": ctx.world_size, **out}


if __name__ == "__main__":
    import json
    import sys

    result = worker(ShardConfig(parts=sys.argv[1:] or ["zero", "fsdp"]))
    if env.rank() == 0:
        print(json.dumps(result, indent=1))
