"""Model parallelism: the article's non-parallel version, a naive split, and pipeline parallelism
(GPipe by hand; GPipe and 1F1B with ``torch.distributed.pipelining``), with measured timelines,
bubbles and activation memory.

Taught in notebooks/04_model_parallel.ipynb. Follows
https://pytorch.org/docs/stable/distributed.pipelining.html and the GPipe (Huang et al., 2019) and
1F1B (PipeDream-Flush, Narayanan et al., 2021) schedules.

One stage per rank: rank s holds stage s of the article's MLP (:meth:`ArticleMLP.split`). A batch of
``batch_size`` samples is cut into ``n_microbatches`` micro-batches; activations travel forward to
rank s+1 and gradients back to rank s−1 with point-to-point send/recv. From the shell::

    torchrun --standalone --nproc-per-node 2 -m mgtutorial pipeline --schedule 1f1b --microbatches 4
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from . import env, models, runlog

SCHEDULES = ("hand-gpipe", "gpipe", "1f1b")


def mlp_data(n: int = 2048, in_features: int = 1024, num_classes: int = 100, seed: int = 0) -> TensorDataset:
    """Seeded inputs ``(n, in_features)`` with labels from a fixed random linear teacher (learnable).

    Every rank builds the identical set (same seed): stage 0 needs the inputs, the last stage the labels.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    teacher = torch.randn(in_features, num_classes, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(1))


@dataclass(kw_only=True)
class PipelineConfig:
    """Configuration of :func:`worker` (and of the single-process reference)."""

    schedule: str = "gpipe"
    """"hand-gpipe" (written here with send/recv) | "gpipe" | "1f1b" (torch.distributed.pipelining)."""
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
    """Seed of the initial weights (the whole model is built, then split, so all splits start equal)."""
    backend: str = "auto"
    """"auto" | "gloo" | "nccl"."""
    timeout_s: float = 60.0
    """Collective timeout in seconds."""
    save_params: bool = True
    """Each stage writes its final parameters to ``<run dir>/stage<s>.pt``."""
    fail_stage: int = -1
    """Fault injection: this stage raises at step 2 (−1: never)."""

    def validate(self, world_size: int) -> None:
        """Called by :func:`mgtutorial.launch` before any process starts (see :func:`check_config`)."""
        check_config(self, world_size)


def check_config(cfg: PipelineConfig, num_stages: int) -> None:
    """Refuse, before any work, what the schedule cannot do. Raises ValueError naming the values."""
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"schedule={cfg.schedule!r} is not one of {SCHEDULES}.")
    if cfg.n_microbatches < 1 or cfg.n_microbatches > cfg.batch_size:
        raise ValueError(f"n_microbatches={cfg.n_microbatches} must be between 1 and batch_size={cfg.batch_size}.")
    if cfg.schedule != "hand-gpipe" and cfg.batch_size % cfg.n_microbatches:
        raise ValueError(
            f"batch_size={cfg.batch_size} is not divisible by n_microbatches={cfg.n_microbatches}: "
            f"torch.distributed.pipelining weights every micro-batch's loss equally (1/{cfg.n_microbatches}), "
            "which is only right for equal sizes. Use a batch size that is a multiple of the micro-batch "
            "count, or schedule='hand-gpipe', which weights each micro-batch by its share."
        )
    if cfg.schedule == "1f1b" and cfg.n_microbatches < num_stages:
        raise ValueError(f"1F1B needs n_microbatches ≥ stages: {cfg.n_microbatches} < {num_stages}.")
    if num_stages > len(cfg.sizes) - 1:
        raise ValueError(f"{num_stages} stages but the MLP has only {len(cfg.sizes) - 1} sub-networks.")


def microbatch_sizes(batch_size: int, n_microbatches: int) -> list[int]:
    """Sizes of ``torch.tensor_split``'s chunks: as equal as possible, the first ones larger."""
    q, r = divmod(batch_size, n_microbatches)
    return [q + 1] * r + [q] * (n_microbatches - r)


def bubble_formula(num_stages: int, n_microbatches: int) -> float:
    """Idle fraction of an ideal GPipe/1F1B pipeline: (p − 1) / (m + p − 1)."""
    return (num_stages - 1) / (n_microbatches + num_stages - 1)


def build_stage(cfg: PipelineConfig, stage: int, num_stages: int) -> nn.Module:
    """The seeded whole MLP, split into ``num_stages``; returns stage ``stage`` (shares no memory
    with the other stages once they live in other processes)."""
    env.seed_everything(cfg.seed)
    return models.ArticleMLP(tuple(cfg.sizes)).split(num_stages)[stage]


