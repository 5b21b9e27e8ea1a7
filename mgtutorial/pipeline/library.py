"""torch.distributed.pipelining on this rank: its stages, the schedule over them, one step.

Taught in notebooks/04a_pipeline_gpipe.ipynb (GPipe with the library, printed there) and
notebooks/04b_pipeline_schedules.ipynb (1F1B, interleaved 1F1B). Follows
https://pytorch.org/docs/stable/distributed.pipelining.html and
https://pytorch.org/tutorials/intermediate/pipelining_tutorial.html: each rank wraps the module(s)
it holds in a ``PipelineStage`` (module, its index among all stages, how many stages, device) and
gives them to a schedule with the micro-batch count and the loss; ``schedule.step`` then runs a
whole batch, with every send and receive between the ranks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


def make_schedule(
    schedule: str,
    modules: list[nn.Module],
    n_microbatches: int,
    rank: int,
    world_size: int,
    device: torch.device,
    group=None,
):
    """The schedule over this rank's stage ``modules``: stage ``rank + i·world_size`` for the
    i-th (one module per rank for GPipe and 1F1B, several for interleaved). Mean cross-entropy per
    micro-batch; the schedule divides the summed gradients by ``n_microbatches``. ``group``: the
    process group of this pipeline's ranks (default: all ranks), in which ``rank`` and
    ``world_size`` are counted (04b's pipeline × data parallel passes the mesh's "pp" group)."""
    n = len(modules) * world_size
    stages = [
        PipelineStage(mod, rank + i * world_size, n, device, group=group)
        for i, mod in enumerate(modules)
    ]
    loss_fn = nn.functional.cross_entropy
    if schedule == "interleaved":  # several stages per rank: the schedule takes the list
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn)
    return CLASSES[schedule](stages[0], n_microbatches, loss_fn=loss_fn)


def step(schedule, x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int) -> float | None:
    """One batch through the pipeline: the first rank gives the inputs ``x`` ``(B, …)``, the
    last the targets ``y`` ``(B,)`` and gets each micro-batch's loss; the others give nothing.
    Returns the batch's mean loss on the last rank, None elsewhere."""
    inputs = (x,) if rank == 0 else ()
    if rank < world_size - 1:
        schedule.step(*inputs)
        return None
    losses = []  # the last rank: targets in, one loss per micro-batch out
    schedule.step(*inputs, target=y, losses=losses)
    return float(torch.stack(losses).mean())
