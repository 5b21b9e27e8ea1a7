"""Chapter 04 (and 06b's naive split): model and pipeline parallelism.

- ``naive``: a model split across devices, one stage busy at a time
- ``schedules``: GPipe by hand and ``torch.distributed.pipelining``'s schedules, the worker
- ``timeline``: the bubble formula and model, the hand-off, activation memory
"""
