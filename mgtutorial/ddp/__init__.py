"""Chapters 01-03c: data parallelism.

- ``trainer``: ``DDPConfig``, ``Trainer`` (the one training loop) and the chapter-02 ``worker``
- ``setup``: what a rank sets up: ``rank_loader``, ``apply_ddp``, ``build``, ``log_step``
- ``reference``: ``combined_batch_reference``, the single-process run DDP equals (chapter 02)
- ``collectives``: the tour of collectives and DDP by hand (chapter 03a)
- ``overlap``: buckets, communication hooks, overlap and accumulation with ``no_sync`` (03b)
- ``by_hand``: DDP by hand with overlap, an all-reduce per parameter, then per bucket (03b)
- ``internals``: DDP's pitfalls: unused parameters, uneven inputs and ``Join`` (03c)
- ``batchnorm``: SyncBatchNorm by hand and the library's (03c)

The names of ``trainer``, ``setup`` and ``reference`` are re-exported here (``ddp.worker``,
``ddp.DDPConfig``, ``ddp.build``, …).
"""

from mgtutorial.ddp.reference import combined_batch_reference
from mgtutorial.ddp.setup import apply_ddp, build, log_step, rank_loader
from mgtutorial.ddp.trainer import DDPConfig, Trainer, worker

__all__ = [
    "DDPConfig",
    "Trainer",
    "apply_ddp",
    "build",
    "combined_batch_reference",
    "log_step",
    "rank_loader",
    "worker",
]
