"""Checker of exercise 09a.3 (notebooks/09a_cost_model.ipynb): choose a (dp, tp, pp, recompute)
layout of a transformer that fits a memory budget per GPU, for an eager attention (which keeps its
s×s scores) and for ``F.scaled_dot_product_attention`` (which does not), and the estimate that
shows it fits.

The reference is :func:`mgtutorial.perf.layout.memory_per_gpu` (DDP across replicas, 1F1B, the
dtype table's 16 bytes per parameter, Korthikanti et al.'s activations, the attention kind of
chapter 07a). The learner's estimate is compared with it on several layouts; the classic wrong
estimates (no optimizer state, no gradients, no activations, states divided by dp, activations
divided by pp, the scores kept under SDPA) are named in the hint, and no hint prints the expected
value.
"""

from __future__ import annotations

import itertools

from mgtutorial.exercises._common import answered, attempt_by_hand, close, passed, require
from mgtutorial.perf import layout, scaling

MODEL = scaling.Transformer(layers=48, hidden=6144, seq=4096)
"""09a.3's model: Ψ = 12·L·h² ≈ 21.7 B parameters, sequences of 4096 tokens."""
HEADS, GPUS, BUDGET, MAX_TP = 48, 64, 80e9, 8
"""Its heads, the GPUs, the memory per GPU (an H100's 80 GB) and the largest TP (one node)."""
COST = {"none": 0, "selective": 1, "full": 2}
"""Recomputation's extra compute, in order: none < selective (attention's softmax) < full."""


def reference(dp: int, tp: int, pp: int, recompute: str, attention: str = "eager") -> float:
    """Bytes per GPU of a layout of :data:`MODEL` (micro-batch 1), by the course's model."""
    return layout.memory_per_gpu(MODEL, dp, tp, pp, recompute, heads=HEADS, attention=attention)[
        "total"
    ]


def valid_layouts():
    """Every (dp, tp, pp, recompute) of :data:`GPUS` GPUs that can run (tp ≤ one node)."""
    for tp, pp in itertools.product((1, 2, 4, 8), (1, 2, 3, 4, 6, 8, 12, 16)):
        if tp <= MAX_TP and GPUS % (tp * pp) == 0 and HEADS % tp == 0 and MODEL.layers % pp == 0:
            for recompute in COST:
                yield GPUS // (tp * pp), tp, pp, recompute


def best_layouts(attention: str = "eager") -> list[tuple]:
    """The fitting layouts with the fewest GPUs per replica (tp·pp), then the least
    recomputation, for that attention: what 09a.3 asks for."""
    fits = [v for v in valid_layouts() if reference(*v, attention) <= BUDGET]
    key = lambda v: (v[1] * v[2], COST[v[3]])  # noqa: E731
    best = min(map(key, fits))
    return [v for v in fits if key(v) == best]


def _mistake(estimate, probes) -> str | None:
    """The name of the classic mistake that reproduces ``estimate`` on every probe, if any."""
    parts = {v: layout.memory_per_gpu(MODEL, *v[:4], heads=HEADS, attention=v[4]) for v in probes}
    variants = {
        "keeps the s×s scores with attention='sdpa': F.scaled_dot_product_attention's fused "
        "kernels keep a logsumexp per row instead (chapter 07a, section 5), so its 5·heads·s/(h·t) "
        "term goes": lambda p, v: reference(*v[:4], "eager"),
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


PROBES = [
    (64, 1, 1, "none", "eager"),
    (8, 8, 1, "selective", "eager"),
    (4, 4, 4, "none", "eager"),
    (8, 4, 2, "full", "sdpa"),
    (4, 4, 4, "none", "sdpa"),
]
"""The layouts (dp, tp, pp, recompute, attention) at which ``per_gpu_bytes`` is compared with
:func:`reference`; calls into ``mgtutorial.perf`` from it are refused (the estimate is the
exercise)."""


def layout_choice(per_gpu_bytes=..., chosen=...) -> None:
    """09a.3: ``per_gpu_bytes(dp, tp, pp, recompute, attention)`` (bytes per GPU of a layout of
    :data:`MODEL`, ``attention`` "eager" or "sdpa") and ``chosen`` = {"eager", "sdpa": a
    ``(dp, tp, pp, recompute)`` tuple}: per attention, a layout that fits :data:`BUDGET` with the
    fewest GPUs per replica, then the least recomputation."""
    ex = "09a.3 layout"
    fn, chosen = answered(per_gpu_bytes, ex, "per_gpu_bytes"), answered(chosen, ex, "chosen")
    probes = PROBES
    estimate = {v: attempt_by_hand(ex, ("perf",), fn, *v) for v in probes}
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
        isinstance(chosen, dict) and set(chosen) == set(layout.ATTENTION),
        ex,
        f"chosen = {chosen!r}: a dict {{'eager': (dp, tp, pp, recompute), 'sdpa': (…)}}",
    )
    for attention in layout.ATTENTION:
        _check_choice(ex, chosen, attention)
    eager, sdpa = (chosen[a] for a in layout.ATTENTION)
    need = {a: reference(*chosen[a], a) / 1e9 for a in layout.ATTENTION}
    passed(
        ex,
        f"eager attention: {eager} needs {need['eager']:.1f} GB per GPU; SDPA: {sdpa} needs "
        f"{need['sdpa']:.1f} GB, within {BUDGET / 1e9:.0f} GB; the layouts as good, eager: "
        f"{best_layouts('eager')}; SDPA: {best_layouts('sdpa')}",
    )


def _check_choice(ex: str, chosen: dict, attention: str) -> None:
    """``chosen[attention]`` runs, fits and is among :func:`best_layouts` for that attention."""
    pick, name = chosen[attention], f'chosen["{attention}"]'
    require(
        isinstance(pick, tuple) and len(pick) == 4,
        ex,
        f"{name} = {pick!r}: a tuple (dp, tp, pp, recompute)",
    )
    require(
        pick in set(valid_layouts()),
        ex,
        f"{name} = {pick} cannot run: dp·tp·pp must be {GPUS}, tp ≤ {MAX_TP} must divide the "
        f"{HEADS} heads, pp the {MODEL.layers} layers, recompute one of {tuple(COST)}",
    )
    require(
        reference(*pick, attention) <= BUDGET,
        ex,
        f"{name} = {pick} needs more than {BUDGET / 1e9:.0f} GB per GPU",
    )
    if pick in best_layouts(attention):
        return
    same_replica = [v for v in best_layouts(attention) if v[1:3] == pick[1:3]]
    sdpa_hint = (
        ": with SDPA no s×s scores are kept, so recomputing attention saves almost nothing"
        if attention == "sdpa" and same_replica and COST[pick[3]] > COST[same_replica[0][3]]
        else ""
    )
    require(
        False,
        ex,
        f"{name} = {pick} fits, but a layout with fewer GPUs per replica (tp·pp), or as few with "
        f"less recomputation, fits too{sdpa_hint}: try them with your `per_gpu_bytes`",
    )
