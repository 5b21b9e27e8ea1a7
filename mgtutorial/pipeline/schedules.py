"""Pipeline parallelism: GPipe and 1F1B with ``torch.distributed.pipelining`` (one stage per rank),
interleaved 1F1B (``ScheduleInterleaved1F1B``, two stages per rank) and GPipe by hand
(:mod:`mgtutorial.pipeline.hand_gpipe`), run by one worker.

Taught in notebooks/04a_pipeline_gpipe.ipynb and notebooks/04b_pipeline_schedules.ipynb. Follows
https://pytorch.org/docs/stable/distributed.pipelining.html and the GPipe (Huang et al., 2019) and
1F1B (PipeDream-Flush, Narayanan et al., 2021) schedules, and its interleaved variant (same paper).
The boxes each stage logs are in :mod:`mgtutorial.pipeline.timeline`, the bubble they leave in
:mod:`mgtutorial.pipeline.bubble`, activation memory in :mod:`mgtutorial.pipeline.activations`, the
naive split in :mod:`mgtutorial.pipeline.naive`.

One stage per rank (two for "interleaved": s and s + p): rank s holds stage s of the article's MLP
(:meth:`~mgtutorial.common.models.ArticleMLP.split`). A batch of ``batch_size`` samples is cut into
``n_microbatches`` micro-batches; activations travel forward to rank s+1 and gradients back to rank
s−1 with point-to-point send/recv. From the shell::

    torchrun --standalone --nproc-per-node 2 -m mgtutorial pipeline --schedule 1f1b --microbatches 4
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import nn

from mgtutorial.common import models
from mgtutorial.common.config import Config, at_least, check_timeout, positive, rank_or_none
from mgtutorial.common.finite import check_loss
from mgtutorial.pipeline import hand_gpipe, library, simulated, timeline
from mgtutorial.pipeline.activations import ActivationMeter
from mgtutorial.pipeline.mlp_data import batches, check_data_fits, mlp_data
from mgtutorial.runtime import env, runlog

Schedule = Literal["hand-gpipe", "gpipe", "1f1b", "interleaved"]
"""A pipeline schedule: "hand-gpipe" is :mod:`mgtutorial.pipeline.hand_gpipe`'s, the others are
torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B."""
SCHEDULES = get_args(Schedule)  # the command line's --schedule choices
__all__ = ["PipelineConfig", "batches", "mlp_data", "unsplit_reference", "worker"]


@dataclass(kw_only=True)
class PipelineConfig(Config):
    """Configuration of :func:`worker` (and of the single-process reference)."""

    schedule: Schedule = "gpipe"
    """"hand-gpipe" (:func:`mgtutorial.pipeline.hand_gpipe.step`), "gpipe", "1f1b" or
    "interleaved" (torch.distributed.pipelining; "interleaved": two stages per rank)."""
    n_microbatches: int = 4
    """Micro-batches per step (m). 1 = naive model parallelism: one stage busy at a time."""
    batch_size: int = 64
    """Samples per step for the whole pipeline (not per rank)."""
    steps: int = 4
    """Optimizer steps."""
    lr: float = 0.05
    """SGD learning rate (every stage steps its own parameters)."""
    sizes: list[int] = field(default_factory=lambda: [1024, 512, 256, 100])
    """Layer widths of the MLP (the article's by default); one sub-network per consecutive pair."""
    seed: int = 0
    """Seed of the initial weights; each sub-network has its own (:func:`init_subnets`), so
    every split starts from the same weights while each rank builds only its stage."""
    backend: env.BackendChoice = "auto"
    """The process group's backend; "auto": NCCL with a GPU per rank, else gloo."""
    timeout_s: float = 60.0
    """Collective timeout in seconds."""
    save_params: bool = True
    """Each stage writes its final parameters to ``<run dir>/stage<s>.pt``."""
    fail_stage: int = -1
    """Fault injection: this stage raises at step 2 (−1: never)."""
    device_ms: float = 0.0
    """A simulated device (:mod:`mgtutorial.pipeline.simulated`): every box lasts a set time on
    the wall clock, the rank sleeping (its core free) for what the arithmetic leaves; the whole
    model's forward of one batch lasts this many milliseconds (its backward twice), shared evenly
    by the stages and micro-batches. 0: no simulated device, the boxes last what the CPU takes."""
    input_grad: bool = False
    """Stage 0 also computes the gradient of its input (work nobody needs), so that in an MLP of
    equal layers every stage's backward does the same work (chapter 04's bubble measurement)."""

    def validate(self, nprocs: int) -> None:
        """Refuse, before any work, what the schedule cannot do on ``nprocs`` ranks: called by
        :func:`mgtutorial.launch` before any process starts, and by :func:`worker`. Raises
        ValueError naming the values."""
        super().validate(nprocs)
        at_least(self, 1, "steps", "batch_size")
        positive(self, "lr")
        check_timeout(self)
        at_least(self, 0, "device_ms")
        if len(self.sizes) < 2 or any(not isinstance(w, int) or w < 1 for w in self.sizes):
            raise ValueError(
                f"sizes={self.sizes!r}: give at least two layer widths, each a positive integer."
            )
        m = self.n_microbatches
        if m < 1 or m > self.batch_size:
            raise ValueError(
                f"n_microbatches={m} must be between 1 and batch_size={self.batch_size}."
            )
        if self.schedule != "hand-gpipe" and self.batch_size % m:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by n_microbatches={m}: "
                "torch.distributed.pipelining weights every micro-batch's loss equally "
                f"(1/{m}), which is only right for equal sizes. Use a batch size that is a "
                "multiple of the micro-batch count, or schedule='hand-gpipe', which weights each "
                "micro-batch by its share."
            )
        if self.schedule == "1f1b" and m < nprocs:
            raise ValueError(
                f"1F1B needs n_microbatches ≥ stages: {m} < {nprocs}. torch's Schedule1F1B "
                "refuses it when it is built, though its step loop could run it (exercise "
                f"04b.3): use n_microbatches ≥ {nprocs}, or schedule='gpipe'."
            )
        if self.schedule == "interleaved":
            check_interleaved_microbatches(m, nprocs)
        per_rank = stages_per_rank(self)
        stages, parts = nprocs * per_rank, len(self.sizes) - 1
        if stages > parts:
            fewer = parts // per_rank  # the most ranks these sub-networks can give their stages
            raise ValueError(
                f"{stages} stages ({nprocs} ranks × {per_rank}) but the MLP has only {parts} "
                f"sub-networks (sizes={self.sizes}): give at least {stages + 1} layer widths "
                f"(--sizes)" + (f", or run on fewer ranks (--nproc {fewer})." if fewer else ".")
            )
        rank_or_none(self, "fail_stage", stages, "stage")
        check_data_fits(self, nprocs)


