"""Checkers of chapter 05a's exercises (notebooks/05a_torchrun_multinode.ipynb): the ranks torchrun
gives each node, the torchrun command of a two-node job, and what the SLURM script passes on.

The references are torch's and the course's own code, not copies of it: the rank table comes from
torchrun's agent (``SimpleElasticAgent._assign_worker_ranks``, run against an in-memory store, one
thread per simulated agent), the command is read by torchrun's own parser
(``torch.distributed.run.get_args_parser``), and the SLURM mapping is compared with what
``scripts/slurm/ddp.sbatch`` runs under a stand-in ``srun`` (:mod:`mgtutorial.scale.slurm`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shlex
import shutil
import threading
import types
from argparse import ArgumentError
from pathlib import Path
from unittest import mock

from mgtutorial.exercises._common import ExerciseError, answered, attempt, passed, require
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


def two_node_command(command) -> None:
    """05a.2: ``command`` (a list of strings, or one string) is the torchrun line that node 1 of a
    two-node job runs: 4 ranks per node, c10d rendezvous at ``node0:29500``, id ``job42``,
    ``python -m mgtutorial ddp --epochs 3``. Read with torchrun's own argument parser."""
    from torch.distributed.run import get_args_parser, parse_min_max_nnodes

    ex = "05a.2 a two-node command"
    require(command is not ... and command, ex, "`command` is still empty: write the torchrun line")
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    first = Path(argv[0]).name if argv else None
    require(first == "torchrun", ex, f"the command starts with {argv[:1]}, not torchrun")
    parser = get_args_parser()
    parser.prog, parser.exit_on_error = "torchrun", False

    def refuse(message: str):  # argparse's errors, raised here instead of exiting
        raise ExerciseError(ex, f"torchrun's parser refuses it ({message}): check the option names")

    parser.error = refuse
    try:
        args, unknown = parser.parse_known_args(argv[1:])
    except ArgumentError as e:
        refuse(str(e))
    # torchrun itself stops here ("unrecognized arguments"); argparse puts what follows in the
    # script's place
    require(
        not unknown,
        ex,
        f"torchrun has no option {' '.join(unknown)}: check the option names (`torchrun --help`)",
    )
    require(
        not args.standalone,
        ex,
        "--standalone makes a one-node job with a local rendezvous: "
        "every node must meet at node0:29500 instead",
    )
    try:
        nnodes = "2" if parse_min_max_nnodes(args.nnodes) == (2, 2) else args.nnodes  # "2" or "2:2"
    except ValueError:
        nnodes = args.nnodes
    checks = [
        (nnodes, "2", "--nnodes", "the job has 2 nodes (2, or 2:2 as min:max)"),
        (args.nproc_per_node, "4", "--nproc-per-node", "4 ranks (one per GPU) on each node"),
        (args.rdzv_backend, "c10d", "--rdzv-backend", "the dynamic rendezvous is c10d"),
        (args.rdzv_endpoint, "node0:29500", "--rdzv-endpoint", "every node meets at node0:29500"),
        (args.rdzv_id, "job42", "--rdzv-id", "the job's id, the same on every node"),
    ]
    for value, want, option, why in checks:
        require(
            str(value) == want, ex, f"torchrun reads {option} as {value!r}, not {want!r}: {why}"
        )
    require(
        args.node_rank == 0 and args.master_addr == "127.0.0.1",
        ex,
        "with the c10d rendezvous nobody passes --node-rank or --master-addr: the rendezvous "
        "hands out node ranks itself",
    )
    require(
        args.module and args.training_script == "mgtutorial",
        ex,
        "torchrun must run the package as a module: `-m mgtutorial` before its arguments",
    )
    require(
        args.training_script_args == ["ddp", "--epochs", "3"],
        ex,
        f"the worker's arguments are {args.training_script_args}, not ['ddp', '--epochs', '3']",
    )
    passed(
        ex,
        "torchrun's parser reads 2 nodes, 4 ranks each, c10d at node0:29500, id job42, "
        "-m mgtutorial ddp: the same line on every node",
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


def agent_store(predicted: dict) -> None:
    """05a.4: ``predicted[mode]["TORCHELASTIC_USE_AGENT_STORE"]`` (the string rank 1 sees, None
    for unset) and ``predicted[mode]["store host"]`` (``"agent"`` or ``"rank 0"``) for ``mode``
    "default" and "disabled" (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agents' environment).

    Runs both two-node jobs (``hello``, one rank per simulated node) at once and reads rank 1's
    record; the host is what torch's ``env://`` rendezvous decides from those variables
    (``torch.distributed.rendezvous._agent_store_serves``: the agent's store, or rank 0 opens one).
    """
    import importlib

    from mgtutorial.runtime import runlog
    from mgtutorial.scale import torchrun

    ex = "05a.4 who hosts the store"
    for mode in ("default", "disabled"):
        guess = predicted.get(mode) or {}
        require(
            guess.get("TORCHELASTIC_USE_AGENT_STORE", ...) is not ...,
            ex,  # None is an answer: unset
            f"`predicted[{mode!r}]['TORCHELASTIC_USE_AGENT_STORE']` is still `...`: replace it "
            "with the string rank 1 sees (None if you think it is unset)",
        )
        answered(guess.get("store host", ...), ex, f"predicted[{mode!r}]['store host']")
    runs = Path("runs/exercises").resolve()
    for mode in ("default", "disabled"):
        shutil.rmtree(runs / f"ex05a-store-{mode}", ignore_errors=True)
    extra = {"default": {}, "disabled": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}}
    hello = ["hello", "--backend", "gloo", "--runs-dir", str(runs), "--run-name"]
    # both jobs run at once; leaving the block stops every agent of both
    with contextlib.ExitStack() as stack:
        jobs = {
            mode: stack.enter_context(
                torchrun.simulated_nodes(
                    [*hello, f"ex05a-store-{mode}"],
                    log_dir=runs / f"ex05a-store-{mode}-agents",
                    extra_env=env,
                )
            )
            for mode, env in extra.items()
        }
        try:
            codes = {mode: agents.wait(timeout=90) for mode, agents in jobs.items()}
        except TimeoutError as e:
            raise ExerciseError(
                ex,
                f"the two-node jobs did not finish within 90 s ({e}): the machine may be "
                f"busy, run the checker again; the agents' logs are in {runs}",
            ) from e
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    for mode, agents in jobs.items():
        require(
            codes[mode] == [0, 0],
            ex,
            f"the {mode} job failed (exit codes {codes[mode]}): see {agents.log_dir}",
        )
        records = runlog.read_run(runs / f"ex05a-store-{mode}")
        rec = next(r for r in records if r["kind"] == "hello" and r["rank"] == 1)
        saw = rec["env"]  # rank 1's variables
        seen = saw["TORCHELASTIC_USE_AGENT_STORE"]
        with mock.patch.dict(os.environ):  # torch's rule, applied to what rank 1 saw
            for k, v in saw.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            served = rdzv._agent_store_serves(saw["MASTER_ADDR"], saw["MASTER_PORT"])
        host = "agent" if served else "rank 0"
        guess, shown = predicted[mode], {None: "unset"}  # the variable's value, None: not set
        value = guess["TORCHELASTIC_USE_AGENT_STORE"]
        require(
            (value is None) == (seen is None) and str(value) == str(seen),
            ex,
            f"{mode}: rank 1 did not see TORCHELASTIC_USE_AGENT_STORE "
            f"{shown.get(value, f'= {value!r}')}: read the rendezvous handler's "
            "use_agent_store (dynamic_rendezvous)",
        )
        require(
            guess["store host"] == host,
            ex,
            f"{mode}: the store at MASTER_ADDR:MASTER_PORT is not hosted by the "
            f"{guess['store host']}: read torch.distributed.rendezvous._create_c10d_store",
        )
    passed(
        ex,
        "by default the agent hosts the store (True); with the sharing disabled rank 0 does "
        "(False)",
    )
