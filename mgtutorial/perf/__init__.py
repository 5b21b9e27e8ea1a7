"""Chapter 09: performance: timing, sweeps, and a cost model.

- ``timing``: timing on CPU and GPU (warm-up, barrier, synchronize, CUDA events), a profiler trace
- ``sweeps``: collective sweeps, the timed trainer and its step worker
- ``costmodel``: what communication costs (bus bandwidth, α–β, ring time, DDP step, hardware)
- ``scaling``: what compute costs and how a step scales (FLOPs, MFU, scaling ratios, a cluster)
"""
