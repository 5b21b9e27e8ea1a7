"""The flaws of the article's first sample, the DDP CNN started with ``mp.spawn``, each reproduced
by code you can run, next to the fixed form.

Taught in notebooks/06a_article_ddp.ipynb, which re-creates the sample with its flaws and shows in
its cells the ones that need no process group. Here: the workers for the flaws that need several
ranks (each rebuilds one mistake, in our own code, and returns or logs the symptom), the join of a
process group with a claimed rank and world size (also chapter 06b's "world size = GPUs × subnets"),
and the plumbing to run a snippet in a fresh interpreter. Follows
https://pytorch.org/docs/stable/notes/ddp.html, https://pytorch.org/docs/stable/distributed.html
and https://pytorch.org/docs/stable/multiprocessing.html.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from mgtutorial.common import data
from mgtutorial.common.config import Config
from mgtutorial.runtime import env, runlog
from mgtutorial.runtime.launcher import free_port

# --- worker demonstrations (each rank runs one; they return what they saw) ----------------------

Flaw = Literal["device_ids", "no_sampler", "no_set_epoch", "fixed_sampler", "summed_loss"]
"""The flaws :func:`flaw_worker` reproduces."""


@dataclass(kw_only=True)
class FlawConfig(Config):
    """Configuration of :func:`flaw_worker`."""

    flaw: Flaw = "device_ids"
    """The flaw to reproduce (see :func:`flaw_worker`)."""
    epochs: int = 2
    """Epochs for the data-loading demonstrations."""
    n_samples: int = 16
    """Size of the toy dataset whose sample ids the ranks log."""
    batch_size: int = 4
    """Per-rank batch size."""
    seed: int = 0
    """Seed (the same on every rank, as a careful script would set it)."""


def flaw_worker(cfg: FlawConfig) -> dict:
    """Reproduce one flaw of the DDP sample inside a real process group; return what this rank saw.

    * ``device_ids``: wrap a CPU module with ``DDP(module, device_ids=[local_rank])`` as the article
      does (it never moves the model to its GPU) → DDP's error message, and the right wrapping.
    * ``no_sampler`` / ``no_set_epoch`` / ``fixed_sampler``: the sample ids each rank trains on per
      epoch (``ids``: epoch → list), with a plain shuffled loader, with DistributedSampler but no
      ``set_epoch``, and done right.
    * ``summed_loss``: each rank's sum of batch losses over an epoch (what the article prints) vs
      the mean over all ranks and batches (``global_mean``).

    The missing ``destroy_process_group`` shows only when a process exits the way a script does,
    which a :func:`~mgtutorial.launch` rank does not: see :func:`exit_without_destroy`.
    """
    with env.distributed() as ctx:
        if cfg.flaw == "device_ids":
            return {"rank": ctx.rank, **_device_ids(ctx)}
        if cfg.flaw == "summed_loss":
            return {"rank": ctx.rank, **_summed_loss(cfg, ctx)}
        loader = _ids_loader(cfg, ctx)
        ids = {}
        for epoch in range(cfg.epochs):
            if cfg.flaw == "fixed_sampler":
                loader.sampler.set_epoch(epoch)
            ids[epoch] = [int(i) for (b,) in loader for i in b]
        return {"rank": ctx.rank, "ids": ids}


def _device_ids(ctx: env.DistContext) -> dict:
    try:
        nn.parallel.DistributedDataParallel(nn.Linear(4, 2), device_ids=[ctx.local_rank])
        as_written = "no error"
    except (ValueError, RuntimeError, AssertionError) as exc:
        as_written = f"{type(exc).__name__}: {exc}"
    # the fix: move to the rank's device first, device_ids only on a GPU
    from mgtutorial.ddp import apply_ddp

    fixed = apply_ddp(nn.Linear(4, 2), ctx)
    where = next(fixed.parameters()).device
    return {"as_written": as_written, "fixed": f"{type(fixed).__name__} on {where}"}


def _ids_loader(cfg: FlawConfig, ctx: env.DistContext) -> DataLoader:
    ds = torch.utils.data.TensorDataset(torch.arange(cfg.n_samples))
    if cfg.flaw == "no_sampler":  # the article: a plain shuffled loader in every process
        g = torch.Generator().manual_seed(cfg.seed)
        return DataLoader(ds, batch_size=cfg.batch_size, shuffle=True, generator=g)
    return data.train_loader(ds, cfg.batch_size, ctx.rank, ctx.world_size, seed=cfg.seed)


def batch_losses(rank: int, seed: int = 0, batch_size: int = 4) -> list[float]:
    """Rank ``rank``'s batch losses for one epoch: ``4 + 2 * rank`` batches (unequal on purpose) of
    a fixed ``Linear(8, 3)`` on random data, the same numbers in a rank and in a single process."""
    env.seed_everything(seed)
    model = nn.Linear(8, 3)
    g = torch.Generator().manual_seed(seed + 1 + rank)
    with torch.no_grad():
        return [
            nn.functional.cross_entropy(
                model(torch.randn(batch_size, 8, generator=g)),
                torch.randint(0, 3, (batch_size,), generator=g),
            ).item()
            for _ in range(4 + 2 * rank)
        ]


def _summed_loss(cfg: FlawConfig, ctx: env.DistContext) -> dict:
    losses = batch_losses(ctx.rank, cfg.seed, cfg.batch_size)
    # the sum and the count of every rank's batches (NCCL: on the GPU)
    total = torch.tensor([sum(losses), len(losses)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(total)
    return {"summed": sum(losses), "global_mean": float(total[0] / total[1])}


# --- the end of a script whose process group is still up ----------------------------------------

EXIT_REACHED = "the interpreter's exit ran"
"""What :data:`NO_DESTROY_PROGRAM` writes to stderr from an ``atexit`` handler: the process went
through the interpreter's normal exit, where a live process group is torn down."""

