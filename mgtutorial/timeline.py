"""Pipeline timelines: when each stage computes, how much activation memory it holds, and the bubble.

Taught in notebooks/04_model_parallel.ipynb (Gantt charts of GPipe and 1F1B, measured vs formula
bubbles) and used by notebooks/06_article_review.ipynb (what ``retain_graph=True`` keeps alive).
Built on module hooks and ``torch.autograd.graph.saved_tensors_hooks``
(https://pytorch.org/docs/stable/autograd.html#saved-tensors-hooks).
"""

from __future__ import annotations

import time
import weakref

import torch
from torch import nn

from . import runlog


def bubble_formula(num_stages: int, n_microbatches: int) -> float:
    """Idle fraction of an ideal GPipe/1F1B pipeline: (p − 1) / (m + p − 1)."""
    return (num_stages - 1) / (n_microbatches + num_stages - 1)



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
        self.log.event(event=name, start=start, end=time.time(), stage=self.stage, microbatch=mb,
                       step=self.step, live_activation_bytes=self.memory.live_bytes)



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
