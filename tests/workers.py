"""Worker functions for the multi-rank tests (importable by spawned ranks, unlike test
functions)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from mgtutorial import ddp
from mgtutorial.runtime import env, runlog


@dataclass(kw_only=True)
class FixedLossConfig:
    """Each rank logs loss = ``base + rank`` for ``steps`` steps."""

    base: float = 1.0
    steps: int = 3


def fixed_loss(cfg: FixedLossConfig) -> dict:
    with env.distributed() as ctx, runlog.RunLog() as log:
        log.plan(steps=cfg.steps)
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
        pass
    if ctx.rank == cfg.rank:
        # Like a crash while the process shuts down: this rank's result is recorded (as the rank's
        # first code would record it), then, once every rank's result exists, the process aborts.
        runlog.write_result("done")
        files = [
            runlog.rank_file(runlog.run_dir(), r, "result.json") for r in range(ctx.world_size)
        ]
        while not all(f.exists() for f in files):
            time.sleep(0.01)
        os.abort()
    return "done"


@dataclass(kw_only=True)
class ProbeConfig:
    """Names of the environment variables to report."""

    names: list[str] = field(default_factory=list)


def env_probe(cfg: ProbeConfig) -> dict:
    """Reports the given environment variables (None: unset) and the process group's backend."""
    with env.distributed() as ctx:
        return {
            "env": {n: os.environ.get(n) for n in cfg.names},
            "backend": ctx.backend,
            "pid": os.getpid(),
        }


@dataclass(kw_only=True)
class FailConfig:
    """All ranks all-reduce once per step; rank ``rank`` raises RuntimeError at step ``step``, and
    its peers wait for it in their next all-reduce (for up to ``timeout_s`` seconds)."""

    rank: int = 1
    step: int = 2
    steps: int = 5
    timeout_s: float = 600.0


def fail_at_step(cfg: FailConfig) -> None:
    import torch
    import torch.distributed as dist

    with env.distributed(timeout_s=cfg.timeout_s) as ctx:
        for step in range(1, cfg.steps + 1):
            if ctx.rank == cfg.rank and step == cfg.step:
                raise RuntimeError(f"injected failure on rank {ctx.rank} at step {step}")
            dist.all_reduce(torch.ones(1))


@dataclass(kw_only=True)
class CrashConfig:
    """Rank ``rank`` dies by ``signal_name`` right after an all-reduce, without a Python error."""

    rank: int = 1
    signal_name: str = "SIGSEGV"


def crash_after_allreduce(cfg: CrashConfig) -> None:
    import signal

    import torch
    import torch.distributed as dist

    with env.distributed() as ctx:
        dist.all_reduce(torch.ones(1))
        if ctx.rank == cfg.rank:
            os.kill(os.getpid(), getattr(signal, cfg.signal_name))
        dist.all_reduce(torch.ones(1))  # the peer waits here for the rank that died


@dataclass(kw_only=True)
class ProfiledCollectiveConfig:
    """One call of ``op`` (see :func:`mgtutorial.perf.sweeps.collective_call`) under
    ``torch.profiler``."""

    op: str = "reduce_scatter"
    nbytes: int = 4096


def profiled_collective(cfg: ProfiledCollectiveConfig) -> list[str]:
    """The names of the backend's own events (``gloo:...``) that one call of ``cfg.op`` records."""
    import torch

    from mgtutorial.perf import sweeps

    with env.distributed("gloo") as ctx:
        fn = sweeps.collective_call(cfg.op, cfg.nbytes, ctx.world_size, ctx.device)
        with torch.profiler.profile() as prof:
            fn()
        return sorted({e.name for e in prof.events() if e.name.startswith("gloo:")})


@dataclass(kw_only=True)
class InterruptConfig:
    """The ranks in ``ranks`` send themselves SIGINT (as a notebook's interrupt reaches every
    process of the kernel's group); the others return at once."""

    ranks: tuple[int, ...] = (1,)


def interrupted(cfg: InterruptConfig) -> str:
    import signal

    with env.distributed() as ctx:
        rank = ctx.rank
    if rank in cfg.ranks:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # the KeyboardInterrupt arrives here
    return "returned"