ABORT = "terminate called without an active exception"
"""What the C++ runtime prints when it aborts a process because a thread was left running."""

NO_DESTROY_PROGRAM = f"""
import atexit, os, sys
import torch
import torch.distributed as dist

backend, destroy = sys.argv[1], sys.argv[2] == "destroy"
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else "cpu"
if backend == "nccl":
    torch.cuda.set_device(device)
dist.init_process_group(backend)
dist.all_reduce(torch.ones(1, device=device))  # the training
if destroy:
    dist.destroy_process_group()  # the fix
print("initialized at exit:", dist.is_initialized(), flush=True)
atexit.register(print, {EXIT_REACHED!r}, file=sys.stderr, flush=True)
# the sample's run() returns here, and the script ends: the interpreter exits
"""
"""The DDP sample's shape as a script: join the group, one all-reduce, end with the group still up
(``argv``: backend, then ``destroy`` to call ``destroy_process_group`` first)."""


def exit_without_destroy(
    backend: str = "gloo", nprocs: int = 2, destroy: bool = False, timeout: float = 60.0
) -> list[dict]:
    """Run :data:`NO_DESTROY_PROGRAM` as ``nprocs`` ranks of one group on this machine, each a fresh
    interpreter that ends as a script does: through the interpreter's exit, where C++ objects such
    as the live process group are destroyed (a :func:`~mgtutorial.launch` rank skips that exit with
    ``os._exit``, so it shows none of this). ``destroy=True`` runs the fixed form.

    Returns one dict per rank: ``rank``, ``returncode`` (negative: killed by that signal, −6 for
    an abort), ``initialized_at_exit`` (bool, None if the rank never printed it), ``exit_reached``
    (:data:`EXIT_REACHED` is on its stderr), ``aborted`` (:data:`ABORT` is), ``stderr`` (text).
    What torch 2.14.1 does there: on gloo no warning, but a rank can abort in the teardown of
    gloo's threads (https://github.com/pytorch/pytorch/issues/190489); on NCCL the process group's
    destructor warns ("WARNING: destroy_process_group() was not called before program exit, …")
    from each rank whose rank is a multiple of the node's GPU count. Taught in
    notebooks/06a_article_ddp.ipynb, section 1.7; see
    https://pytorch.org/docs/stable/distributed.html#shutdown.

    Raises:
        ValueError: ``backend`` is not "gloo" or "nccl", or ``nprocs`` < 1.
        subprocess.TimeoutExpired: the ranks had not ended after ``timeout`` s (all are killed).
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: use 'gloo' or 'nccl' (NCCL needs a GPU per rank)")
    if nprocs < 1:
        raise ValueError(f"nprocs={nprocs}: run at least one rank")
    common = {
        **os.environ,
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    argv = [sys.executable, "-c", NO_DESTROY_PROGRAM, backend, "destroy" if destroy else "keep"]
    procs = [
        subprocess.Popen(
            argv,
            env={**common, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(nprocs)
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:  # a rank left waiting for a peer that died: stop it
            if p.poll() is None:
                p.kill()
                p.communicate()
    ranks = []
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        said = [ln.rsplit(" ", 1)[1] for ln in out.splitlines() if ln.startswith("initialized")]
        ranks.append(
            {
                "rank": r,
                "returncode": p.returncode,
                "initialized_at_exit": {"True": True, "False": False}.get(said[-1] if said else ""),
                "exit_reached": EXIT_REACHED in err,
                "aborted": ABORT in err,
                "stderr": err,
            }
        )
    return ranks


# --- a rank and a world size, claimed ------------------------------------------------------------


@dataclass(kw_only=True)
class RankConfig(Config):
    """Configuration of :func:`rank_from_gpu_worker`."""

    gpus_per_node: int = 1
    """GPUs per (simulated) node: ranks 0 and 1 are on different nodes when this is 1."""
    claimed_world_size: int | None = None
    """World size to pass to ``init_process_group`` (None: the real one)."""
    use_local_rank_as_rank: bool = True
    """The article's ``rank = gpu``: pass the GPU index (the local rank) as the global rank."""
    timeout_s: float = 5.0
    """Rendezvous timeout: how long to wait for ranks that never come."""


