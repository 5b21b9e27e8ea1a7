"""Chapters 09a and 09b: performance: timing, sweeps, and a cost model.

- ``timing``: timing on CPU and GPU (warm-up, barrier, synchronize, CUDA events), a profiler trace
- ``sweeps``: collective sweeps, the timed trainer and its step worker
- ``ddp_ops``: what DDP adds to a step, op by op, from ``torch.profiler`` (lockstep vs DDP)
- ``costmodel``: what communication costs (bus bandwidth, α–β, ring time, DDP step, hardware)
  and the one dtype table (``Dtypes``) that prices memory and traffic in chapters 07–09
- ``scaling``: what compute costs and how a step scales (FLOPs, MFU, scaling ratios, a cluster)
"""
