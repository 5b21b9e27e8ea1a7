"""Chapters 06a-06b: the article's two samples, their flaws reproduced and fixed.

- ``ddp_flaws``: the DDP CNN sample's flaws (sampler, seeds, ranks vs GPUs, the loss printed)
- ``model_parallel_flaws``: the "model parallel" MLP sample, N unsynchronised copies
"""
