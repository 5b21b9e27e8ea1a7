"""A simulated device: each box holds the rank for a set time while leaving the core free, as a
host waiting on a GPU stream would.

Taught in notebooks/04a_pipeline_gpipe.ipynb (the bubble formula, shown holding) and
notebooks/04b_pipeline_schedules.ipynb (1F1B, interleaved). On a GPU the host only *queues* a
stage's kernels; the device computes while the host's core is free, and the timeline that matters
is the device's. Here every rank's arithmetic holds one of the machine's shared cores, so a box's
length depends on who else computes.

:class:`SimulatedDevice` makes each box last a set *device time* on the wall clock without holding
a core: the real schedule runs as usual (``torch.distributed.pipelining``, real send/recv, real
arithmetic, which stays equal to the unsplit model), and at the end of each forward or backward box
the rank sleeps until the box has lasted its device time (``time.sleep``: the thread waits, the core
is free for the other ranks). Only the boxes' compute time is simulated; the order of the boxes,
the waits for a neighbour's activation or gradient, the send/recv and the schedule's own Python are
the real run's, and the bubble is measured from the boxes' wall-clock timestamps.
"""

from __future__ import annotations

import time


def box_seconds(device_ms: float, num_stages: int, n_microbatches: int) -> tuple[float, float]:
    """(forward, backward) seconds of one box: the whole model's forward of one batch,
    ``device_ms``, shared evenly by ``num_stages`` stages and ``n_microbatches`` micro-batches;
    a backward lasts twice a forward."""
    forward_s = device_ms / 1e3 / (num_stages * n_microbatches)
    return forward_s, 2 * forward_s


class SimulatedDevice:
    """One rank's simulated device: a forward box lasts ``forward_s`` seconds, a backward box
    ``backward_s`` (wall clock), of which the real arithmetic takes what it takes and a sleep the
    rest. Shared by the rank's stages: the rank runs one box at a time."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        self.seconds = {"forward": forward_s, "backward": backward_s}

    def hold(self, event: str, start: float) -> None:
        """Sleep until the box ``event`` ("forward"|"backward") that started at ``start``
        (``time.time()``, seconds) has lasted its device time; return at once if the arithmetic
        already took longer. Call it before the box's output or gradient is sent on."""
        left = start + self.seconds[event] - time.time()
        if left > 0:
            time.sleep(left)
