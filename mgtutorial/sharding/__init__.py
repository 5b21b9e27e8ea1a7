"""Chapters 07a and 07b: ZeRO by hand, FSDP2 (``fully_shard``), memory per rank, activations and
recomputation, sharded checkpoints.

- ``model``: the chapter's block stack, batches, training loop and one-process reference
- ``zero``: ZeRO-1/2 by hand, against ``ZeroRedundancyOptimizer`` and DDP
- ``fsdp``: ``fully_shard`` and its collectives, mixed precision, meta-device init
- ``memory``: bytes per rank, predicted and measured (tensors, and the allocator's events)
- ``recompute``: activation bytes per block, full and selective recomputation
- ``practice``: FSDP2's prefetch order, accumulation without syncing, HSDP
- ``checkpoint``: ``torch.distributed.checkpoint`` save and load of model and optimizer
- ``worker``: ``ShardConfig`` and the worker that runs the parts in one process group
"""
