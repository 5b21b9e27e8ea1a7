"""05a.2's checker: a broken multi-node ``torchrun`` command, diagnosed and fixed for a given SLURM
allocation, read by torchrun's own option handling (``torch.distributed.run.get_args_parser`` and
``config_from_args``, which turns the options into the agent's ``LaunchConfig``).

Taught in notebooks/05a_torchrun_multinode.ipynb, sections 2 and 3 (PyTorch: torchrun,
https://docs.pytorch.org/docs/stable/elastic/run.html).
"""

from __future__ import annotations

import logging
import os
import shlex
from argparse import ArgumentError
from pathlib import Path
from unittest import mock

from mgtutorial.exercises._common import ExerciseError, passed, require

ALLOCATION = {
    "SLURM_JOB_ID": "977",
    "SLURM_JOB_NODELIST": "n[003-005]",
    "hostnames": ["n003", "n004", "n005"],
    "SLURM_GPUS_ON_NODE": "8",
}
"""The job of 05a.2: 3 nodes with 8 GPUs each (what SLURM reports; ``hostnames`` is what
``scontrol show hostnames`` prints)."""

BROKEN = (
    "torchrun --nnodes 3 --node-rank 1 --nproc-per-node 4 --rdzv-backend c10d "
    "--rdzv-endpoint localhost:29500 --rdzv-id 977 -m mgtutorial ddp --epochs 3"
)
"""What was typed on n004 (with ``--node-rank 0`` on n003 and ``2`` on n005)."""

WORKER = ["ddp", "--epochs", "3"]
_LOCAL = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}


def _argv(ex: str, command) -> list[str]:
    require(command is not ... and command, ex, "`fixed` is still empty: write the torchrun line")
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    first = Path(argv[0]).name if argv else None
    require(first == "torchrun", ex, f"the command starts with {argv[:1]}, not torchrun")
    return argv[1:]


def launch_config(ex: str, command):
    """``(args, LaunchConfig)`` of ``command`` (a string or a list of strings starting with
    ``torchrun``) as torchrun itself reads it. ``--nproc-per-node gpu``/``auto`` count the GPUs of
    the allocation's nodes (``ALLOCATION``), not of this machine. Raises ExerciseError (naming
    the option) where torchrun's parser or ``config_from_args`` refuses it."""
    from torch.distributed.run import config_from_args, get_args_parser

    parser = get_args_parser()
    parser.prog, parser.exit_on_error = "torchrun", False

    def refuse(message: str):  # argparse's errors, raised here instead of exiting
        raise ExerciseError(ex, f"torchrun's parser refuses it ({message}): check the option names")

    parser.error = refuse
    try:
        args, unknown = parser.parse_known_args(_argv(ex, command))
    except ArgumentError as e:
        refuse(str(e))
    # torchrun itself stops here ("unrecognized arguments"); argparse would put what follows in
    # the script's place
    require(not unknown, ex, f"torchrun has no option {' '.join(unknown)} (`torchrun --help`)")
    if args.nproc_per_node in ("gpu", "auto"):  # the node's GPUs, not this machine's
        args.nproc_per_node = ALLOCATION["SLURM_GPUS_ON_NODE"]
    quiet = logging.getLogger("torch.distributed.run")
    level, quiet.level = quiet.level, logging.ERROR  # its warnings are checked below, by value
    try:  # config_from_args may set OMP_NUM_THREADS in the environment: not in this process's
        with mock.patch.dict(os.environ):
            config, _, _ = config_from_args(args)
    except (AssertionError, ValueError, RuntimeError) as e:
        raise ExerciseError(ex, f"torchrun refuses these options: {e}") from None
    finally:
        quiet.level = level
    return args, config


def fixed_command(fixed) -> None:
    """05a.2: ``fixed`` (a string, or a list of strings) is the one ``torchrun`` line that every
    node of :data:`ALLOCATION` runs to start ``python -m mgtutorial ddp --epochs 3`` with one rank
    per GPU and a c10d rendezvous, :data:`BROKEN` repaired.

    Read with torchrun's parser and ``config_from_args``; the rendezvous endpoint must be a node of
    the allocation, the same for every node."""
    ex = "05a.2 a broken command"
    args, config = launch_config(ex, fixed)
    nodes, gpus = ALLOCATION["hostnames"], int(ALLOCATION["SLURM_GPUS_ON_NODE"])
    require(
        not args.standalone,
        ex,
        "--standalone makes a one-node job with a rendezvous of its own on each node",
    )
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:  # as the c10d backend reads it on the node (its default port: 29400)
        host, port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=29400)
    except ValueError as e:
        raise ExerciseError(ex, f"torchrun's c10d rendezvous refuses it: {e}") from None
    require(
        host not in _LOCAL,
        ex,
        f"--rdzv-endpoint {config.rdzv_endpoint or '(none)'}: on each node that names the node "
        "itself, so every node waits at a rendezvous of its own. Name one machine all nodes can "
        "reach",
    )
    require(
        host in nodes,
        ex,
        f"--rdzv-endpoint {config.rdzv_endpoint}: {host!r} is not a node of the allocation "
        f"{ALLOCATION['SLURM_JOB_NODELIST']} (`scontrol show hostnames` expands it)",
    )
    require(
        port > 0,
        ex,
        f"--rdzv-endpoint {config.rdzv_endpoint}: port 0 lets the host pick any free port, which "
        "the other nodes cannot know",
    )
    require(
        (config.min_nodes, config.max_nodes) == (len(nodes), len(nodes)),
        ex,
        f"torchrun waits for {config.min_nodes}:{config.max_nodes} nodes (min:max): count the "
        "nodes SLURM gave the job",
    )
    require(
        config.nproc_per_node == gpus,
        ex,
        f"--nproc-per-node {config.nproc_per_node} starts that many ranks per node: compare with "
        "the GPUs SLURM reports per node",
    )
    require(
        config.rdzv_backend == "c10d",
        ex,
        f"the rendezvous backend is {config.rdzv_backend!r}: the same line on every node needs "
        "the c10d rendezvous, which hands out the node ranks itself",
    )
    require(
        args.node_rank == 0,
        ex,
        f"--node-rank {args.node_rank}: config_from_args warns that c10d ignores it, and the "
        "line would differ per node; the rendezvous hands out node ranks",
    )
    require(
        config.run_id not in ("", "none"),
        ex,
        "give the job an --rdzv-id (e.g. SLURM's job id): torchrun's default is the same for "
        "every job",
    )
    require(
        args.module and args.training_script == "mgtutorial",
        ex,
        "torchrun must run the package as a module: `-m mgtutorial` before its arguments",
    )
    require(
        args.training_script_args == WORKER,
        ex,
        f"the worker's arguments are {args.training_script_args}, not {WORKER}",
    )
    passed(
        ex,
        f"torchrun reads {len(nodes)} nodes of {gpus} ranks, c10d at {config.rdzv_endpoint} "
        f"(a node of {ALLOCATION['SLURM_JOB_NODELIST']}), id {config.run_id}: one line for "
        "every node",
    )
