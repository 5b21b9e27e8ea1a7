"""Checker of exercise 09a.4 (notebooks/09a_cost_model.ipynb): choose a (dp, tp, pp, recompute)
layout of a transformer that fits a memory budget per GPU, and the estimate that shows it fits.

The reference is :func:`mgtutorial.perf.layout.memory_per_gpu` (DDP across replicas, 1F1B, the
dtype table's 16 bytes per parameter, Korthikanti et al.'s activations). The learner's estimate is
compared with it on several layouts; the classic wrong estimates (no optimizer state, no
gradients, no activations, states divided by dp, activations divided by pp) are named in the
hint, and no hint prints the expected value.
"""

from __future__ import annotations

import itertools

from mgtutorial.exercises._common import answered, attempt, close, passed, require
from mgtutorial.perf import layout, scaling

MODEL = scaling.Transformer(layers=48, hidden=6144, seq=4096)
"""09a.4's model: Ψ = 12·L·h² ≈ 21.7 B parameters, sequences of 4096 tokens."""
HEADS, GPUS, BUDGET, MAX_TP = 48, 64, 80e9, 8
"""Its heads, the GPUs, the memory per GPU (an H100's 80 GB) and the largest TP (one node)."""
COST = {"none": 0, "selective": 1, "full": 2}
"""Recomputation's extra compute, in order: none < selective (attention's softmax) < full."""


def reference(dp: int, tp: int, pp: int, recompute: str) -> float:
    """Bytes per GPU of a layout of :data:`MODEL` (micro-batch 1), by the course's model."""
    return layout.memory_per_gpu(MODEL, dp, tp, pp, recompute, heads=HEADS)["total"]


def valid_layouts():
    """Every (dp, tp, pp, recompute) of :data:`GPUS` GPUs that can run (tp ≤ one node)."""
    for tp, pp in itertools.product((1, 2, 4, 8), (1, 2, 3, 4, 6, 8, 12, 16)):
        if tp <= MAX_TP and GPUS % (tp * pp) == 0 and HEADS % tp == 0 and MODEL.layers % pp == 0:
            for recompute in COST:
                yield GPUS // (tp * pp), tp, pp, recompute


def best_layouts() -> list[tuple]:
    """The fitting layouts with the fewest GPUs per replica (tp·pp), then the least
    recomputation: what 09a.4 asks for."""
    fits = [v for v in valid_layouts() if reference(*v) <= BUDGET]
    key = lambda v: (v[1] * v[2], COST[v[3]])  # noqa: E731
    best = min(map(key, fits))
    return [v for v in fits if key(v) == best]


def _mistake(estimate, probes) -> str | None:
    """The name of the classic mistake that reproduces ``estimate`` on every probe, if any."""
    parts = {v: layout.memory_per_gpu(MODEL, *v, heads=HEADS) for v in probes}
    variants = {
        "leaves out Adam(W)'s state (exp_avg, exp_avg_sq: 8 bytes per parameter, the largest of "
        "the three)": lambda p, v: p["total"] - p["optimizer"],
        "leaves out the gradients (fp32, as the dtype table says)": lambda p, v: (
            p["total"] - p["grads"]
        ),
        "counts a second gradient: the exercise's DDP runs with gradient_as_bucket_view=True, "
        "its buckets are the gradients": lambda p, v: p["total"] + p["grads"],
        "leaves out the activations: backward needs what forward kept, L layers' worth on "
        "1F1B's first stage": lambda p, v: p["total"] - p["activations"],
        "divides parameters, gradients and optimizer state by dp: DDP keeps a full replica per "
        "data-parallel rank (only FSDP/ZeRO shards it)": lambda p, v: (
            (p["total"] - p["activations"]) / v[0] + p["activations"]
        ),
        "divides the activations by pp: under 1F1B the first stage keeps pp micro-batches in "
        "flight, L/pp layers each": lambda p, v: p["total"] - p["activations"] * (1 - 1 / v[2]),
    }
    for name, wrong in variants.items():
        if all(close(estimate[v], wrong(parts[v], v), rel=0.02) for v in probes):
            return name
    return None


def layout_choice(per_gpu_bytes=..., chosen=...) -> None:
    """09a.4: ``per_gpu_bytes(dp, tp, pp, recompute)`` (bytes per GPU of a layout of
    :data:`MODEL`) and ``chosen``, a ``(dp, tp, pp, recompute)`` tuple: a layout that fits
    :data:`BUDGET` with the fewest GPUs per replica, then the least recomputation."""
    ex = "09a.4 layout"
    fn, chosen = answered(per_gpu_bytes, ex, "per_gpu_bytes"), answered(chosen, ex, "chosen")
    probes = [(64, 1, 1, "none"), (8, 8, 1, "selective"), (8, 4, 2, "full"), (4, 4, 4, "none")]
    estimate = {v: attempt(ex, fn, *v) for v in probes}
    for v in probes:
        if not close(estimate[v], reference(*v), rel=0.02):
            mistake = _mistake(estimate, probes)
            require(mistake is None, ex, f"`per_gpu_bytes` {mistake}")
            side = "too small" if estimate[v] < reference(*v) else "too large"
            require(
                False,
                ex,
                f"`per_gpu_bytes{v}` is {side} (by more than 2 %): check each term, the bytes "
                "per parameter of the dtype table, and which degrees divide which term",
            )
    require(
        isinstance(chosen, tuple) and len(chosen) == 4,
        ex,
        f"chosen = {chosen!r}: a tuple (dp, tp, pp, recompute)",
    )
    dp, tp, pp, recompute = chosen
    require(
        chosen in set(valid_layouts()),
        ex,
        f"{chosen} cannot run: dp·tp·pp must be {GPUS}, tp ≤ {MAX_TP} must divide the {HEADS} "
        f"heads, pp the {MODEL.layers} layers, recompute one of {tuple(COST)}",
    )
    need = reference(*chosen)
    require(need <= BUDGET, ex, f"{chosen} needs more than {BUDGET / 1e9:.0f} GB per GPU")
    best = best_layouts()
    require(
        chosen in best,
        ex,
        f"{chosen} fits, but a layout with fewer GPUs per replica (tp·pp), or as few with less "
        "recomputation, fits too: try them with your `per_gpu_bytes`",
    )
    passed(
        ex,
        f"{chosen} needs {need / 1e9:.1f} GB per GPU, within {BUDGET / 1e9:.0f} GB; the layouts "
        f"as good: {best}",
    )
