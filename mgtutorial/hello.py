"""Chapter 00's first multi-rank program: every rank says who it is and all-reduces its rank.

Taught in notebooks/00_setup.ipynb; ``python -m mgtutorial hello`` runs it from the shell::

    torchrun --standalone --nproc-per-node 2 -m mgtutorial hello

Follows https://pytorch.org/docs/stable/distributed.html (``init_process_group`` from environment
variables, ``all_reduce``).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mgtutorial.common.config import Config
from mgtutorial.runtime import env, runlog


@dataclass(kw_only=True)
class HelloConfig(Config):
    """Configuration of :func:`hello` (chapter 00's first multi-rank program)."""

    backend: env.BackendChoice = "auto"
    """"auto" (NCCL with a GPU per local rank, else gloo), "gloo" or "nccl"."""


def hello(cfg: HelloConfig) -> dict:
    """Each rank reports who it is and all-reduces its rank; every rank receives the sum
    0 + 1 + … + (world size − 1).

    Logs one ``kind="hello"`` record and returns it: rank, local_rank, group_rank (the node),
    world_size, backend, device, host, pid, rank_sum and env
    (:func:`~mgtutorial.runtime.env.variables`).
    """
    with env.distributed(cfg.backend) as ctx:
        t = torch.tensor([float(ctx.rank)], device=ctx.device)
        if ctx.initialized:
            dist.all_reduce(t)
        with runlog.RunLog() as log:
            rec = log.write(
                kind="hello",
                local_rank=ctx.local_rank,
                world_size=ctx.world_size,
                group_rank=int(os.environ.get("GROUP_RANK", 0)),
                backend=ctx.backend,
                device=str(ctx.device),
                host=platform.node(),
                pid=os.getpid(),
                rank_sum=int(t.item()),
                env=env.variables(),
            )
        print(
            f"[rank {ctx.rank}] hello, world size {ctx.world_size}, device {ctx.device}", flush=True
        )
        return rec
