"""Measuring distributed training right: timing, collective sweeps, DDP step phases, a profiler trace.

Taught in notebooks/09_performance.ipynb; the arithmetic lives in :mod:`mgtutorial.perf.costmodel`.
Follows https://pytorch.org/docs/stable/distributed.html (collectives),
https://pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution (CUDA events),
https://pytorch.org/docs/stable/profiler.html and https://pytorch.org/docs/stable/notes/ddp.html.

Timing done right: warm up first (the first calls allocate, connect and compile); a ``barrier``
before the clock so every rank starts together; ``time.perf_counter`` (monotonic, high
resolution); several repeats, reported as median and spread. On a GPU a collective or a kernel
*returns before it finishes* (it is queued on a CUDA stream; NCCL runs on a stream of its own —
chapter 03), so the clock must stop only after ``torch.cuda.synchronize()``, or use CUDA events.
From the shell (2 ranks)::

    torchrun --standalone --nproc-per-node 2 benchmarks/collectives.py --out collectives.json
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from mgtutorial import ddp
from mgtutorial.runtime import env, runlog

KIB, MIB = 1024, 1024 * 1024
MODES = ("ddp", "independent", "alone")


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
    """Wait until all queued work on ``device`` is done (no-op on CPU, where ops are synchronous)."""
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

    ``start.record()`` and ``end.record()`` are queued on the current stream around ``fn``; the time
    between them is read after ``end.synchronize()``. No warm-up and no barrier: do both before
    calling it (:func:`time_op` does). Work ``fn`` queues on another stream is covered only if the
    current stream waits for it: a collective only when called synchronously (``async_op=False``,
    which orders it on the current stream), not with ``async_op=True`` before ``work.wait()``.
    Raises RuntimeError without CUDA. Follows https://pytorch.org/docs/stable/generated/torch.cuda.Event.html.
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


def collective_call(op: str, nbytes: int, world_size: int, device: torch.device):
    """A zero-argument function running ``op`` on float32 tensors of nccl-tests' size ``nbytes``.

    all_reduce/broadcast: a buffer of ``nbytes``; all_gather: each rank sends ``nbytes / n`` and
    receives ``nbytes``; reduce_scatter: each rank sends ``nbytes`` and keeps ``nbytes / n``.
    """
    numel = max(world_size, nbytes // 4 // world_size * world_size)
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // world_size, device=device)
    calls = {
        "all_reduce": lambda: dist.all_reduce(full),
        "broadcast": lambda: dist.broadcast(full, src=0),
        "all_gather": lambda: dist.all_gather_into_tensor(full, part),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
    }
    return calls[op]


@dataclass(kw_only=True)
class SweepConfig:
    """Configuration of :func:`sweep_worker`."""

    ops: list[str] = field(
        default_factory=lambda: ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
    )
    """Collectives to time (see :data:`mgtutorial.perf.costmodel.COLLECTIVES`)."""
    sizes: list[int] = field(default_factory=lambda: [4 * KIB * 4**i for i in range(7)])
    """Tensor sizes in bytes (nccl-tests' size; default 4 KiB … 16 MiB)."""
    warmup: int = 2
    """Untimed calls per (op, size)."""
    repeats: int = 5
    """Timed calls per (op, size); the median is kept."""
    backend: str = "auto"
    """"auto" | "gloo" | "nccl"."""
    timeout_s: float = 120.0
    """Collective timeout in seconds."""

    def validate(self, world_size: int) -> None:
        """Raises ValueError for an unknown op, a size < 4 bytes or fewer than 1 repeat."""
        from mgtutorial.perf.costmodel import COLLECTIVES

        bad = [op for op in self.ops if op not in COLLECTIVES]
        if bad:
            raise ValueError(f"ops {bad} are not among {COLLECTIVES}.")
        if min(self.sizes) < 4 or self.repeats < 1 or self.warmup < 0:
            raise ValueError(
                f"sizes ≥ 4 bytes, repeats ≥ 1, warmup ≥ 0 (got {min(self.sizes)}, "
                f"{self.repeats}, {self.warmup})."
            )


def sweep_worker(cfg: SweepConfig) -> list[dict]:
    """Time every (op, size) on every rank; the collective's time is the *slowest* rank's.

    Logs and returns ``kind="collective_time"`` records: ``op``, ``nbytes``, ``world_size``,
    ``time_s`` (median over repeats of the max over ranks), ``times`` (s).
    """
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx, runlog.RunLog() as log:
        out = []
        for op in cfg.ops:
            for nbytes in cfg.sizes:
                fn = collective_call(op, nbytes, ctx.world_size, ctx.device)
                t = torch.tensor(
                    time_op(fn, ctx.device, cfg.warmup, cfg.repeats, barrier=True),
                    device=ctx.device,
                )
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # done when the last rank is done
                times = t.tolist()
                out.append(
                    log.write(
                        kind="collective_time",
                        op=op,
                        nbytes=nbytes,
                        world_size=ctx.world_size,
                        time_s=statistics.median(times),
                        times=times,
                    )
                )
        return out


def matmul_flops(n: int = 256, repeats: int = 5, threads: int = 1) -> dict:
    """FLOP/s of an ``n×n @ n×n`` float32 matmul (2n³ FLOPs) on ``threads`` CPU threads (or the GPU).

    Returns ``{"flops": median FLOP/s, "times": [s]}``; restores the caller's thread count.
    """
    device = env.device_for(env.resolve_backend("auto", 1))
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = time_op(lambda: a @ b, device, warmup=2, repeats=repeats)
    finally:
        torch.set_num_threads(before)
    return {"flops": 2 * n**3 / statistics.median(times), "times": times}


class TimedTrainer(ddp.Trainer):
    """Chapter 02's Trainer whose ``_run_batch`` also times forward, backward and optimizer step.

    ``self.phases`` gets one ``(start, fwd_s, bwd_s, opt_s)`` tuple per step (perf_counter s);
    the time between two starts is the whole step (data loading and logging included). On a GPU the
    phases end with :func:`sync`, which costs some overlap but makes the split honest. Step number
    ``profile_step`` (if set) runs under ``torch.profiler`` and its Chrome trace goes to ``trace``.
    """

    def __init__(self, *args, profile_step: int | None = None, trace: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.phases: list[tuple[float, float, float, float]] = []
        self.profile_step, self.trace = profile_step, trace

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.step != self.profile_step:
            return self._timed_batch(x, y)
        from torch.profiler import ProfilerActivity, profile

        cuda = [ProfilerActivity.CUDA] if self.ctx.device.type == "cuda" else []
        with profile(activities=[ProfilerActivity.CPU, *cuda]) as prof:
            loss = self._timed_batch(x, y)
        prof.export_chrome_trace(self.trace)
        return loss

    def _timed_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        sync(self.ctx.device)
        t1 = time.perf_counter()
        loss.backward()  # DDP's all-reduces run during this call; gloo waits for the last at its end
        sync(self.ctx.device)
        t2 = time.perf_counter()
        self.optimizer.step()
        sync(self.ctx.device)
        self.phases.append((t0, t1 - t0, t2 - t1, time.perf_counter() - t2))
        return loss.item()


@dataclass(kw_only=True)
class StepConfig(ddp.DDPConfig):
    """:class:`~mgtutorial.ddp.DDPConfig` plus the variants :func:`step_worker` times in turn."""

    variants: list[dict] = field(default_factory=lambda: [{"batch_size": 32}])
    """Each a dict of ``batch_size``, ``mode`` and DDP keywords (``bucket_cap_mb``,
    ``gradient_as_bucket_view``, ``static_graph``); every variant trains ``warmup + steps`` steps with a
    fresh model, all ranks starting it together (a barrier). ``mode``: "ddp" (default); "independent":
    each rank trains alone (no DDP, no collectives) on the whole data set, N independent trainings at
    once, the machine's ceiling; "alone": rank 0 trains alone while the others wait (idle) at a barrier."""
    warmup: int = 3
    """Steps per variant that are not counted."""
    steps: int = 10
    """Timed steps per variant."""
    profile: bool = False
    """Train one more step of the first "ddp" variant under ``torch.profiler`` (not timed); each
    rank writes its Chrome trace to ``<run dir>/trace_rank<r>.json``."""

    def validate(self, world_size: int) -> None:
        """DDPConfig's checks, plus warmup ≥ 1 (DDP rebuilds its buckets after step 1) and steps ≥ 2."""
        super().validate(world_size)
        if self.warmup < 1 or self.steps < 2:
            raise ValueError(
                f"warmup={self.warmup}, steps={self.steps}: need warmup ≥ 1 and steps ≥ 2."
            )
        allowed = {"batch_size", "mode", "bucket_cap_mb", "gradient_as_bucket_view", "static_graph"}
        for v in self.variants:
            if set(v) - allowed or v.get("mode", "ddp") not in MODES:
                raise ValueError(
                    f"variant {v}: keys must be among {sorted(allowed)}, mode one of {MODES}."
                )


def step_worker(cfg: StepConfig) -> list[dict]:
    """Train each variant of ``cfg`` and return the median phase times per variant (rank's view).

    Returns dicts: the variant, ``world_size`` (1 unless "ddp"), ``fwd_s``, ``bwd_s``, ``opt_s``,
    ``step_s`` (medians over the timed steps), ``samples_per_s`` (this rank), ``step_times`` (s);
    ``{**variant, "idle": True}`` where a rank waited. With ``profile``, the first "ddp" one also
    has ``trace`` (its path) and ``grad_bytes`` (per parameter, in the order backward produces them
    here, for :func:`mgtutorial.perf.costmodel.bucket_layout`).
    """
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        out, n = [], cfg.warmup + cfg.steps
        profiled = next(
            (i for i, v in enumerate(cfg.variants) if v.get("mode", "ddp") == "ddp"), None
        )
        for i, variant in enumerate(cfg.variants):
            mode = variant.get("mode", "ddp")
            if mode == "alone" and ctx.rank != 0:
                dist.barrier()  # rank 0's start; its end is the next variant's barrier
                out.append({**variant, "idle": True})
                continue
            own = (
                ctx
                if mode == "ddp"
                else dataclasses.replace(ctx, rank=0, world_size=1, initialized=False)
            )
            kwargs = {k: v for k, v in variant.items() if k not in ("batch_size", "mode")}
            extra = (
                {"trace": str(runlog.run_dir() / f"trace_rank{ctx.rank}.json")}
                if cfg.profile and i == profiled
                else {}
            )
            run_cfg = dataclasses.replace(
                cfg,
                batch_size=variant.get("batch_size", cfg.batch_size),
                max_steps=n + len(extra),
                epochs=10_000,
                evaluate=False,
            )
            model, train_set, test_set, optimizer = ddp.build(
                run_cfg, own, wrap=functools.partial(ddp.apply_ddp, **kwargs)
            )
            trainer = TimedTrainer(
                model,
                train_set,
                test_set,
                optimizer,
                own,
                run_cfg,
                profile_step=n if extra else None,
                trace=extra.get("trace"),
            )
            if ctx.initialized:
                dist.barrier()
            trainer.train()
            timed, starts = (
                trainer.phases[cfg.warmup : n],
                [p[0] for p in trainer.phases[cfg.warmup : n + 1]],
            )
            steps = [b - a for a, b in zip(starts, starts[1:])]
            if extra:
                extra["grad_bytes"] = [
                    p.numel() * p.element_size() for p in reversed(list(model.parameters()))
                ]
            out.append(
                {
                    **variant,
                    **extra,
                    "world_size": own.world_size,
                    "step_times": steps,
                    **{
                        k: statistics.median(p[i] for p in timed)
                        for i, k in enumerate(("fwd_s", "bwd_s", "opt_s"), 1)
                    },
                    "step_s": statistics.median(steps),
                    "samples_per_s": run_cfg.batch_size / statistics.median(steps),
                }
            )
        return out


COMM_NAMES = ("all_reduce", "allreduce")


def trace_events(path: str | Path) -> list[dict]:
    """The complete events (``ph == "X"``) of a Chrome trace, each ``name``, ``start`` and ``dur``
    in seconds from the first event, ``tid``, and ``kind``: "backward" (autograd engine ops),
    "all_reduce" (the backend's all-reduce, e.g. ``gloo:all_reduce``), "forward" (DDP's forward),
    "optimizer" or "other"."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    t0 = min(e["ts"] for e in events)

    def kind(name: str) -> str:
        if name.startswith("autograd::engine::evaluate_function"):
            return "backward"
        if (
            ":" in name
            and any(c in name.split(":")[-1] for c in COMM_NAMES)
            and not name.startswith("c10d::")
        ):
            return "all_reduce"
        if name == "DistributedDataParallel.forward":
            return "forward"
        return "optimizer" if name.startswith("Optimizer.step") else "other"

    return [
        {
            "name": e["name"],
            "start": (e["ts"] - t0) / 1e6,
            "dur": e.get("dur", 0) / 1e6,
            "tid": e.get("tid"),
            "kind": kind(e["name"]),
        }
        for e in events
    ]
