"""The items of ``scripts/gpu_check.py``: each one checks a CUDA-only path of the course.

An item is a function ``item(w: Where) -> dict`` that runs in its own process (started by
``gpu_check.py``), raises :class:`CheckFailed` (or any exception) when what the course says does not
hold, :class:`Skip` when it cannot run here, and otherwise returns its figures (plain JSON values).
Multi-rank items start their ranks with :func:`mgtutorial.launch`, the way the chapters do; their
rank code is :func:`rank_worker`, which dispatches to one of :data:`RANK_TASKS`.

``Where.device == "cpu"`` is the dry run (``gpu_check.py --device cpu``, used by
tests/test_gpu_check.py): the same code on CPU with gloo and 2 ranks, so that typos and API misuse
show up before anyone gets GPU time. CUDA-only calls (events, pinned memory, memory counters,
SyncBatchNorm) are then left out and the comparisons that need them are reported as not made.

The items of chapters 07 (FSDP2), 08 (tensor parallelism) and 09 (performance) use torch's APIs
directly, so they do not depend on those chapters' modules.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from mgtutorial import RunResult, ddp, launch
from mgtutorial.common import models
from mgtutorial.common.compare import max_abs_diff
from mgtutorial.ddp import batchnorm
from mgtutorial.hello import HelloConfig, hello

# NVIDIA's libraries read this: no TF32 in cuBLAS/cuDNN, so GPU results compare with CPU fp32 ones
from mgtutorial.perf import costmodel, timing
from mgtutorial.pipeline import bubble, naive, schedules, timeline
from mgtutorial.runtime import env, runlog

NO_TF32 = {"NVIDIA_TF32_OVERRIDE": "0"}
FP32_TOL = {"rtol": 1e-4, "atol": 1e-4}  # fp32 on a GPU vs fp32 on a CPU, after a few steps
MIB = 2**20
HOST_CLOCK_NOTE = (
    "bubble_measured comes from the Timeline's host timestamps (module hooks): on a GPU they "
    "time kernel launches and waits, not the kernels themselves"
)


class Skip(Exception):
    """The item cannot run here; the message is the reason."""


class CheckFailed(AssertionError):
    """What the course says did not hold. ``figures``: what was measured before it failed."""

    def __init__(self, message: str, figures: dict | None = None):
        super().__init__(message)
        self.figures = figures or {}


def expect(condition: bool, message: str, figures: dict | None = None) -> None:
    """Raise :class:`CheckFailed` with ``message`` (and the figures so far) unless ``condition``."""
    if not condition:
        raise CheckFailed(message, figures)


@dataclass
class Where:
    """Where an item runs: ``device`` "cuda" (a GPU check) or "cpu" (the dry run), the number of
    GPUs, and a work directory for run folders and checkpoints."""

    device: str
    gpus: int
    workdir: Path

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def backend(self) -> str:
        return "nccl" if self.cuda else "gloo"

    @property
    def nprocs(self) -> int:
        """Ranks for a multi-rank item: one per GPU (all of them), or 2 CPU ranks in the dry run."""
        return self.gpus if self.cuda else 2


@dataclass(frozen=True)
class Item:
    """One check: ``name``, the ``chapter`` it backs, the GPUs it needs, its time limit (s), a line
    saying ``what`` it checks, and ``target`` ("module:function") for the process that runs it."""

    name: str
    chapter: str
    min_gpus: int
    timeout_s: float
    what: str
    target: str


ITEMS: dict[str, Item] = {}


def item(name: str, *, chapter: str, min_gpus: int, timeout_s: float, what: str) -> Callable:
    """Register the decorated function as the item ``name`` (in :data:`ITEMS`, in order)."""

    def register(fn):
        ITEMS[name] = Item(name, chapter, min_gpus, timeout_s, what, f"{__name__}:{fn.__name__}")
        return fn

    return register


# ---------------------------------------------------------------------------------------------
# plumbing


class Timer:
    """Milliseconds between ``__enter__`` and ``__exit__``: CUDA events on a GPU (the GPU's own
    clock, waited for), ``time.perf_counter`` on CPU. ``ms`` after the block."""

    def __init__(self, device: torch.device):
        self.device, self.ms = device, float("nan")

    def __enter__(self):
        if self.device.type == "cuda":
            self._start, self._end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self._end.record()
            self._end.synchronize()
            self.ms = self._start.elapsed_time(self._end)
        else:
            self.ms = (time.perf_counter() - self._t0) * 1e3


def _allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _run(worker, cfg, nprocs: int, w: Where, timeout_s: float = 120.0) -> RunResult:
    """``launch(worker, cfg, nprocs)`` into the item's work directory, waited for; stopped on
    error."""
    run = launch(worker, cfg, nprocs, runs_dir=w.workdir / "runs", extra_env=NO_TF32)
    try:
        return run.wait(timeout=timeout_s)
    except BaseException:
        run.stop()
        raise


def _max_diff(got: dict, ref: dict) -> float:
    expect(got.keys() == ref.keys(), f"different parameters: {sorted(got)} vs {sorted(ref)}")
    return max(
        (got[k].detach().float().cpu() - ref[k].detach().float().cpu()).abs().max().item()
        for k in ref
    )


def _close(got: dict, ref: dict, what: str, figures: dict, tol: dict = FP32_TOL) -> None:
    """``assert_close`` over two state dicts (CPU), failing with the figures so far."""
    try:
        torch.testing.assert_close(
            {k: v.detach().float().cpu() for k, v in got.items()},
            {k: v.detach().float().cpu() for k, v in ref.items()},
            **tol,
        )
    except AssertionError as exc:
        raise CheckFailed(f"{what}: {exc}", figures) from None


# ---------------------------------------------------------------------------------------------
# rank code of the multi-rank items


@dataclass(kw_only=True)
class RankConfig:
    """Configuration of :func:`rank_worker`."""

    task: str = "fsdp2_memory"
    """Which rank function to run: a key of :data:`RANK_TASKS`."""
    backend: str = "auto"
    """"auto" | "gloo" | "nccl"."""
    params: dict = field(default_factory=dict)
    """Keyword arguments of the task."""
    timeout_s: float = 60.0
    """Collective timeout in seconds."""


def rank_worker(cfg: RankConfig):
    """One rank of a multi-rank item: join the process group, run ``RANK_TASKS[cfg.task]``."""
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        return RANK_TASKS[cfg.task](ctx, **cfg.params)


def _mesh(ctx):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, (ctx.world_size,))


def _params_full(model: nn.Module) -> dict:
    """Parameters by name, DTensors gathered to full tensors (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
        for n, p in model.named_parameters()
    }


