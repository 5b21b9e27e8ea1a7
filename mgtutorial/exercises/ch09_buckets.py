"""Checker of chapter 09's exercise 09b.2 (notebooks/09b_measurement.ipynb): the buckets DDP
all-reduces for a tiny ``bucket_cap_mb``, reached as ``ex.ch09.buckets``.

The prediction is compared with step 2 of a real 2-rank DDP run (chapter 03b's counting hook,
:func:`mgtutorial.ddp.overlap.hooks_worker`) and with
:func:`mgtutorial.perf.costmodel.bucket_layout`.
"""

from __future__ import annotations

import itertools

from mgtutorial.common import models
from mgtutorial.ddp import overlap
from mgtutorial.exercises._common import answered, passed, require, run_ranks
from mgtutorial.perf import costmodel
from mgtutorial.runtime import runlog

CAP_MB = 0.0001
"""09b.2's ``bucket_cap_mb``."""


def _ddp_buckets() -> tuple[list[int], list[int]]:
    """Bytes per bucket of steps 1 and 2 of a 2-rank DDP run of the chapter's CNN with
    ``bucket_cap_mb=CAP_MB`` (a counting communication hook, chapter 03b); DDP rebuilds its
    buckets after step 1."""
    cfg = overlap.HooksConfig(
        bucket_cap_mb=CAP_MB, max_steps=2, epochs=1, dataset="digits", evaluate=False, batch_size=8
    )
    result = run_ranks("09b.2 buckets", overlap.hooks_worker, cfg, 2, name="buckets")
    steps = [r for r in runlog.of_kind(runlog.read_run(result.run_dir), "sync") if r["rank"] == 0]
    return tuple([4 * n for n in steps[i]["bucket_sizes"]] for i in (0, -1))  # float32: 4 bytes


def _layouts(cap_bytes: int, backward: bool = True) -> list[list[int]]:
    """:func:`mgtutorial.perf.costmodel.bucket_layout` over ``reversed(parameters())`` (or,
    ``backward=False``, the forward order), first, and with the weight and bias of any layers in
    the other order."""
    layers: dict[str, list[int]] = {}
    params = list(models.ArticleCNN().named_parameters())
    for name, p in reversed(params) if backward else params:
        layers.setdefault(name.rsplit(".", 1)[0], []).append(p.numel() * p.element_size())
    return [
        costmodel.bucket_layout(
            [
                b
                for flip, sizes in zip(flips, layers.values())
                for b in (sizes[::-1] if flip else sizes)
            ],
            cap_bytes,
        )
        for flips in itertools.product((False, True), repeat=len(layers))
    ]


def buckets(cap_bytes: int, predicted=...) -> None:
    """09b.2: ``cap_bytes`` (``bucket_cap_mb=0.0001`` in bytes, as DDP rounds it) and ``predicted``
    (list of ints), the bytes of each bucket DDP all-reduces per step for ``models.ArticleCNN()``
    once it has rebuilt its buckets, in the order DDP all-reduces them (the arrival order of
    step 1, about reverse registration order). Compared with step 2 of a real 2-rank DDP run;
    the weight and bias of a layer may come in either order (the pass line says when they differ
    from the run's), the buckets may not: a list in reverse or in another order gets its own
    hint."""
    ex = "09b.2 buckets"
    require(
        cap_bytes == int(CAP_MB * 1024 * 1024),
        ex,
        f"cap_bytes = {cap_bytes!r}: bucket_cap_mb is in MiB; "
        "DDP uses int(bucket_cap_mb * 1024 * 1024) bytes",
    )
    guess = answered(predicted, ex, "predicted")
    require(
        isinstance(guess, (list, tuple)) and all(isinstance(b, int) for b in guess),
        ex,
        f"predicted = {guess!r}: a list of ints, the bytes of each bucket",
    )
    total = sum(p.numel() * p.element_size() for p in models.ArticleCNN().parameters())
    require(
        sum(guess) == total,
        ex,
        f"your buckets hold {sum(guess):,} bytes, the 6 gradients {total:,}: each "
        "gradient sits in exactly one bucket, numel() × 4 bytes (float32)",
    )
    (first,), later = _ddp_buckets()
    layouts = _layouts(cap_bytes)
    require(
        later in layouts,
        ex,
        f"DDP made buckets {later} from step 2 on, which no order of each layer's weight "
        "and bias explains: DDP's rule has changed in this torch version",
    )
    guess = list(guess)
    if guess not in layouts:
        near = {len(b): b for b in layouts}.get(len(guess))
        require(
            len(guess) != 1,
            ex,
            "one bucket is DDP's first step, before it knows the order gradients arrive "
            "in; predict the buckets it rebuilds for step 2 and after",
        )
        require(
            guess[::-1] not in layouts,
            ex,
            "these are the right buckets in reverse order: DDP fills buckets in the order "
            "backward produced the gradients (recorded in step 1; reverse registration order, "
            "reversed(parameters()), approximates it) and all-reduces each as it fills: the "
            "first holds fc2's",
        )
        require(
            guess not in _layouts(cap_bytes, backward=False),
            ex,
            "these are the buckets in forward order, "
            "conv1 first: backward produces the last layer's gradients first (fc2)",
        )
        require(
            not any(sorted(guess) == sorted(b) for b in layouts),
            ex,
            "the right buckets in the wrong order: list them in the order DDP all-reduces "
            "them, the order they fill, which is the order backward produces the gradients "
            "(about reverse registration order: fc2's first)",
        )
        require(
            near is not None,
            ex,
            f"DDP all-reduced {len(later)} buckets per step from step 2 on, not {len(guess)}: "
            "each gradient joins the current bucket, which closes as soon as it holds at least "
            f"{cap_bytes} bytes (the first bucket too: with bucket_cap_mb set there is no 1 MiB "
            "first bucket)",
        )
        require(
            False,
            ex,
            f"the right count, {len(guess)}, but not DDP's bytes: go from fc2 back to conv1, "
            f"closing a bucket once it holds at least {cap_bytes} bytes",
        )
    layout = layouts[0]
    note = (
        "the same"
        if layout == later
        else f"{layout}: the same buckets, in another order (DDP's is the real arrival order)"
    )
    match = (
        "as predicted"
        if guess == later
        else f"yours, {guess}, has a layer's weight and bias the other way round: either "
        "arrives first (the exercise accepts both), the rest in DDP's order"
    )
    passed(
        ex,
        f"from step 2 on DDP all-reduces {len(later)} buckets, {later} bytes, {match} (step "
        f"1: one of {first:,}); bucket_layout over reversed(parameters()) gives {note}",
    )
