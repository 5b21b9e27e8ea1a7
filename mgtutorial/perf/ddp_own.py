"""DDP's own work per step (chapter 09b): the same model stepped plain and wrapped in DDP on a
world of one, so that what DDP adds is its autograd hooks and bucket copies, with no other rank to
wait for. The measured input of :func:`mgtutorial.perf.costmodel.ddp_added_time`.

Taught in notebooks/09b_measurement.ipynb (section 1); called as ``sweeps.ddp_own_worker``
(re-exported by :mod:`mgtutorial.perf.sweeps`). Follows
https://pytorch.org/docs/stable/notes/ddp.html.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from mgtutorial.common.config import Config
from mgtutorial.runtime import env


@dataclass(kw_only=True)
class OwnConfig(Config):
    """Configuration of :func:`ddp_own_worker`."""

    batch_size: int = 1
    """Images per step (chapter 01's CNN, 3×32×32); DDP's own work depends on the gradients'
    bytes, not on the batch, so a small batch keeps the steps, and the noise on them, short."""
    repeats: int = 300
    """Timed pairs of steps (plain and DDP, either first in turn), after 3 untimed ones; the
    median difference is kept."""

    def validate(self, nprocs: int | None = None) -> None:
        """Raises ValueError for a batch size < 1, fewer than 1 repeat, or more than 1 rank."""
        super().validate(nprocs)
        if self.batch_size < 1 or self.repeats < 1:
            raise ValueError(
                f"batch_size={self.batch_size}, repeats={self.repeats}: need both ≥ 1."
            )
        if nprocs not in (None, 1):
            raise ValueError(f"nprocs={nprocs}: ddp_own_worker measures on a world of one; use 1.")


def ddp_own_worker(cfg: OwnConfig) -> dict:
    """DDP's own work per step on the training thread: the same model and batch, plain and
    wrapped in DDP on a world of one (gloo), stepped in turn (either first); there is no other
    rank to wait for, so what DDP adds is its autograd hooks and the copies of the gradients into
    the flat buckets and back. Each pair of steps runs under the same load, so the median of the
    pairs' differences is kept.

    Returns a dict: ``batch_size``; ``plain_s`` (the plain step's median, the training thread's
    CPU time, s); ``own_raw_s`` (median difference DDP − plain of that CPU time over forward +
    backward + optimizer step) and ``own_s`` (the same, at least 0: a negative median is noise),
    the input of :func:`costmodel.ddp_added_time` for CPU time; ``own_wall_s`` (the median
    difference of the same steps' wall time, ``perf_counter``, at least 0), its input for wall
    time;
    ``fwd_s``, ``bwd_s``, ``opt_s`` (the CPU difference per phase).
    Taught in notebooks/09b_measurement.ipynb (section 1);
    https://pytorch.org/docs/stable/notes/ddp.html.
    """
    from torch.nn.parallel import DistributedDataParallel

    from mgtutorial.common import models

    with env.distributed("gloo", num_threads=1):
        torch.manual_seed(0)
        plain = models.ArticleCNN(in_shape=(3, 32, 32))
        wrapped = DistributedDataParallel(models.ArticleCNN(in_shape=(3, 32, 32)))
        pair = [(m, torch.optim.SGD(m.parameters(), lr=0.01)) for m in (plain, wrapped)]
        x, y = torch.randn(cfg.batch_size, 3, 32, 32), torch.randint(0, 10, (cfg.batch_size,))
        diffs, plains, walls = [], [], []
        for i in range(3 + cfg.repeats):
            phases, wall = [], []
            for model, opt in pair if i % 2 else pair[::-1]:  # either first, in turn
                t0 = time.perf_counter()
                c0 = time.thread_time()
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                c1 = time.thread_time()
                loss.backward()
                c2 = time.thread_time()
                opt.step()
                phases.append((c1 - c0, c2 - c1, time.thread_time() - c2))
                wall.append(time.perf_counter() - t0)
            plain_p, ddp_p = phases if i % 2 else phases[::-1]
            plain_w, ddp_w = wall if i % 2 else wall[::-1]
            if i >= 3:
                diffs.append([d - p for p, d in zip(plain_p, ddp_p)])
                plains.append(sum(plain_p))
                walls.append(ddp_w - plain_w)
        med = [statistics.median(d[k] for d in diffs) for k in range(3)]
        raw = statistics.median(sum(d) for d in diffs)
        return {
            "batch_size": cfg.batch_size,
            "plain_s": statistics.median(plains),
            "own_s": max(0.0, raw),
            "own_raw_s": raw,
            "own_wall_s": max(0.0, statistics.median(walls)),
            **dict(zip(("fwd_s", "bwd_s", "opt_s"), med)),
        }
