"""The collective sweep of chapter 09a (section 2): every collective timed over message sizes, the
input of the α–β fit (:func:`mgtutorial.perf.costmodel.fit_alpha_beta`).

Taught in notebooks/09a_cost_model.ipynb; called as ``sweeps.sweep_worker`` (re-exported by
:mod:`mgtutorial.perf.sweeps`). Follows https://pytorch.org/docs/stable/distributed.html. From
the shell (2 ranks)::

    torchrun --standalone --nproc-per-node 2 benchmarks/collectives.py --out collectives.json
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mgtutorial.common.config import Config
from mgtutorial.perf import costmodel
from mgtutorial.perf.timing import time_op
from mgtutorial.runtime import env, runlog

KIB, MIB = 1024, 1024 * 1024


def collective_call(op: costmodel.Collective, nbytes: int, world_size: int, device: torch.device):
    """A zero-argument function running ``op`` on float32 tensors of nccl-tests' size ``nbytes``.

    all_reduce/broadcast: a buffer of ``nbytes``; all_gather: each rank sends ``nbytes / n`` and
    receives ``nbytes``; reduce_scatter: each rank sends ``nbytes`` and keeps ``nbytes / n``.
    """
    numel = max(world_size, nbytes // 4 // world_size * world_size)
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // world_size, device=device)
    calls = {
        "all_reduce": lambda: dist.all_reduce(full),
        "broadcast": lambda: dist.broadcast(full, src=0),
        "all_gather": lambda: dist.all_gather_single(full, part),
        "reduce_scatter": lambda: dist.reduce_scatter_single(part, full),
    }
    return calls[op]


@dataclass(kw_only=True)
class SweepConfig(Config):
    """Configuration of :func:`sweep_worker`."""

    ops: list[costmodel.Collective] = field(
        default_factory=lambda: ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
    )
    """Collectives to time (see :data:`mgtutorial.perf.costmodel.Collective`)."""
    sizes: list[int] = field(default_factory=lambda: [4 * KIB * 4**i for i in range(7)])
    """Tensor sizes in bytes (nccl-tests' size; default 4 KiB … 16 MiB)."""
    warmup: int = 2
    """Untimed calls per (op, size)."""
    repeats: int = 5
    """Timed calls per (op, size); the median is kept."""
    backend: env.BackendChoice = "auto"
    """"auto" | "gloo" | "nccl"."""
    timeout_s: float = 120.0
    """Collective timeout in seconds."""

    def validate(self, nprocs: int) -> None:
        """Raises ValueError for an unknown op, a size < 4 bytes or fewer than 1 repeat."""
        super().validate(nprocs)  # ops and backend: among their choices
        if min(self.sizes) < 4 or self.repeats < 1 or self.warmup < 0:
            raise ValueError(
                f"sizes ≥ 4 bytes, repeats ≥ 1, warmup ≥ 0 (got {min(self.sizes)}, "
                f"{self.repeats}, {self.warmup})."
            )


def sweep_worker(cfg: SweepConfig) -> list[dict]:
    """Time every (op, size) on every rank; the collective's time is the *slowest* rank's.

    Logs and returns ``kind="collective_time"`` records: ``op``, ``nbytes``, ``world_size``,
    ``time_s`` (median over repeats of the max over ranks), ``time_min_s`` (the fastest repeat:
    the one a busy machine disturbed least), ``times`` (s), ``cpu_min_s`` (the smallest CPU time
    of this rank's timed calls, all its threads, not necessarily the fastest call's: what the
    collective costs a core at least, waiting excluded).
    """
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx, runlog.RunLog() as log:
        out = []
        for op in cfg.ops:
            for nbytes in cfg.sizes:
                call, cpu = collective_call(op, nbytes, ctx.world_size, ctx.device), []

                def fn(call=call, cpu=cpu):  # the process's CPU time too (gloo's threads)
                    c0 = time.process_time()
                    call()
                    cpu.append(time.process_time() - c0)

                seconds = time_op(fn, ctx.device, cfg.warmup, cfg.repeats, barrier=True)
                t = torch.tensor(seconds, device=ctx.device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # done when the last rank is done
                times = t.tolist()
                record = log.write(
                    kind="collective_time",
                    op=op,
                    nbytes=nbytes,
                    world_size=ctx.world_size,
                    time_s=statistics.median(times),
                    time_min_s=min(times),
                    times=times,
                    cpu_min_s=min(cpu[cfg.warmup :]),
                )
                out.append(record)
        return out
