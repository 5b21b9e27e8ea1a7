"""Chapters 01-03b: data parallelism.

- ``trainer``: ``DDPConfig``, ``Trainer`` (the one training loop) and the chapter-02 ``worker``
  (re-exported here: ``ddp.worker``, ``ddp.DDPConfig``)
- ``collectives``: the tour of collectives and DDP by hand (chapter 03a)
- ``internals``: hooks, buckets, gradient accumulation, pitfalls and SyncBatchNorm (chapter 03b)
"""

from mgtutorial.ddp.trainer import (
    DDPConfig,
    Trainer,
    apply_ddp,
    build,
    combined_batch_reference,
    log_step,
    max_param_diff,
    rank_loader,
    worker,
)

__all__ = [
    "DDPConfig",
    "Trainer",
    "apply_ddp",
    "build",
    "combined_batch_reference",
    "log_step",
    "max_param_diff",
    "rank_loader",
    "worker",
]
