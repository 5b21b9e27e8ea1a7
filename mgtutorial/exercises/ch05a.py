"""Checkers of chapter 05a's exercises (notebooks/05a_torchrun_multinode.ipynb): the ranks torchrun
gives each node, a broken multi-node command repaired (05a.2, :mod:`.ch05a_command`), what the
SLURM script passes on, and the ranks' store after a restart (05a.4, :mod:`.ch05a_store`).

The references are torch's and the course's own code, not copies of it: the rank table comes from
torchrun's agent (``SimpleElasticAgent._assign_worker_ranks``, run against an in-memory store, one
thread per simulated agent), the command is read by torchrun's own option handling
(``torch.distributed.run.get_args_parser`` and ``config_from_args``), the SLURM mapping is
compared with what ``scripts/slurm/ddp.sbatch`` runs under a stand-in ``srun``
(:mod:`mgtutorial.scale.slurm`), and the store's fate comes from two real two-node restarts.
"""

from __future__ import annotations

import datetime
import threading
import types

from mgtutorial.exercises._common import attempt, passed, require
from mgtutorial.exercises.ch05a_command import BROKEN, fixed_command  # noqa: F401
from mgtutorial.exercises.ch05a_store import store_after_restart  # noqa: F401  (05a.4)
from mgtutorial.scale import slurm

_LAYOUTS = ((4, 4), (2, 2, 2), (8,), (1, 1, 1, 1), (4, 2), (1, 3, 2))  # ranks per node, in order


def torchrun_ranks(nprocs: tuple[int, ...]) -> dict[int, list[dict]]:
    """{node rank: [{"RANK", "LOCAL_RANK", "WORLD_SIZE"} per local rank]} as torchrun's agents
    assign them when node ``i`` runs ``nprocs[i]`` ranks: torch's
    ``SimpleElasticAgent._assign_worker_ranks``, one thread per agent, a ``HashStore``."""
    import torch.distributed as dist
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=10))
    out: dict[int, list] = {}
    assign = SimpleElasticAgent._assign_worker_ranks  # what each node's agent runs

    def agent(group_rank: int) -> None:
        spec = types.SimpleNamespace(role="default", local_world_size=nprocs[group_rank])
        workers = assign(None, store, group_rank, len(nprocs), spec)
        out[group_rank] = [
            {"RANK": w.global_rank, "LOCAL_RANK": w.local_rank, "WORLD_SIZE": w.world_size}
            for w in workers
        ]

    threads = [threading.Thread(target=agent, args=(g,), daemon=True) for g in range(len(nprocs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return {g: out[g] for g in sorted(out)}


def ranks_of(fn) -> None:
    """05a.1: ``fn(node_rank, nprocs)`` (``nprocs[i]``: the ``--nproc-per-node`` of node ``i``, a
    list of ints) returns node ``node_rank``'s ranks as a list of dicts ``{"RANK", "LOCAL_RANK",
    "WORLD_SIZE"}`` (ints), one per local rank, in local-rank order.

    Verified against torchrun's own assignment for nodes of 4+4, 2+2+2, 8, 1+1+1+1, 4+2 and 1+3+2
    ranks.
    """
    ex = "05a.1 ranks of a node"
    for nprocs in _LAYOUTS:
        truth = torchrun_ranks(nprocs)
        for node, per_node in enumerate(nprocs):
            got = attempt(ex, fn, node, list(nprocs))
            where = f"node {node} of a job with {'+'.join(map(str, nprocs))} ranks per node"
            require(
                isinstance(got, (list, tuple)) and len(got) == per_node,
                ex,
                f"{where}: return a list of {per_node} dicts (one per local rank), not {got!r}",
            )
            for want, row in zip(truth[node], got):
                require(
                    isinstance(row, dict) and {"RANK", "LOCAL_RANK", "WORLD_SIZE"} <= set(row),
                    ex,
                    f"{where}: each row is a dict with RANK, LOCAL_RANK, WORLD_SIZE, not {row!r}",
                )
                for key, hint in (
                    ("LOCAL_RANK", "local ranks restart at 0 on every node"),
                    ("WORLD_SIZE", "WORLD_SIZE counts the ranks of all nodes"),
                    ("RANK", "global ranks continue where the nodes before this one stopped"),
                ):
                    require(
                        row[key] == want[key],
                        ex,
                        f"{where}, local rank {want['LOCAL_RANK']}: your {key}={row[key]} is "
                        f"not the one torchrun sets: {hint}",
                    )
    passed(
        ex,
        "RANK, LOCAL_RANK and WORLD_SIZE match torchrun's for 4+4, 2+2+2, 8, 1+1+1+1, 4+2 and "
        "1+3+2 ranks per node",
    )


_SLURM = "SLURM_NNODES SLURM_JOB_ID SLURM_JOB_NODELIST SLURM_GPUS_ON_NODE SLURM_CPUS_PER_TASK"
_JOBS = (  # (SLURM's variables, in _SLURM's order; node names); job 977: < 1 core per rank
    (dict(zip(_SLURM.split(), ("2", "4242", "gpu-a[17-18]", "4", "16"))), ["gpu-a17", "gpu-a18"]),
    (dict(zip(_SLURM.split(), ("3", "977", "n[003-005]", "8", "4"))), ["n003", "n004", "n005"]),
)
_MAPPED = ("--nnodes", "--nproc-per-node", "--rdzv-id", "--rdzv-endpoint", "OMP_NUM_THREADS")


def slurm_mapping(fn) -> None:
    """05a.3: ``fn(slurm, hostnames)`` gets SLURM's variables (a dict of strings) and the node
    names (``scontrol show hostnames``, a list) and returns what the batch script passes to
    torchrun: ``{"--nnodes", "--nproc-per-node", "--rdzv-id", "--rdzv-endpoint",
    "OMP_NUM_THREADS"}`` (strings).

    Compared with what ``scripts/slurm/ddp.sbatch`` itself runs for a 2-node and a 3-node job
    (:func:`mgtutorial.scale.slurm.dry_run`).
    """
    ex = "05a.3 SLURM to torchrun"
    for variables, hosts in _JOBS:
        run = slurm.dry_run(variables, hosts)
        if run.returncode:
            raise RuntimeError(f"ddp.sbatch failed: {run.stderr.strip()}")
        truth = slurm.torchrun_options(run.stdout)
        got = attempt(ex, fn, dict(variables), list(hosts))
        require(isinstance(got, dict), ex, f"return a dict of options, not {type(got).__name__}")
        job = f"the {variables['SLURM_NNODES']}-node job {variables['SLURM_JOB_ID']}"
        for key in _MAPPED:
            require(key in got, ex, f"{job}: your dict has no {key!r}")
            require(
                str(got[key]) == truth[key],
                ex,
                f"{job}: your {key} {got[key]!r} is not what ddp.sbatch gives: read the "
                "script's line that sets it from the SLURM variables (not the values of the "
                "example above)",
            )
    passed(
        ex,
        "your mapping gives ddp.sbatch's torchrun options and OMP_NUM_THREADS for a 2-node and a "
        "3-node job",
    )
