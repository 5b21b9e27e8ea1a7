"""Chapter 07: ZeRO by hand, FSDP2 (``fully_shard``), memory per rank, sharded checkpoints.

- ``zero``: the chapter's config, model, ZeRO by hand and the worker
- ``fsdp``: ``fully_shard`` and its collectives, mixed precision, meta-device init
- ``memory``: bytes per rank, predicted and measured
- ``checkpoint``: ``torch.distributed.checkpoint`` save and load
"""
