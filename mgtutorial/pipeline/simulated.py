"""A simulated device: the host queues a stage's work and is free while it runs, as with a GPU.

Taught in notebooks/04a_pipeline_gpipe.ipynb (the bubble formula, shown holding) and
notebooks/04b_pipeline_schedules.ipynb (1F1B, interleaved). On a GPU the host only *queues* a
stage's kernels and runs ahead; the timeline that matters is the device's, which CUDA events read.
Here every rank's arithmetic holds one of the machine's shared cores, so the host's timestamps mix
the pipeline with everything else the machine does.

:class:`DeviceClock` gives each rank a device with a clock of its own. The real schedule runs as
usual (``torch.distributed.pipelining``, real send/recv, real arithmetic, which stays equal to the
unsplit model), and each box it issues also runs on the device: it starts when the device is free
and the box's input is ready *on the device* (the producing box's end, which its rank posts to the
store before it sends the tensor), and lasts a set time. The device's clock ignores how long the
host took, exactly as a GPU's stream does when the host is ahead; nothing else about the step is
simulated. A transfer between devices takes no device time here.
"""

from __future__ import annotations

import torch.distributed as dist

from mgtutorial.pipeline.bubble import producer


def box_seconds(device_ms: float, num_stages: int, n_microbatches: int) -> tuple[float, float]:
    """(forward, backward) seconds of one box: the whole model's forward of one batch,
    ``device_ms``, shared evenly by ``num_stages`` stages and ``n_microbatches`` micro-batches;
    a backward lasts twice a forward."""
    forward_s = device_ms / 1e3 / (num_stages * n_microbatches)
    return forward_s, 2 * forward_s


class DeviceClock:
    """One rank's simulated device: a clock (seconds from 0) and the time it is next free.

    ``store``: a store all ranks share (the box ends travel through it); ``last_stage``: the index
    of the pipeline's last stage (its backward waits for its own forward). One clock per rank,
    shared by the rank's stages (a device runs one box at a time).
    """

    def __init__(
        self, store: dist.Store, forward_s: float, backward_s: float, last_stage: int
    ) -> None:
        self.store, self.last_stage = store, last_stage
        self.seconds = {"forward": forward_s, "backward": backward_s}
        self.free = 0.0

    def box(self, event: str, stage: int, microbatch: int, step: int) -> tuple[float, float]:
        """(start, end) of one box on this device, in device seconds: it starts when the device is
        free and its :func:`~mgtutorial.pipeline.bubble.producer`'s box has ended, and lasts
        its set time. Posts its end for the box that waits for it (call it before the output or the
        gradient is sent on)."""
        dep = producer(event, stage, microbatch, self.last_stage)
        ready = 0.0 if dep is None else float(self.store.get(_key(step, *dep)))
        start = max(self.free, ready)
        self.free = start + self.seconds[event]
        self.store.set(_key(step, stage, event, microbatch), repr(self.free))
        return start, self.free


def _key(step: int, stage: int, event: str, microbatch: int) -> str:
    return f"{step}/{stage}/{event}/{microbatch}"
