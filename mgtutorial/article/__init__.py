"""Chapters 06a-06b: the article's two samples, their flaws reproduced and fixed.

- ``ddp_flaws``: the DDP CNN sample's flaws (sampler, seeds, ranks vs GPUs)
"""
