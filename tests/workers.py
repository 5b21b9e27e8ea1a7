"""Worker functions for the multi-rank tests (importable by spawned ranks, unlike test functions)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from mgtutorial import ddp, env, runlog


@dataclass(kw_only=True)
class FixedLossConfig:
    """Each rank logs loss = ``base + rank`` for ``steps`` steps."""

    base: float = 1.0
    steps: int = 3


def fixed_loss(cfg: FixedLossConfig) -> dict:
    with env.distributed() as ctx, runlog.RunLog() as log:
        for step in range(1, cfg.steps + 1):
            rec = ddp.log_step(log, ctx, step=step, epoch=0, loss=cfg.base + ctx.rank, samples=step)
        return rec


@dataclass(kw_only=True)
class SleepConfig:
    """Sleep ``seconds`` inside the process group, logging a record every 0.1 s."""

    seconds: float = 60.0


def sleeper(cfg: SleepConfig) -> None:
    with env.distributed(), runlog.RunLog() as log:
        end = time.time() + cfg.seconds
        step = 0
        while time.time() < end:
            step += 1
            log.write(kind="tick", step=step)
            time.sleep(0.1)


@dataclass(kw_only=True)
class AbortConfig:
    """Rank ``rank`` finishes its work, then its process aborts during interpreter exit."""

    rank: int = 0


def finish_then_abort(cfg: AbortConfig) -> str:
    with env.distributed() as ctx:
        if ctx.rank == cfg.rank:
            # SIGABRT shortly after the worker returned, like a crash while the process shuts down
            threading.Timer(0.3, os.abort).start()
    return "done"


@dataclass(kw_only=True)
class ProfiledCollectiveConfig:
    """One call of ``op`` (see :func:`mgtutorial.perf.collective_call`) under ``torch.profiler``."""

    op: str = "reduce_scatter"
    nbytes: int = 4096


def profiled_collective(cfg: ProfiledCollectiveConfig) -> list[str]:
    """The names of the backend's own events (``gloo:...``) that one call of ``cfg.op`` records."""
    import torch

    from mgtutorial import perf

    with env.distributed("gloo") as ctx:
        fn = perf.collective_call(cfg.op, cfg.nbytes, ctx.world_size, ctx.device)
        with torch.profiler.profile() as prof:
            fn()
        return sorted({e.name for e in prof.events() if e.name.startswith("gloo:")})
