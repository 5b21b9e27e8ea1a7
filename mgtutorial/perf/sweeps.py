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
from mgtutorial.perf.collective_sweep import (  # noqa: F401  (09a, section 2)
    KIB,
    MIB,
    SweepConfig,
    collective_call,
    sweep_worker,
)
from mgtutorial.perf.ddp_own import OwnConfig, ddp_own_worker  # noqa: F401  (09b, section 1)
from mgtutorial.perf.timing import sync
from mgtutorial.runtime import env, runlog

Mode = Literal["ddp", "independent", "lockstep", "alone"]
"""How a variant of :func:`step_worker` trains (see :attr:`StepConfig.variants`)."""
MODES = get_args(Mode)


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
