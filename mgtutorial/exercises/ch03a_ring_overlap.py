"""Checkers of chapter 03a's exercises 03a.3 and 03a.4 (notebooks/03a_collectives.ipynb), whose
code is the rank's communication itself: a ring all-reduce from send/recv, and computing while an
asynchronous all-reduce is in flight. Called as ``ex.ch03a.ring_all_reduce`` and
``ex.ch03a.overlap`` (:mod:`mgtutorial.exercises.ch03a` has the chapter's other checkers).

The workers run the learner's function (from a ``%%writefile`` module, imported by path) inside
the ranks, with ``torch.distributed``'s calls recorded or refused
(:func:`mgtutorial.exercises.ddp_checks.patched`), so that the checkers count calls and elements.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mgtutorial.common.config import Config
from mgtutorial.ddp import collectives
from mgtutorial.exercises._common import function_from, passed, require, run_ranks
from mgtutorial.exercises.ddp_checks import NO_ALL_REDUCE_SEEN, patched
from mgtutorial.runtime import env

# --- 03a.3 ----------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class FileConfig(Config):
    """The learner's module for a 03a worker."""

    path: str
    """Absolute path of the learner's module."""
    size: int = 8
    """Elements of each rank's tensor (rank r starts with ``[10r, 10r + 1, …]``)."""
    backend: env.BackendChoice = "auto"
    """Process-group backend ("auto": NCCL with a GPU per local rank, else gloo)."""
    head_start_s: float = 2.0
    """03a.4: the last rank calls the learner's function once rank 0's ``compute()`` has finished,
    or after this long if it does not (a blocking all-reduce waits for the last rank first)."""
    compute_s: float = 0.3
    """03a.4: how long ``compute()`` computes."""


def ring_worker(cfg: FileConfig) -> dict:
    """Rank-side: the learner's ``ring_all_reduce(t, rank, world_size)`` with ``dist.isend`` and
    ``dist.send`` recorded and the built-in collectives refused. Returns ``result``, ``expected``
    (dist.all_reduce's answer) and ``sent`` (elements this rank sent)."""
    fn = function_from(cfg.path, "ring_all_reduce")
    with env.distributed(cfg.backend) as ctx:
        t = collectives.start_tensor(ctx.rank, cfg.size, ctx.device)
        expected = t.clone()
        dist.all_reduce(expected)
        refused = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
        with patched([], ("isend", "send"), refused) as sent:
            out = fn(t, ctx.rank, ctx.world_size)
        return {
            "result": (t if out is None else out).tolist(),
            "expected": expected.tolist(),
            "sent": sum(entry[2] for entry in sent),
        }


def ring_all_reduce(path: str = "ex03a_ring.py", nprocs: int = 4) -> None:
    """03a.3: ``ring_all_reduce(t, rank, world_size)`` in ``path`` sums ``t`` ``(8,)`` over
    ``nprocs`` ranks with send/recv only, sending 2(N−1)/N of the tensor per rank (counted)."""
    ex = "03a.3 ring all-reduce"
    function_from(path, "ring_all_reduce", ex)
    cfg = FileConfig(path=str(Path(path).resolve()))
    values = run_ranks(ex, ring_worker, cfg, nprocs, name="ring").values
    for rank, v in sorted(values.items()):
        size = cfg.size // nprocs
        chunks = [slice(i * size, (i + 1) * size) for i in range(nprocs)]
        complete = [c for c in chunks if v["result"][c] == v["expected"][c]]
        require(
            not (v["result"] != v["expected"] and len(complete) == 1),
            ex,
            f"rank {rank} holds the full sum in one chunk only: the reduce-scatter is done; now "
            "pass the complete chunks on around the ring (the all-gather), copying, not adding",
        )
        require(
            v["result"] == v["expected"],
            ex,
            f"rank {rank} does not hold the sum of the ranks' tensors: in the reduce-scatter, "
            "add what you receive into the chunk the step names; in the all-gather, copy it",
        )
    ideal = 2 * (nprocs - 1) * cfg.size // nprocs
    for rank, v in sorted(values.items()):
        require(
            v["sent"] == ideal,
            ex,
            f"every rank holds the sum, but rank {rank} sent {v['sent']} elements for "
            f"its tensor of {cfg.size} ({v['sent'] / cfg.size:.2f}×); a ring sends "
            f"2(N−1)/N = {ideal / cfg.size:.2f}×: one chunk of size/N per step, N−1 "
            f"steps that add (reduce-scatter), then N−1 that copy (all-gather)",
        )
    passed(
        ex,
        f"{nprocs} ranks hold the sum, and each sent {ideal} elements for {cfg.size} (2(N−1)/N = "
        f"{ideal / cfg.size:g}×)",
    )


