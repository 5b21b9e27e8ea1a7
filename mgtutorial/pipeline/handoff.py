"""The hand-off alone: what it costs to pass one micro-batch's activation to the next stage.

Taught in notebooks/04z_appendix_delays.ipynb (section 2: the delay between boxes that the bubble
formula does not see, held against the hand-off's floor). Uses ``dist.send``/``dist.recv``
(https://pytorch.org/docs/stable/distributed.html#point-to-point-communication), as a pipeline
does per micro-batch.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mgtutorial.common.config import Config
from mgtutorial.runtime import env


@dataclass(kw_only=True)
class HandoffConfig(Config):
    """Configuration of :func:`handoff_worker` (2 ranks)."""

    rows: list[int] = field(default_factory=lambda: [512, 256, 128, 64])
    """Rows of the activation handed over (one micro-batch), one measurement per entry."""
    width: int = 1024
    """Columns of the activation (the layers' width), float32."""
    reps: int = 60
    """Round trips per size; the minimum of all but the first two is the floor reported."""
    backend: env.BackendChoice = "auto"
    """The process group's backend; "auto": NCCL with a GPU per rank, else gloo."""

    def validate(self, nprocs: int) -> None:
        """Before any process starts (:func:`mgtutorial.launch`): 2 ranks, reps ≥ 3, positive
        sizes. Raises ValueError naming the values."""
        super().validate(nprocs)
        sizes_ok = bool(self.rows) and min(self.rows) >= 1 and self.width >= 1
        if nprocs != 2 or self.reps < 3 or not sizes_ok:
            raise ValueError(
                f"the hand-off needs 2 ranks (got {nprocs}), reps ≥ 3 (got {self.reps}), "
                f"positive rows and width (got {self.rows}, {self.width})."
            )


def handoff_worker(cfg: HandoffConfig) -> list[dict]:
    """The hand-off alone: rank 0 sends a ``(rows, width)`` activation, rank 1 receives it and sends
    it back (``dist.send``/``dist.recv``, what a pipeline does per micro-batch), nothing else
    running.

    Returns ``[{"rows", "bytes", "handoff_ms", "median_ms"}]``, one per size: the fastest round
    trip / 2 (ms), the hand-off's floor when no other process takes the core, and the median round
    trip / 2.
    """
    with env.distributed(cfg.backend) as ctx:
        peer, out = 1 - ctx.rank, []
        for rows in cfg.rows:
            x = torch.randn(rows, cfg.width, device=ctx.device)
            times = []
            for _ in range(cfg.reps):
                dist.barrier()
                t0 = _synced(ctx.device)
                first, second = (dist.send, dist.recv) if ctx.rank == 0 else (dist.recv, dist.send)
                first(x, peer)
                second(x, peer)
                times.append((_synced(ctx.device) - t0) / 2)
            out.append(
                {
                    "rows": rows,
                    "bytes": x.numel() * x.element_size(),
                    "handoff_ms": 1e3 * min(times[2:]),
                    "median_ms": 1e3 * statistics.median(times[2:]),
                }
            )
        return out


def _synced(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work (a GPU's kernels)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