def join_claimed(rank: int, world_size: int, timeout_s: float) -> dict:
    """Join a gloo process group as ``rank`` of ``world_size`` (whatever the job really is), pass
    one barrier and leave; returns the group's ``{"rank", "world_size"}``.

    Raises what the rendezvous raises when the claims cannot form a group: two processes claiming
    rank 0 (two stores on one port), or ranks that never come (a timeout after ``timeout_s``).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    try:
        dist.barrier()
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    finally:
        dist.destroy_process_group()


def rank_from_gpu_worker(cfg: RankConfig) -> dict:
    """Join the process group the article's way: ``rank`` = this process's GPU index on its node.

    On 2 nodes × 1 GPU both processes claim rank 0, and rendezvous fails (two rank-0 stores, or a
    rank that never arrives) within ``timeout_s``. With ``claimed_world_size`` larger than the
    processes actually started (the MLP sample's ``num_gpus × subnets``), the ranks wait for
    peers that do not exist until the timeout. Logs ``kind="rank_claim"`` first; returns
    {"rank", "world_size"} when it works.
    """
    # what the article calls `gpu`: a device index on this node
    gpu = env.rank() % cfg.gpus_per_node
    rank = gpu if cfg.use_local_rank_as_rank else env.rank()
    world = cfg.claimed_world_size or env.world_size()
    runlog.RunLog().write(kind="rank_claim", claimed_rank=rank, claimed_world_size=world, gpu=gpu)
    return join_claimed(rank, world, cfg.timeout_s)


# --- plumbing for the flaws shown without a process group ---------------------------------------


def run_snippet(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``code`` (Python source) in a fresh interpreter without ``MASTER_ADDR``/``MASTER_PORT``
    (as a plain script started by hand has them); return the finished process (``stdout``,
    ``stderr``, ``returncode``, text). Raises ``subprocess.TimeoutExpired`` after ``timeout`` s."""
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