def check_interleaved_microbatches(n_microbatches: int, nprocs: int) -> None:
    """Refuse an m that ``ScheduleInterleaved1F1B`` refuses on ``nprocs`` ranks: torch 2.14.1 runs
    the micro-batches in max(1, ⌊m / p⌋) rounds (``number_of_rounds``), which must divide m (taught
    in 04b, section 1). So m ≤ p and every multiple of p pass, and another m only when ⌊m / p⌋
    divides it (p = 4, m = 10: 2 rounds of 5). Raises ValueError naming m and the rounds."""
    m, rounds = n_microbatches, max(1, n_microbatches // nprocs)
    if m % rounds:
        raise ValueError(
            f"interleaved runs n_microbatches={m} in max(1, m // ranks) = {rounds} rounds, "
            "which must divide m (torch's ScheduleInterleaved1F1B refuses it otherwise): use "
            f"m ≤ {nprocs}, a multiple of the {nprocs} ranks (e.g. {-(-m // nprocs) * nprocs}), "
            f"or another m that m // {nprocs} divides."
        )


def stages_per_rank(cfg: PipelineConfig) -> int:
    """2 for "interleaved" (rank r holds stages r and r + p), else 1 (stage = rank)."""
    return 2 if cfg.schedule == "interleaved" else 1


def init_subnets(subnets, indices, seed: int) -> None:
    """Initialise each sub-network from a seed of its own, ``seed`` + 1000 × its index in the whole
    MLP: whoever builds a sub-network, alone or in the whole model, gets the same weights."""
    for i, sub in zip(indices, subnets):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1000 * i)
            sub.linear.reset_parameters()


def initial_mlp(cfg: PipelineConfig) -> models.ArticleMLP:
    """The whole MLP with the weights every split of it starts from (:func:`init_subnets`)."""
    mlp = models.ArticleMLP(tuple(cfg.sizes))
    init_subnets(mlp.subnets, range(len(mlp.subnets)), cfg.seed)
    return mlp


def build_stage(cfg: PipelineConfig, stage: int, num_stages: int) -> nn.Sequential:
    """Stage ``stage`` of ``num_stages`` and nothing else, on the CPU: the whole MLP is only
    described, on the meta device (shapes, no memory); the cut is made there, and only this stage's
    sub-networks get memory (``to_empty``) and weights (:func:`init_subnets`). The meta-device
    build follows "splitting a model manually" in
    https://docs.pytorch.org/docs/stable/distributed.pipelining.html, which leaves materialising
    to you; here the CPU's generator draws the weights (the worker then moves the stage), so that
    every split, on any device, starts from :func:`initial_mlp`'s."""
    with torch.device("meta"):
        whole = models.ArticleMLP(tuple(cfg.sizes))
    mine = whole.split(num_stages)[stage]
    indices = [i for i, sub in enumerate(whole.subnets) if any(sub is m for m in mine)]
    mine = mine.to_empty(device="cpu")
    init_subnets(mine, indices, cfg.seed)
    return mine