def batches(cfg: PipelineConfig):
    """The ``cfg.steps`` batches ``(x, y)`` every rank and the reference agree on."""
    ds = mlp_data(cfg.steps * cfg.batch_size, cfg.sizes[0], cfg.sizes[-1], seed=cfg.seed + 1)
    for s in range(cfg.steps):
        yield ds.tensors[0][s * cfg.batch_size:(s + 1) * cfg.batch_size], ds.tensors[1][s * cfg.batch_size:(s + 1) * cfg.batch_size]


def unsplit_reference(cfg: PipelineConfig) -> tuple[nn.Module, list[float]]:
    """One process, the whole MLP, full batches: what every schedule must reproduce.

    Returns (model, loss per step).
    """
    env.seed_everything(cfg.seed)
    model = models.ArticleMLP(tuple(cfg.sizes))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses = []
    for x, y in batches(cfg):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


class ActivationMeter:
    """Counts the bytes of activations autograd saves for backward (parameters excluded).

    It counts saves, not storage: a tensor saved by two operations (e.g. log-softmax's output,
    kept by both ``log_softmax`` and ``nll_loss``) counts twice.

    ``with meter.saving(): ...`` installs saved-tensor hooks: ``live_bytes`` rises at each save and
    falls when backward (or the graph's end) frees it; ``peak_bytes`` is the maximum since
    :meth:`reset_peak`. Measured, not assumed: this is how chapter 04 compares GPipe with 1F1B and
    chapter 06 shows what ``retain_graph=True`` keeps alive.
    """

    def __init__(self, module: nn.Module):
        self.live_bytes = self.peak_bytes = 0
        self._params = {p.data_ptr() for p in module.parameters()}

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def saving(self):
        def pack(t):
            holder = _Saved(t)
            if t.data_ptr() not in self._params:
                n = t.numel() * t.element_size()
                self.live_bytes += n
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
                weakref.finalize(holder, self._release, n)
            return holder

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t)

    def _release(self, n: int) -> None:
        self.live_bytes -= n


class _Saved:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t.detach()  # no grad_fn: holding it must not keep the graph alive by itself


class Timeline:
    """Logs a forward and a backward event per micro-batch of one stage, from module hooks.

    Events: ``kind="event"``, ``event`` ("forward"|"backward"), ``start``, ``end`` (unix s),
    ``stage``, ``microbatch``, ``step``. Works for hand-written and library schedules alike: forward
    from forward pre/post hooks; backward from the full-backward pre-hook (its start) and a
    multi-grad hook over the stage's parameters (its end). ``memory`` is the stage's
    :class:`ActivationMeter`; events carry its ``live_activation_bytes``.
    """

    def __init__(self, module: nn.Module, stage: int, log: runlog.RunLog):
        self.stage, self.log, self.step = stage, log, 0
        self.ignore_forwards = 0  # forward passes to leave out (shape inference), see worker()
        self.fwd = self.bwd = 0
        self._t0 = self._b0 = 0.0
        self.memory = ActivationMeter(module)
        module.register_forward_pre_hook(self._fwd_start)
        module.register_forward_hook(self._fwd_end)
        module.register_full_backward_pre_hook(self._bwd_start)
        torch.autograd.graph.register_multi_grad_hook(list(module.parameters()), self._bwd_end)

    def new_step(self, step: int) -> None:
        self.step, self.fwd, self.bwd = step, 0, 0
        self.memory.reset_peak()

    def _fwd_start(self, module, args):
        self._t0 = time.time()

    def _fwd_end(self, module, args, out):
        if self.ignore_forwards:
            self.ignore_forwards -= 1
            return
        self._event("forward", self.fwd, self._t0)
        self.fwd += 1

    def _bwd_start(self, module, grad_out):
        self._b0 = time.time()

    def _bwd_end(self, grads):
        self._event("backward", self.bwd, self._b0)
        self.bwd += 1

    def _event(self, name: str, mb: int, start: float) -> None:
        self.log.write(kind="event", event=name, start=start, end=time.time(), stage=self.stage,
                       microbatch=mb, step=self.step, live_activation_bytes=self.memory.live_bytes)


def _hand_gpipe_step(module: nn.Module, x, y, cfg: PipelineConfig, ctx: env.DistContext) -> float:
    """One GPipe step by hand: all forwards (send activations on), then all backwards (send
    gradients back); each micro-batch's loss weighted by its share n_i / batch."""
    s, p = ctx.rank, ctx.world_size
    sizes = microbatch_sizes(cfg.batch_size, cfg.n_microbatches)
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    in_features = module[0].linear.in_features  # what this stage receives
    inputs, outputs, sends, total = [], [], [], 0.0
    for i, n in enumerate(sizes):
        if s == 0:
            inp = x[bounds[i]:bounds[i + 1]].to(ctx.device)
        else:
            inp = torch.empty(n, in_features, device=ctx.device)
            dist.recv(inp, s - 1)
            inp.requires_grad_()
        out = module(inp)
        if s == p - 1:
            target = y[bounds[i]:bounds[i + 1]].to(ctx.device)
            out = nn.functional.cross_entropy(out, target) * (n / cfg.batch_size)
            total += out.item()
        else:
            sends.append(dist.isend(out.detach(), s + 1))
        inputs.append(inp)
        outputs.append(out)
    for i, out in enumerate(outputs):
        if s == p - 1:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, s + 1)
            out.backward(grad)
        if s > 0:
            sends.append(dist.isend(inputs[i].grad, s - 1))
    for req in sends:
        req.wait()
    return total


