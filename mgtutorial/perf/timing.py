"""Timing done right, on a CPU and on a GPU: warm-up, barrier, clock, synchronize, repeats; CUDA
events; the FLOP/s of a matmul; the events of a profiler trace.

Taught in notebooks/09a_cost_model.ipynb (sections 1 and 3) and notebooks/09b_measurement.ipynb
(section 2). The sweeps that use these live in :mod:`mgtutorial.perf.sweeps`, the arithmetic in
:mod:`mgtutorial.perf.costmodel`. Follows
https://pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution (CUDA events) and
https://pytorch.org/docs/stable/profiler.html.

Timing done right: warm up first (the first calls allocate, connect and compile); a ``barrier``
before the clock so every rank starts together; ``time.perf_counter`` (monotonic, high
resolution); several repeats, reported as median and spread. On a GPU a collective or a kernel
*returns before it finishes* (it is queued on a CUDA stream: a synchronous NCCL call on the
current one, an asynchronous one, as DDP's, on the process group's own stream — chapter 03), so
the clock must stop only after ``torch.cuda.synchronize()``, or use CUDA events.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mgtutorial.common.compare import collective_name


def summarize(times: list[float]) -> dict:
    """Median, min, max and the interquartile range of a list of seconds."""
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {
        "median": statistics.median(times),
        "min": min(times),
        "max": max(times),
        "iqr": q[2] - q[0],
    }


def sync(device: torch.device) -> None:
    """Wait until all queued work on ``device`` is done (a no-op on CPU, where ops are
    synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(
    fn, device: torch.device, warmup: int = 2, repeats: int = 5, barrier: bool = False
) -> list[float]:
    """Seconds per call of ``fn()``: ``warmup`` untimed calls, then ``repeats`` timed ones.

    Each timed call: (``barrier`` if asked, so all ranks start together) → ``perf_counter`` →
    ``fn()`` → :func:`sync` → ``perf_counter``.
    """
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def time_cuda_events(fn, repeats: int = 5) -> list[float]:
    """Seconds per call of ``fn()`` measured on the GPU's own clock with CUDA events (GPU only).

    ``start.record()`` and ``end.record()`` are queued on the current stream around ``fn``; the
    time between them is read after ``end.synchronize()``. No warm-up and no barrier: do both
    before calling it (:func:`time_op` does). Work ``fn`` queues on another stream is covered
    only if the current stream waits for it: a collective only when called synchronously
    (``async_op=False``, which orders it on the current stream), not with ``async_op=True``
    before ``work.wait()``. Raises RuntimeError without CUDA. Follows
    https://pytorch.org/docs/stable/generated/torch.cuda.Event.html.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA events need a CUDA GPU; on CPU use time_op (perf_counter).")
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)  # ms → s
    return times


def matmul_flops(
    n: int = 256, repeats: int = 5, threads: int = 1, device: torch.device | None = None
) -> dict:
    """FLOP/s of an ``n×n @ n×n`` float32 matmul (2n³ FLOPs) on ``threads`` CPU threads, or on
    ``device`` when given (default: the CPU, whatever GPU the machine has, since chapter 09a's
    MFU and roofline compare it with CPU work).

    Returns ``{"flops": median FLOP/s, "best": the fastest call's FLOP/s, "times": [s]}``;
    restores the caller's thread count.
    """
    device = device or torch.device("cpu")
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = time_op(lambda: a @ b, device, warmup=2, repeats=repeats)
    finally:
        torch.set_num_threads(before)
    work = 2 * n**3
    return {"flops": work / statistics.median(times), "best": work / min(times), "times": times}


def matmul_peak(
    sizes=(128, 256, 512, 1024), repeats: int = 21, threads: int = 1, device=None
) -> dict:
    """A measured reference rate for MFU (not a hardware bound): the median FLOP/s of ``repeats``
    calls of :func:`matmul_flops` at the size that saturates, the one of ``sizes`` whose fastest
    of 5 calls (the least disturbed by other programs: what the core can do at that size) is
    highest; beyond it the operands leave the cache. Compare it with a workload timed the same
    way (median of its calls), on the same ``device`` (default: the CPU). Returns ``{"flops":
    that median, "n": its size, "by_size": {n: fastest FLOP/s of 5 calls}, "quartiles": (q1, q3)
    FLOP/s of the ``repeats`` calls, "best": their fastest FLOP/s}``."""
    by_size = {n: matmul_flops(n, 5, threads, device)["best"] for n in sizes}
    n = max(by_size, key=by_size.get)
    run = matmul_flops(n, repeats, threads, device)
    rates = sorted(2 * n**3 / t for t in run["times"])
    q1, _, q3 = statistics.quantiles(rates, n=4)
    return {
        "flops": run["flops"],
        "n": n,
        "by_size": by_size,
        "quartiles": (q1, q3),
        "best": run["best"],
    }


def event_kind(name: str) -> str:
    """What a profiler event is: "backward" (autograd engine ops), "all_reduce" (the backend's
    own all-reduce, e.g. ``gloo:all_reduce``, on the backend's thread), "all_reduce_launch" (c10d's
    ``c10d::allreduce_``, on the thread that launched it: DDP's hook, inside backward), "forward"
    (DDP's forward), "optimizer" or "other"."""
    if name.startswith("autograd::engine::evaluate_function"):
        return "backward"
    if ":" in name and collective_name(name.rsplit(":", 1)[-1]) == "all_reduce":
        return "all_reduce_launch" if name.startswith("c10d::") else "all_reduce"
    if name == "DistributedDataParallel.forward":
        return "forward"
    return "optimizer" if name.startswith("Optimizer.step") else "other"


def trace_events(path: str | Path) -> list[dict]:
    """The complete events (``ph == "X"``) of a Chrome trace, each ``name``, ``start`` and ``dur``
    in seconds from the first event, ``tid``, and ``kind`` (see :func:`event_kind`)."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    t0 = min(e["ts"] for e in events)
    return [
        {
            "name": e["name"],
            "start": (e["ts"] - t0) / 1e6,
            "dur": e.get("dur", 0) / 1e6,
            "tid": e.get("tid"),
            "kind": event_kind(e["name"]),
        }
        for e in events
    ]
