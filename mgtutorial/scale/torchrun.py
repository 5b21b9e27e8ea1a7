"""torchrun from a cell: its command lines, the agents it starts, nodes simulated on one machine.

Taught in notebooks/05a_torchrun_multinode.ipynb (one node, two simulated nodes, SLURM) and used by
notebooks/05b_elastic_restarts.ipynb (a restart under ``--max-restarts`` on two simulated nodes, a
node joining a ``--nnodes 1:2`` job) and notebooks/05c_hangs_and_debugging.ipynb. Follows
https://pytorch.org/docs/stable/elastic/run.html (torchrun, its agent, the c10d rendezvous).

Two nodes on a cluster, the same worker as chapter 02 (run on each node; SLURM's script in
``scripts/slurm/ddp.sbatch`` does exactly this)::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
             --rdzv-id $JOB_ID -m mgtutorial ddp --epochs 3
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mgtutorial.runtime import procs, runlog
from mgtutorial.runtime.launcher import free_port

JOB_VARIABLES = (
    "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT "
    "TORCHELASTIC_RUN_ID"
).split() + [runlog.RUN_DIR_ENV]
"""A rank's identity in its job: what :func:`agent_env` removes before starting new agents."""


def torchrun_executable() -> str:
    """The ``torchrun`` next to this Python (the course's environment), else the one on PATH."""
    here = Path(sys.executable).with_name("torchrun")
    return str(here) if here.exists() else "torchrun"


def torchrun_command(
    module_args: list[str],
    *,
    nproc_per_node: int = 2,
    nnodes: int | str = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    run_id: str | None = None,
    max_restarts: int = 0,
    rdzv_conf: str | None = None,
    module: str = "mgtutorial",
) -> list[str]:
    """The torchrun command line that runs ``python -m <module> <module_args>`` on one node
    (``module``: ``mgtutorial`` unless given).

    * One node, no endpoint: ``--standalone`` (torchrun picks a free port itself).
    * Several nodes, dynamic (the default): a c10d rendezvous at ``rdzv_endpoint`` (``host:port``
      of one node, reachable from all), the same ``run_id`` everywhere. The rendezvous hands out
      node ranks (GROUP_RANK) itself (torch 2.14 sorts the nodes by host name, then process id);
      no ``--node-rank``. An elastic job gives ``nnodes`` as ``"MIN:MAX"`` (e.g. ``"1:2"``): it
      starts with MIN nodes and restarts its ranks when another node joins, up to MAX;
      ``rdzv_conf`` (e.g. ``"last_call_timeout=1"``) tunes the rendezvous.
    * Several nodes, static: give ``node_rank`` too; each node then passes ``--node-rank`` and the
      endpoint as ``--master-addr/--master-port`` (node 0 hosts it).

    Raises:
        ValueError: several nodes without an endpoint, or a node rank outside 0 … nnodes − 1.
    """
    cmd = [torchrun_executable(), "--nproc-per-node", str(nproc_per_node)]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    elif rdzv_endpoint is None:
        raise ValueError(f"nnodes={nnodes} needs rdzv_endpoint='HOST:PORT' of the first node.")
    elif node_rank is None:
        cmd += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d"]
        cmd += ["--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", run_id or "mgtutorial"]
        cmd += ["--rdzv-conf", rdzv_conf] if rdzv_conf else []
    elif not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank={node_rank} must be in 0 … {nnodes - 1}.")
    else:
        host, _, port = rdzv_endpoint.rpartition(":")
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
        cmd += ["--master-addr", host, "--master-port", port]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    return cmd + ["-m", module, *module_args]


def agent_env() -> dict[str, str]:
    """The environment the course gives torchrun agents: this process's, OMP_NUM_THREADS=1 unless
    set (torchrun then passes it on; it sets 1 itself only if unset and ``--nproc-per-node`` > 1),
    loopback for gloo (``GLOO_SOCKET_IFNAME``), and none of a job's rank variables."""
    e = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    e["PYTHONUNBUFFERED"] = "1"
    for name in JOB_VARIABLES:
        e.pop(name, None)  # a notebook started from inside a job must not leak its own identity
    if "GLOO_SOCKET_IFNAME" not in e:
        e["GLOO_SOCKET_IFNAME"] = procs.loopback_ifname()  # simulated nodes talk over loopback
    return e