def unsplit_reference(cfg: PipelineConfig) -> tuple[nn.Module, list[float]]:
    """One process, the whole MLP, full batches: what every schedule must reproduce.

    Returns (model, loss per step).
    """
    model = initial_mlp(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses = []
    for x, y in batches(cfg):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def worker(cfg: PipelineConfig) -> dict:
    """One pipeline stage per rank (stage = rank; two for "interleaved": r and r + p); trains
    ``cfg.steps`` steps with ``cfg.schedule``.

    Logs per step ``kind="train"`` (last stage: loss) and the :class:`~timeline.Timeline` events;
    writes each stage's parameters to ``<run dir>/stage<s>.pt``. Returns {"stage", "losses",
    "peak_activation_bytes", "step_times_s", "step_cpu_s", "step_wait_s", "parameter_bytes"}: per
    step its wall time, the main thread's CPU time and its time waiting for a core
    (:func:`timeline.thread_clock`; None off Linux), seconds; the bytes of this rank's parameters.

    Raises:
        ValueError: see :meth:`PipelineConfig.validate` (before any work).
    """
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx, runlog.RunLog() as log:
        s, p, v = ctx.rank, ctx.world_size, stages_per_rank(cfg)
        cfg.validate(p)
        ids = [s + i * p for i in range(v)]  # the global stages this rank holds
        modules = [build_stage(cfg, i, v * p).to(ctx.device) for i in ids]  # only those
        device = None
        if cfg.device_ms:  # a simulated device: each box holds the rank for its device time
            device = simulated.SimulatedDevice(
                *simulated.box_seconds(cfg.device_ms, v * p, cfg.n_microbatches)
            )
        memory = ActivationMeter(nn.ModuleList(modules))
        timelines = [timeline.Timeline(mod, i, log, memory, device) for mod, i in zip(modules, ids)]
        opt = torch.optim.SGD(nn.ModuleList(modules).parameters(), lr=cfg.lr)
        schedule = None
        if cfg.schedule != "hand-gpipe":
            schedule = library.make_schedule(
                cfg.schedule, modules, cfg.n_microbatches, s, p, ctx.device
            )
        for t in timelines:
            # the library runs one extra forward per stage before its first step to infer shapes;
            # it is not part of the schedule, so the timeline leaves it out
            t.ignore_forwards = int(schedule is not None)
        losses, peaks, times, cpu, wait = [], [], [], [], []
        log.plan(steps=cfg.steps)
        for step, (x, y) in enumerate(batches(cfg), start=1):
            if cfg.fail_stage in ids and step == 2:  # the rank that holds that stage
                raise RuntimeError(f"injected failure in stage {cfg.fail_stage} at step {step}")
            for t in timelines:
                t.new_step(step)
            opt.zero_grad(set_to_none=True)
            t0, (c0, w0) = time.time(), timeline.thread_clock()
            with memory.saving():
                if schedule is None:
                    loss = hand_gpipe.step(
                        modules[0], x, y, cfg.n_microbatches, ctx, cfg.input_grad
                    )
                else:
                    x = x.to(ctx.device).requires_grad_(cfg.input_grad and s == 0)
                    loss = library.step(schedule, x, y.to(ctx.device), s, p)
            opt.step()
            times.append(time.time() - t0)
            c1, w1 = timeline.thread_clock()
            cpu.append(c1 - c0)
            wait.append(None if w0 is None else w1 - w0)
            peaks.append(memory.peak_bytes)
            if s == p - 1:
                losses.append(loss)
                log.train(
                    step=step, epoch=0, loss=loss, global_loss=loss, samples=step * cfg.batch_size
                )
                check_loss(loss, step=step, cfg=cfg)
        if cfg.save_params:
            for mod, i in zip(modules, ids):
                torch.save(mod.state_dict(), runlog.run_dir() / f"stage{i}.pt")
        return {
            "stage": s,
            "losses": losses,
            "peak_activation_bytes": max(peaks),
            "step_times_s": times,
            "step_cpu_s": cpu,
            "step_wait_s": wait,
            "parameter_bytes": sum(
                t.numel() * t.element_size() for mod in modules for t in mod.parameters()
            ),
        }


def gather_params(run_dir, cfg: PipelineConfig, num_stages: int) -> dict:
    """The stages' saved parameters reassembled into the unsplit MLP's ``state_dict`` keys
    (``num_stages``: the ranks of the run; twice as many stages for "interleaved"). Raises
    FileNotFoundError when the run saved no parameters (``save_params=False``)."""
    whole = models.ArticleMLP(tuple(cfg.sizes))
    stages = whole.split(num_stages * stages_per_rank(cfg))
    for s, stage in enumerate(stages):
        stage.load_state_dict(torch.load(f"{run_dir}/stage{s}.pt", weights_only=True))
    return whole.state_dict()
