"""What DDP adds to a step, op by op (chapter 09b): one rank's steps profiled with
``torch.profiler``, plain in lockstep (a barrier after each step) and wrapped in DDP (the same
barrier), on the same model and batch; the ops that DDP adds or calls more often, with their
calls and self time per step (the profiler's ``self_cpu_time_total``: wall time on the
thread), the training thread and gloo's apart.

Taught in notebooks/09b_measurement.ipynb (section 1); called as ``sweeps.ddp_ops_worker``
(re-exported by :mod:`mgtutorial.perf.sweeps`). Follows
https://pytorch.org/docs/stable/notes/ddp.html and
https://pytorch.org/docs/stable/profiler.html.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mgtutorial.common.config import Config
from mgtutorial.runtime import env

GROUPS = (
    ("the all-reduces' launches (c10d::allreduce_, DDP's hook)", ("c10d::allreduce_",)),
    (
        "DDP's own ops (forward, bucket copies, averaging, casts)",
        (
            "DistributedDataParallel",
            "reducer",
            "aten::copy_",
            "aten::mul",
            "aten::_to_copy",
            "aten::to",
            "aten::as_strided",
            "aten::empty_strided",
            "aten::div",
        ),
    ),
)
"""How :func:`group_of` files an op that DDP adds, by its name (first match wins)."""
BACKWARD = "backward, outside its ops"
"""The name of the range around ``loss.backward()``: its self time is backward's time in no op,
which with DDP holds the reducer's wait for every bucket's all-reduce at backward's end
(``Reducer::finalize_backward`` waits on each bucket's future outside any recorded op)."""
SHARED = (
    "the compute both steps run (forward, backward, optimizer), DDP − lockstep",
    "the barrier that ends each step (c10d::barrier), DDP − lockstep",
    f"{BACKWARD} (DDP: the wait for the all-reduces), DDP − lockstep",
)
"""The lines of the ops both steps run, as often: the compute, the barrier, and backward's own
time (:data:`BACKWARD`)."""


@dataclass(kw_only=True)
class OpsConfig(Config):
    """Configuration of :func:`ddp_ops_worker`."""

    batch_size: int = 32
    """Images per step and rank (chapter 01's CNN, 3×32×32)."""
    warmup: int = 3
    """Untimed steps of each variant first (DDP rebuilds its buckets after its first step)."""
    pairs: int = 20
    """Profiled pairs of steps: one lockstep step, then one DDP step (or the other way round, in
    turn), so that a change of load touches both alike; means over the pairs are kept."""

    def validate(self, nprocs: int | None = None) -> None:
        """Raises ValueError for a batch size or pairs < 1, or a warm-up below 2."""
        super().validate(nprocs)
        if min(self.batch_size, self.pairs) < 1 or self.warmup < 2:
            raise ValueError(
                f"batch_size={self.batch_size}, warmup={self.warmup}, pairs={self.pairs}: need "
                "warmup ≥ 2 (DDP's buckets are rebuilt after step 1) and the others ≥ 1."
            )


def runqueue_s() -> float:
    """Seconds this thread has waited on a run queue for a core so far (Linux:
    ``/proc/self/task/<tid>/schedstat``, its second field, in ns); NaN where the file is missing
    or unreadable (not Linux, or a kernel without schedstats): unknown, printed as n/a."""
    import threading
    from pathlib import Path

    try:
        stat = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").read_text()
        return int(stat.split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return math.nan


def thread_tables(events) -> dict:
    """{"training", "gloo": {op name: [calls, self seconds]}} from a profiler's ``events()``: a
    thread that ran any ``gloo:`` op is one of gloo's; the training thread is the thread with the
    most events among the others (the profiler's own thread has one)."""
    by_thread: dict = {}
    for e in events:
        by_thread.setdefault(e.thread, []).append(e)
    gloo = {t for t, es in by_thread.items() if any(e.name.startswith("gloo:") for e in es)}
    rest = [t for t in by_thread if t not in gloo]
    training = max(rest, key=lambda t: len(by_thread[t])) if rest else None
    out: dict = {"training": {}, "gloo": {}}
    for t, es in by_thread.items():
        table = out["gloo"] if t in gloo else out["training"] if t == training else None
        for e in es if table is not None else ():
            row = table.setdefault(e.name, [0, 0.0])
            row[0] += 1
            row[1] += e.self_cpu_time_total / 1e6
    return out


def ddp_ops_worker(cfg: OpsConfig) -> dict:
    """Profile (``torch.profiler``, CPU) ``cfg.pairs`` pairs of steps, one of the plain model in
    lockstep and one of the same model in DDP (either first, in turn), after ``cfg.warmup``
    untimed steps of each. Each step starts after a barrier (outside the profile) and ends with
    one (for DDP it stands for the logging's all-reduce of the loss).

    Returns {"lockstep", "ddp": one table per step, in pair order: {"training", "gloo": {op:
    (calls, self s)} (:func:`thread_tables`), "step_s": wall seconds (``perf_counter``),
    "cpu_s": the training thread's CPU seconds (``thread_time``), "runqueue_s": its seconds
    waiting for a core (:func:`runqueue_s`)}, "rank",
    "batch_size", "pairs"}. The profiler's self time is the time on its thread inside the op and
    not in a child op: wall time, waiting for a core included.
    """
    import time

    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile, record_function

    from mgtutorial.common import models

    with env.distributed("gloo", num_threads=1) as ctx:
        torch.manual_seed(0)
        plain = models.ArticleCNN(in_shape=(3, 32, 32))
        wrapped = DistributedDataParallel(models.ArticleCNN(in_shape=(3, 32, 32)))
        x = torch.randn(cfg.batch_size, 3, 32, 32)
        y = torch.randint(0, 10, (cfg.batch_size,))
        steps = {}
        for name, model in (("lockstep", plain), ("ddp", wrapped)):
            opt = torch.optim.SGD(model.parameters(), lr=0.01)

            def step(model=model, opt=opt):
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                with record_function(BACKWARD):
                    loss.backward()
                opt.step()
                dist.barrier()

            for _ in range(cfg.warmup):
                step()
            steps[name] = step
        out: dict = {"rank": ctx.rank, "batch_size": cfg.batch_size, "pairs": cfg.pairs}
        out |= {m: [] for m in steps}
        for i in range(cfg.pairs):
            for name in ("lockstep", "ddp") if i % 2 == 0 else ("ddp", "lockstep"):
                dist.barrier()  # both ranks start the step together
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    t0, c0, q0 = time.perf_counter(), time.thread_time(), runqueue_s()
                    steps[name]()
                    step_s, cpu_s = time.perf_counter() - t0, time.thread_time() - c0
                    queued_s = runqueue_s() - q0
                tables = thread_tables(prof.events())
                out[name].append(
                    {w: {op: tuple(v) for op, v in t.items()} for w, t in tables.items()}
                )
                out[name][-1] |= {"step_s": step_s, "cpu_s": cpu_s, "runqueue_s": queued_s}
        return out


def group_of(name: str) -> str:
    """The group of :data:`GROUPS` an op that DDP adds falls in, or "other"."""
    return next((g for g, keys in GROUPS if any(k in name for k in keys)), "other")


def breakdown(lockstep: dict, ddp: dict) -> dict:
    """What DDP adds to the training thread's step, per step (s), from two of
    :func:`ddp_ops_worker`'s tables (``"lockstep"`` and ``"ddp"``).

    Returns {"added_ops": [{"name", "group", "calls", "self_s"}] for every op DDP calls more
    often (calls and self time DDP − lockstep, largest time first), "groups": {group: (calls,
    self s)} over those rows, then the three lines of :data:`SHARED` (the ops called as often in
    both: their time difference), "accounted_s" (the sum of the groups), "measured_s" (step_s,
    DDP − lockstep), "unaccounted_s" (measured − accounted: time on the training thread outside
    any op, or off it), "gloo": {op: (calls, self s) per step, DDP − lockstep} on gloo's threads}.
    """
    t_lock, t_ddp = lockstep["training"], ddp["training"]
    rows, shared = [], [0.0, 0.0, 0.0]
    for name in sorted(set(t_ddp) | set(t_lock)):
        (dc, ds), (lc, ls) = t_ddp.get(name, (0.0, 0.0)), t_lock.get(name, (0.0, 0.0))
        if dc > lc:
            rows.append(
                {"name": name, "group": group_of(name), "calls": dc - lc, "self_s": ds - ls}
            )
        else:
            shared[1 if name == "c10d::barrier" else 2 if name == BACKWARD else 0] += ds - ls
    rows.sort(key=lambda r: -r["self_s"])
    groups = {g: (0.0, 0.0) for g, _ in GROUPS} | {"other": (0.0, 0.0)}
    for r in rows:
        c, s = groups[r["group"]]
        groups[r["group"]] = (c + r["calls"], s + r["self_s"])
    groups = {g: v for g, v in groups.items() if v != (0.0, 0.0)} | {
        line: (0.0, t) for line, t in zip(SHARED, shared)
    }
    accounted = sum(s for _, s in groups.values())
    measured = ddp["step_s"] - lockstep["step_s"]
    cpu = ddp.get("cpu_s", 0.0) - lockstep.get("cpu_s", 0.0)
    queued = ddp.get("runqueue_s", math.nan) - lockstep.get("runqueue_s", math.nan)
    g_lock, g_ddp = lockstep["gloo"], ddp["gloo"]
    gloo = {
        op: (
            g_ddp.get(op, (0, 0.0))[0] - g_lock.get(op, (0, 0.0))[0],
            g_ddp.get(op, (0, 0.0))[1] - g_lock.get(op, (0, 0.0))[1],
        )
        for op in sorted(set(g_ddp) | set(g_lock))
    }
    return {
        "added_ops": rows,
        "groups": groups,
        "accounted_s": accounted,
        "measured_s": measured,
        "unaccounted_s": measured - accounted,
        "measured_cpu_s": cpu,
        "measured_runqueue_s": queued,
        "gloo": gloo,
    }


def paired_breakdown(lockstep: list[dict], ddp: list[dict]) -> dict:
    """:func:`breakdown` of each pair of steps (``lockstep[i]``, ``ddp[i]``), and the means over
    the pairs (means add up: the groups' means plus ``unaccounted_s`` equal ``measured_s``):
    {"groups": {group: (calls, mean self s)}, "accounted_s", "measured_s", "measured_cpu_s",
    "measured_runqueue_s", "unaccounted_s": means; "added_ops" and "gloo": the first pair's;
    "counts_agree": whether every pair added the same ops, as often; "pairs"}.
    """
    import statistics

    each = [breakdown(lk, dd) for lk, dd in zip(lockstep, ddp)]
    calls = [{r["name"]: r["calls"] for r in b["added_ops"]} for b in each]
    names = list(dict.fromkeys(g for b in each for g in b["groups"]))
    groups = {
        g: (
            next(b["groups"][g][0] for b in each if g in b["groups"]),
            statistics.fmean(b["groups"].get(g, (0.0, 0.0))[1] for b in each),
        )
        for g in names
    }
    keys = ("accounted_s", "measured_s", "measured_cpu_s", "measured_runqueue_s", "unaccounted_s")
    return {
        "groups": groups,
        **{k: statistics.fmean(b[k] for b in each) for k in keys},
        "added_ops": each[0]["added_ops"],
        "gloo": each[0]["gloo"],
        "counts_agree": all(c == calls[0] for c in calls),
        "pairs": len(each),
    }
