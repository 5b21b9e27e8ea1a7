"""Beyond one machine and surviving failures: torchrun commands, simulated nodes, elastic restarts,
hangs and how to see inside them.

Taught in notebooks/05a_torchrun_multinode.ipynb (commands, simulated nodes, SLURM) and
notebooks/05b_elastic_and_hangs.ipynb (restarts, hangs). Follows https://pytorch.org/docs/stable/elastic/run.html
(torchrun, rendezvous, ``--max-restarts``), https://pytorch.org/docs/stable/distributed.html#debugging-torch-distributed-applications
(``TORCH_DISTRIBUTED_DEBUG``) and py-spy (https://github.com/benfred/py-spy).

Two nodes on a cluster, the same worker as chapter 02 (run on each node; SLURM's script in
``scripts/slurm/ddp.sbatch`` does exactly this)::

    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 4 \\
             --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 -m mgtutorial ddp --epochs 3
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mgtutorial.runtime import env, procs, runlog
from mgtutorial.runtime.launcher import free_port
from mgtutorial.scale.output import clean, digest, shell, short  # noqa: F401  (re-exported)


def torchrun_executable() -> str:
    """The ``torchrun`` next to this Python (the course's environment), else the one on PATH."""
    here = Path(sys.executable).with_name("torchrun")
    return str(here) if here.exists() else "torchrun"


def torchrun_command(
    module_args: list[str],
    *,
    nproc_per_node: int = 2,
    nnodes: int = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    run_id: str | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """The torchrun command line that runs ``python -m mgtutorial <module_args>`` on one node.

    * One node, no endpoint: ``--standalone`` (torchrun picks a free port itself).
    * Several nodes, dynamic (the default): a c10d rendezvous at ``rdzv_endpoint`` (``host:port``
      of one node, reachable from all), the same ``run_id`` everywhere. The rendezvous hands out
      node ranks (GROUP_RANK) itself (torch 2.14 sorts the nodes by host name, then process id);
      no ``--node-rank``.
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
        cmd += [
            "--nnodes",
            str(nnodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            rdzv_endpoint,
            "--rdzv-id",
            run_id or "mgtutorial",
        ]
    else:
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"node_rank={node_rank} must be in 0 … {nnodes - 1}.")
        host, _, port = rdzv_endpoint.rpartition(":")
        cmd += [
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(node_rank),
            "--master-addr",
            host,
            "--master-port",
            port,
        ]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    return cmd + ["-m", "mgtutorial", *module_args]


def agent_env() -> dict[str, str]:
    """The environment the course gives torchrun agents: this process's, OMP_NUM_THREADS=1 unless set
    (torchrun then passes it on; it sets 1 itself only if unset and ``--nproc-per-node`` > 1),
    loopback for gloo (``GLOO_SOCKET_IFNAME``), and none of a job's rank variables."""
    e = dict(
        os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1"
    )
    for name in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        runlog.RUN_DIR_ENV,
        "TORCHELASTIC_RUN_ID",
    ):
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
        for i, cmd in enumerate(commands):
            with open(self.log_dir / f"node{i}.log", "w") as out:
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env={**agent_env(), **(extra_env or {})},
                        start_new_session=True,
                    )
                )
        self.started = time.time()

    def wait(self, timeout: float) -> list[int]:
        """Exit codes of all agents; raises TimeoutError (after ending them) if one runs longer."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                raise TimeoutError(
                    f"torchrun agents still running after {timeout} s; stopped them."
                ) from None
        return [p.returncode for p in self.procs]

    def output(self, node: int = 0) -> str:
        """What agent ``node`` printed so far."""
        return (self.log_dir / f"node{node}.log").read_text()

    def stop(self) -> None:
        """SIGTERM each agent's process group (agent and workers), SIGKILL what is left after 5 s."""
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
) -> Agents:
    """Start ``nnodes`` torchrun agents on this machine as if each were a node: node ranks 0 … nnodes − 1,
    one c10d rendezvous (``--rdzv-id run_id``, default a fresh one) on 127.0.0.1 at a free port.
    Returns the running :class:`Agents`.

    Every simulated node's ranks have local ranks 0, 1, …, so on a GPU machine they would all pick
    ``cuda:0``, which NCCL refuses: pass ``--backend gloo`` in ``module_args`` there."""
    endpoint = f"127.0.0.1:{free_port()}"
    run_id = run_id or f"sim-{free_port()}"
    cmds = [
        torchrun_command(
            module_args,
            nproc_per_node=nproc_per_node,
            nnodes=nnodes,
            rdzv_endpoint=endpoint,
            run_id=run_id,
        )
        for _ in range(nnodes)
    ]
    return Agents(cmds, log_dir, extra_env)


def run_torchrun(
    module_args: list[str],
    *,
    timeout: float = 120,
    log_dir: str | os.PathLike = "runs/torchrun",
    extra_env: dict | None = None,
    **kwargs,
) -> tuple[int, str]:
    """Run one torchrun (see :func:`torchrun_command` for ``kwargs``) to the end; returns (exit code, output)."""
    with Agents([torchrun_command(module_args, **kwargs)], log_dir, extra_env) as agents:
        code = agents.wait(timeout)[0]
        return code, agents.output(0)


