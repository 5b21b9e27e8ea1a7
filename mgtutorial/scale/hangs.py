"""A hung job: a rank that skips a collective, where each rank waits, and py-spy to see it.

Taught in notebooks/05c_hangs_and_debugging.ipynb (collective timeouts, mismatched collectives,
``TORCH_DISTRIBUTED_DEBUG=DETAIL``, faulthandler, C++ stacks, py-spy). Follows
https://pytorch.org/docs/stable/distributed.html#debugging-torch-distributed-applications and
py-spy (https://github.com/benfred/py-spy).

From a cell, 2 ranks, rank 1 skipping the all-reduce of step 1 (the job fails after 5 s)::

    launch(hangs.hang_worker, hangs.HangConfig(timeout_s=5), 2)
"""

from __future__ import annotations

import faulthandler
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mgtutorial.common.config import Config, at_least, positive, rank_or_none
from mgtutorial.runtime import env, runlog


@dataclass(kw_only=True)
class HangConfig(Config):
    """Configuration of :func:`hang_worker`."""

    steps: int = 3
    """All-reduces every rank should make."""
    skip_rank: int = 1
    """This rank skips the all-reduce of step ``skip_step`` (−1: nobody does: no hang)."""
    skip_step: int = 1
    """The step whose all-reduce ``skip_rank`` skips."""
    timeout_s: float = 5.0
    """Collective timeout: how long a rank waits in a collective before it fails (on gloo the call
    raises; on NCCL it has returned at once and the watchdog aborts the process: no
    TimeoutError)."""
    rank_work_s: float = 30.0
    """After its loop, ``skip_rank`` does rank-only work (sleeps) this long before leaving."""
    backend: env.BackendChoice = "auto"
    """The process group's backend ("auto": NCCL with a GPU per rank, else gloo)."""
    dump_after_s: float = 0.0
    """If > 0, a rank still inside an all-reduce after this many seconds writes every thread's
    Python stack to its stderr (``faulthandler.dump_traceback_later``; 0: never). On NCCL the
    all-reduce returns at once, so the rank then waits in ``torch.cuda.synchronize`` before
    cancelling: that is where a hung collective keeps the host, and what the dump shows."""

    def validate(self, nprocs: int) -> None:
        """Called by :func:`mgtutorial.launch` before any process starts.

        Raises:
            ValueError: a value out of range, or ``skip_rank`` not a rank of the job.
        """
        super().validate(nprocs)
        at_least(self, 1, "steps")
        at_least(self, 0, "skip_step", "rank_work_s", "dump_after_s")
        positive(self, "timeout_s")
        rank_or_none(self, "skip_rank", nprocs)


def _timed_out(exc: Exception) -> bool:
    """Whether a failed collective's error is a timeout: gloo's own, or DETAIL's monitored barrier
    naming ranks that did not arrive in time."""
    return any(w in str(exc).lower() for w in ("timed out", "failed to pass monitoredbarrier"))


def hang_worker(cfg: HangConfig) -> dict:
    """Every rank all-reduces once per step, except ``skip_rank`` at ``skip_step`` — the classic bug
    of a collective inside ``if rank == …``. The others wait inside their all-reduce until
    ``timeout_s``, then fail with an error that names the collective, the step and the time waited:
    ``TimeoutError`` if the collective timed out (on gloo; or DETAIL's monitored barrier named ranks
    that did not arrive in time), else ``RuntimeError`` (a peer that left, or DETAIL's mismatch
    report), the backend's error chained and quoted. On NCCL without DETAIL the all-reduce returns
    at once and the watchdog aborts the process at the timeout: no Python error is raised here.

    Collectives are matched by order, not by step: rank 1's step-2 call (3 elements) pairs with
    rank 0's step-1 call (2 elements). Such a mismatched pair is undefined behaviour: on gloo (torch
    2.14) rank 0's half returns unchecked, rank 1's waits for data that never comes, and so does
    rank 0's next; the first to reach its timeout fails. With ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
    the mismatch is caught at that very call. Logs ``kind="collective_start"`` before each
    all-reduce (so a debugger knows where each rank is). If the skipping rank gets past its
    collectives, it does ``rank_work_s`` of work of its own before leaving. Returns ``{"steps"}``.
    """
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx, runlog.RunLog() as log:
        for step in range(cfg.steps):
            if ctx.rank == cfg.skip_rank and step == cfg.skip_step:
                continue  # the bug: this rank never joins this collective...
            log.write(kind="collective_start", op="all_reduce", step=step, pid=os.getpid())
            t0 = time.time()
            if cfg.dump_after_s:  # still here after dump_after_s: every thread's stack to stderr
                faulthandler.dump_traceback_later(cfg.dump_after_s, exit=False)
            try:
                dist.all_reduce(torch.ones(step + 1, device=ctx.device))  # step s: s + 1 elements
                if cfg.dump_after_s and ctx.device.type == "cuda":
                    torch.cuda.synchronize(ctx.device)  # NCCL returned at once: the host waits here
                faulthandler.cancel_dump_traceback_later()
            except Exception as exc:  # a timeout, a peer gone, or (DETAIL) a mismatch: say which
                timed_out = _timed_out(exc)
                raise (TimeoutError if timed_out else RuntimeError)(
                    f"all_reduce of step {step} on rank {ctx.rank} "
                    f"{'timed out' if timed_out else 'failed'} after {time.time() - t0:.1f} s "
                    f"(timeout {cfg.timeout_s:g} s): {type(exc).__name__}: {exc}"
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


def py_spy_dump(pid: int, timeout: float = 30) -> str:
    """The Python stack of a running process (``py-spy dump --pid PID``), e.g. of a hung rank: its
    output and errors as one string, within ``timeout`` seconds (else
    ``subprocess.TimeoutExpired``).

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


def main_thread_frames(dump: str) -> list[str]:
    """The main thread's frames of a :func:`py_spy_dump` output, innermost first, no colours."""
    dump = re.sub(r"\x1b\[[0-9;]*m", "", dump)
    thread = dump.split('"MainThread"')[1].split("\nThread ")[0]
    return [frame.strip() for frame in thread.strip().splitlines()]


MISMATCHED_GATHER = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.all_gather([torch.ones(1)], torch.ones(2))  # room for 1 element, 2 sent: c10d refuses it
"""
"""A one-rank script whose collective fails in PyTorch's C++ (a ``TORCH_CHECK`` in
``ProcessGroupGloo``): what ``TORCH_SHOW_CPP_STACKTRACES=1`` adds to an error (05c)."""


def run_python(code: str, extra_env: dict | None = None, timeout: float = 60) -> str:
    """Run ``code`` in a fresh Python with this environment plus ``extra_env``; returns what it
    wrote to stderr (its traceback, if it failed), within ``timeout`` seconds (else
    ``subprocess.TimeoutExpired``)."""
    env = {**os.environ, **(extra_env or {})}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
    )
    return out.stderr
