"""Chapter 04 (and 06b's naive split): model and pipeline parallelism.

- ``naive``: a model split across devices, one stage busy at a time
- ``schedules``: the config, each rank's own stage, the worker that runs every schedule
- ``library``: ``torch.distributed.pipelining``'s stage and schedule, built and stepped
- ``library_order``: the boxes a library schedule runs on one stage, recorded without ranks
- ``simulated``: a stage whose compute does not hold a core (the simulated device)
- ``pp_dp``: pipeline × data parallel on a (dp, pp) mesh, each stage's gradients averaged
- ``zero_bubble``: the zero-bubble schedules (backward split into I and W) and their ideal step
- ``hand_gpipe``: GPipe by hand with send/recv, micro-batch losses weighted by their share
- ``timeline``: the step's boxes, recorded from module hooks and drawn
- ``bubble``: the bubble formula, an ideal step, the measured bubble and its model
- ``activations``: the bytes autograd keeps for backward (ActivationMeter)
- ``handoff``: the hand-off of one activation between two ranks, timed alone
"""