def rank_table(records: list[dict]) -> list[dict]:
    """One row per rank from ``kind="hello"`` records: rank, local rank, node, world size, device, host."""
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


# ---------------------------------------------------------------------------------------------
# Hangs


@dataclass(kw_only=True)
class HangConfig:
    """Configuration of :func:`hang_worker`."""

    steps: int = 3
    """All-reduces every rank should make."""
    skip_rank: int = 1
    """This rank skips the all-reduce of step ``skip_step`` (−1: nobody does: no hang)."""
    skip_step: int = 1
    """The step whose all-reduce ``skip_rank`` skips."""
    timeout_s: float = 5.0
    """Collective timeout: how long a rank waits in a collective before it fails (on gloo the call
    raises; on NCCL it has returned at once and the watchdog aborts the process: no TimeoutError)."""
    rank_work_s: float = 30.0
    """After its loop, ``skip_rank`` does rank-only work (sleeps) this long before leaving."""
    backend: str = "auto"
    """"auto" | "gloo" | "nccl"."""


def hang_worker(cfg: HangConfig) -> dict:
    """Every rank all-reduces once per step, except ``skip_rank`` at ``skip_step`` — the classic bug
    of a collective inside ``if rank == …``. The others wait inside their all-reduce until
    ``timeout_s``, then fail with an error that names the collective, the step and the time waited:
    ``TimeoutError`` if the collective timed out (on gloo; or DETAIL's monitored barrier named ranks
    that did not arrive in time), else ``RuntimeError`` (a peer that left, or DETAIL's mismatch
    report), the backend's error chained and quoted. On NCCL without DETAIL the all-reduce returns at
    once and the watchdog aborts the process at the timeout: no Python error is raised here.

    Collectives are matched by order, not by step: rank 1's step-2 call (3 elements) pairs with
    rank 0's step-1 call (2 elements). Such a mismatched pair is undefined behaviour: gloo may pair
    them silently (as it does here, in torch 2.14) or hang; then both ranks wait for data that
    never comes, and the first to reach its timeout fails. With ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
    the mismatch is caught at that very call. Logs ``kind="collective_start"`` before each
    all-reduce (so a debugger knows where each rank is). If the skipping rank gets past its
    collectives, it does ``rank_work_s`` of work of its own before leaving.
    """
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx, runlog.RunLog() as log:
        for step in range(cfg.steps):
            if ctx.rank == cfg.skip_rank and step == cfg.skip_step:
                continue  # the bug: this rank never joins this collective...
            log.write(kind="collective_start", op="all_reduce", step=step, pid=os.getpid())
            t0 = time.time()
            try:
                dist.all_reduce(torch.ones(step + 1, device=ctx.device))  # step s: s + 1 elements
            except (
                Exception
            ) as exc:  # a timeout, a peer that left, or (DETAIL) a mismatch: say which
                timed_out = any(
                    w in str(exc).lower() for w in ("timed out", "failed to pass monitoredbarrier")
                )
                raise (TimeoutError if timed_out else RuntimeError)(
                    f"all_reduce of step {step} on rank {ctx.rank} {'timed out' if timed_out else 'failed'} "
                    f"after {time.time() - t0:.1f} s (timeout {cfg.timeout_s:g} s): {type(exc).__name__}: {exc}"
                ) from exc
        if ctx.rank == cfg.skip_rank:
            log.write(kind="rank_work", seconds=cfg.rank_work_s)
            time.sleep(cfg.rank_work_s)  # ...and goes on with work of its own (saving, evaluating)
        return {"steps": cfg.steps}


def pids_at_collective(
    run_dir: str | os.PathLike, step: int, nranks: int, timeout: float = 60
) -> dict[int, int]:
    """Poll the run's ``kind="collective_start"`` records until ``nranks`` ranks have logged the
    all-reduce of ``step``; returns {rank: pid}. Raises TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        pids = {
            rec["rank"]: rec["pid"]
            for rec in runlog.read_run(run_dir)
            if rec.get("kind") == "collective_start" and rec["step"] == step
        }
        if len(pids) >= nranks:
            return pids
        if time.monotonic() > deadline:
            raise TimeoutError(f"only ranks {sorted(pids)} reached step {step} within {timeout} s")
        time.sleep(0.2)


def main_thread_frames(dump: str) -> list[str]:
    """The main thread's frames of a ``py-spy dump`` output, innermost first, colours removed."""
    dump = re.sub(r"\x1b\[[0-9;]*m", "", dump)
    return [
        f.strip() for f in dump.split('"MainThread"')[1].split("\nThread ")[0].strip().splitlines()
    ]


def py_spy_dump(pid: int, timeout: float = 30) -> str:
    """The Python stack of a running process (``py-spy dump --pid PID``), e.g. of a hung rank.

    Needs permission to trace the process (same user; root in containers, or ptrace allowed).
    """
    exe = Path(sys.executable).with_name("py-spy")
    out = subprocess.run(
        [str(exe) if exe.exists() else "py-spy", "dump", "--pid", str(pid)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out.stdout + out.stderr
