"""Pipeline × data parallel on a 2-D mesh: ``dp`` replicas of a ``pp``-stage pipeline, each stage's
gradients averaged over the replicas that hold it.

Taught in notebooks/04b_pipeline_schedules.ipynb (section 6). Follows
https://pytorch.org/docs/stable/distributed.pipelining.html (a ``PipelineStage`` takes the process
group of its pipeline) and https://pytorch.org/docs/stable/distributed.html#devicemesh
(``init_device_mesh`` with named dimensions), as PyTorch's own composability tests
(test/distributed/_composable/test_composability/test_pp_composability.py) and torchtitan
(``ParallelDims``) build PP × DP: the pipeline over ``mesh["pp"]``, the replicas over
``mesh["dp"]``.

On ``pp × dp`` ranks, rank ``s·dp + d`` holds stage s of replica d: "pp" is the outer dimension, as
in torchtitan, so a stage's replicas are neighbouring ranks (on a cluster, the same node) and only
the pipeline's point-to-point hand-offs cross nodes. Each replica takes its
``batch_size / dp`` rows of every batch, runs them through its pipeline in ``n_microbatches``
micro-batches, and, before the optimizer steps, all-reduces each gradient over its stage's
"dp" group and divides by ``dp``: the mean over the whole batch, as one process computes it.
Started as ``launch(pp_dp.worker, PPDPConfig(dp=2), 4)`` (a 2 × 2 mesh).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from mgtutorial.common import models
from mgtutorial.common.compare import counting_mode
from mgtutorial.common.config import Config, at_least, check_timeout, positive
from mgtutorial.pipeline import library, schedules
from mgtutorial.pipeline.mlp_data import batches
from mgtutorial.runtime import env, runlog


@dataclass(kw_only=True)
class PPDPConfig(Config):
    """Configuration of :func:`worker` (and of its single-process reference,
    :func:`mgtutorial.pipeline.schedules.unsplit_reference`)."""

    dp: int = 2
    """Pipeline replicas (the mesh's "dp" dimension); the stages per pipeline are the world size
    divided by ``dp`` (the "pp" dimension)."""
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    """torch.distributed.pipelining's ScheduleGPipe or Schedule1F1B, one stage per rank."""
    n_microbatches: int = 4
    """Micro-batches per step in each replica (m)."""
    batch_size: int = 64
    """Samples per step over all replicas; each replica takes ``batch_size / dp``."""
    steps: int = 3
    """Optimizer steps."""
    lr: float = 0.05
    """SGD learning rate."""
    sizes: list[int] = field(default_factory=lambda: [64] * 5)
    """Layer widths of the MLP; one sub-network per consecutive pair."""
    seed: int = 0
    """Seed of the initial weights (one per sub-network, as in chapter 04a's ``init_subnets``)."""
    all_reduce: bool = True
    """Average each stage's gradients over its replicas; False: the replicas never exchange a
    gradient (the negative control: they drift apart, and from one process; ``wrap="hand"``
    only)."""
    wrap: Literal["hand", "ddp", "fsdp"] = "hand"
    """Who averages the replicas' gradients: "hand", :func:`average_gradients` after the step's
    last backward; "ddp", the stage wrapped in ``DistributedDataParallel`` over ``mesh["dp"]``;
    "fsdp", the stage sharded over ``mesh["dp"]`` with ``fully_shard`` (FSDP2). The library's
    stage drives the last two itself (its ``no_sync`` and FSDP hooks)."""
    backend: env.BackendChoice = "auto"
    """The process group's backend; "auto": NCCL with a GPU per rank, else gloo."""
    timeout_s: float = 60.0
    """Collective timeout in seconds."""

    def validate(self, nprocs: int) -> None:
        """Refuse, before any rank starts, a world size that is not ``dp × pp`` and a batch that
        ``dp × n_microbatches`` does not divide; then the pipeline's own checks
        (:meth:`~mgtutorial.pipeline.schedules.PipelineConfig.validate`) for one replica.

        Raises:
            ValueError: naming the value and the fix.
        """
        super().validate(nprocs)
        at_least(self, 1, "dp", "n_microbatches", "batch_size", "steps")
        positive(self, "lr")
        check_timeout(self)
        if self.wrap not in ("hand", "ddp", "fsdp") or (
            self.wrap != "hand" and not self.all_reduce
        ):
            raise ValueError(
                f"wrap={self.wrap!r}, all_reduce={self.all_reduce}: wrap is 'hand', 'ddp' or "
                "'fsdp', and all_reduce=False (no gradient exchange) exists only with wrap='hand'."
            )
        if self.wrap == "ddp" and self.n_microbatches == 2:
            # seen with torch 2.14.1 on gloo, pp = 2, GPipe and 1F1B alike: m = 3, 4 and 8 run
            raise ValueError(
                "wrap='ddp' with n_microbatches=2 stops at an internal assert of DDP's reducer "
                "(rebuilt parameter indices) under torch.distributed.pipelining (seen with "
                "pp = 2): use n_microbatches ≥ 3, or wrap='hand' or 'fsdp'."
            )
        dp, m = self.dp, self.n_microbatches
        if nprocs % dp or nprocs // dp < 2:
            raise ValueError(
                f"world size {nprocs} is not dp × pp with dp={dp} replicas of at least 2 stages: "
                f"launch a multiple of {dp} ranks, at least {2 * dp} (a {dp} × 2 mesh), or choose "
                f"a dp that divides {nprocs} and leaves at least 2 stages per replica."
            )
        if self.batch_size % (dp * m):
            fits = self.batch_size // (dp * m) * dp * m or dp * m
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by dp × n_microbatches = "
                f"{dp} × {m} = {dp * m}: each replica takes batch_size / dp rows and cuts them "
                f"into {m} equal micro-batches. Use a multiple of {dp * m} (e.g. {fits})."
            )
        schedules.PipelineConfig(**self.pipeline_fields()).validate(nprocs // dp)

    def pipeline_fields(self) -> dict:
        """One replica's pipeline, as :class:`~mgtutorial.pipeline.schedules.PipelineConfig`'s
        fields (its share of the batch)."""
        fields = ("schedule", "n_microbatches", "steps", "lr", "sizes", "seed", "backend")
        return {"batch_size": self.batch_size // self.dp} | {k: getattr(self, k) for k in fields}


def average_gradients(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Each gradient of ``module`` summed over the ranks of ``group`` (the replicas of this stage)
    and divided by their number: every replica then holds the gradient of the whole batch's mean
    loss. One all-reduce per parameter, as chapter 02's DDP by hand."""
    replicas = dist.get_world_size(group)
    for p in module.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
        p.grad /= replicas


def wrap_replicas(stage: nn.Module, wrap: str, mesh) -> nn.Module:
    """The module the pipeline stage runs: ``stage`` itself for "hand" (the worker all-reduces),
    ``DistributedDataParallel(stage)`` over ``mesh["dp"]``'s group for "ddp", or ``stage``
    sharded in place with FSDP2's ``fully_shard(stage, mesh=mesh["dp"])`` for "fsdp"; follows
    test_pp_composability.py. The optimizer takes ``stage.parameters()`` in every case."""
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(stage, process_group=mesh["dp"].get_group())
    if wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(stage, mesh=mesh["dp"])
    return stage


def worker(cfg: PPDPConfig) -> dict:
    """Stage s of replica d on rank ``s·dp + d`` of a ``("pp", "dp")`` mesh; trains ``cfg.steps``
    steps and writes the stage's parameters to ``<run dir>/replica<d>-stage<s>.pt``.

    Returns {"coords": [d, s], "losses" (the last stage's, per step; [] elsewhere),
    "collectives": {name: calls} of the last step on this rank, as ``CommDebugMode`` counts them
    (the replicas' all-reduces; the pipeline's point-to-point sends and receives are not
    collectives and are not listed; {} with one step), "parameter_bytes"}.

    Raises:
        ValueError: see :meth:`PPDPConfig.validate` (before any work).
    """
    from torch.distributed.device_mesh import init_device_mesh

    with env.distributed(cfg.backend, cfg.timeout_s) as ctx, runlog.RunLog() as log:
        cfg.validate(ctx.world_size)
        pp = ctx.world_size // cfg.dp
        mesh = init_device_mesh(ctx.device.type, (pp, cfg.dp), mesh_dim_names=("pp", "dp"))
        d, s = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
        stage = schedules.build_stage(cfg, s, pp).to(ctx.device)  # stage s, as in every replica
        module = wrap_replicas(stage, cfg.wrap, mesh)
        schedule = library.make_schedule(
            cfg.schedule, [module], cfg.n_microbatches, s, pp, ctx.device, mesh["pp"].get_group()
        )
        opt = torch.optim.SGD(stage.parameters(), lr=cfg.lr)
        losses, counts = [], {}
        for step, (x, y) in enumerate(batches(cfg), start=1):
            x, y = x.chunk(cfg.dp)[d].to(ctx.device), y.chunk(cfg.dp)[d].to(ctx.device)
            opt.zero_grad(set_to_none=True)
            # counted from step 2: step 1's shape inference runs autograd.grad, which the
            # counting mode's module hooks do not support
            with counting_mode() if step > 1 else contextlib.nullcontext() as mode:
                loss = library.step(schedule, x, y, s, pp)
                if cfg.wrap == "hand" and cfg.all_reduce:
                    average_gradients(stage, mesh["dp"].get_group())
            opt.step()
            counts = mode.counts() if mode is not None else counts
            if s == pp - 1:
                losses.append(loss)
                log.train(step=step, epoch=0, loss=loss, global_loss=loss, samples=len(x) * step)
        full = {
            k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in stage.state_dict().items()
        }
        torch.save(full, runlog.run_dir() / f"replica{d}-stage{s}.pt")  # FSDP's shards gathered
        return {
            "coords": [d, s],
            "losses": losses,
            "collectives": counts,
            "parameter_bytes": sum(t.numel() * t.element_size() for t in stage.parameters()),
        }


def replica_params(run_dir, cfg: PPDPConfig, replica: int, pp: int) -> dict:
    """Replica ``replica``'s stages, saved by :func:`worker` on ``pp`` stages, reassembled into
    the unsplit MLP's ``state_dict`` keys."""
    whole = models.ArticleMLP(tuple(cfg.sizes))
    for s, stage in enumerate(whole.split(pp)):
        path = f"{run_dir}/replica{replica}-stage{s}.pt"
        stage.load_state_dict(torch.load(path, weights_only=True))
    return whole.state_dict()
