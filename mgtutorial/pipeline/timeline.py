"""Pipeline timelines: when each stage computes, how much activation memory it holds, and the bubble.

Taught in notebooks/04_model_parallel.ipynb (Gantt charts of GPipe and 1F1B, measured vs formula
bubbles) and used by notebooks/06b_article_model_parallel.ipynb (what ``retain_graph=True`` keeps alive).
Built on module hooks and ``torch.autograd.graph.saved_tensors_hooks``
(https://pytorch.org/docs/stable/autograd.html#saved-tensors-hooks).
"""

from __future__ import annotations

import statistics
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mgtutorial.runtime import env, runlog


def bubble_formula(num_stages: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of an ideal GPipe/1F1B pipeline on p = ``num_stages`` ranks: (p − 1) / (m + p − 1);
    with v = ``stages_per_rank`` (interleaved 1F1B, Narayanan et al., 2021) (p − 1) / (v·m + p − 1)."""
    return (num_stages - 1) / (stages_per_rank * n_microbatches + num_stages - 1)


def bubble_model(
    num_stages: int,
    n_microbatches: int,
    forward_s: float,
    backward_s: float,
    delay_s: float,
    stages_per_rank: int = 1,
) -> float:
    """The formula with a cost between the boxes: every box but the step's first starts ``delay_s`` = o late
    (:func:`box_delays`). The critical path has v·m + p − 1 forwards and as many backwards, so the span is
    (v·m + p − 1)·(f + b + 2·o) − o, and the idle fraction 1 − v·m·(f + b) / ((v·m + p − 1)·(f + b + 2·o) − o);
    seconds, f and b one box of one stage. With o = 0 it is :func:`bubble_formula`."""
    p, vm, work = num_stages, stages_per_rank * n_microbatches, forward_s + backward_s
    return 1 - vm * work / ((vm + p - 1) * (work + 2 * delay_s) - delay_s)


@dataclass(kw_only=True)
class HandoffConfig:
    """Configuration of :func:`handoff_worker` (2 ranks)."""

    rows: list[int] = field(default_factory=lambda: [512, 256, 128, 64])
    """Rows of the activation handed over (one micro-batch), one measurement per entry."""
    width: int = 1024
    """Columns of the activation (the layers' width), float32."""
    reps: int = 60
    """Round trips per size; the minimum of all but the first two is the floor reported."""
    backend: str = "auto"
    """"auto" | "gloo" | "nccl"."""

    def validate(self, world_size: int) -> None:
        """Before any process starts (:func:`mgtutorial.launch`): 2 ranks, reps ≥ 3, positive sizes."""
        if (
            world_size != 2
            or self.reps < 3
            or not self.rows
            or min(self.rows) < 1
            or self.width < 1
        ):
            raise ValueError(
                f"the hand-off needs 2 ranks (got {world_size}), reps ≥ 3 (got {self.reps}), "
                f"positive rows and width (got {self.rows}, {self.width})."
            )


def handoff_worker(cfg: HandoffConfig) -> list[dict]:
    """The hand-off alone: rank 0 sends a ``(rows, width)`` activation, rank 1 receives it and sends it
    back (``dist.send``/``dist.recv``, what a pipeline does per micro-batch), nothing else running.

    Returns ``[{"rows", "bytes", "handoff_ms", "median_ms"}]``, one per size: the fastest round trip / 2
    (ms), the hand-off's floor when no other process takes the core, and the median round trip / 2.
    """
    with env.distributed(cfg.backend) as ctx:
        peer, out = 1 - ctx.rank, []
        for rows in cfg.rows:
            x = torch.randn(rows, cfg.width, device=ctx.device)
            times = []
            for _ in range(cfg.reps):
                dist.barrier()
                t0 = _synced(ctx.device)
                first, second = (dist.send, dist.recv) if ctx.rank == 0 else (dist.recv, dist.send)
                first(x, peer), second(x, peer)
                times.append((_synced(ctx.device) - t0) / 2)
            out.append(
                {
                    "rows": rows,
                    "bytes": x.numel() * x.element_size(),
                    "handoff_ms": 1e3 * min(times[2:]),
                    "median_ms": 1e3 * statistics.median(times[2:]),
                }
            )
        return out


def thread_clock() -> tuple[float, float | None]:
    """(CPU time, time spent runnable but waiting for a core) of the calling thread so far, seconds:
    ``time.thread_time()`` and field 2 of Linux's ``/proc/self/task/<tid>/schedstat``; None where that
    file does not exist (not Linux, or a kernel without scheduler statistics)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            wait = int(f.read().split()[1]) / 1e9
    except OSError:
        wait = None
    return time.thread_time(), wait


def _synced(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work (a GPU's kernels)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class ActivationMeter:
    """Bytes of the distinct storages autograd keeps for backward (parameters excluded).

    It measures storage, not saves: a tensor saved by two operations (log-softmax's output, kept by
    both ``log_softmax`` and ``nll_loss``; a ReLU's output, kept by the ReLU and by the next
    ``Linear``) counts once, by its storage's ``data_ptr``, for as long as any save of it is alive.

    ``with meter.saving(): ...`` installs saved-tensor hooks: ``live_bytes`` rises when a storage is
    first saved and falls when backward (or the graph's end) drops its last save; ``peak_bytes`` is
    the maximum since :meth:`reset_peak`. Measured, not assumed: this is how chapter 04 compares
    GPipe with 1F1B and chapter 06b shows what ``retain_graph=True`` keeps alive.
    """

    def __init__(self, module: nn.Module):
        self.live_bytes = self.peak_bytes = 0
        self._params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._saves: dict[int, list[int]] = {}  # storage data_ptr -> [saves alive, bytes]

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def saving(self):
        def pack(t):
            holder = _Saved(t)
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self._params:
                entry = self._saves.setdefault(ptr, [0, t.untyped_storage().nbytes()])
                if entry[0] == 0:
                    self.live_bytes += entry[1]
                    self.peak_bytes = max(self.peak_bytes, self.live_bytes)
                entry[0] += 1
                weakref.finalize(holder, self._release, ptr)
            return holder

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t)

    def _release(self, ptr: int) -> None:
        entry = self._saves[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._saves[ptr]


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
    :class:`ActivationMeter` (pass ``memory`` to share one between the stages of one rank); events
    carry its ``live_activation_bytes`` at the box's end.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        log: runlog.RunLog,
        memory: ActivationMeter | None = None,
    ):
        self.stage, self.log, self.step = stage, log, 0
        self.ignore_forwards = 0  # forward passes to leave out (shape inference), see worker()
        self.fwd = self.bwd = 0
        self._t0 = self._b0 = 0.0
        self.memory = memory or ActivationMeter(module)
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
        self.log.event(
            event=name,
            start=start,
            end=time.time(),
            stage=self.stage,
            microbatch=mb,
            step=self.step,
            live_activation_bytes=self.memory.live_bytes,
        )


def events(records: list[dict], step: int | None = None) -> list[dict]:
    """The timeline events of ``records`` (optionally of one step), sorted by start time."""
    evs = [r for r in records if r.get("kind") == "event" and (step is None or r["step"] == step)]
    return sorted(evs, key=lambda e: e["start"])


def bubble_measured(evs: list[dict], by: str = "stage") -> float:
    """Idle fraction of a step: 1 − (busy time summed over lanes) / (lanes × span of the step).

    A lane is what computes one box at a time: a stage (``by="stage"``), or a rank (``by="rank"``,
    for schedules with several stages per rank). Busy time is the sum of the logged boxes, so a pause
    of the process inside a box counts as busy, and one between boxes as idle.
    """
    lanes = {e[by] for e in evs}
    span = max(e["end"] for e in evs) - min(e["start"] for e in evs)
    busy = sum(e["end"] - e["start"] for e in evs)
    return 1 - busy / (len(lanes) * span)


def step_costs(evs: list[dict], by: str = "stage", stages_per_rank: int = 1) -> dict:
    """Where one step's time goes, from its events, in seconds: ``forward``/``backward``, the mean box
    (one stage's); ``delay``, the mean of :func:`box_delays`; ``span``, first start to last end;
    ``model``, :func:`bubble_model` of these; ``m``; ``p``, the lanes (stages, or ranks with ``by="rank"``)."""
    p, m = len({e[by] for e in evs}), len({e["microbatch"] for e in evs})
    f = statistics.fmean(e["end"] - e["start"] for e in evs if e["event"] == "forward")
    b = statistics.fmean(e["end"] - e["start"] for e in evs if e["event"] == "backward")
    o = statistics.fmean(box_delays(evs, by))
    span = max(e["end"] for e in evs) - min(e["start"] for e in evs)
    return {
        "forward": f,
        "backward": b,
        "delay": o,
        "span": span,
        "m": m,
        "p": p,
        "model": bubble_model(p, m, f, b, o, stages_per_rank),
    }


def box_delays(evs: list[dict], by: str = "stage") -> list[float]:
    """How late each box started (s): its start minus the moment it could have started, the later of
    its lane's previous box's end and its input's producer's end (a forward: the previous stage's
    forward of the micro-batch; a backward: the next stage's backward, or the last stage's own forward).
    This is the time between boxes that the formula does not see: the hand-off through the backend,
    the schedule's Python, and waiting for a core. The step's first box has no delay and is left out."""
    done = {(e["stage"], e["event"], e["microbatch"]): e["end"] for e in evs}
    last, lane_end, delays = max(e["stage"] for e in evs), {}, []
    for e in sorted(evs, key=lambda e: e["start"]):
        s, i = e["stage"], e["microbatch"]
        dep = (
            ((s - 1, "forward", i) if s > 0 else None)
            if e["event"] == "forward"
            else ((s + 1, "backward", i) if s < last else (s, "forward", i))
        )
        ready = [t for t in (lane_end.get(e[by]), done.get(dep)) if t is not None]
        if ready:
            delays.append(e["start"] - max(ready))
        lane_end[e[by]] = e["end"]
    return delays


def median_over_steps(records: list[dict], fn, steps) -> float:
    """Median of ``fn(events of step)`` over ``steps`` (robust to a step a busy machine paused)."""
    return statistics.median(fn(events(records, step)) for step in steps)


def median_step(records: list[dict], fn, steps) -> int:
    """The step of ``steps`` whose ``fn(events of step)`` is the median (the lower middle one for an
    even count): the step to draw when a table reports the median."""
    ranked = sorted((fn(events(records, step)), step) for step in steps)
    return ranked[(len(ranked) - 1) // 2][1]


def memory_curve(evs: list[dict], lane: int, by: str = "stage") -> tuple[list[float], list[int]]:
    """(ms since the step's first event, live activation bytes) at each box's end on ``lane``."""
    t0 = min(e["start"] for e in evs)
    mine = sorted((e for e in evs if e[by] == lane), key=lambda e: e["end"])
    return [(e["end"] - t0) * 1e3 for e in mine], [e["live_activation_bytes"] for e in mine]


def gantt(evs: list[dict], ax=None, title: str = "", by: str = "stage"):
    """Draw a Gantt chart of timeline events: one row per stage (or per rank, ``by="rank"``), F/B
    boxes labelled by micro-batch (and by stage when a rank holds several)."""
    from matplotlib.figure import Figure

    lanes = sorted({e[by] for e in evs})
    fig = None
    if ax is None:
        fig = Figure(figsize=(9, 0.6 + 0.55 * len(lanes)), layout="constrained")
        ax = fig.add_subplot()
    t0 = min(e["start"] for e in evs)
    span = (max(e["end"] for e in evs) - t0) * 1e3
    for e in evs:
        color = "tab:blue" if e["event"] == "forward" else "tab:orange"
        if by == "rank" and e["stage"] != e["rank"]:  # a rank's second stage: lighter
            color = "lightskyblue" if e["event"] == "forward" else "navajowhite"
        left, width = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
        ax.barh(e[by], width, left=left, color=color, edgecolor="black", linewidth=0.5)
        if width < 0.02 * span:  # too narrow for a label
            continue
        ax.text(
            left + width / 2,
            e[by],
            f"{'F' if e['event'] == 'forward' else 'B'}{e['microbatch']}",
            ha="center",
            va="center",
            fontsize=7,
            color="black" if by == "rank" else "white",
        )
    ax.set_yticks(lanes, [f"{by} {s}" for s in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title, loc="left", fontsize=10)
    return fig if fig is not None else ax