def worker(cfg: PipelineConfig) -> dict:
    """One pipeline stage per rank (stage = rank); trains ``cfg.steps`` steps with ``cfg.schedule``.

    Logs per step ``kind="train"`` (last stage: loss) and the :class:`Timeline` events; writes the
    stage's parameters to ``<run dir>/stage<s>.pt``. Returns {"stage", "losses", "peak_activation_bytes",
    "step_times_s"}.

    Raises:
        ValueError: see :func:`check_config` (before any work).
    """
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx, runlog.RunLog() as log:
        s, p = ctx.rank, ctx.world_size
        check_config(cfg, p)
        module = build_stage(cfg, s, p).to(ctx.device)
        timeline = Timeline(module, s, log)
        opt = torch.optim.SGD(module.parameters(), lr=cfg.lr)
        schedule = None
        if cfg.schedule != "hand-gpipe":
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            stage = PipelineStage(module, s, p, ctx.device)
            cls = ScheduleGPipe if cfg.schedule == "gpipe" else Schedule1F1B
            schedule = cls(stage, cfg.n_microbatches, loss_fn=nn.functional.cross_entropy)
            # the library runs one extra forward before its first step to infer shapes; it is not
            # part of the schedule, so the timeline leaves it out
            timeline.ignore_forwards = 1
        losses, peaks, times = [], [], []
        for step, (x, y) in enumerate(batches(cfg), start=1):
            if s == cfg.fail_stage and step == 2:
                raise RuntimeError(f"injected failure in stage {s} at step {step}")
            timeline.new_step(step)
            opt.zero_grad(set_to_none=True)
            t0 = time.time()
            with timeline.memory.saving():
                if schedule is None:
                    loss = _hand_gpipe_step(module, x, y, cfg, ctx)
                elif s == 0:
                    schedule.step(x.to(ctx.device))
                elif s == p - 1:
                    mb_losses = []
                    schedule.step(target=y.to(ctx.device), losses=mb_losses)
                    loss = float(torch.stack(mb_losses).mean())
                else:
                    schedule.step()
            opt.step()
            times.append(time.time() - t0)
            peaks.append(timeline.memory.peak_bytes)
            if s == p - 1:
                losses.append(loss)
                log.write(kind="train", step=step, epoch=0, loss=loss, global_loss=loss,
                          samples=step * cfg.batch_size)
        if cfg.save_params:
            torch.save(module.state_dict(), runlog.run_dir() / f"stage{s}.pt")
        return {"stage": s, "losses": losses, "peak_activation_bytes": max(peaks), "step_times_s": times}


def gather_params(run_dir, cfg: PipelineConfig, num_stages: int) -> dict:
    """The stages' saved parameters reassembled into the unsplit MLP's ``state_dict`` keys."""
    whole = models.ArticleMLP(tuple(cfg.sizes))
    stages = whole.split(num_stages)
    for s, stage in enumerate(stages):
        stage.load_state_dict(torch.load(f"{run_dir}/stage{s}.pt", weights_only=True))
    return whole.state_dict()


def events(records: list[dict], step: int | None = None) -> list[dict]:
    """The timeline events of ``records`` (optionally of one step), sorted by start time."""
    evs = [r for r in records if r.get("kind") == "event" and (step is None or r["step"] == step)]
    return sorted(evs, key=lambda e: e["start"])


def bubble_measured(evs: list[dict]) -> float:
    """Idle fraction of a step: 1 − (busy time summed over stages) / (stages × span of the step)."""
    stages = {e["stage"] for e in evs}
    span = max(e["end"] for e in evs) - min(e["start"] for e in evs)
    busy = sum(e["end"] - e["start"] for e in evs)
    return 1 - busy / (len(stages) * span)


