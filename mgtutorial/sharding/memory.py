"""Bytes per rank of DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP): the formula, the measurement, the chart.

Taught in notebooks/07a_zero_memory.ipynb, sections 1–4. Follows the ZeRO paper's accounting
(Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", §3) and
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html (how FSDP2 shards dim 0).

For Ψ parameters trained with Adam(W), one rank of plain DDP holds

=============  ======  ====================================================================
precision      bytes   params + grads + optimizer state
=============  ======  ====================================================================
``fp32``       16Ψ     4Ψ + 4Ψ + 8Ψ (exp_avg, exp_avg_sq)
``mixed``      16Ψ     2Ψ (bf16) + 2Ψ (bf16) + 12Ψ (fp32 master copy, exp_avg, exp_avg_sq)
=============  ======  ====================================================================

and sharding over N ranks divides the optimizer state (ZeRO-1), also the gradients (ZeRO-2), also
the parameters (ZeRO-3 / FSDP) by N. ``mixed`` is the ZeRO paper's mixed precision (half-precision
parameters and gradients in the model, the fp32 master copy in the optimizer). FSDP2 with
``MixedPrecisionPolicy(param_dtype=bfloat16)`` keeps fp32 parameter and gradient shards (bf16 only
in the gathered copies), so between steps it holds the ``fp32`` row (measured in
notebooks/07b_fsdp2.ipynb, section 4).

The formula is exact, with the padding the implementations add:

* ZeRO-1/2 as written in :mod:`mgtutorial.sharding.zero` flatten all parameters into one buffer
  padded to N·S elements, S = ⌈Ψ/N⌉; each rank owns one slice of S elements;
* FSDP2 shards every parameter along dim 0 in chunks of c = ⌈d₀/N⌉ rows (``torch.chunk``): the
  parameter and gradient storages are padded to c rows on every rank, the optimizer state (created
  with ``zeros_like`` from the unpadded local shard) holds only the rows rank r owns.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Literal, get_args

import torch

from mgtutorial.perf.costmodel import FP32, ZERO_MIXED

Scheme = Literal["ddp", "zero1", "zero2", "zero3"]
"""What each rank keeps in full: everything (DDP), all but the optimizer state (ZeRO-1), the
parameters only (ZeRO-2), nothing (ZeRO-3 / FSDP)."""
SCHEMES = get_args(Scheme)
Precision = Literal["fp32", "mixed"]
BYTES_PER_PARAM: dict[Precision, tuple[int, int, int]] = {
    "fp32": FP32.per_param,
    "mixed": ZERO_MIXED.per_param,
}
"""Bytes per parameter of (params, grads, optimizer state) for Adam(W), from the course's one
dtype table (:class:`mgtutorial.perf.costmodel.Dtypes`): (4, 4, 8) in fp32, (2, 2, 12) in the
ZeRO paper's mixed precision."""
PARTS = ("params", "grads", "optimizer")
Unit = Literal["B", "GB"]
"""Bytes, or GB (10⁹ bytes), in tables and figures."""
DIVISOR: dict[Unit, float] = {"B": 1, "GB": 1e9}


def rows_owned(d0: int, world_size: int, rank: int) -> int:
    """Rows of a dim-0 size ``d0`` that rank ``rank`` owns under ``torch.chunk`` (what FSDP2
    does): ⌈d0/N⌉, fewer on the last ranks, possibly 0."""
    c = math.ceil(d0 / world_size)
    return max(0, min(c, d0 - rank * c))


def memory_per_rank(
    shapes: Iterable[Sequence[int]],
    world_size: int,
    scheme: Scheme,
    precision: Precision = "fp32",
    rank: int = 0,
) -> dict[str, int]:
    """Bytes that rank ``rank`` holds for parameters, gradients and Adam(W) state.

    Args:
        shapes: the parameters' shapes, e.g. ``[p.shape for p in model.parameters()]``;
            ``[(Ψ,)]`` for a model described only by its size.
        world_size: N ≥ 1.
        scheme: one of :data:`Scheme`.
        precision: "fp32" | "mixed" (the rows of :data:`BYTES_PER_PARAM`).
        rank: which rank (only FSDP2's optimizer state differs between ranks).

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` in bytes (ints). AdamW's per-tensor ``step``
        counters (4 bytes each) are not counted.

    Raises:
        ValueError: unknown scheme or precision, world_size < 1, rank outside 0…N−1.
    """
    if scheme not in SCHEMES or precision not in BYTES_PER_PARAM:
        raise ValueError(
            f"scheme={scheme!r} / precision={precision!r}: use one of {SCHEMES} / "
            f"{tuple(BYTES_PER_PARAM)}."
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"world_size={world_size}, rank={rank}: need world_size ≥ 1 and 0 ≤ rank < world_size."
        )
    shapes = [tuple(s) for s in shapes]
    p, g, o = BYTES_PER_PARAM[precision]
    psi = sum(math.prod(s) for s in shapes)
    n, s = world_size, math.ceil(psi / world_size)  # flat slice (ZeRO-1/2 by hand)
    rest = [math.prod(sh[1:]) for sh in shapes]
    padded = sum(math.ceil(sh[0] / n) * k for sh, k in zip(shapes, rest))  # FSDP2 storage
    owned = sum(rows_owned(sh[0], n, rank) * k for sh, k in zip(shapes, rest))
    elements = {
        "ddp": (psi, psi, psi),
        "zero1": (n * s, n * s, s),
        "zero2": (n * s, s, s),
        "zero3": (padded, padded, owned),
    }[scheme]
    out = dict(zip(PARTS, (p * elements[0], g * elements[1], o * elements[2])))
    out["total"] = sum(out.values())
    return out


