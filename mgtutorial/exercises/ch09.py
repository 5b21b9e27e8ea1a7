"""Checkers of chapter 09's exercises: in notebooks/09a_cost_model.ipynb a ring all-reduce
(09a.1), what timers report for a short kernel on a simulated GPU and one that is right (09a.2, in
:mod:`mgtutorial.exercises.ch09_timing`) and a layout that fits a memory budget (09a.3, in
:mod:`mgtutorial.exercises.ch09_layout`); in
notebooks/09b_measurement.ipynb the exposed all-reduce of a DDP step with one worker and with two
(09b.1), DDP's buckets for a tiny cap (09b.2, in :mod:`mgtutorial.exercises.ch09_buckets`) and the
closed form of TP's communication over compute with its crossovers (09b.3, in
:mod:`mgtutorial.exercises.ch09_crossover`); all six are reached as ``ex.ch09.<checker>``.

Nothing here asserts on a measured duration: 09a.1 runs the learner's ring on made-up chunks;
09a.3 compares with :mod:`mgtutorial.perf.layout`, 09b.1 and 09b.3 with
:mod:`mgtutorial.perf.costmodel` and :mod:`mgtutorial.tensor_parallel.cost` (09b.1 and 09b.3 refuse
a learner's function that calls them), 09b.2 with the buckets a real DDP run reports; 09a.2 runs
the learner's timer against a simulated GPU on a fake clock.
"""

from __future__ import annotations

from mgtutorial.exercises._common import (
    attempt,
    attempt_by_hand,
    close,
    passed,
    require,
)
from mgtutorial.exercises.ch09_buckets import CAP_MB, buckets
from mgtutorial.exercises.ch09_crossover import LINKS, N_HEADS, PCIE_BW, crossover
from mgtutorial.exercises.ch09_layout import layout_choice
from mgtutorial.exercises.ch09_timing import GPU, timing
from mgtutorial.perf import costmodel

__all__ = [
    "BUCKETS",
    "CAP_MB",
    "CASES",
    "GPU",
    "LINKS",
    "N_HEADS",
    "PCIE_BW",
    "READY",
    "RING_SIZES",
    "STEP",
    "buckets",
    "crossover",
    "exposed",
    "layout_choice",
    "ring",
    "timing",
]

# --- 09a.1 ---------------------------------------------------------------------------------------

RING_SIZES = (2, 3, 4, 8)
"""World sizes on which 09a.1's ring all-reduce is run."""


def ring(fn) -> None:
    """09a.1: ``fn(chunks, send) -> chunks``, a ring all-reduce built by the learner.

    ``chunks[r][c]`` is rank r's chunk c (n ranks, n chunks each, float32 tensors of 4 elements);
    ``send(src, dst, tensor)`` delivers a copy of ``tensor`` from rank ``src`` to ``dst`` and must
    go to the right-hand neighbour ``(src + 1) % n``. Run on n = 2, 3, 4, 8 with random chunks;
    passes when every rank ends with every chunk summed over the ranks, and reports the bus
    factor the learner's own sends give (bytes each rank sent ÷ the buffer's bytes S), compared
    with :func:`mgtutorial.perf.costmodel.bus_factor`.
    """
    import torch

    ex = "09a.1 ring"
    factors = {}
    for n in RING_SIZES:
        gen = torch.Generator().manual_seed(n)
        chunks = [[torch.randn(4, generator=gen) for _ in range(n)] for _ in range(n)]
        want = [sum(chunks[r][c] for r in range(n)) for c in range(n)]
        sent = [0] * n

        def send(src, dst, tensor, n=n, sent=sent):
            require(
                dst == (src + 1) % n,
                ex,
                f"n={n}: rank {src} sent to rank {dst}; on a ring each rank sends only to its "
                f"right-hand neighbour, (src + 1) % n = {(src + 1) % n}",
            )
            sent[src] += tensor.numel() * tensor.element_size()
            return tensor.clone()

        got = attempt(ex, fn, [list(c) for c in chunks], send)
        for r in range(n):
            for c in range(n):
                require(
                    torch.allclose(got[r][c], want[c], atol=1e-5),
                    ex,
                    f"n={n}: rank {r}'s chunk {c} is not the sum over the ranks. After the "
                    "reduce-scatter each rank holds one finished chunk; in the all-gather, each "
                    "round every rank passes on the finished chunk it received last (its own "
                    "in the first round) and stores what arrives in place",
                )
        size = 4 * 4 * n  # S: n chunks of 4 float32 elements
        factors[n] = max(sent) / size
        require(
            close(factors[n], costmodel.bus_factor("all_reduce", n)),
            ex,
            f"n={n}: a rank sent {max(sent)} bytes, {factors[n]:.2f} × the buffer: each round "
            "each rank sends one chunk; how many rounds do the two halves need?",
        )
    passed(
        ex,
        "every rank holds the sum; your ring sends "
        + ", ".join(f"{f:.2f}·S at n = {n}" for n, f in factors.items())
        + " per rank: 2(n−1)/n, the all-reduce's bus factor",
    )