class Agents:
    """torchrun agents started as subprocesses (one per simulated node), each in its own process
    group with its output in ``<log_dir>/node<i>.log``. Use as a context manager: leaving the block
    ends every agent and every worker it started."""

    def __init__(
        self, commands: list[list[str]], log_dir: str | os.PathLike, extra_env: dict | None = None
    ):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.commands: list[list[str]] = []
        self.env = {**agent_env(), **(extra_env or {})}
        for cmd in commands:
            self.join(cmd)
        self.started = time.time()

    def join(self, command: list[str]) -> None:
        """Start one more agent (node ``len(self.procs)``): a node joining the job later."""
        self.commands.append(command)
        with open(self.log_dir / f"node{len(self.procs)}.log", "w") as out:
            self.procs.append(
                subprocess.Popen(
                    command,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                )
            )

    def wait(self, timeout: float) -> list[int]:
        """Exit codes of all agents; raises TimeoutError (after ending them) if one runs longer
        than ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                message = f"torchrun agents still running after {timeout} s; stopped them."
                raise TimeoutError(message) from None
        return [p.returncode for p in self.procs]

    def output(self, node: int = 0) -> str:
        """What agent ``node`` printed so far."""
        return (self.log_dir / f"node{node}.log").read_text()

    def stop(self) -> None:
        """SIGTERM each agent's process group (agent and ranks), SIGKILL what is left after 5 s."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
            try:
                for p in self.procs:
                    p.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> Agents:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def simulated_nodes(
    module_args: list[str],
    nnodes: int = 2,
    nproc_per_node: int = 1,
    log_dir: str | os.PathLike = "runs/nodes",
    extra_env: dict | None = None,
    run_id: str | None = None,
    **kwargs,
) -> Agents:
    """Start ``nnodes`` torchrun agents on this machine as if each were a node: node ranks
    0 … nnodes − 1, one c10d rendezvous (``--rdzv-id run_id``, default a fresh one) on 127.0.0.1 at
    a free port; ``kwargs`` as :func:`torchrun_command`'s (``max_restarts``, ``module``). Returns
    the running :class:`Agents`.

    Every simulated node's ranks have local ranks 0, 1, …, so on a GPU machine they would all pick
    ``cuda:0``, which NCCL refuses: pass ``--backend gloo`` in ``module_args`` there."""
    endpoint = f"127.0.0.1:{free_port()}"
    run_id = run_id or f"sim-{free_port()}"
    command = torchrun_command(
        module_args,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        rdzv_endpoint=endpoint,
        run_id=run_id,
        **kwargs,
    )
    return Agents([command] * nnodes, log_dir, extra_env)


def run_torchrun(
    module_args: list[str],
    *,
    timeout: float = 120,
    log_dir: str | os.PathLike = "runs/torchrun",
    extra_env: dict | None = None,
    **kwargs,
) -> tuple[int, str]:
    """Run one torchrun (see :func:`torchrun_command` for ``kwargs``) to the end, at most
    ``timeout`` seconds (else TimeoutError); returns (exit code, output)."""
    with Agents([torchrun_command(module_args, **kwargs)], log_dir, extra_env) as agents:
        code = agents.wait(timeout)[0]
        return code, agents.output(0)


def wait_for_step(run_dir: str | os.PathLike, step: int, timeout: float = 120) -> float:
    """Poll the run's ``kind="train"`` records until one has ``step``; returns its time. Raises
    TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Path(run_dir).exists():
            for rec in runlog.read_run(run_dir):
                if rec.get("kind") == "train" and rec["step"] >= step:
                    return rec["time"]
        time.sleep(0.2)
    raise TimeoutError(f"no rank of {run_dir} logged step {step} within {timeout} s")


def rank_table(records: list[dict]) -> list[dict]:
    """One row per rank, in rank order, from ``kind="hello"`` records (chapter 00's worker): RANK,
    LOCAL_RANK, GROUP_RANK (the node), WORLD_SIZE, device and host."""
    rows = [
        {
            "RANK": r["rank"],
            "LOCAL_RANK": r["local_rank"],
            "GROUP_RANK": r["group_rank"],
            "WORLD_SIZE": r["world_size"],
            "device": r["device"],
            "host": r["host"],
        }
        for r in records
        if r.get("kind") == "hello"
    ]
    return sorted(rows, key=lambda row: row["RANK"])
