"""The flaws of the blog post the course started from, each reproduced by code you can run, next to
the fixed form.

Taught in notebooks/06a_article_ddp.ipynb (the DDP CNN started with ``mp.spawn``) and
notebooks/06b_article_model_parallel.ipynb (the "model parallel" MLP of sub-networks), which show
the article's two samples re-created with their flaws and reproduce the flaws that need no process
group in their cells. Here: the workers for the flaws
that need several ranks (each rebuilds one mistake, in our own code, and returns or logs the
symptom) and the plumbing to run a snippet in a fresh interpreter. Follows
https://pytorch.org/docs/stable/notes/ddp.html, https://pytorch.org/docs/stable/distributed.html
and https://pytorch.org/docs/stable/multiprocessing.html.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from mgtutorial.common import data

# ---------------------------------------------------------------------------------------------
from mgtutorial.runtime import env, runlog

# Worker demonstrations (each rank runs one; they return what they saw)


@dataclass(kw_only=True)
class FlawConfig:
    """Configuration of :func:`flaw_worker`."""

    flaw: str = "device_ids"
    """"device_ids" | "no_sampler" | "no_set_epoch" | "fixed_sampler" | "summed_loss" | "no_destroy"."""
    epochs: int = 2
    """Epochs for the data-loading demonstrations."""
    n_samples: int = 16
    """Size of the toy dataset whose sample ids the ranks log."""
    batch_size: int = 4
    """Per-rank batch size."""
    seed: int = 0
    """Seed (the same on every rank, as a careful script would set it)."""


def _ids_loader(cfg: FlawConfig, ctx: env.DistContext, how: str) -> DataLoader:
    ds = torch.utils.data.TensorDataset(torch.arange(cfg.n_samples))
    if how == "no_sampler":  # the article: a plain shuffled loader in every process
        return DataLoader(
            ds,
            batch_size=cfg.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(cfg.seed),
        )
    return data.train_loader(ds, cfg.batch_size, ctx.rank, ctx.world_size, seed=cfg.seed)


def flaw_worker(cfg: FlawConfig) -> dict:
    """Reproduce one flaw of the DDP sample inside a real process group; return what this rank saw.

    * ``device_ids``: wrap a CPU module with ``DDP(module, device_ids=[local_rank])`` as the article
      does (it never moves the model to its GPU) → DDP's error message, and the right wrapping.
    * ``no_sampler`` / ``no_set_epoch`` / ``fixed_sampler``: the sample ids each rank trains on per
      epoch (``ids``: epoch → list), with a plain shuffled loader, with DistributedSampler but no
      ``set_epoch``, and done right.
    * ``summed_loss``: each rank's sum of batch losses over an epoch (what the article prints) vs
      the mean over all ranks and batches (``global_mean``).
    * ``no_destroy``: return without ``destroy_process_group``: the group is still up when the
      worker ends (``initialized_at_exit``). On gloo nothing is printed at exit; on NCCL torch
      prints "WARNING: destroy_process_group() was not called before program exit, which can leak
      resources" (torch 2.14.1).
    """
    if cfg.flaw == "no_destroy":
        # the article's shape: init, train, return — no destroy_process_group
        dist.init_process_group(env.resolve_backend("auto"))
        dist.all_reduce(torch.ones(1))
        return {"rank": dist.get_rank(), "initialized_at_exit": dist.is_initialized()}
    with env.distributed() as ctx:
        out: dict = {"rank": ctx.rank}
        if cfg.flaw == "device_ids":
            try:
                nn.parallel.DistributedDataParallel(nn.Linear(4, 2), device_ids=[ctx.local_rank])
                out["as_written"] = "no error"
            except (ValueError, RuntimeError, AssertionError) as exc:
                out["as_written"] = f"{type(exc).__name__}: {exc}"
            from mgtutorial.ddp import (
                apply_ddp,  # the fix: move to the rank's device first, device_ids only on GPU
            )

            fixed = apply_ddp(nn.Linear(4, 2), ctx)
            out["fixed"] = f"{type(fixed).__name__} on {next(fixed.parameters()).device}"
        elif cfg.flaw in ("no_sampler", "no_set_epoch", "fixed_sampler"):
            loader = _ids_loader(cfg, ctx, cfg.flaw)
            out["ids"] = {}
            for epoch in range(cfg.epochs):
                if cfg.flaw == "fixed_sampler":
                    loader.sampler.set_epoch(epoch)
                out["ids"][epoch] = [int(i) for (b,) in loader for i in b]
        elif cfg.flaw == "summed_loss":
            env.seed_everything(cfg.seed)
            model = nn.Linear(8, 3)
            g = torch.Generator().manual_seed(cfg.seed + 1 + ctx.rank)
            losses = [
                nn.functional.cross_entropy(
                    model(torch.randn(cfg.batch_size, 8, generator=g)),
                    torch.randint(0, 3, (cfg.batch_size,), generator=g),
                ).item()
                for _ in range(4 + 2 * ctx.rank)
            ]  # ranks with different numbers of batches
            out["summed"] = sum(losses)
            total = torch.tensor(
                [sum(losses), len(losses)], dtype=torch.float64, device=ctx.device
            )  # NCCL: on the GPU
            dist.all_reduce(total)
            out["global_mean"] = float(total[0] / total[1])
        else:
            raise ValueError(f"flaw={cfg.flaw!r} is not one FlawConfig knows.")
        return out


@dataclass(kw_only=True)
class RankConfig:
    """Configuration of :func:`rank_from_gpu_worker`."""

    gpus_per_node: int = 1
    """GPUs per (simulated) node: ranks 0 and 1 are on different nodes when this is 1."""
    claimed_world_size: int | None = None
    """World size to pass to ``init_process_group`` (None: the real one)."""
    use_local_rank_as_rank: bool = True
    """The article's ``rank = gpu``: pass the GPU index (the local rank) as the global rank."""
    timeout_s: float = 5.0
    """Rendezvous timeout: how long to wait for ranks that never come."""


def rank_from_gpu_worker(cfg: RankConfig) -> dict:
    """Join the process group the article's way: ``rank`` = this process's GPU index on its node.

    On 2 nodes × 1 GPU both processes claim rank 0, and rendezvous fails (two rank-0 stores, or a
    rank that never arrives) within ``timeout_s``. With ``claimed_world_size`` larger than the
    processes actually started (the MLP sample's ``num_gpus × subnets``), the ranks wait for
    peers that do not exist until the timeout. Returns {"rank", "world_size"} when it works.
    """
    gpu = (
        env.rank() % cfg.gpus_per_node
    )  # what the article calls `gpu`: a device index on this node
    rank = gpu if cfg.use_local_rank_as_rank else env.rank()
    world = cfg.claimed_world_size or env.world_size()
    runlog.RunLog().write(kind="rank_claim", claimed_rank=rank, claimed_world_size=world, gpu=gpu)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=cfg.timeout_s)
    )
    try:
        dist.barrier()
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Plumbing for the flaws shown without a process group


def run_snippet(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``code`` (Python source) in a fresh interpreter without ``MASTER_ADDR``/``MASTER_PORT``
    (as a plain script started by hand has them); return the finished process (``stdout``,
    ``stderr``, ``returncode``, text)."""
    env_ = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env_
    )


def last_error_line(code: str, timeout: float = 60) -> str:
    """The last line of the error of ``code`` run by :func:`run_snippet`, or "no error". Used for
    the sample's ``set_start_method`` called twice."""
    out = run_snippet(code, timeout)
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if out.returncode else "no error"
