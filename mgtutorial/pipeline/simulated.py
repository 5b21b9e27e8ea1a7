"""A simulated device: a stage whose compute does not hold a core.

Taught in notebooks/04a_pipeline_gpipe.ipynb (the bubble formula, shown holding) and
notebooks/04b_pipeline_schedules.ipynb (1F1B, interleaved). On a GPU the host only *queues* a
stage's kernels and is free while they run; on this machine's CPU the stage's arithmetic holds a
core, and two ranks on two busy cores wait for each other's cores. :class:`Busy`, appended to a
stage, keeps the stage's real arithmetic (so every schedule still equals the unsplit model) and adds
a fixed time that the host spends asleep: ``forward_s`` in forward, ``backward_s`` in backward.
With those times much longer than the real arithmetic, the boxes last what a device would take,
and what is left between them is the schedule's own cost (send/recv through gloo, Python).

Follows https://pytorch.org/docs/stable/notes/extending.html (a custom ``autograd.Function``).
"""

from __future__ import annotations

import time

import torch
from torch import nn


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.backward_s)
        return grad, None, None


class Busy(nn.Module):
    """The simulated device's time, for the end of a stage: the identity on ``(B, …)`` tensors,
    after sleeping ``forward_s`` seconds; its backward sleeps ``backward_s`` seconds first (it
    is the first node the stage's backward reaches). No parameters: the stage's ``state_dict``
    keeps its keys."""

    def __init__(self, forward_s: float, backward_s: float):
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.forward_s, self.backward_s)

    def extra_repr(self) -> str:
        return f"forward_s={self.forward_s:g}, backward_s={self.backward_s:g}"


def box_seconds(device_ms: float, num_stages: int, n_microbatches: int) -> tuple[float, float]:
    """(forward, backward) seconds of one box: the whole model's forward of one batch,
    ``device_ms``, shared evenly by ``num_stages`` stages and ``n_microbatches`` micro-batches;
    a backward lasts twice a forward."""
    forward_s = device_ms / 1e3 / (num_stages * n_microbatches)
    return forward_s, 2 * forward_s


def on_simulated_device(
    stage: nn.Sequential, device_ms: float, num_stages: int, n_microbatches: int
) -> nn.Sequential:
    """``stage`` with :class:`Busy` appended (in place; returned), its times from
    :func:`box_seconds`."""
    stage.append(Busy(*box_seconds(device_ms, num_stages, n_microbatches)))
    return stage
