"""The data of chapter 04's pipelines: a seeded MLP task (inputs and a fixed random teacher's
labels) that every rank and the single-process reference build identically, and the check that it
fits in memory before any rank builds it.

Taught in notebooks/04a_pipeline_gpipe.ipynb and notebooks/04b_pipeline_schedules.ipynb; used
by :mod:`mgtutorial.pipeline.schedules`, :mod:`mgtutorial.pipeline.naive` and the article's sample
(:mod:`mgtutorial.article`).
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def mlp_data(
    n: int = 2048, in_features: int = 1024, num_classes: int = 100, seed: int = 0
) -> TensorDataset:
    """Seeded inputs ``(n, in_features)`` with labels from a fixed random linear teacher
    (learnable). Every rank builds the identical set (same seed): stage 0 needs the inputs, the
    last stage the labels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    teacher = torch.randn(in_features, num_classes, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(1))


def batches(cfg):
    """The ``cfg.steps`` batches ``(x, y)`` of a
    :class:`~mgtutorial.pipeline.schedules.PipelineConfig` that every rank and the reference agree
    on."""
    ds = mlp_data(cfg.steps * cfg.batch_size, cfg.sizes[0], cfg.sizes[-1], seed=cfg.seed + 1)
    for s in range(cfg.steps):  # copies, as a DataLoader's batches are: each its own storage
        rows = slice(s * cfg.batch_size, (s + 1) * cfg.batch_size)
        yield ds.tensors[0][rows].clone(), ds.tensors[1][rows].clone()


def data_bytes(cfg) -> int:
    """Bytes of the batches :func:`batches` builds up front in every rank: ``steps × batch_size``
    float32 inputs of ``sizes[0]`` features and int64 labels."""
    return cfg.steps * cfg.batch_size * (4 * cfg.sizes[0] + 8)


def check_data_fits(cfg, nprocs: int) -> None:
    """Refuse a run whose data, built whole in each of ``nprocs`` ranks on this machine, would take
    more than half of the memory available now (psutil's ``virtual_memory().available``).

    Raises:
        ValueError: naming the bytes, the memory available and the largest ``steps`` that fits.
    """
    import psutil

    need, free = nprocs * data_bytes(cfg), psutil.virtual_memory().available
    if need > free / 2:
        per_step = need // cfg.steps
        raise ValueError(
            f"steps={cfg.steps} × batch_size={cfg.batch_size} × {cfg.sizes[0]} input features: "
            f"every rank builds all its batches before the first step, {need / 2**30:.1f} GiB "
            f"for {nprocs} rank(s), more than half of the {free / 2**30:.1f} GiB available. Use "
            f"at most steps={int(free / 2 // per_step)} (or a smaller batch_size or sizes[0])."
        )
