"""FSDP2's prefetching, read from a real step's profiler events: when each unit's all-gather and
reduce-scatter is issued, how long the training thread spends in it, when the collective itself
runs (on the backend's own thread), and whether any compute runs while a collective is in flight.

FSDP2 (torch 2.14.1, ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``) gathers a unit
in its ``pre_forward`` unless an earlier unit named it in ``set_modules_to_forward_prefetch``;
in backward each unit's ``pre_backward`` prefetches the unit before it by default
(``_backward_prefetch``). It issues the all-gather on a separate stream
(``FSDPCommContext.get_all_gather_streams``) and waits on an event only when the unit needs the
result. On CPU those streams and events are no-ops
(``torch.cpu.Stream``), and a gloo collective called with ``async_op=False`` returns only when it
has finished: the order changes, the training thread still waits. On CUDA with NCCL the call
returns once the collective is queued on the all-gather stream, so the CPU runs ahead and the GPU
runs a unit's all-gather beside the kernels of the unit before, with or without explicit
prefetching; explicit prefetching issues it earlier, which matters when the CPU cannot run ahead.

Taught in notebooks/07b_fsdp2.ipynb, section 7. :func:`step_timeline` runs inside
:func:`mgtutorial.sharding.practice.part_practice`.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from mgtutorial.sharding.fsdp import apply_fsdp, mesh_for
from mgtutorial.sharding.model import batch, make_model

LABELS = {
    "FSDP::all_gather": "AG",
    "FSDP::pre_forward": "fwd",
    "FSDP::pre_backward": "bwd",
    "FSDP::post_backward_reduce": "RS",
}
"""FSDP2's own profiler labels (``record_function`` in ``_fsdp_param_group.py``, followed by
`` (<module>)``; the root's has no module) → short names."""

COMPUTE = ("aten::addmm", "aten::mm", "aten::tanh", "aten::tanh_backward")
"""The model's compute ops, forward and backward (the blocks are ``tanh(Linear(x))``)."""

Mode = Literal["implicit", "prefetch", "async"]
"""How a step gathers the next block: in its own pre-forward ("implicit"), named by the block before
in ``set_modules_to_forward_prefetch`` ("prefetch"), or issued by the block before with the
public ``FSDPModule.unshard(async_op=True)``, which the next pre-forward waits on ("async": on gloo
the all-gather then runs on gloo's thread while the training thread computes)."""

BACKEND_PREFIXES = ("gloo:", "nccl:")
"""Profiler events of the collectives themselves, recorded by the process group's own thread."""


def short_name(name: str) -> str | None:
    """``"FSDP::all_gather (blocks.1)"`` → ``"AG 1"``, ``"FSDP::all_gather"`` → ``"AG root"``;
    None for any other event."""
    for label, short in LABELS.items():
        rest = name[len(label) :]
        if name.startswith(label) and (rest == "" or rest.startswith(" (")):
            unit = rest[2:-1].split(".")[-1] if rest else ""
            return f"{short} {unit or 'root'}"
    return None


def read_spans(events) -> dict:
    """From a finished profile's ``events()``: ``order`` (the FSDP labels by start time),
    ``spans`` [[row, label, start ms, end ms], …] with rows "compute" and "FSDP call" (the
    training thread) and "collective" (the backend's thread), times from the step's first event,
    and ``overlapped``: how many compute ops ran while a collective was in flight (None when no
    collective event was recorded off the training thread, as with NCCL under a CPU profile)."""
    events = sorted(events, key=lambda e: e.time_range.start)
    t0 = events[0].time_range.start
    main = next(e.thread for e in events if short_name(e.name))

    def ms(e):
        return [(e.time_range.start - t0) / 1e3, (e.time_range.end - t0) / 1e3]

    order, spans = [], []
    for e in events:
        label = short_name(e.name)
        if label:
            order.append(label)
            if label.startswith(("AG", "RS")):
                spans.append(["FSDP call", label, *ms(e)])
        elif e.thread == main and e.name in COMPUTE:
            spans.append(["compute", e.name.split("::")[1], *ms(e)])
        elif e.thread != main and e.name.startswith(BACKEND_PREFIXES):
            spans.append(["collective", e.name, *ms(e)])
    flying = [(a, b) for row, _, a, b in spans if row == "collective"]
    overlapped = sum(
        any(a < end and start < b for a, b in flying)
        for row, _, start, end in spans
        if row == "compute"
    )
    if not flying:  # NCCL: its collectives run on the GPU, which a CPU profile does not see
        overlapped = None
    return {"order": order, "spans": spans, "overlapped": overlapped}


def step_timeline(cfg, ctx, mode: Mode) -> dict:
    """One warm training step of 3 blocks under ``torch.profiler`` (after one unprofiled step),
    read with :func:`read_spans`; see :data:`Mode`. Backward prefetches implicitly (FSDP2's
    default) in every mode."""
    from torch.profiler import ProfilerActivity, profile

    model = apply_fsdp(make_model(cfg, 3).to(ctx.device), mesh_for(cfg, ctx))
    for block, following in zip(model.blocks, model.blocks[1:]):
        if mode == "prefetch":
            block.set_modules_to_forward_prefetch([following])
        elif mode == "async":  # after FSDP2's own pre-forward hook: this block is gathered
            block.register_forward_pre_hook(
                lambda *_, f=following: f.unshard(async_op=True) and None
            )
    x, y = (t.to(ctx.device) for t in batch(cfg, 0, ctx.rank, ctx.world_size))
    nn.functional.mse_loss(model(x), y).backward()  # the first step also initialises FSDP2
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        nn.functional.mse_loss(model(x), y).backward()
    return read_spans(prof.events())


def timeline_figure(timelines: dict[str, dict]):
    """One panel per ``{title: step_timeline(...)}``: rows compute, FSDP call, collective, in ms
    from the step's start; all-gathers blue, reduce-scatters orange, each compute op a green
    tick. Returns a matplotlib ``Figure``."""
    from matplotlib.figure import Figure

    rows = ("compute", "FSDP call", "collective")
    fig = Figure(figsize=(9, 1.3 + 1.2 * len(timelines)), layout="constrained")
    for ax, (title, t) in zip(
        fig.subplots(len(timelines), 1, squeeze=False)[:, 0], timelines.items()
    ):
        for row, label, start, end in t["spans"]:
            if row == "compute":  # µs-long ops: a tick each, or they vanish beside the collectives
                ax.vlines(start, -0.3, 0.3, color="tab:green", linewidth=1)
                continue
            gathered = "all_gather" in label or label.startswith("AG")
            color = "tab:blue" if gathered else "tab:orange"
            ax.barh(rows.index(row), end - start, left=start, color=color, height=0.6)
            if row == "FSDP call":
                ax.text(start, 1.35, label.split()[1][0], fontsize=6)
        ax.set_yticks(range(3), rows, fontsize=8)
        seen = "not measured" if t["overlapped"] is None else t["overlapped"]
        ax.set_title(f"{title}: compute ops during a collective: {seen}", fontsize=9)
    ax.set_xlabel(
        "ms from the step's start (rank 0; blue all-gather, orange reduce-scatter, green compute)"
    )
    return fig
