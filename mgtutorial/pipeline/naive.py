"""Model parallelism without a pipeline: the naive split of one model over two devices, in one
process, one stage busy at a time.

Taught in notebooks/04a_pipeline_gpipe.ipynb (section 2) and shown again in
notebooks/06b_article_model_parallel.ipynb (what the article's sample should have been). Follows
https://pytorch.org/tutorials/intermediate/model_parallel_tutorial.html. The article's own "model
parallel" sample (N unsynchronised copies) is :mod:`mgtutorial.article.model_parallel_flaws`.
"""

from __future__ import annotations

import torch
from torch import nn

from mgtutorial.common import models
from mgtutorial.pipeline.schedules import PipelineConfig, batches, initial_mlp
from mgtutorial.pipeline.timeline import Timeline
from mgtutorial.runtime import env, runlog


def naive_devices() -> list[torch.device]:
    """cuda:0 and cuda:1 with two GPUs, else the CPU twice (the same code either way)."""
    if env.gpu_count() >= 2:
        return [torch.device("cuda", 0), torch.device("cuda", 1)]
    return [torch.device("cpu")] * 2


class NaiveModelParallel(nn.Module):
    """The MLP cut in two, stage i on ``devices[i]``; ``forward`` moves activations between them.

    Only one device computes at a time: stage 1 waits for stage 0's output, and in backward
    stage 0 waits for stage 1's gradients. Shapes: ``(B, 1024)`` → ``(B, 100)`` on ``devices[-1]``.
    """

    def __init__(self, mlp: models.ArticleMLP, devices: list[torch.device]):
        super().__init__()
        self.devices = devices
        self.stages = nn.ModuleList(st.to(d) for st, d in zip(mlp.split(len(devices)), devices))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, device in zip(self.stages, self.devices):
            x = stage(x.to(device))
        return x


def train_naive(
    cfg: PipelineConfig, devices: list[torch.device] | None = None
) -> tuple[nn.Module, list[dict]]:
    """Train :class:`NaiveModelParallel` in this process on
    :func:`~mgtutorial.pipeline.schedules.batches`; returns (model, events).

    ``devices``: one per stage (default :func:`naive_devices`). Events are the same records
    :class:`~mgtutorial.pipeline.timeline.Timeline` logs (forward/backward per stage), in memory.
    """
    model = NaiveModelParallel(initial_mlp(cfg), devices or naive_devices())
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)

    memory = runlog.MemoryLog()
    timelines = [Timeline(st, i, memory) for i, st in enumerate(model.stages)]
    for step, (x, y) in enumerate(batches(cfg), start=1):
        for t in timelines:
            t.new_step(step)
        opt.zero_grad()
        out = model(x.to(model.devices[0]))
        nn.functional.cross_entropy(out, y.to(out.device)).backward()  # targets to the last device
        opt.step()
    return model, memory.records
