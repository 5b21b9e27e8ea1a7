"""Chapter 09: performance: timing, sweeps, and a cost model.

- ``timing``: timing on CPU and GPU, collective sweeps, the timed trainer
- ``costmodel``: pure arithmetic (bus bandwidth, ring time, DDP step, MFU)
"""
