"""Where am I, and what should I run on? Rank, world size, backend, device, seeding, threads.

Taught in notebooks/00_setup.ipynb and notebooks/02_ddp.ipynb.
Follows https://pytorch.org/docs/stable/distributed.html (environment variable initialisation)
and https://pytorch.org/docs/stable/elastic/run.html (the variables torchrun sets).

Every worker reads its identity from the environment, exactly as under ``torchrun``:

=================  ==========================================================
``RANK``           global rank, 0 … world size − 1
``LOCAL_RANK``     rank on this machine; picks the GPU (never the global rank)
``WORLD_SIZE``     number of ranks in the job
``LOCAL_WORLD_SIZE`` ranks on this machine
=================  ==========================================================
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist

from mgtutorial.runtime import runlog
from mgtutorial.runtime.rounds import agree_on_round

Backend = Literal["gloo", "nccl"]
"""A process group's backend."""
BackendChoice = Literal["auto", "gloo", "nccl"]
"""What a config asks for: "auto" is NCCL with a GPU per local rank, else gloo."""
BACKENDS = get_args(BackendChoice)
BACKEND_ENV = "MGTUTORIAL_BACKEND"  # set by mgtutorial.launch: the backend it resolved for the job


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def rank() -> int:
    """Global rank from ``RANK`` (0 when unset, i.e. a plain single process)."""
    return _int_env("RANK", 0)


def local_rank() -> int:
    """Rank on this node from ``LOCAL_RANK`` (0 when unset). Chooses the GPU."""
    return _int_env("LOCAL_RANK", 0)


def world_size() -> int:
    """Number of ranks in the job from ``WORLD_SIZE`` (1 when unset)."""
    return _int_env("WORLD_SIZE", 1)


def local_world_size() -> int:
    """Ranks on this node from ``LOCAL_WORLD_SIZE`` (1 when unset)."""
    return _int_env("LOCAL_WORLD_SIZE", 1)


def restart_count() -> int:
    """How many times torchrun restarted this job (``TORCHELASTIC_RESTART_COUNT``; 0: the first
    attempt)."""
    return _int_env("TORCHELASTIC_RESTART_COUNT", 0)


def is_distributed_env() -> bool:
    """True inside a rank started by :func:`mgtutorial.launch` or ``torchrun`` (``RANK`` is set)."""
    return "RANK" in os.environ and "MASTER_ADDR" in os.environ


def gpu_count() -> int:
    """Number of CUDA devices visible to this process (0 on a CPU-only machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: BackendChoice = "auto", nprocs_per_node: int | None = None) -> Backend:
    """Turn ``"auto" | "gloo" | "nccl"`` into the backend to use, or raise a clear error.

    "auto" is NCCL when CUDA is available with at least one GPU per local rank, else gloo.

    Args:
        backend: requested backend.
        nprocs_per_node: ranks on this node (default ``LOCAL_WORLD_SIZE``).

    Raises:
        ValueError: unknown backend; NCCL without CUDA; NCCL with more ranks than GPUs.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}.")
    n = local_world_size() if nprocs_per_node is None else nprocs_per_node
    gpus = gpu_count()
    if backend == "auto":
        return "nccl" if gpus >= n and gpus > 0 else "gloo"
    if backend == "nccl":
        if gpus == 0:
            raise ValueError(
                "backend='nccl' needs CUDA GPUs, and this machine has none "
                "(torch.cuda.is_available() is False). Use backend='gloo' or 'auto' to run on CPU."
            )
        if n > gpus:
            raise ValueError(
                f"backend='nccl' with {n} ranks per node needs {n} GPUs, but {gpus} are visible. "
                f"Use nprocs={gpus} (one rank per GPU), or backend='gloo' to run on CPU."
            )
    return backend


def device_for(backend: Backend, local_rank_: int | None = None) -> torch.device:
    """The device a rank computes on: ``cuda:LOCAL_RANK`` under NCCL, else CPU.

    The index is the *local* rank: on the second node of a 2×4 GPU job, global rank 5 uses cuda:1.
    """
    if backend == "nccl":
        return torch.device("cuda", local_rank() if local_rank_ is None else local_rank_)
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    """Seed Python and torch (CPU and every GPU) with ``seed``. Offset it by rank yourself where
    the data must differ."""
    random.seed(seed)
    torch.manual_seed(seed)


def set_threads(num_threads: int | None = None) -> int:
    """Set torch's intra-op threads: ``num_threads``, else ``OMP_NUM_THREADS``, else 1 per rank.

    One thread per rank keeps 2 ranks on a 2-core laptop from fighting over cores.
    Returns the number of threads set.
    """
    n = num_threads or _int_env("OMP_NUM_THREADS", 1)
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