def fsdp2_memory_rank(ctx, width: int = 4096, layers: int = 8, batch: int = 8) -> dict:
    """FSDP2 with bf16 compute / fp32 master weights and Adam; memory against chapter 07's formula.

    Per rank, for Ψ parameters sharded over N ranks (bytes):

        fp32 parameter shard      4Ψ/N
        fp32 gradient shard       4Ψ/N
        Adam exp_avg, exp_avg_sq  8Ψ/N
        steady state             16Ψ/N   (plain DDP keeps 16Ψ on every rank)

    plus, only while a layer computes, its all-gathered bf16 parameters (2Ψ_layer) and its unsharded
    gradient. Measured with ``torch.cuda.memory_allocated`` after sharding (expect 4Ψ/N) and after
    one optimizer step (expect 16Ψ/N), and ``torch.cuda.max_memory_allocated`` for the peak.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dev, n = ctx.device, ctx.world_size
    if dev.type != "cuda":  # the dry run: a small model
        width = 256
    mesh = _mesh(ctx)
    # cuBLAS allocates its workspaces now, not inside the measurement
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(64, 64, device=dev, dtype=dtype, requires_grad=True)
        (w @ w).sum().backward()
    del w
    base = _allocated(dev)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(dev)
    psi = models.count_parameters(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    after_shard = _allocated(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    out = model(torch.randn(batch, width, device=dev))
    out_dtype = str(out.dtype)
    out.float().pow(2).mean().backward()
    grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})
    optimizer.step()
    del out
    steady = _allocated(dev)
    figures = {
        "world_size": n,
        "parameters": psi,
        "output_dtype": out_dtype,
        "grad_dtypes": grad_dtypes,
        "formula": "params 4Ψ/N + grads 4Ψ/N + Adam 8Ψ/N = 16Ψ/N bytes per rank",
        "expected_params_MiB": 4 * psi / n / MIB,
        "expected_steady_MiB": 16 * psi / n / MIB,
    }
    expect(out_dtype == "torch.bfloat16", f"forward computed in {out_dtype}, not bf16", figures)
    expect(
        grad_dtypes == ["torch.float32"], f"gradient shards are {grad_dtypes}, not fp32", figures
    )
    if base is None:
        figures["measured"] = "not on CPU (no memory counters)"
        return figures
    peak = torch.cuda.max_memory_allocated(dev)
    figures.update(
        measured_params_MiB=(after_shard - base) / MIB,
        measured_steady_MiB=(steady - base) / MIB,
        measured_peak_MiB=(peak - base) / MIB,
    )
    slack = 0.05  # the input, the loss, allocator rounding
    for what, got, want in (
        ("after fully_shard", after_shard - base, 4 * psi / n),
        ("after one Adam step", steady - base, 16 * psi / n),
    ):
        expect(
            abs(got - want) <= slack * want + 2 * MIB,
            f"{what}: {got / MIB:.1f} MiB allocated, formula {want / MIB:.1f} MiB (±{slack:.0%})",
            figures,
        )
    expect(peak >= steady, "peak below the steady state", figures)
    return figures


def fsdp2_parity_rank(ctx, steps: int = 3, batch: int = 4) -> dict:
    """FSDP2 (fp32) on N ranks, each on its 1/N of the batch == one process on the whole batch."""
    from torch.distributed.fsdp import fully_shard

    dev, n = ctx.device, ctx.world_size
    mesh = _mesh(ctx)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)).to(dev)
    ref = copy.deepcopy(model)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        x, y = (
            torch.randn(n * batch, 16, generator=g).to(dev),
            torch.randn(n * batch, 16, generator=g).to(dev),
        )
        rows = slice(ctx.rank * batch, (ctx.rank + 1) * batch)
        nn.functional.mse_loss(
            model(x[rows]), y[rows]
        ).backward()  # FSDP2 averages gradients over ranks
        nn.functional.mse_loss(ref(x), y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    got, want = _params_full(model), _params_full(ref)
    figures = {"world_size": n, "steps": steps, "max_param_diff": _max_diff(got, want)}
    _close(got, want, "FSDP2 vs one process", figures, {"rtol": 1e-5, "atol": 1e-5})
    return figures


def tp_parity_rank(ctx, steps: int = 3, batch: int = 8) -> dict:
    """Megatron-style MLP with ``parallelize_module`` (ColwiseParallel, then RowwiseParallel) ==
    one process."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dev, n = ctx.device, ctx.world_size
    mesh = _mesh(ctx)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16 * n), nn.ReLU(), nn.Linear(16 * n, 16)).to(dev)
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    local_rows = model[0].weight.to_local().shape[0]
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(200 + step)  # every rank: the same (replicated) input
        x, y = (
            torch.randn(batch, 16, generator=g).to(dev),
            torch.randn(batch, 16, generator=g).to(dev),
        )
        loss, ref_loss = nn.functional.mse_loss(model(x), y), nn.functional.mse_loss(ref(x), y)
        losses.append([loss.item(), ref_loss.item()])
        for lo, o in ((loss, opt), (ref_loss, ref_opt)):
            lo.backward()
            o.step()
            o.zero_grad()
    got, want = _params_full(model), _params_full(ref)
    figures = {
        "world_size": n,
        "fc1_local_rows": local_rows,
        "losses_tp_vs_ref": losses,
        "max_param_diff": _max_diff(got, want),
    }
    expect(
        local_rows == 16,
        f"ColwiseParallel left {local_rows} rows of 16·{n} on this rank, not 16",
        figures,
    )
    _close(got, want, "tensor parallel vs one process", figures, {"rtol": 1e-5, "atol": 1e-5})
    return figures


