"""Pipeline timelines: when each stage computes, recorded as one event per box, and drawn.

Taught in notebooks/04a_pipeline_gpipe.ipynb and notebooks/04b_pipeline_schedules.ipynb (Gantt
charts of the naive split, GPipe, 1F1B and interleaved 1F1B; activation memory over a step) and
used by
notebooks/06b_article_model_parallel.ipynb (the naive split's order of work). Built on module hooks
(``register_forward_hook``, https://pytorch.org/docs/stable/generated/torch.nn.Module.html) and
``torch.autograd.graph.register_multi_grad_hook``. The bubble computed from these events is in
:mod:`mgtutorial.pipeline.bubble`, activation memory in :mod:`mgtutorial.pipeline.activations`.

A box is one forward or one backward of one micro-batch on one stage; its event is the record
``kind="event"`` with ``event`` ("forward"|"backward"), ``stage``, ``microbatch``, ``step``,
``start``, ``end`` (unix seconds) and ``live_activation_bytes``; the record adds ``rank``.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch
from torch import nn

from mgtutorial.pipeline.activations import ActivationMeter
from mgtutorial.runtime import runlog


def thread_clock() -> tuple[float, float | None]:
    """(CPU time, time spent runnable but waiting for a core) of the calling thread so far,
    seconds: ``time.thread_time()`` and field 2 of Linux's ``/proc/self/task/<tid>/schedstat``;
    None where that file does not exist (not Linux, or a kernel without scheduler statistics)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            wait = int(f.read().split()[1]) / 1e9
    except OSError:
        wait = None
    return time.thread_time(), wait


class Timeline:
    """Logs a forward and a backward event per micro-batch of one stage, from module hooks.

    Events: ``kind="event"``, ``event`` ("forward"|"backward"), ``start``, ``end`` (unix s),
    ``stage``, ``microbatch``, ``step``. Works for hand-written and library schedules alike: forward
    from forward pre/post hooks; backward from the full-backward pre-hook (its start) and a
    multi-grad hook over the stage's parameters (its end). ``memory`` is the stage's
    :class:`ActivationMeter` (pass ``memory`` to share one between the stages of one rank); events
    carry its ``live_activation_bytes`` at the box's end. With ``device``
    (:class:`~mgtutorial.pipeline.simulated.SimulatedDevice`) each box lasts at least its device
    time: the rank sleeps at the box's end (before its output or gradient is sent on), and the
    event's ``end`` is read after the sleep.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        log: runlog.RunLog,
        memory: ActivationMeter | None = None,
        device=None,
    ):
        self.stage, self.log, self.step, self.device = stage, log, 0, device
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
        if self.device is not None:  # the simulated device: the box lasts its device time
            self.device.hold(name, start)
        end = time.time()
        self.log.event(
            event=name,
            start=start,
            end=end,
            stage=self.stage,
            microbatch=mb,
            step=self.step,
            live_activation_bytes=self.memory.live_bytes,
        )


def events(records: list[dict], step: int | None = None) -> list[dict]:
    """The timeline events of ``records`` (optionally of one step), sorted by start time."""
    evs = [r for r in records if r.get("kind") == "event" and (step is None or r["step"] == step)]
    return sorted(evs, key=lambda e: e["start"])


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


COLORS = {
    "forward": "tab:blue",
    "backward": "tab:orange",
    "input": "tab:orange",
    "weight": "tab:green",
}
LIGHT = {"forward": "lightskyblue", "weight": "lightgreen"}


def gantt(evs: list[dict], ax=None, title: str = "", by: str = "stage"):
    """Draw a Gantt chart of timeline events: one row per stage (or per rank, ``by="rank"``), boxes
    labelled by kind (F, B; I and W for a split backward) and micro-batch, a rank's second stage
    lighter."""
    from matplotlib.figure import Figure

    lanes = sorted({e[by] for e in evs})
    fig = None
    if ax is None:
        fig = Figure(figsize=(9, 0.6 + 0.55 * len(lanes)), layout="constrained")
        ax = fig.add_subplot()
    t0 = min(e["start"] for e in evs)
    span = (max(e["end"] for e in evs) - t0) * 1e3
    for e in evs:
        color = COLORS.get(e["event"], "tab:orange")
        if by == "rank" and e["stage"] != e["rank"]:  # a rank's second stage: lighter
            color = LIGHT.get(e["event"], "navajowhite")
        left, width = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
        ax.barh(e[by], width, left=left, color=color, edgecolor="black", linewidth=0.5)
        if width < 0.02 * span:  # too narrow for a label
            continue
        ax.text(
            left + width / 2,
            e[by],
            f"{e['event'][0].upper()}{e['microbatch']}",
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
