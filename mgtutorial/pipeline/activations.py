"""Activation memory: the bytes autograd keeps alive for backward, measured with saved-tensor hooks.

Taught in notebooks/04b_pipeline_schedules.ipynb (GPipe against 1F1B, section 3) and used by
notebooks/06b_article_model_parallel.ipynb (what ``retain_graph=True`` keeps alive). Built on
``torch.autograd.graph.saved_tensors_hooks``
(https://pytorch.org/docs/stable/autograd.html#saved-tensors-hooks).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn


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
        """Start a new peak from what is alive now (a new step)."""
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
    """What autograd holds instead of a saved tensor: when it is freed, the save is over."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t.detach()  # no grad_fn: holding it must not keep the graph alive by itself