def async_rank(ctx, numel: int = 64 * 2**20, matmuls: int = 8, size: int = 4096) -> dict:
    """Chapter 03's asynchrony: an all-reduce call returns before the all-reduce has happened.

    Queue ``matmuls`` big matmuls, then ``all_reduce(t, async_op=True)``: the call returns at once,
    ``work.is_completed()`` is still False, and only ``torch.cuda.synchronize()`` waits for it.
    The blocking form (``async_op=False``) returns early too on NCCL: it only orders the GPU stream.
    """
    dev = ctx.device
    if dev.type != "cuda":  # the dry run: small sizes, same calls
        numel, size, matmuls = 2**16, 128, 2
    t = torch.ones(numel, device=dev)
    a = torch.randn(size, size, device=dev) / size**0.5
    c = torch.empty_like(a)
    dist.all_reduce(t)  # warm-up: the first collective may set the communicator up
    rows = {}
    for mode in ("async_op=True", "async_op=False"):
        t.fill_(1.0)
        timing.sync(dev)
        for _ in range(matmuls):  # GPU work queued ahead of the collective
            torch.matmul(a, a, out=c)
        t0 = time.perf_counter()
        work = dist.all_reduce(t, async_op=mode == "async_op=True")
        returned = time.perf_counter() - t0
        row = {"call_returned_ms": returned * 1e3}
        if work is not None:
            row["work_completed_at_return"] = work.is_completed()
            work.wait()  # NCCL: the current stream waits for the collective; the host does not
        if dev.type == "cuda":  # has the stream reached this point (after the all-reduce)?
            event = torch.cuda.Event()
            event.record()
            row["stream_past_it_at_return"] = event.query()
        timing.sync(dev)
        row["synchronized_ms"] = (time.perf_counter() - t0) * 1e3
        expect(
            torch.all(t == ctx.world_size).item(),
            f"all-reduce of ones gave {t[0].item()}, not {ctx.world_size}",
        )
        rows[mode] = row
    figures = {
        "world_size": ctx.world_size,
        "bytes": numel * 4,
        "queued_matmuls": matmuls,
        "rows": rows,
    }
    if dev.type == "cuda":
        expect(
            rows["async_op=True"]["work_completed_at_return"] is False,
            "the all-reduce had completed when the call returned",
            figures,
        )
        for mode, r in rows.items():
            expect(
                r["stream_past_it_at_return"] is False
                and r["call_returned_ms"] < 0.5 * r["synchronized_ms"],
                f"{mode}: the call did not return before the all-reduce completed",
                figures,
            )
    return figures


