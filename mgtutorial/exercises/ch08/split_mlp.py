"""The rank side of exercise 08a.3 (notebooks/08a_tensor_parallel.ipynb): the chapter's hand-split
MLP (:class:`mgtutorial.tensor_parallel.fg.HandTPMLP`) with the learner's forward, compared in
each rank with the unsplit MLP (output, input gradient, every parameter's gradient).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from mgtutorial.common.config import Config
from mgtutorial.exercises._common import function_from, import_file, run_ranks
from mgtutorial.runtime import env
from mgtutorial.runtime.env import BackendChoice
from mgtutorial.tensor_parallel import config, fg, worker
from mgtutorial.tensor_parallel.transformer import MLP


@dataclass(kw_only=True)
class SplitMLPConfig(Config):
    """Configuration of :func:`split_mlp_worker`."""

    path: str
    """The learner's module (absolute path): its ``forward(m, x)`` replaces
    ``HandTPMLP.forward``."""
    h: int = 16
    """Hidden size."""
    ffn: int = 32
    """MLP inner width (a multiple of the world size)."""
    batch: int = 2
    """Batch size b."""
    seq: int = 8
    """Sequence length s."""
    seed: int = 0
    """Seed of the unsplit MLP's weights and of the input."""
    backend: BackendChoice = "auto"
    """The process group's backend; "auto" is NCCL with a GPU per rank, else gloo."""


def ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    """The scalar k that makes ``k · b`` closest to ``a`` (least squares)."""
    return float((a * b).sum() / (b * b).sum())


def split_mlp_worker(cfg: SplitMLPConfig) -> dict:
    """Run the hand-split MLP with the learner's forward and the unsplit MLP on the same input.

    The split MLP is built on an explicit group (``dist.new_group`` of all ranks). Returns
    {"output", "x.grad", "w1", "b1", "w2", "b2": [max |split − unsplit|, least-squares ratio split
    / unsplit]}, "partial_sum" (max |output − this rank's partial sum + b2|, i.e. the output had g
    not summed) and "bias_copies" (least-squares k in output − unsplit = (k − 1)·b2).
    """
    with env.distributed(cfg.backend) as ctx:
        env.seed_everything(cfg.seed)
        group = torch.distributed.new_group(list(range(ctx.world_size)))
        ref = MLP(cfg.h, cfg.ffn).to(ctx.device)
        split = fg.HandTPMLP(ref, ctx.rank, ctx.world_size, group=group)
        x, dy = (t.to(ctx.device) for t in config.inputs(cfg))
        want, want_dx, _ = worker.forward_backward(ref, x, dy)
        split.forward = functools.partial(function_from(cfg.path, "forward"), split)
        out, dx, _ = worker.forward_backward(split, x, dy)
        result = {"output": (out, want), "x.grad": (dx, want_dx)}
        for name, p in split.named_parameters():
            full = ref.get_parameter(fg.unsplit_name(name)).grad
            result[name] = (p.grad, fg.hand_shard(name, full, ctx.rank, ctx.world_size))
        partial = F.linear(F.gelu(F.linear(x, split.w1, split.b1)), split.w2)
        return {
            **{k: [float((a - b).abs().max()), ratio(a, b)] for k, (a, b) in result.items()},
            "partial_sum": float((out - partial - split.b2).abs().max()),
            "bias_copies": 1 + ratio(out - want, split.b2.detach().expand_as(out)),
        }


def run_split(ex: str, path: str) -> dict:
    """Run :func:`split_mlp_worker` on 2 ranks with the learner's module at ``path``; returns
    {rank: its values}. A syntax error or a missing file is named before any rank starts."""
    import_file(path, ex)
    cfg = SplitMLPConfig(path=str(Path(path).resolve()))
    return run_ranks(ex, split_mlp_worker, cfg, 2, name="split_mlp").values