def gantt(evs: list[dict], ax=None, title: str = ""):
    """Draw a Gantt chart of timeline events: one row per stage, F/B boxes labelled by micro-batch."""
    from matplotlib.figure import Figure

    fig = None
    if ax is None:
        fig = Figure(figsize=(9, 0.6 + 0.55 * len({e['stage'] for e in evs})), layout="constrained")
        ax = fig.add_subplot()
    t0 = min(e["start"] for e in evs)
    span = (max(e["end"] for e in evs) - t0) * 1e3
    for e in evs:
        color = "tab:blue" if e["event"] == "forward" else "tab:orange"
        left, width = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
        ax.barh(e["stage"], width, left=left, color=color, edgecolor="black", linewidth=0.5)
        if width < 0.02 * span:  # too narrow for a label
            continue
        ax.text(left + width / 2, e["stage"], f"{'F' if e['event'] == 'forward' else 'B'}{e['microbatch']}",
                ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(sorted({e["stage"] for e in evs}), [f"stage {s}" for s in sorted({e['stage'] for e in evs})])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title, loc="left", fontsize=10)
    return fig if fig is not None else ax


# ---------------------------------------------------------------------------------------------
# The article's "model parallel" sample, in spirit, and the naive split in one process


@dataclass(kw_only=True)
class ArticleConfig:
    """Configuration of :func:`article_worker`."""

    steps: int = 5
    """Optimizer steps."""
    batch_size: int = 32
    """Samples per step on each rank."""
    lr: float = 0.05
    """SGD learning rate."""
    seed: int = 0
    """Seed of the initial weights (identical on every rank, so any difference is divergence)."""
    backend: str = "auto"
    """"auto" | "gloo" | "nccl"."""


def article_worker(cfg: ArticleConfig) -> dict:
    """What the article's second sample does: every rank builds the *whole* MLP, trains it on its own
    shuffle of the data and never exchanges a gradient — N unsynchronised copies, not a split model.

    Logs per step ``kind="article"`` with this rank's parameter count and a parameter checksum, and
    writes its final parameters to ``<run dir>/rank<r>-model.pt``.
    """
    with env.distributed(cfg.backend) as ctx, runlog.RunLog() as log:
        env.seed_everything(cfg.seed)
        model = models.ArticleMLP().to(ctx.device)  # the whole model on every rank
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        ds = mlp_data(cfg.steps * cfg.batch_size, seed=cfg.seed + 1)
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(1000 + ctx.rank))
        for step in range(1, cfg.steps + 1):
            idx = order[(step - 1) * cfg.batch_size:step * cfg.batch_size]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(ds.tensors[0][idx].to(ctx.device)), ds.tensors[1][idx].to(ctx.device))
            loss.backward()
            opt.step()
            log.write(kind="article", step=step, loss=loss.item(), parameters=models.count_parameters(model),
                      checksum=float(sum(p.double().sum() for p in model.parameters())))
        torch.save(model.state_dict(), runlog.run_dir() / f"rank{ctx.rank}-model.pt")
        return {"parameters": models.count_parameters(model)}


def naive_devices() -> list[torch.device]:
    """cuda:0 and cuda:1 with two GPUs, else the CPU twice (the same code either way)."""
    if env.gpu_count() >= 2:
        return [torch.device("cuda", 0), torch.device("cuda", 1)]
    return [torch.device("cpu")] * 2


class NaiveModelParallel(nn.Module):
    """The MLP cut in two, stage i on ``devices[i]``; ``forward`` moves activations between them.

    Only one device computes at a time: stage 1 waits for stage 0's output, and in backward
    stage 0 waits for stage 1's gradients. Shapes: ``(B, 1024)`` → ``(B, 100)`` on ``devices[-1]``.
    """

    def __init__(self, mlp: models.ArticleMLP, devices: list[torch.device]):
        super().__init__()
        self.devices = devices
        self.stages = nn.ModuleList(st.to(d) for st, d in zip(mlp.split(len(devices)), devices))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, device in zip(self.stages, self.devices):
            x = stage(x.to(device))
        return x


def train_naive(cfg: PipelineConfig, devices: list[torch.device] | None = None) -> tuple[nn.Module, list[dict]]:
    """Train :class:`NaiveModelParallel` in this process on :func:`batches`; returns (model, events).

    Events are the same records :class:`Timeline` logs (forward/backward per stage), in memory.
    """
    env.seed_everything(cfg.seed)
    model = NaiveModelParallel(models.ArticleMLP(tuple(cfg.sizes)), devices or naive_devices())
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)

    class _Memory(list):
        def write(self, **rec):
            self.append(rec)

    memory = _Memory()
    timelines = [Timeline(st, i, memory) for i, st in enumerate(model.stages)]
    for step, (x, y) in enumerate(batches(cfg), start=1):
        for t in timelines:
            t.new_step(step)
        opt.zero_grad()
        out = model(x.to(model.devices[0]))
        nn.functional.cross_entropy(out, y.to(out.device)).backward()  # targets to the last device
        opt.step()
    return model, list(memory)

