"""Chapter 04 (and 06b's naive split): model and pipeline parallelism.

- ``naive``: a model split across devices, one stage busy at a time
- ``schedules``: ``torch.distributed.pipelining``'s schedules, the worker that runs them all
- ``hand_gpipe``: GPipe by hand with send/recv, micro-batch losses weighted by their share
- ``timeline``: the step's boxes, recorded from module hooks and drawn
- ``bubble``: the bubble formula, an ideal step, the measured bubble and its model
- ``activations``: the bytes autograd keeps for backward (ActivationMeter)
- ``handoff``: the hand-off of one activation between two ranks, timed alone
"""
