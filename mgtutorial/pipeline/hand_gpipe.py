"""GPipe by hand: one step of a pipeline written with point-to-point ``dist.send``/``dist.recv``.

Taught in notebooks/04a_pipeline_gpipe.ipynb (section 3a, before the library's schedules of
:mod:`mgtutorial.pipeline.schedules`, whose worker runs it for ``schedule="hand-gpipe"``). Follows
the GPipe schedule (Huang et al., 2019) and
https://pytorch.org/docs/stable/distributed.html#point-to-point-communication.

Unlike ``torch.distributed.pipelining``, which weights every micro-batch's loss by 1/m, each
micro-batch's loss here is weighted by its share of the batch, so batches that do not divide into
equal micro-batches give the full batch's gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mgtutorial.runtime import env


def microbatch_sizes(batch_size: int, n_microbatches: int) -> list[int]:
    """Sizes of ``torch.tensor_split``'s chunks: as equal as possible, the first ones larger."""
    q, r = divmod(batch_size, n_microbatches)
    return [q + 1] * r + [q] * (n_microbatches - r)


def step(
    module: nn.Module, x, y, n_microbatches: int, ctx: env.DistContext, input_grad: bool = False
) -> float:
    """One GPipe step by hand on this rank's stage ``module`` (stage = rank): all forwards (send
    activations on), then all backwards (send gradients back); each micro-batch's loss weighted by
    its share n_i / batch. ``x`` ``(batch, in_features)`` is read on the first stage (with
    ``input_grad`` its gradient is computed too), ``y`` ``(batch,)`` on the last; returns the
    step's loss there (0.0 on the other stages)."""
    s, p, batch = ctx.rank, ctx.world_size, len(y)
    sizes = microbatch_sizes(batch, n_microbatches)
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    in_features = module[0].linear.in_features  # what this stage receives
    inputs, outputs, sends, total = [], [], [], 0.0
    for i, n in enumerate(sizes):
        if s == 0:
            inp = x[bounds[i] : bounds[i + 1]].to(ctx.device).requires_grad_(input_grad)
        else:
            inp = torch.empty(n, in_features, device=ctx.device)
            dist.recv(inp, s - 1)
            inp.requires_grad_()
        out = module(inp)
        if s == p - 1:
            target = y[bounds[i] : bounds[i + 1]].to(ctx.device)
            out = nn.functional.cross_entropy(out, target) * (n / batch)
            total += out.item()
        else:
            sends.append(dist.isend(out.detach(), s + 1))
        inputs.append(inp)
        outputs.append(out)
    for i, out in enumerate(outputs):
        if s == p - 1:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, s + 1)
            out.backward(grad)
        if s > 0:
            sends.append(dist.isend(inputs[i].grad, s - 1))
    for req in sends:
        req.wait()
    return total