# --- 03a.4 ----------------------------------------------------------------------------------------


def overlap_worker(cfg: FileConfig) -> dict:
    """Rank-side, on gloo (where a blocking all-reduce returns only once it is done; on NCCL it
    returns once queued): the learner's ``reduce_while_computing(t, compute)``; the last rank calls
    it once rank 0's ``compute()`` has finished (a store key), at most ``head_start_s`` late.
    ``compute()`` notes whether the all-reduce was in flight when it started; the result is read
    as soon as the function returns."""
    fn = function_from(cfg.path, "reduce_while_computing")
    with env.distributed("gloo") as ctx:
        t = collectives.start_tensor(ctx.rank, cfg.size, ctx.device)
        store = dist.distributed_c10d._get_default_store()
        seen = {"computed": 0}

        def compute():
            seen["computed"] += 1
            work = calls[-1][3] if calls else None
            seen["in_flight"] = work is not None and not work.is_completed()
            x, start = torch.randn(128, 128), time.time()
            while time.time() - start < cfg.compute_s:
                x = torch.tanh(x @ x)
            store.set(f"computed{ctx.rank}", "1")
            return x.sum().item()

        dist.barrier()
        if ctx.rank == ctx.world_size - 1:
            for key, wait_s in (("computed0", cfg.head_start_s), ("returned0", 0.5)):
                # after rank 0's compute(), and after rank 0 returned if it returns without waiting
                with contextlib.suppress(dist.DistStoreError):  # it did not: go anyway
                    store.wait([key], timedelta(seconds=wait_s))
        with patched([], ("all_reduce",)) as calls:
            fn(t, compute)
        result = t.tolist()  # what the function left in t when it returned
        if ctx.rank == 0:
            store.set("returned0", "1")
        for call in calls:  # an all-reduce left in flight must finish before the group goes
            if call[3] is not None:
                call[3].wait()
        return {"result": result, "calls": len(calls), **seen}


def overlap(path: str = "ex03a_overlap.py") -> None:
    """03a.4: ``reduce_while_computing(t, compute)`` in ``path`` all-reduces ``t`` and calls
    ``compute()`` once while the all-reduce is in flight. Verified on rank 0: the last rank joins
    the all-reduce only once rank 0's ``compute()`` has finished."""
    ex = "03a.4 overlap"
    function_from(path, "reduce_while_computing", ex)
    values = run_ranks(
        ex, overlap_worker, FileConfig(path=str(Path(path).resolve())), 2, name="overlap"
    ).values
    first = values[0]
    require(first["calls"] != 0, ex, NO_ALL_REDUCE_SEEN)
    require(
        first["calls"] == 1,
        ex,
        f"rank 0 called dist.all_reduce {first['calls']} times: call it once",
    )
    require(
        first["computed"] == 1,
        ex,
        f"rank 0 called compute() {first['computed']} times: call it once",
    )
    require(
        first["in_flight"],
        ex,
        "when compute() started on rank 0 its all-reduce had already finished: on gloo a "
        "collective called without async_op returns only once the data has been exchanged, and "
        "so does a Work you wait for at once (section 2's async_allreduce)",
    )
    starts = [collectives.start_tensor(r, 8, "cpu").tolist() for r in range(2)]
    total = [sum(v) for v in zip(*starts)]
    for rank, v in sorted(values.items()):
        require(
            v["result"] == total,
            ex,
            f"after your function returned, rank {rank} held {v['result']}, not the "
            f"sum {total}: call work.wait() before returning",
        )
    passed(
        ex,
        "rank 0 computed while its all-reduce was in flight, and every rank returned holding the "
        "sum",
    )
