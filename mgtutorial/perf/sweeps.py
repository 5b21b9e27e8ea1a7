"""Sweeps that measure: every collective over message sizes, and DDP steps split into forward,
backward and optimizer phases over batch sizes, modes and DDP's switches.

Taught in notebooks/09a_cost_model.ipynb (section 2) and notebooks/09b_measurement.ipynb. The clocks
are :mod:`mgtutorial.perf.timing`'s; the results feed :mod:`mgtutorial.perf.costmodel` (α–β fit,
step-time model) and :func:`mgtutorial.perf.scaling.scaling_ratios`. Follows
https://pytorch.org/docs/stable/distributed.html (collectives) and
https://pytorch.org/docs/stable/notes/ddp.html. From the shell (2 ranks)::

    torchrun --standalone --nproc-per-node 2 benchmarks/collectives.py --out collectives.json
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
import torch.distributed as dist

from mgtutorial import ddp
from mgtutorial.common.config import Config
from mgtutorial.perf import costmodel
from mgtutorial.perf.timing import sync, time_op
from mgtutorial.runtime import env, runlog

KIB, MIB = 1024, 1024 * 1024
Mode = Literal["ddp", "independent", "lockstep", "alone"]
"""How a variant of :func:`step_worker` trains (see :attr:`StepConfig.variants`)."""
MODES = get_args(Mode)


def collective_call(op: costmodel.Collective, nbytes: int, world_size: int, device: torch.device):
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
        "all_gather": lambda: dist.all_gather_single(full, part),
        "reduce_scatter": lambda: dist.reduce_scatter_single(part, full),
    }
    return calls[op]


@dataclass(kw_only=True)
class SweepConfig(Config):
    """Configuration of :func:`sweep_worker`."""

    ops: list[costmodel.Collective] = field(
        default_factory=lambda: ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
    )
    """Collectives to time (see :data:`mgtutorial.perf.costmodel.Collective`)."""
    sizes: list[int] = field(default_factory=lambda: [4 * KIB * 4**i for i in range(7)])
    """Tensor sizes in bytes (nccl-tests' size; default 4 KiB … 16 MiB)."""
    warmup: int = 2
    """Untimed calls per (op, size)."""
    repeats: int = 5
    """Timed calls per (op, size); the median is kept."""
    backend: env.BackendChoice = "auto"
    """"auto" | "gloo" | "nccl"."""
    timeout_s: float = 120.0
    """Collective timeout in seconds."""

    def validate(self, nprocs: int) -> None:
        """Raises ValueError for an unknown op, a size < 4 bytes or fewer than 1 repeat."""
        super().validate(nprocs)  # ops and backend: among their choices
        if min(self.sizes) < 4 or self.repeats < 1 or self.warmup < 0:
            raise ValueError(
                f"sizes ≥ 4 bytes, repeats ≥ 1, warmup ≥ 0 (got {min(self.sizes)}, "
                f"{self.repeats}, {self.warmup})."
            )


def sweep_worker(cfg: SweepConfig) -> list[dict]:
    """Time every (op, size) on every rank; the collective's time is the *slowest* rank's.

    Logs and returns ``kind="collective_time"`` records: ``op``, ``nbytes``, ``world_size``,
    ``time_s`` (median over repeats of the max over ranks), ``time_min_s`` (the fastest repeat:
    the one a busy machine disturbed least), ``times`` (s), ``cpu_min_s`` (the smallest CPU time
    of this rank's timed calls, all its threads, not necessarily the fastest call's: what the
    collective costs a core at least, waiting excluded).
    """
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx, runlog.RunLog() as log:
        out = []
        for op in cfg.ops:
            for nbytes in cfg.sizes:
                call, cpu = collective_call(op, nbytes, ctx.world_size, ctx.device), []

                def fn(call=call, cpu=cpu):  # the process's CPU time too (gloo's threads)
                    c0 = time.process_time()
                    call()
                    cpu.append(time.process_time() - c0)

                seconds = time_op(fn, ctx.device, cfg.warmup, cfg.repeats, barrier=True)
                t = torch.tensor(seconds, device=ctx.device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # done when the last rank is done
                times = t.tolist()
                record = log.write(
                    kind="collective_time",
                    op=op,
                    nbytes=nbytes,
                    world_size=ctx.world_size,
                    time_s=statistics.median(times),
                    time_min_s=min(times),
                    times=times,
                    cpu_min_s=min(cpu[cfg.warmup :]),
                )
                out.append(record)
        return out


class TimedTrainer(ddp.Trainer):
    """Chapter 02's Trainer whose ``_run_batch`` also times forward, backward and optimizer step.

    ``self.phases`` gets one ``(start, fwd_s, bwd_s, opt_s, samples, cpu_start, fwd_cpu_s,
    bwd_cpu_s, thread_start)`` tuple per step (perf_counter s; ``samples`` this step's batch,
    smaller for an epoch's last, partial batch; ``cpu_start``: the process's CPU time, all its
    threads, gloo's included; ``*_cpu_s``: the training thread's CPU time in the phase;
    ``thread_start``: the training thread's CPU time); the time between two
    starts is the whole step (data loading and logging included). On a GPU
    the phases end with :func:`~mgtutorial.perf.timing.sync`, which costs some overlap but makes
    the split honest. Step number ``profile_step`` (if set) runs under ``torch.profiler`` and its
    Chrome trace goes to ``trace``; ``step_barrier``: all ranks meet at a barrier after each step.
    """

    def __init__(
        self,
        *args,
        profile_step: int | None = None,
        trace: str | None = None,
        step_barrier: bool = False,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.phases: list[tuple] = []
        self.profile_step, self.trace, self.step_barrier = profile_step, trace, step_barrier

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
        t0, c0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        sync(self.ctx.device)
        t1, h1 = time.perf_counter(), time.thread_time()
        # DDP's all-reduces run during this call; gloo waits for the last one at its end
        loss.backward()
        sync(self.ctx.device)
        t2, h2 = time.perf_counter(), time.thread_time()
        self.optimizer.step()
        sync(self.ctx.device)
        t3 = time.perf_counter()
        self.phases.append((t0, t1 - t0, t2 - t1, t3 - t2, len(x), c0, h1 - h0, h2 - h1, h0))
        if self.step_barrier:  # "lockstep": every rank waits for the slowest, as under DDP
            dist.barrier()
        return loss.item()


VARIANT_KEYS = ("batch_size", "mode", "bucket_cap_mb", "gradient_as_bucket_view", "static_graph")
"""The keys a variant of :attr:`StepConfig.variants` may have."""


@dataclass(kw_only=True)
class StepConfig(ddp.DDPConfig):
    """:class:`~mgtutorial.ddp.DDPConfig` plus the variants :func:`step_worker` times in turn."""

    variants: list[dict] = field(default_factory=lambda: [{"batch_size": 32}])
    """Each a dict of ``batch_size``, ``mode`` (:data:`Mode`) and DDP keywords
    (``bucket_cap_mb``, ``gradient_as_bucket_view``, ``static_graph``); every variant trains
    ``warmup + steps`` steps with a fresh model, all ranks starting it together (a barrier).
    ``mode``: "ddp" (default); "independent": each rank trains alone (no DDP, no collectives)
    on the whole data set, N independent trainings at once, the machine's ceiling; "lockstep":
    as "independent", with a barrier of all ranks after every step (DDP's synchrony without its
    gradients); "alone":
    rank 0 trains alone while the others wait (idle) at a barrier."""
    warmup: int = 3
    """Steps per variant that are not counted."""
    steps: int = 10
    """Steps per variant after the warm-up: steps − 1 durations (start to next start)."""
    profile: bool = False
    """Train one more step of the first "ddp" variant under ``torch.profiler`` (not timed); each
    rank writes its Chrome trace to ``<run dir>/trace_rank<r>.json``."""

    def validate(self, nprocs: int) -> None:
        """DDPConfig's checks, plus warmup ≥ 1 (DDP rebuilds its buckets after step 1), steps ≥ 2
        and variants with known keys and modes."""
        super().validate(nprocs)
        if self.warmup < 1 or self.steps < 2:
            raise ValueError(
                f"warmup={self.warmup}, steps={self.steps}: need warmup ≥ 1 and steps ≥ 2."
            )
        for v in self.variants:
            if set(v) - set(VARIANT_KEYS) or v.get("mode", "ddp") not in MODES:
                raise ValueError(
                    f"variant {v}: keys must be among {sorted(VARIANT_KEYS)}, mode one of {MODES}."
                )


def run_variant(cfg: StepConfig, ctx, variant: dict, trace: str | None, barrier: bool) -> dict:
    """Train one variant of ``cfg`` on ``ctx`` (a world of one for the modes that train alone);
    its medians and step times, as :func:`step_worker` returns them. ``trace``: profile one more
    step and write its Chrome trace there; ``barrier``: start training at a barrier of the whole
    job (which the ranks of the alone modes join too)."""
    n = cfg.warmup + cfg.steps
    kwargs = {k: v for k, v in variant.items() if k not in ("batch_size", "mode")}
    run_cfg = dataclasses.replace(
        cfg,
        batch_size=variant.get("batch_size", cfg.batch_size),
        max_steps=n + (trace is not None),
        epochs=10_000,
        evaluate=False,
    )
    wrap = functools.partial(ddp.apply_ddp, **kwargs)
    model, train_set, test_set, optimizer = ddp.build(run_cfg, ctx, wrap=wrap)
    trainer = TimedTrainer(
        model,
        train_set,
        test_set,
        optimizer,
        ctx,
        run_cfg,
        profile_step=n if trace else None,
        trace=trace,
        step_barrier=variant.get("mode") == "lockstep",
    )
    if barrier:
        dist.barrier()
    trainer.train()
    # an epoch's last batch is partial (the data set is not a multiple of the batch): its shorter
    # step would mix into the statistics, so only full batches are timed
    full = run_cfg.batch_size
    timed = [p for p in trainer.phases[cfg.warmup : n] if p[4] == full]
    starts = trainer.phases[cfg.warmup : n + 1]
    steps = [b[0] - a[0] for a, b in zip(starts, starts[1:]) if a[4] == full]
    cpu = [b[5] - a[5] for a, b in zip(starts, starts[1:]) if a[4] == full]
    thread = [b[8] - a[8] for a, b in zip(starts, starts[1:]) if a[4] == full]
    extra = {}
    if trace:
        extra["trace"] = trace
        extra["grad_bytes"] = [
            p.numel() * p.element_size() for p in reversed(list(model.parameters()))
        ]
    phases = {"fwd_s": 1, "bwd_s": 2, "opt_s": 3, "fwd_cpu_s": 6, "bwd_cpu_s": 7}
    return {
        **variant,
        **extra,
        "world_size": ctx.world_size,
        "step_times": steps,
        **{k: statistics.median(p[i] for p in timed) for k, i in phases.items()},
        "cpu_times": cpu,
        "thread_cpu_times": thread,
        "step_s": statistics.median(steps),
        "samples_per_s": run_cfg.batch_size / statistics.median(steps),
    }


def step_worker(cfg: StepConfig) -> list[dict]:
    """Train each variant of ``cfg``; per variant (this rank's view) the variant, ``world_size``
    (1 unless "ddp"), ``fwd_s``, ``bwd_s``, ``opt_s``, ``step_s`` (medians over the timed steps),
    ``samples_per_s``, ``step_times`` (s), ``fwd_cpu_s``, ``bwd_cpu_s`` (the training thread's,
    medians), ``cpu_times`` and ``thread_cpu_times`` (per step: the process's CPU, all threads,
    and the training thread's); ``{**variant, "idle": True, "idle_cpu_s"}`` where a
    rank waited from rank 0's start to its end of training alone (its CPU seconds meanwhile).
    With ``profile``, the first "ddp" one also has ``trace`` (its path) and ``grad_bytes`` (per
    parameter, in the order backward produces them, for ``costmodel.bucket_layout``)."""
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        out = []
        modes = [v.get("mode", "ddp") for v in cfg.variants]
        profiled = modes.index("ddp") if cfg.profile and "ddp" in modes else None
        for i, (variant, mode) in enumerate(zip(cfg.variants, modes)):
            if mode == "alone" and ctx.rank != 0:
                dist.barrier()  # rank 0's start
                cpu = time.process_time()
                dist.barrier()  # rank 0's end: nothing of the next variant is built meanwhile
                out.append({**variant, "idle": True, "idle_cpu_s": time.process_time() - cpu})
                continue
            own = (
                ctx
                if mode == "ddp"
                else dataclasses.replace(ctx, rank=0, world_size=1, initialized=False)
            )
            trace = str(runlog.run_dir() / f"trace_rank{ctx.rank}.json") if i == profiled else None
            out.append(run_variant(cfg, own, variant, trace, barrier=ctx.initialized))
            if mode == "alone" and ctx.initialized:
                dist.barrier()  # rank 0 has finished training alone: the others go on
        return out


@dataclass(kw_only=True)
class OwnConfig(Config):
    """Configuration of :func:`ddp_own_worker`."""

    batch_size: int = 1
    """Images per step (chapter 01's CNN, 3×32×32); DDP's own work depends on the gradients'
    bytes, not on the batch, so a small batch keeps the steps, and the noise on them, short."""
    repeats: int = 300
    """Timed pairs of steps (plain and DDP, either first in turn), after 3 untimed ones; the
    median difference is kept."""

    def validate(self, nprocs: int | None = None) -> None:
        """Raises ValueError for a batch size < 1, fewer than 1 repeat, or more than 1 rank."""
        super().validate(nprocs)
        if self.batch_size < 1 or self.repeats < 1:
            raise ValueError(
                f"batch_size={self.batch_size}, repeats={self.repeats}: need both ≥ 1."
            )
        if nprocs not in (None, 1):
            raise ValueError(f"nprocs={nprocs}: ddp_own_worker measures on a world of one; use 1.")


def ddp_own_worker(cfg: OwnConfig) -> dict:
    """DDP's own work per step on the training thread: the same model and batch, plain and
    wrapped in DDP on a world of one (gloo), stepped in turn (either first); there is no other
    rank to wait for, so what DDP adds is its autograd hooks and the copies of the gradients into
    the flat buckets and back. Each pair of steps runs under the same load, so the median of the
    pairs' differences is kept.

    Returns a dict: ``batch_size``; ``plain_s`` (the plain step's median, the training thread's
    CPU time, s); ``own_raw_s`` (median difference DDP − plain of that CPU time over forward +
    backward + optimizer step) and ``own_s`` (the same, at least 0: a negative median is noise),
    the input of :func:`costmodel.ddp_added_time` for CPU time; ``own_wall_s`` (the median
    difference of the same steps' wall time, ``perf_counter``, at least 0), its input for wall
    time;
    ``fwd_s``, ``bwd_s``, ``opt_s`` (the CPU difference per phase).
    Taught in notebooks/09b_measurement.ipynb (section 1);
    https://pytorch.org/docs/stable/notes/ddp.html.
    """
    from torch.nn.parallel import DistributedDataParallel

    from mgtutorial.common import models

    with env.distributed("gloo", num_threads=1):
        torch.manual_seed(0)
        plain = models.ArticleCNN(in_shape=(3, 32, 32))
        wrapped = DistributedDataParallel(models.ArticleCNN(in_shape=(3, 32, 32)))
        pair = [(m, torch.optim.SGD(m.parameters(), lr=0.01)) for m in (plain, wrapped)]
        x, y = torch.randn(cfg.batch_size, 3, 32, 32), torch.randint(0, 10, (cfg.batch_size,))
        diffs, plains, walls = [], [], []
        for i in range(3 + cfg.repeats):
            phases, wall = [], []
            for model, opt in pair if i % 2 else pair[::-1]:  # either first, in turn
                t0 = time.perf_counter()
                c0 = time.thread_time()
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                c1 = time.thread_time()
                loss.backward()
                c2 = time.thread_time()
                opt.step()
                phases.append((c1 - c0, c2 - c1, time.thread_time() - c2))
                wall.append(time.perf_counter() - t0)
            plain_p, ddp_p = phases if i % 2 else phases[::-1]
            plain_w, ddp_w = wall if i % 2 else wall[::-1]
            if i >= 3:
                diffs.append([d - p for p, d in zip(plain_p, ddp_p)])
                plains.append(sum(plain_p))
                walls.append(ddp_w - plain_w)
        med = [statistics.median(d[k] for d in diffs) for k in range(3)]
        raw = statistics.median(sum(d) for d in diffs)
        return {
            "batch_size": cfg.batch_size,
            "plain_s": statistics.median(plains),
            "own_s": max(0.0, raw),
            "own_raw_s": raw,
            "own_wall_s": max(0.0, statistics.median(walls)),
            **dict(zip(("fwd_s", "bwd_s", "opt_s"), med)),
        }
