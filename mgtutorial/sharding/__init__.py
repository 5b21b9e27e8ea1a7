"""Chapter 07: ZeRO by hand, FSDP2 (``fully_shard``), memory per rank, sharded checkpoints.

- ``model``: the chapter's block stack, batches, training loop and one-process reference
- ``zero``: ZeRO-1/2 by hand, against ``ZeroRedundancyOptimizer`` and DDP
- ``fsdp``: ``fully_shard`` and its collectives, mixed precision, meta-device init
- ``memory``: bytes per rank, predicted and measured
- ``checkpoint``: ``torch.distributed.checkpoint`` save and load
- ``worker``: ``ShardConfig`` and the worker that runs the parts in one process group
"""