def busbw_rank(
    ctx, sizes: tuple[int, ...] = tuple(2**k for k in (10, 14, 18, 20, 22, 24, 26, 28))
) -> list[dict]:
    """NCCL all-reduce bandwidth over message sizes, as nccl-tests reports it.

    algbw = bytes / time; busbw = algbw · 2(n − 1)/n (the data each link carries in a ring
    all-reduce). Timed with CUDA events over several iterations after a warm-up.
    """
    dev, n = ctx.device, ctx.world_size
    if dev.type != "cuda":
        sizes = tuple(s for s in sizes if s <= 2**20)
    rows = []
    for nbytes in sizes:
        t = torch.full((nbytes // 4,), float(ctx.rank + 1), device=dev)
        dist.all_reduce(t)
        expect(
            torch.all(t == n * (n + 1) / 2).item(), f"all-reduce of {nbytes} B gave {t[0].item()}"
        )
        t.zero_()  # stays 0 under repeated SUMs
        iters = 5 if dev.type != "cuda" else (20 if nbytes >= 2**24 else 50)
        for _ in range(3):
            dist.all_reduce(t)
        with Timer(dev) as timer:
            for _ in range(iters):
                dist.all_reduce(t)
        seconds = timer.ms / 1e3 / iters
        rows.append(
            {
                "bytes": nbytes,
                "time_us": seconds * 1e6,
                "algbw_GBps": costmodel.algbw(nbytes, seconds) / 1e9,
                "busbw_GBps": costmodel.busbw("all_reduce", nbytes, seconds, n) / 1e9,
            }
        )
    return rows


def syncbn_rank(ctx, batch: int = 4, channels: int = 3) -> dict:
    """SyncBatchNorm over N ranks == BatchNorm2d on their combined batch: outputs, running
    statistics, input gradients (the chapter's ``apply_sync_batchnorm`` + DDP)."""
    dev, n = ctx.device, ctx.world_size
    g = torch.Generator().manual_seed(7)
    x_all = torch.randn(n * batch, channels, 4, 4, generator=g) * 2 + 1
    w_all = torch.randn(n * batch, channels, 4, 4, generator=g)  # a loss with a nontrivial gradient
    rows = slice(ctx.rank * batch, (ctx.rank + 1) * batch)
    bn = nn.Sequential(nn.BatchNorm2d(channels))
    ref = copy.deepcopy(bn)
    x_ref = x_all.clone().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * w_all).sum().backward()
    figures = {"world_size": n}
    if dev.type != "cuda":
        try:
            batchnorm.apply_sync_batchnorm(bn, ctx)
        except RuntimeError as exc:
            figures["dry_run"] = f"refused on CPU as the chapter says: {str(exc)[:60]}…"
            return figures
        raise CheckFailed("apply_sync_batchnorm accepted a CPU rank", figures)
    model = nn.parallel.DistributedDataParallel(
        batchnorm.apply_sync_batchnorm(bn, ctx), device_ids=[dev.index]
    )
    x = x_all[rows].to(dev).requires_grad_()
    out = model(x)
    (out * w_all[rows].to(dev)).sum().backward()
    got = {
        "output": out,
        "input_grad": x.grad,
        "running_mean": model.module[0].running_mean,
        "running_var": model.module[0].running_var,
        "weight_grad_x_N": model.module[0].weight.grad * n,
    }
    want = {
        "output": out_ref[rows],
        "input_grad": x_ref.grad[rows],
        "running_mean": ref[0].running_mean,
        "running_var": ref[0].running_var,
        "weight_grad_x_N": ref[0].weight.grad,
    }
    figures["max_diff"] = _max_diff(got, want)
    _close(got, want, "SyncBatchNorm vs BatchNorm on the combined batch", figures)
    return figures


RANK_TASKS: dict[str, Callable] = {
    "fsdp2_memory": fsdp2_memory_rank,
    "fsdp2_parity": fsdp2_parity_rank,
    "tp_parity": tp_parity_rank,
    "async": async_rank,
    "busbw": busbw_rank,
    "syncbn": syncbn_rank,
}


def _ranks(task: str, w: Where, nprocs: int, timeout_s: float = 120.0, **params) -> dict:
    cfg = RankConfig(task=task, backend=w.backend, params=params)
    return _run(rank_worker, cfg, nprocs, w, timeout_s).values


# ---------------------------------------------------------------------------------------------
# the items, in the order they run (one GPU first, then two or more)


@item(
    "nccl_world_size_1",
    chapter="00_setup, 02_ddp",
    min_gpus=1,
    timeout_s=120,
    what="launch with backend nccl, world size 1: the rank joins, is on cuda:0 and all-reduces",
)
def nccl_world_size_1(w: Where) -> dict:
    rec = _run(hello, HelloConfig(backend=w.backend), 1, w).values[0]
    figures = {k: rec[k] for k in ("backend", "device", "world_size", "rank_sum")}
    expect(rec["backend"] == w.backend, f"backend {rec['backend']}, not {w.backend}", figures)
    expect(rec["device"] == ("cuda:0" if w.cuda else "cpu"), f"device {rec['device']}", figures)
    expect(
        rec["world_size"] == 1 and rec["rank_sum"] == 0, "all-reduce of the ranks is not 0", figures
    )
    return figures


def _ddp_config(w: Where, name: str) -> ddp.DDPConfig:
    return ddp.DDPConfig(
        dataset="synthetic",
        batch_size=8,
        epochs=1,
        max_steps=3,
        lr=0.05,
        evaluate=False,
        checkpoint=str(w.workdir / name),
        backend=w.backend,
    )


@item(
    "ddp_cuda0_vs_cpu",
    chapter="02_ddp",
    min_gpus=1,
    timeout_s=150,
    what="the chapter-02 DDP worker on cuda:0 (NCCL, 1 rank) gives the CPU parameters (fp32, "
    "no TF32)",
)
def ddp_cuda0_vs_cpu(w: Where) -> dict:
    cfg = _ddp_config(w, "ddp1.pt")
    result = _run(ddp.worker, cfg, 1, w)
    got = torch.load(cfg.checkpoint, map_location="cpu", weights_only=True)["model"]
    want = ddp.combined_batch_reference(cfg, 1).state_dict()
    figures = {
        "steps": result.values[0]["steps"],
        "max_param_diff": _max_diff(got, want),
        "tolerance": FP32_TOL,
    }
    _close(got, want, "DDP on the GPU vs one CPU process", figures)
    return figures


@item(
    "device_basics",
    chapter="01_single_device, 02_ddp",
    min_gpus=1,
    timeout_s=90,
    what="torch.cuda.set_device, a pinned-memory loader with non_blocking copies, bf16 autocast",
)
def device_basics(w: Where) -> dict:
    from torch.utils.data import DataLoader, TensorDataset

    dev = torch.device("cuda", 0) if w.cuda else torch.device("cpu")
    figures: dict = {"device": str(dev)}
    if w.cuda:
        torch.cuda.set_device(dev)
        figures["current_device"] = torch.cuda.current_device()
        expect(figures["current_device"] == 0, "set_device(0) did not make cuda:0 current", figures)
        if w.gpus >= 2:  # what env.distributed does in rank 1: plain "cuda" now means cuda:1
            torch.cuda.set_device(1)
            figures["plain_cuda_after_set_device_1"] = str(torch.zeros(1, device="cuda").device)
            torch.cuda.set_device(dev)
            expect(
                figures["plain_cuda_after_set_device_1"] == "cuda:1",
                "set_device(1) did not move 'cuda'",
                figures,
            )
        if not torch.cuda.is_bf16_supported():
            raise Skip(f"{torch.cuda.get_device_name(0)} has no bf16")
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(
        torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    )
    loader = DataLoader(ds, batch_size=16, pin_memory=w.cuda)
    x, y = next(iter(loader))
    figures["pinned"] = x.is_pinned() if w.cuda else "not on CPU"
    expect(
        figures["pinned"] in (True, "not on CPU"), "pin_memory=True gave unpinned batches", figures
    )
    xd, yd = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
    timing.sync(dev)
    expect(
        torch.equal(xd.cpu(), x) and torch.equal(yd.cpu(), y),
        "non_blocking copy changed the batch",
        figures,
    )
    torch.manual_seed(0)
    model = models.ArticleCNN().to(dev)
    with torch.no_grad():
        fp32 = model(xd)
    with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
        out = model(xd)
        loss = nn.functional.cross_entropy(out, yd)
    loss.backward()
    rel = ((out.float() - fp32).norm() / fp32.norm()).item()
    figures.update(
        autocast_output_dtype=str(out.dtype),
        grad_dtypes=sorted({str(p.grad.dtype) for p in model.parameters()}),
        bf16_vs_fp32_rel_error=rel,
    )
    expect(out.dtype == torch.bfloat16, f"autocast output is {out.dtype}", figures)
    expect(
        figures["grad_dtypes"] == ["torch.float32"],
        "gradients are not fp32 (the parameters' dtype)",
        figures,
    )
    expect(
        rel < 2e-2,
        f"bf16 output differs from fp32 by {rel:.3g} (relative), more than 2e-2",
        figures,
    )
    return figures


@item(
    "fsdp2_memory",
    chapter="07b_fsdp2",
    min_gpus=1,
    timeout_s=150,
    what="fully_shard + MixedPrecisionPolicy(bf16, fp32 reduce), Adam: memory_allocated vs 16Ψ/N "
    "(all GPUs)",
)
def fsdp2_memory(w: Where) -> dict:
    return _ranks("fsdp2_memory", w, w.nprocs)[0]


@item(
    "cuda_event_timing",
    chapter="09a_cost_model",
    min_gpus=1,
    timeout_s=90,
    what="CUDA-event timing: matmul FLOP/s (fp32 without TF32, bf16), a training step; host time "
    "without synchronize",
)
def cuda_event_timing(w: Where) -> dict:
    dev = torch.device("cuda", 0) if w.cuda else torch.device("cpu")
    n, iters = (8192, 10) if w.cuda else (256, 2)
    figures: dict = {"n": n, "iters": iters}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = (
            torch.randn(n, n, device=dev, dtype=dtype),
            torch.randn(n, n, device=dev, dtype=dtype),
        )
        for _ in range(2):
            a @ b
        timing.sync(dev)
        t0 = time.perf_counter()
        with Timer(dev) as timer:
            for _ in range(iters):
                a @ b
            host_ms = (time.perf_counter() - t0) * 1e3  # before the GPU is waited for
        name = str(dtype).removeprefix("torch.")
        figures[f"matmul_{name}_ms"] = timer.ms / iters
        figures[f"matmul_{name}_TFLOPs"] = 2 * n**3 / (timer.ms / iters / 1e3) / 1e12
        figures[f"host_loop_{name}_ms"] = host_ms
        expect(timer.ms > 0, "the events measured no time", figures)
        if w.cuda:  # chapter 09a's timer: an event pair around each call
            events_s = timing.time_cuda_events(lambda: a @ b, repeats=3)
            figures[f"time_cuda_events_{name}_ms"] = min(events_s) * 1e3
            expect(all(t > 0 for t in events_s), "time_cuda_events measured no time", figures)
            expect(
                host_ms < timer.ms, "the host loop did not return before the GPU finished", figures
            )
    torch.manual_seed(0)
    model = models.ArticleCNN().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(256, 3, 32, 32, device=dev), torch.randint(0, 10, (256,), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step()
    with Timer(dev) as timer:
        for _ in range(iters):
            step()
    figures["cnn_step_batch256_ms"] = timer.ms / iters
    return figures


@item(
    "nccl_async",
    chapter="03a_collectives",
    min_gpus=1,
    timeout_s=120,
    what="an NCCL all-reduce returns before it completes: call time vs synchronize, "
    "work.is_completed()",
)
def nccl_async(w: Where) -> dict:
    return _ranks("async", w, w.nprocs)[0]


@item(
    "laptop_gpu_row",
    chapter="00_setup (make check)",
    min_gpus=1,
    timeout_s=60,
    what="the GPU row of `make check` (laptop_machine.check_gpu): the GPUs torch sees, their "
    "names, and the backend 'auto' picks for the default ranks",
)
def laptop_gpu_row(w: Where) -> dict:
    from mgtutorial.workshop import laptop_machine
    from mgtutorial.workshop.laptop_packages import INFO

    row = laptop_machine.check_gpu()
    figures = {"status": row.status, "detail": row.detail}
    expect(row.status == INFO, f"the GPU row is {row.status}, not {INFO}", figures)
    if not w.cuda:
        expect(row.detail.startswith("no CUDA GPU"), "the CPU row does not say so", figures)
        return figures
    names = sorted({torch.cuda.get_device_name(i) for i in range(w.gpus)})
    backend = "nccl" if w.gpus >= 2 else "gloo"  # default ranks: one per GPU from 2 GPUs, else 2
    want = f"{w.gpus} × {', '.join(names)}; backend auto → {backend}"
    expect(row.detail == want, f"the GPU row reads {row.detail!r}, not {want!r}", figures)
    return figures


@item(
    "nccl_exit_without_destroy",
    chapter="06a_article_ddp",
    min_gpus=1,
    timeout_s=120,
    what="a script that ends with its NCCL group up (06a 1.7, ddp_flaws.exit_without_destroy): "
    "the 'destroy_process_group() was not called' warning, from rank 0 only, one rank per GPU",
)
def nccl_exit_without_destroy(w: Where) -> dict:
    from mgtutorial.article import ddp_flaws

    nprocs = w.gpus if w.cuda else 2
    ranks = ddp_flaws.exit_without_destroy(w.backend, nprocs=nprocs, timeout=90)
    warned = ["destroy_process_group() was not called" in r["stderr"] for r in ranks]
    figures = {
        "backend": w.backend,
        "ranks": nprocs,
        "warned": warned,
        "exit_codes": [r["returncode"] for r in ranks],
        "aborted": [r["aborted"] for r in ranks],
        "stderr_rank0": ranks[0]["stderr"].splitlines()[-4:],
    }
    expect(all(r["exit_reached"] for r in ranks), "a rank skipped the interpreter's exit", figures)
    expect(all(r["initialized_at_exit"] for r in ranks), "the group was not up at exit", figures)
    # NCCL warns from rank % (GPUs on the node) == 0: the first rank of the node; gloo never
    expect(warned == [w.cuda] + [False] * (nprocs - 1), "not the warning the chapter says", figures)
    fixed = ddp_flaws.exit_without_destroy(w.backend, nprocs=nprocs, destroy=True, timeout=90)
    figures["with_destroy_exit_codes"] = [r["returncode"] for r in fixed]
    expect(
        not any("destroy_process_group" in r["stderr"] for r in fixed),
        "warned although destroy_process_group was called",
        figures,
    )
    return figures


@item(
    "ddp_nccl_vs_one_process",
    chapter="02_ddp",
    min_gpus=2,
    timeout_s=150,
    what="DDP on NCCL with one rank per GPU == one CPU process on the combined batch",
)
def ddp_nccl_vs_one_process(w: Where) -> dict:
    cfg = _ddp_config(w, "ddpn.pt")
    _run(ddp.worker, cfg, w.nprocs, w)
    got = torch.load(cfg.checkpoint, map_location="cpu", weights_only=True)["model"]
    want = ddp.combined_batch_reference(cfg, w.nprocs).state_dict()
    alone = ddp.combined_batch_reference(cfg, 1).state_dict()
    figures = {
        "world_size": w.nprocs,
        "max_param_diff": _max_diff(got, want),
        "control_rank0_alone_diff": _max_diff(got, alone),
        "tolerance": FP32_TOL,
    }
    _close(got, want, "DDP on NCCL vs one process", figures)
    expect(
        figures["control_rank0_alone_diff"] > 10 * FP32_TOL["atol"],
        "the control does not differ: the comparison could not have failed",
        figures,
    )
    return figures


@item(
    "sync_batchnorm",
    chapter="03c_ddp_pitfalls",
    min_gpus=2,
    timeout_s=120,
    what="SyncBatchNorm on N GPUs == BatchNorm2d on the combined batch (outputs, statistics, "
    "gradients); chapter 03c's sync_batchnorm_worker, as its GPU cell runs it, on 2 GPUs",
)
def sync_batchnorm(w: Where) -> dict:
    figures = _ranks("syncbn", w, w.nprocs)[0]
    # the notebook's cell: torch's layer on GPUs; the dry run takes the stand-in, same worker code
    cfg = batchnorm.BatchNormConfig(backend=w.backend, sync_layer="torch" if w.cuda else "by_hand")
    got = _run(batchnorm.sync_batchnorm_worker, cfg, 2, w).values
    inputs = [batchnorm.batchnorm_inputs(cfg, r) for r in range(2)]
    bn = nn.BatchNorm2d(cfg.channels, momentum=1.0, affine=False)
    want = bn(torch.cat(inputs)).split([len(x) for x in inputs])
    for r in range(2):
        stats = {k: torch.tensor(got[r][k]) for k in ("out", "running_mean", "running_var")}
        ref = {"out": want[r], "running_mean": bn.running_mean, "running_var": bn.running_var}
        figures[f"worker_rank{r}_max_diff"] = diff = max_abs_diff(stats, ref)
        what = f"sync_batchnorm_worker, rank {r}: differs from BatchNorm on the combined batch"
        expect(diff < FP32_TOL["atol"], f"{what} by {diff:.1e}", figures)
    return figures


@item(
    "naive_split",
    chapter="04a_pipeline_gpipe",
    min_gpus=2,
    timeout_s=90,
    what="the article's MLP split over cuda:0 and cuda:1 (NaiveModelParallel) == the unsplit model",
)
def naive_split(w: Where) -> dict:
    cfg = schedules.PipelineConfig(steps=3, batch_size=64)
    devices = naive.naive_devices() if w.cuda else [torch.device("cpu")] * 2
    figures: dict = {"devices": [str(d) for d in devices]}
    if w.cuda:
        expect(
            figures["devices"] == ["cuda:0", "cuda:1"],
            "naive_devices() is not cuda:0, cuda:1",
            figures,
        )
    model, evs = naive.train_naive(cfg, devices)
    figures["stage_devices"] = [str(next(st.parameters()).device) for st in model.stages]
    expect(figures["stage_devices"] == figures["devices"], "a stage is not on its device", figures)
    ref, _ = schedules.unsplit_reference(cfg)
    got = {str(i): p for i, p in enumerate(model.parameters())}
    want = {str(i): p for i, p in enumerate(ref.parameters())}
    figures["max_param_diff"] = _max_diff(got, want)
    figures["bubble_measured_last_step"] = bubble.bubble_measured(
        [e for e in evs if e["step"] == cfg.steps]
    )
    figures["note"] = HOST_CLOCK_NOTE
    _close(got, want, "naive split vs unsplit model", figures)
    return figures


@item(
    "pipeline_stages",
    chapter="04a_pipeline_gpipe",
    min_gpus=2,
    timeout_s=300,
    what="one pipeline stage per GPU (torch.distributed.pipelining GPipe/1F1B, GPipe by hand) == "
    "unsplit; "
    "bubble table",
)
def pipeline_stages(w: Where) -> dict:
    rows = []
    for schedule, m in (("gpipe", 1), ("gpipe", 4), ("1f1b", 4), ("1f1b", 8), ("hand-gpipe", 3)):
        cfg = schedules.PipelineConfig(
            schedule=schedule, n_microbatches=m, batch_size=64, steps=3, backend=w.backend
        )
        result = _run(schedules.worker, cfg, 2, w)
        got = schedules.gather_params(result.run_dir, cfg, 2)
        ref, losses = schedules.unsplit_reference(cfg)
        evs = timeline.events(runlog.read_run(result.run_dir), step=cfg.steps)
        times = result.values[1]["step_times_s"]
        rows.append(
            {
                "schedule": schedule,
                "microbatches": m,
                "bubble_formula": bubble.bubble_formula(2, m),
                "bubble_measured": bubble.bubble_measured(evs),
                "step_ms": 1e3 * min(times),
                "max_param_diff": _max_diff(got, ref.state_dict()),
                "max_loss_diff": max(
                    abs(a - b) for a, b in zip(result.values[1]["losses"], losses)
                ),
            }
        )
        _close(got, ref.state_dict(), f"{schedule} m={m} vs unsplit", {"rows": rows})
    return {"stages": 2, "rows": rows, "note": HOST_CLOCK_NOTE}


@item(
    "allreduce_busbw",
    chapter="09a_cost_model",
    min_gpus=2,
    timeout_s=150,
    what="NCCL all-reduce over 1 KiB … 256 MiB on all GPUs: time, algbw, busbw = algbw·2(n−1)/n",
)
def allreduce_busbw(w: Where) -> dict:
    return {"world_size": w.nprocs, "rows": _ranks("busbw", w, w.nprocs)[0]}


@item(
    "tp_parity",
    chapter="08a_tensor_parallel",
    min_gpus=2,
    timeout_s=120,
    what="parallelize_module(ColwiseParallel, RowwiseParallel) on all GPUs == one process",
)
def tp_parity(w: Where) -> dict:
    return _ranks("tp_parity", w, w.nprocs)[0]


@item(
    "fsdp2_parity",
    chapter="07b_fsdp2",
    min_gpus=2,
    timeout_s=120,
    what="fully_shard on all GPUs, each rank on its part of the batch == one process on the whole "
    "batch",
)
def fsdp2_parity(w: Where) -> dict:
    return _ranks("fsdp2_parity", w, w.nprocs)[0]


@item(
    "fsdp2_meta_init",
    chapter="07b_fsdp2",
    min_gpus=2,
    timeout_s=120,
    what="meta-device init on all GPUs: build on meta, fully_shard, to_empty(cuda), "
    "reset_parameters with one seed (DTensor's RNG tracker): shard bytes == formula, "
    "weights within 1/√fan_in, no two rows equal",
)
def fsdp2_meta_init(w: Where) -> dict:
    from mgtutorial.sharding.worker import ShardConfig, worker

    cfg = ShardConfig(parts=["meta"], batch_size=2 * w.nprocs, backend=w.backend)
    values = _run(worker, cfg, w.nprocs, w).values
    metas = [values[r]["meta"] for r in sorted(values)]
    figures = {
        "ranks": len(metas),
        "before": metas[0]["before"]["device"],
        "params_bytes": [m["params_bytes"] for m in metas],
        "formula": [m["formula"] for m in metas],
    }
    expect(all(m["before"]["device"] == "meta" for m in metas), "not built on meta", figures)
    expect(
        figures["params_bytes"] == figures["formula"],
        "shard bytes differ from the formula",
        figures,
    )
    expect(all(m["within_init_bound"] for m in metas), "a weight outside 1/√fan_in", figures)
    expect(
        all(m["distinct_rows"] for m in metas),
        "two rows equal: shards drew the same numbers",
        figures,
    )
    return figures


@item(
    "ring_attention",
    chapter="10a_context_parallel",
    min_gpus=2,
    timeout_s=150,
    what="ring attention by hand (batch_isend_irecv on NCCL) == full attention, all GPUs; torch's "
    "context_parallel on CUDA (flash/efficient SDPA) == full attention",
)
def ring_attention(w: Where) -> dict:
    from mgtutorial.context_expert import config, cp_worker

    cfg = config.CPConfig(seq=8 * w.nprocs, backend=w.backend)
    v = _run(cp_worker.worker, cfg, w.nprocs, w).values[0]
    figures = {
        "max_diff": {name: v[name]["max_diff"] for name, _, _ in cp_worker.CASES},
        "counts": v["zigzag"]["counts"],
        "wrong_merge": v["wrong_merge"],
        "context_parallel": v["context_parallel"],
    }
    expect(max(figures["max_diff"].values()) < 1e-4, "ring attention != full attention", figures)
    expect(v["wrong_merge"] > 0.1, "the negative control was not caught", figures)
    if w.cuda:  # on CPU the worker records why torch's version cannot run (its error)
        cp = v["context_parallel"]
        expect(cp["ran"] and cp["max_diff"] < 1e-3, "context_parallel != full attention", figures)
    return figures


@item(
    "expert_parallel",
    chapter="10b_expert_parallel",
    min_gpus=2,
    timeout_s=120,
    what="MoE experts over all GPUs, all_to_all_single dispatch/combine on NCCL == one process; "
    "bytes counted == predicted",
)
def expert_parallel(w: Where) -> dict:
    from mgtutorial.context_expert import config, ep_worker

    cfg = config.EPConfig(experts=2 * w.nprocs, backend=w.backend)
    values = _run(ep_worker.worker, cfg, w.nprocs, w).values
    figures = {
        "max_diff": max(v["max_diff"] for v in values.values()),
        "counted": [values[r]["counted"] for r in sorted(values)],
        "predicted": [values[r]["predicted"] for r in sorted(values)],
    }
    expect(figures["max_diff"] < 1e-4, "expert-parallel layer != one process", figures)
    expect(figures["counted"] == figures["predicted"], "all-to-all bytes != predicted", figures)
    return figures


@item(
    "hang_dump_nccl",
    chapter="05c_hangs_and_debugging",
    min_gpus=2,
    timeout_s=120,
    what="faulthandler.dump_traceback_later around a hung all-reduce: on NCCL the call returns at "
    "once and the dump shows the rank waiting in torch.cuda.synchronize (05c's hang_worker)",
)
def hang_dump_nccl(w: Where) -> dict:
    from mgtutorial import WorkerFailed
    from mgtutorial.scale import hangs

    # rank 1 skips the last all-reduce and sleeps: rank 0's has no partner (no mismatched pair)
    cfg = hangs.HangConfig(
        timeout_s=5, skip_step=2, rank_work_s=20, backend=w.backend, dump_after_s=1
    )
    try:
        run = _run(hangs.hang_worker, cfg, 2, w, timeout_s=90)
        raise CheckFailed(f"the job did not fail: {run.values}")
    except WorkerFailed as exc:
        failed = {"rank": exc.rank, "exc_type": exc.exc_type, "exitcode": exc.exitcode}
        err = Path(exc.log_path).with_name("rank0.err").read_text()
    dump = err[err.index("Timeout (") :] if "Timeout (" in err else ""
    waits_in = "synchronize" if w.cuda else "all_reduce"
    figures = {"failed": failed, "dumped": bool(dump), "waits_in": waits_in}
    expect(bool(dump), "rank 0 wrote no faulthandler dump before its timeout", figures)
    main = next((b for b in dump.split("\n\n") if "hang_worker" in b), "")
    figures["main_thread"] = main.splitlines()[:4]
    expect(f"in {waits_in}" in main, f"the dump does not show rank 0 in {waits_in}", figures)
    return figures


@item(
    "elastic_restart_nccl",
    chapter="05b_elastic_restarts",
    min_gpus=2,
    timeout_s=240,
    what="torchrun --max-restarts 1 of 05b's elastic worker on 2 GPUs (NCCL): rank 1 SIGKILLed "
    "after step 10; the agent stops rank 0 (SIGTERM) and restarts both from the snapshot of "
    "step 8; the final parameters == one process",
)
def elastic_restart_nccl(w: Where) -> dict:
    from mgtutorial.scale import elastic, torchrun

    steps, every, fail = 12, 4, 10
    ckpt, runs = w.workdir / "elastic.pt", w.workdir / "runs"
    cfg = elastic.ElasticConfig(
        dataset="digits",
        epochs=1,
        max_steps=steps,
        evaluate=False,
        checkpoint=str(ckpt),
        checkpoint_every=every,
        resume=True,
        backend=w.backend,
    )
    args = ["elastic", "--dataset", "digits", "--epochs", "1", "--max-steps", str(steps)]
    args += ["--no-evaluate", "--checkpoint", str(ckpt), "--checkpoint-every", str(every)]
    args += ["--resume", "--backend", w.backend, "--runs-dir", str(runs), "--run-name", "killed"]
    args += ["--fail-rank", "1", "--fail-step", str(fail), "--fail-how", "sigkill"]
    code, out = torchrun.run_torchrun(
        args,
        nproc_per_node=2,
        max_restarts=1,
        timeout=180,
        log_dir=w.workdir / "agents",
        extra_env={**NO_TF32, "LOGLEVEL": "INFO"},
    )
    recs = runlog.read_run(runs / "killed")
    resumes = sorted((r["rank"], r["step"], r["attempt"]) for r in recs if r["kind"] == "resume")
    figures: dict = {
        "exit_code": code,
        "backend": w.backend,
        "resumes_rank_step_restart_count": resumes,
        "agent_saw_the_kill": "failed (exitcode: -9)" in out,
        "agent_stopped_the_survivor": "closing signal SIGTERM" in out,
    }
    expect(code == 0, f"torchrun exited with {code}: {out[-1500:]}", figures)
    expect(figures["agent_saw_the_kill"], "the agent did not report rank 1's SIGKILL", figures)
    if w.cuda:  # on gloo rank 0 may have raised (connection reset) before the agent's SIGTERM
        expect(figures["agent_stopped_the_survivor"], "the agent sent rank 0 no SIGTERM", figures)
    want = [(r, fail - fail % every, 1) for r in (0, 1)]
    expect(resumes == want, f"resumes {resumes}, not {want} (rank, step, restart count)", figures)
    final = torch.load(ckpt, map_location="cpu", weights_only=True)
    ref = ddp.combined_batch_reference(cfg, 2).state_dict()
    figures["final_step"] = final["step"]
    figures["max_param_diff"] = _max_diff(final["model"], ref)
    expect(final["step"] == steps, f"the job ended at step {final['step']}", figures)
    _close(final["model"], ref, "restarted NCCL job vs one process", figures)
    return figures


@item(
    "zero_bubble_interleaved",
    chapter="04b_pipeline_schedules",
    min_gpus=2,
    timeout_s=240,
    what="ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleInterleaved1F1B, two "
    "stages per rank on 2 GPUs (NCCL): gradients == the unsplit model's; schedules.worker's "
    "interleaved 1F1B over 3 steps == unsplit",
)
def zero_bubble_interleaved(w: Where) -> dict:
    from mgtutorial.pipeline import zero_bubble

    figures: dict = {"max_grad_diff": {}}
    for cls in (
        "ScheduleInterleavedZeroBubble",
        "ScheduleZBVZeroBubble",
        "ScheduleInterleaved1F1B",
    ):
        cfg = zero_bubble.ZeroBubbleConfig(schedule=cls, backend=w.backend)
        values = _run(zero_bubble.worker, cfg, 2, w).values
        figures["max_grad_diff"][cls] = diff = max(v["max_grad_diff"] for v in values.values())
        expect(diff < FP32_TOL["atol"], f"{cls}: gradients differ from the unsplit model", figures)
        actions = {a[1] for acts in values[0]["order"].values() for a in acts}
        expect({"F"} <= actions, f"{cls}: no forward in its order", figures)
    cfg = schedules.PipelineConfig(
        schedule="interleaved",
        n_microbatches=4,
        batch_size=64,
        steps=3,
        sizes=[64] * 5,  # 4 stages: two per rank
        backend=w.backend,
    )
    result = _run(schedules.worker, cfg, 2, w)
    got = schedules.gather_params(result.run_dir, cfg, 2)
    ref, _ = schedules.unsplit_reference(cfg)
    figures["interleaved_max_param_diff"] = _max_diff(got, ref.state_dict())
    _close(got, ref.state_dict(), "interleaved 1F1B vs unsplit", figures)
    return figures


@item(
    "handoff_nccl",
    chapter="04z_appendix_delays",
    min_gpus=2,
    timeout_s=120,
    what="04z's hand-off timing on 2 GPUs (handoff.handoff_worker: send/recv, timed after "
    "torch.cuda.synchronize): a floor and a median per size, the bytes of each activation",
)
def handoff_nccl(w: Where) -> dict:
    from mgtutorial.pipeline import handoff

    cfg = handoff.HandoffConfig(rows=[256, 64], reps=10, backend=w.backend)
    rows = _run(handoff.handoff_worker, cfg, 2, w).values[0]
    figures = {"width": cfg.width, "rows": rows}
    expect([r["rows"] for r in rows] == cfg.rows, "not one row per size, in order", figures)
    for r in rows:
        expect(r["bytes"] == r["rows"] * cfg.width * 4, f"{r['rows']} rows: bytes", figures)
        expect(0 < r["handoff_ms"] <= r["median_ms"], f"{r['rows']} rows: floor > median", figures)
    return figures


@item(
    "fsdp2_part_counts",
    chapter="07b_fsdp2",
    min_gpus=2,
    timeout_s=150,
    what="07b's collective counts (fsdp.part_counts, CommDebugMode) on all GPUs == "
    "predicted_collectives for 1-3 blocks, every reshard_after_forward; the CUDA peak measured",
)
def fsdp2_part_counts(w: Where) -> dict:
    from mgtutorial.sharding import worker as shard_worker

    cfg = shard_worker.ShardConfig(parts=["counts"], backend=w.backend)
    rows = _run(shard_worker.worker, cfg, w.nprocs, w, timeout_s=120).values[0]["counts"]
    figures = {
        "world_size": w.nprocs,
        "rows": [
            {k: r[k] for k in ("blocks", "reshard_after_forward", "counted", "peak_cuda_bytes")}
            for r in rows
        ],
    }
    expect(len(rows) == 9, f"{len(rows)} rows, not 3 block counts × 3 settings", figures)
    for r in rows:
        expect(
            r["counted"] == r["predicted"],
            f"{r['blocks']} block(s), "
            f"reshard_after_forward={r['reshard_after_forward']}: counted != predicted",
            figures,
        )
        if w.cuda:  # the step's peak holds at least what was gathered at once
            expect(
                isinstance(r["peak_cuda_bytes"], int)
                and r["peak_cuda_bytes"] >= max(r["alive_bytes"]),
                "the CUDA peak is missing or below the gathered bytes",
                figures,
            )
        else:
            expect(r["peak_cuda_bytes"] is None, "a CUDA peak on CPU", figures)
    return figures


@item(
    "exercise_06a2_nccl_hint",
    chapter="06a_article_ddp",
    min_gpus=2,
    timeout_s=150,
    what="exercise 06a.2's checker on NCCL: the loss tensor left on the CPU fails with the hint "
    "that NCCL all-reduces CUDA tensors only; on ctx.device it passes",
)
def exercise_06a2_nccl_hint(w: Where) -> dict:
    import contextlib
    import io
    import os

    from mgtutorial.exercises import ExerciseError, ch06a

    body = (
        "import torch\nimport torch.distributed as dist\n\n\ndef epoch_loss(losses, sizes, ctx):\n"
        "    summed = sum(loss * n for loss, n in zip(losses, sizes))\n"
        "    total = torch.tensor([summed, sum(sizes)], dtype=torch.float64{where})\n"
        "    dist.all_reduce(total)\n    return float(total[0] / total[1])\n"
    )
    os.chdir(w.workdir)  # the checker's runs go to runs/exercises here
    figures: dict = {}
    for name, where in (("on_cpu", ""), ("on_ctx_device", ", device=ctx.device")):
        path = w.workdir / f"ex06a_loss_{name}.py"
        path.write_text(body.format(where=where))
        try:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                ch06a.global_mean_loss(str(path))
            figures[name] = out.getvalue().strip()
        except ExerciseError as exc:
            figures[name] = f"ExerciseError: {exc.hint}"
    expect(figures["on_ctx_device"].startswith("✓"), "the right answer did not pass", figures)
    if w.cuda:  # NCCL refuses the CPU tensor, and the checker says why
        expect(
            "NCCL all-reduces CUDA tensors only" in figures["on_cpu"],
            "the CPU tensor did not get the NCCL hint",
            figures,
        )
    else:  # gloo all-reduces CPU tensors: the same answer passes (what the exercise text says)
        expect(figures["on_cpu"].startswith("✓"), "gloo refused a CPU tensor", figures)
    return figures


@item(
    "pp_dp_mesh",
    chapter="04b_pipeline_schedules",
    min_gpus=4,
    timeout_s=240,
    what="pipeline × data parallel on a 2 × 2 (pp, dp) mesh of 4 GPUs (NCCL): each replica == one "
    "process, by hand, with DDP and with FSDP2 stages; without the replicas' all-reduce they drift "
    "(04b section 6)",
)
def pp_dp_mesh(w: Where) -> dict:
    from mgtutorial.common.compare import max_abs_diff
    from mgtutorial.pipeline import pp_dp

    cfg = pp_dp.PPDPConfig(
        dp=2, schedule="1f1b", n_microbatches=2, batch_size=32, steps=3, backend=w.backend
    )
    ref, _ = schedules.unsplit_reference(cfg)
    figures: dict = {}
    for all_reduce in (True, False):
        run_cfg = pp_dp.PPDPConfig(**{**cfg.__dict__, "all_reduce": all_reduce})
        result = _run(pp_dp.worker, run_cfg, 4, w)
        params = [pp_dp.replica_params(result.run_dir, run_cfg, d, 2) for d in range(2)]
        diffs = [max_abs_diff(p, ref.state_dict()) for p in params]
        figures[f"max_param_diff_all_reduce_{all_reduce}"] = diffs
        figures[f"collectives_all_reduce_{all_reduce}"] = result.values[0]["collectives"]
    expect(
        max(figures["max_param_diff_all_reduce_True"]) < FP32_TOL["atol"],
        "a replica differs from one process",
        figures,
    )
    expect(
        min(figures["max_param_diff_all_reduce_False"]) > 1e-4,
        "without the all-reduce the replicas still equal one process: the check cannot fail",
        figures,
    )
    for wrap in ("ddp", "fsdp"):  # the library's stage drives DDP and FSDP2 itself (04b)
        run_cfg = pp_dp.PPDPConfig(**{**cfg.__dict__, "wrap": wrap, "n_microbatches": 4})
        result = _run(pp_dp.worker, run_cfg, 4, w)
        params = [pp_dp.replica_params(result.run_dir, run_cfg, d, 2) for d in range(2)]
        figures[f"max_param_diff_{wrap}"] = [max_abs_diff(p, ref.state_dict()) for p in params]
        figures[f"collectives_{wrap}"] = result.values[0]["collectives"]
        expect(
            max(figures[f"max_param_diff_{wrap}"]) < FP32_TOL["atol"],
            f"a {wrap} replica differs from one process",
            figures,
        )
    return figures