@dataclass(frozen=True)
class DistContext:
    """What a rank knows about itself once the process group is up.

    Attributes: rank, local_rank, world_size (ints), backend ("gloo"/"nccl", or None without a
    process group), device (torch.device), initialized (False when running as a plain process
    without a process group; :meth:`single_process` builds that one).
    """

    rank: int
    local_rank: int
    world_size: int
    backend: Backend | None
    device: torch.device
    initialized: bool

    @classmethod
    def single_process(cls, device: torch.device | str = "cpu") -> DistContext:
        """Rank 0 of 1 with no process group: what a single-process reference runs under."""
        return cls(
            rank=0,
            local_rank=0,
            world_size=1,
            backend=None,
            device=torch.device(device),
            initialized=False,
        )

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that prints and saves."""
        return self.rank == 0

    def print(self, *args, **kwargs) -> None:
        """Print on rank 0 only, prefixed ``[rank 0]``."""
        if self.is_main:
            print(f"[rank {self.rank}]", *args, flush=True, **kwargs)


@contextlib.contextmanager
def distributed(
    backend: BackendChoice = "auto", timeout_s: float = 120.0, num_threads: int | None = None
):
    """Join the process group for the duration of the block; leave it cleanly either way.

    Inside a rank (``RANK`` and ``MASTER_ADDR`` set): ``init_process_group`` with the resolved
    backend, ``torch.cuda.set_device(local_rank)`` under NCCL. On normal exit: ``barrier`` then
    ``destroy_process_group``. On an exception: the error is first recorded in this rank's
    ``rank<r>.error.json`` (so the launcher can tell the rank that failed first from the ranks
    that failed because of it), then the group is destroyed *without* a barrier (the other ranks
    may be inside a different collective). Outside a rank, yields a world-size-1 context with no
    process group, so the same worker code runs as a plain function.

    Args:
        backend: "auto" | "gloo" | "nccl" (see :func:`resolve_backend`); "auto" is the backend
            :func:`mgtutorial.launch` resolved for the job where it started the rank.
        timeout_s: collective timeout in seconds; a rank waiting longer for its peers raises.
        num_threads: CPU threads for this rank (see :func:`set_threads`).

    Yields:
        DistContext
    """
    set_threads(num_threads)
    if not is_distributed_env():
        yield DistContext.single_process()
        return
    name = resolve_backend(os.environ.get(BACKEND_ENV, "auto") if backend == "auto" else backend)
    device = device_for(name)
    # torch reads TORCH_DISTRIBUTED_DEBUG when it is imported, which in a spawned rank is before
    # the launcher's variables are in place: read it again now
    dist.set_debug_level_from_env()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    # torch's env:// rendezvous gives the store; under torchrun that is the agent's store, which
    # outlives a restart: without a prefix of their own, restarted ranks read the dead ranks'
    # addresses. The restart count is per node, so the ranks agree on the round through the store.
    store, rank_, world = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"round_{agree_on_round(store, rank_, world, timeout)}", store)
    dist.init_process_group(
        backend=name,
        store=store,
        rank=rank_,
        world_size=world,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    ctx = DistContext(
        rank=dist.get_rank(),
        local_rank=local_rank(),
        world_size=dist.get_world_size(),
        backend=name,
        device=device,
        initialized=True,
    )
    try:
        yield ctx
    except BaseException as exc:
        runlog.write_error(exc)
        dist.destroy_process_group()
        raise
    dist.barrier()
    dist.destroy_process_group()


def global_mean(value: float | torch.Tensor, ctx: DistContext) -> float:
    """Mean of ``value`` over all ranks, returned on every rank (an all-reduce, SUM ÷ world size).

    SUM then divide: the same on every backend. Identity without a process group.
    """
    t = torch.as_tensor(value, dtype=torch.float64).detach().reshape(1).to(ctx.device)
    if ctx.initialized and ctx.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= ctx.world_size
    return float(t.item())


def default_nprocs() -> int:
    """Ranks the chapters launch by default: one per GPU when there are at least 2, else 2 CPU
    ranks."""
    return gpu_count() if gpu_count() >= 2 else 2


VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "OMP_NUM_THREADS",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_DISTRIBUTED_DEBUG",
    "NCCL_DEBUG",
)


def variables() -> dict[str, str | None]:
    """The environment variables that shape a distributed run, as this process sees them (None:
    unset)."""
    return {name: os.environ.get(name) for name in VARIABLES}