def memory_table(shapes, ranks=(1, 2, 4), precision: Precision = "fp32") -> list[dict]:
    """One row per (scheme, N): ``{"scheme", "N", "params", "grads", "optimizer", "total"}``
    (bytes of rank 0)."""
    return [
        {"scheme": sch, "N": n, **memory_per_rank(shapes, n, sch, precision)}
        for sch in SCHEMES
        for n in ranks
    ]


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors count their local shard).

    Views of one buffer (a flat parameter, a DDP bucket, an FSDP2 reduce-scatter output) are counted
    once, with the padding the buffer has: that is what the rank actually holds.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 points at /dev/null inside the block (C++ prints included)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def allocator_bytes(fn):
    """Run ``fn()`` under ``torch.profiler`` with ``profile_memory=True`` and read the allocator's
    memory events (allocations +, frees −, in time order): returns ``(fn's result, {"net": bytes
    still allocated when it returns, "peak": the highest running total})``, both relative to the
    start. Unlike :func:`held_bytes` this is what the allocator holds (padding, temporaries,
    buffers the library keeps), on CPU as on GPU. Follows
    https://pytorch.org/docs/stable/profiler.html (``profile_memory``).
    """
    import json
    import tempfile
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _stderr_silenced():  # the profiler's start and stop lines, printed by its C++ side
        prof.__enter__()
    try:
        result = fn()
    finally:
        with _stderr_silenced():
            prof.__exit__(None, None, None)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    running = peak = 0
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        running += e["args"]["Bytes"]
        peak = max(peak, running)
    return result, {"net": running, "peak": peak}


def measure(
    params: Iterable[torch.Tensor], optimizers: Iterable[torch.optim.Optimizer]
) -> dict[str, int]:
    """Bytes this rank holds now: parameters, their ``.grad``, and the optimizers' Adam(W) state.

    ``params`` are the tensors the model computes with (for ZeRO by hand: the full parameters);
    the optimizer state counted is ``exp_avg`` and ``exp_avg_sq`` (not the ``step`` scalars), and a
    gradient held by an optimizer's own parameters (the ZeRO slice) counts as a gradient.
    """
    params = list(params)
    opt_params = [q for opt in optimizers for grp in opt.param_groups for q in grp["params"]]
    own = {id(q) for q in params}
    state = [
        st[k]
        for opt in optimizers
        for st in opt.state.values()
        for k in ("exp_avg", "exp_avg_sq")
        if k in st
    ]
    grads = [q.grad for q in params] + [q.grad for q in opt_params if id(q) not in own]
    out = {"params": held_bytes(params), "grads": held_bytes(grads), "optimizer": held_bytes(state)}
    out["total"] = sum(out.values())
    return out


def format_table(rows: list[dict], unit: Unit = "B") -> str:
    """Rows of :func:`memory_table` (or measured rows of the same keys) as a fixed-width text
    table, in bytes (``unit="B"``) or GB (``"GB"``, 10⁹ bytes)."""
    div = DIVISOR[unit]
    head = f"{'scheme':<7}{'N':>3}" + "".join(f"{k:>12}" for k in (*PARTS, "total"))
    lines = [head] + [
        f"{r['scheme']:<7}{r['N']:>3}"
        + "".join(f"{r[k] / div:>12,.{0 if unit == 'B' else 2}f}" for k in (*PARTS, "total"))
        for r in rows
    ]
    return "\n".join(lines)


def memory_figure(rows: list[dict], unit: Unit = "B", title: str = ""):
    """Stacked bars (params, grads, optimizer) per (scheme, N), drawn from rows of
    :func:`memory_table`; returns a matplotlib ``Figure``."""
    from matplotlib.figure import Figure

    div = DIVISOR[unit]
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    ax = fig.subplots()
    labels = [f"{r['scheme']}\nN={r['N']}" for r in rows]
    bottom = [0.0] * len(rows)
    for part, color in zip(PARTS, ("tab:blue", "tab:orange", "tab:green")):
        vals = [r[part] / div for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel(f"{unit} per rank")
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    return fig


def calculator(params_billions: float = 7.0, ranks: int = 8, precision: Precision = "mixed"):
    """Sliders (parameters, ranks, schemes, precision) redrawing the per-rank bars from
    :func:`memory_per_rank`.

    Shows the sliders, then the figure as an ordinary image output (so a saved notebook shows the
    first one without a kernel), replaced in place whenever a slider moves. Returns the display
    handle (None outside IPython).
    """
    import ipywidgets as widgets
    from IPython.display import Image, display

    from mgtutorial.runtime.live import figure_png

    psi = widgets.FloatLogSlider(
        value=params_billions, base=10, min=-1, max=3, description="params (B)"
    )
    n = widgets.IntSlider(value=ranks, min=1, max=64, description="ranks N")
    prec = widgets.ToggleButtons(
        options=tuple(BYTES_PER_PARAM), value=precision, description="precision"
    )
    schemes = widgets.SelectMultiple(options=SCHEMES, value=SCHEMES, description="schemes")

    def image():
        shapes = [(int(psi.value * 1e9),)]
        rows = [
            {"scheme": s, "N": n.value, **memory_per_rank(shapes, n.value, s, prec.value)}
            for s in schemes.value
        ]
        label = {"fp32": "fp32", "mixed": "mixed precision (ZeRO paper: 2 + 2 + 12)"}[prec.value]
        return Image(
            figure_png(memory_figure(rows, "GB", f"{psi.value:.1f} B parameters, Adam(W), {label}"))
        )

    display(widgets.VBox([widgets.HBox([psi, n]), widgets.HBox([prec, schemes])]))
    handle = display(image(), display_id=True)
    for w in (psi, n, prec, schemes):
        w.observe(lambda _: handle.update(image()), names="value")
    return handle