# --- 09b.1 ---------------------------------------------------------------------------------------

STEP = dict(bwd_s=2e-3, alpha=400e-6, beta=0.66e-9)
"""09b.1's step: backward (s), the all-reduce's α (s) and β (s/byte), of the order of the fit
at the top of notebooks/09b_measurement.ipynb (section 1)."""
BUCKETS = [1608488, 9728]
"""09b.1's two buckets (bytes): fc2 + fc1, then conv1 (the chapter's CNN, default caps)."""
READY = [0.3, 1.0]
"""Fraction of backward done when each of :data:`BUCKETS` is ready."""
CASES = {
    "one bucket": ([sum(BUCKETS)], [1.0]),
    "two buckets": (BUCKETS, READY),
    "three buckets": ([1_200_000, 800_000, 9728], [0.3, 0.6, 1.0]),
    "all hidden but the last": ([200_000, 9728], [0.1, 1.0]),
    "both workers busy": ([1_600_000, 1_600_000, 9728], [0.3, 0.4, 1.0]),
}
"""The bucket layouts (bytes, ready fractions) 09b.1's function is run on, each with 1 and 2
workers."""


def exposed_reference(bwd_s, bucket_bytes, ready, alpha, beta, workers=1) -> float:
    """Seconds of all-reduce after backward's end: bucket i is ready at ``bwd_s * ready[i]``, and
    starts then or when a worker is free, whichever is later, the buckets taken in order by the
    worker free first, each taking ``alpha + beta * bytes``. With ``workers=1`` this is
    :func:`mgtutorial.perf.costmodel.ddp_step_time`'s ``exposed`` (NCCL: one stream); 2 is a gloo
    process group's default thread count."""
    free = [0.0] * workers
    for b, r in zip(bucket_bytes, ready):
        w = free.index(min(free))
        free[w] = max(free[w], bwd_s * r) + alpha + beta * b
    return max(0.0, max(free) - bwd_s)


def _exposed_why(name, workers, guess, want) -> str:
    """What a learner's exposed time ``guess`` (``want`` is right) most likely missed."""
    sizes, ready = CASES[name]
    bwd_s, a, b = STEP["bwd_s"], STEP["alpha"], STEP["beta"]
    if close(guess, want - a * len(sizes), rel=1e-6) or close(guess, want - a, rel=1e-6):
        return "α is paid once per bucket"
    if close(guess, sum(a + b * s for s in sizes), rel=1e-6):
        return "that is all of the communication: a bucket that is ready early starts early"
    if len(sizes) > 1 and close(guess, a + b * sum(sizes), rel=1e-6):
        return "that is one bucket holding every byte: here each bucket has its own α and start"
    if workers == 2 and close(guess, exposed_reference(bwd_s, sizes, ready, a, b), rel=1e-6):
        return (
            "that is the answer for one worker: with two, a bucket waits only until one of them "
            "is free"
        )
    if workers == 1 and close(guess, exposed_reference(bwd_s, sizes, ready, a, b, 99), rel=1e-6):
        return "with one worker a bucket waits until the previous one is done, not only until ready"
    if close(guess, want * 1e3, rel=1e-6):
        return "seconds, not ms: 1 ms = 1e-3 s"
    return (
        "a bucket starts when it is ready and a worker is free; what lies after backward's end "
        "is exposed"
    )


def exposed(fn) -> None:
    """09b.1: ``fn(bwd_s, bucket_bytes, ready, alpha, beta, workers) -> float``, the seconds of
    all-reduce after backward's end, worked out by the learner (calls into ``mgtutorial.perf``
    or ``mgtutorial.exercises`` are refused); run on :data:`CASES` with 1 and 2 workers and
    compared with :func:`exposed_reference` (for one worker, ``costmodel.ddp_step_time``'s)."""
    ex = "09b.1 exposed all-reduce"
    bwd_s, a, b = STEP["bwd_s"], STEP["alpha"], STEP["beta"]
    got = {}
    for workers in (1, 2):
        for name, (sizes, ready) in CASES.items():
            args = (fn, bwd_s, list(sizes), list(ready), a, b, workers)
            guess = attempt_by_hand(ex, ("perf", "exercises"), *args)
            want = exposed_reference(bwd_s, sizes, ready, a, b, workers)
            got[name, workers] = guess
            if close(guess, want, rel=1e-6):
                continue
            direction = "too large" if isinstance(guess, (int, float)) and guess > want else "wrong"
            require(
                False,
                ex,
                f"{name} ({sizes} bytes, ready at {ready}), {workers} worker(s): "
                f"{guess!r} s is {direction}: {_exposed_why(name, workers, guess, want)}",
            )
    two = [got["two buckets", w] * 1e3 for w in (1, 2)]
    passed(
        ex,
        f"the chapter's two buckets expose {two[0]:.3f} ms with one worker and {two[1]:.3f} ms "
        "with two; one bucket exposes all of α + β·S, whatever the workers",
    )
