"""Checkers of chapter 09's exercises (notebooks/09_performance.ipynb): bus bandwidth, the exposed
all-reduce of a DDP step, DDP's buckets for a tiny cap, and a timing function that is right on a GPU.

Nothing here asserts on a measured duration: 09.1–09.3 compare with :mod:`mgtutorial.perf.costmodel`
and with the buckets a real DDP run reports; 09.4 runs the learner's timing function against a
simulated device with a fake clock, whose every call is recorded.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics

from mgtutorial.common import models
from mgtutorial.ddp import overlap
from mgtutorial.exercises._common import answered, attempt, close, passed, require, run_ranks
from mgtutorial.perf import costmodel as cm
from mgtutorial.runtime import runlog

# --- 09.1 ---------------------------------------------------------------------------------------

WHY = {
    "all_reduce": "a ring all-reduce (a reduce-scatter, then an all-gather) sends 2(n − 1)/n of the buffer from each rank",
    "all_gather": "each rank receives the n − 1 chunks it lacks: (n − 1)/n of the output",
    "reduce_scatter": "each rank sends the n − 1 chunks it does not keep: (n − 1)/n of the input",
    "broadcast": "a pipelined broadcast passes the whole buffer along every link once: factor 1",
}


def busbw(fn) -> None:
    """09.1: ``fn(algbw, op, n) -> float``, the bus bandwidth (B/s) of ``op`` (one of
    :data:`mgtutorial.perf.costmodel.COLLECTIVES`) on ``n`` ranks; compared with :func:`costmodel.busbw`
    for n = 4, 8, 2, 3, 1 and every collective."""
    ex = "09.1 busbw"
    algbw = 1e9
    for n in (4, 8, 2, 3, 1):
        for op in cm.COLLECTIVES:
            got, want = attempt(ex, fn, algbw, op, n), cm.busbw(op, algbw, 1.0, n)
            require(
                close(got, want, rel=1e-9),
                ex,
                f"busbw(1e9, {op!r}, n={n}) returned {got!r}, expected "
                f"{want:.4g} (factor {cm.bus_factor(op, n):.4g}): {WHY[op]}",
            )
    passed(
        ex,
        "busbw == algbw × 2(n−1)/n, (n−1)/n, (n−1)/n, 1 for all-reduce, all-gather, reduce-scatter, broadcast",
    )


# --- 09.2 ---------------------------------------------------------------------------------------

STEP = dict(fwd_s=2e-3, bwd_s=5e-3, opt_s=1e-3, alpha=400e-6, beta=0.66e-9)
"""The step of 09.2: forward, backward, optimizer (s), the all-reduce's α (s) and β (s/byte)."""
BUCKETS = [1608488, 9728]
"""09.2's two buckets (bytes): fc2 + fc1, then conv1 (the chapter's CNN, default caps)."""
READY = [0.3, 1.0]
"""Fraction of backward done when each of :data:`BUCKETS` is ready."""


def exposed(answers: dict) -> None:
    """09.2: ``answers`` = {"one bucket", "two buckets": exposed all-reduce time (s)} for the step
    of :data:`STEP` with all gradients (``sum(BUCKETS)`` bytes) in one bucket, and with
    :data:`BUCKETS` ready at :data:`READY`; compared with :func:`costmodel.ddp_step_time`."""
    ex = "09.2 exposed all-reduce"
    a, b = STEP["alpha"], STEP["beta"]
    cases = {"one bucket": ([sum(BUCKETS)], [1.0]), "two buckets": (BUCKETS, READY)}
    for name, (buckets, ready) in cases.items():
        guess = answered(answers.get(name), ex, f'answers["{name}"]')
        want = cm.ddp_step_time(
            STEP["fwd_s"], STEP["bwd_s"], STEP["opt_s"], buckets, a, b, ready=ready
        )["exposed"]
        if close(guess, want, rel=1e-6):
            continue
        comm = sum(a + b * s for s in buckets)
        why = (
            "you left out α, paid once per bucket"
            if close(guess, want - a, rel=1e-6)
            else "that is all of the communication: bucket 0 is ready at 30 % of backward and hides behind the rest"
            if close(guess, comm, rel=1e-6)
            else "seconds, not ms: 1 ms = 1e-3 s"
            if close(guess, want * 1e3, rel=1e-6)
            else "a bucket starts when it is ready and the previous one is done; what lies after backward's end is exposed"
        )
        require(False, ex, f'answers["{name}"] = {guess!r} s, the model gives {want:.6g} s: {why}')
    passed(ex, "one bucket exposes all of α + β·S; two buckets expose only the last one's α + β·S")


# --- 09.3 ---------------------------------------------------------------------------------------

CAP_MB = 0.0001
"""09.3's ``bucket_cap_mb``."""


def _ddp_buckets() -> tuple[list[int], list[int]]:
    """Bytes per bucket of steps 1 and 2 of a 2-rank DDP run of the chapter's CNN with
    ``bucket_cap_mb=CAP_MB`` (a counting communication hook, chapter 03b); DDP rebuilds its
    buckets after step 1."""
    cfg = overlap.HooksConfig(
        bucket_cap_mb=CAP_MB, max_steps=2, epochs=1, dataset="digits", evaluate=False, batch_size=8
    )
    result = run_ranks("09.3 buckets", overlap.hooks_worker, cfg, 2, name="buckets")
    steps = [r for r in runlog.of_kind(runlog.read_run(result.run_dir), "sync") if r["rank"] == 0]
    return tuple(
        [4 * elements for elements in steps[i]["bucket_sizes"]] for i in (0, -1)
    )  # float32


def _layouts(cap_bytes: int, backward: bool = True) -> list[list[int]]:
    """:func:`costmodel.bucket_layout` over ``reversed(parameters())`` (or, ``backward=False``, the
    forward order), first, and with the weight and bias of any layers in the other order."""
    layers: dict[str, list[int]] = {}
    params = list(models.ArticleCNN().named_parameters())
    for name, p in reversed(params) if backward else params:
        layers.setdefault(name.rsplit(".", 1)[0], []).append(p.numel() * p.element_size())
    return [
        cm.bucket_layout(
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
    """09.3: ``cap_bytes`` (``bucket_cap_mb=0.0001`` in bytes, as DDP rounds it) and ``predicted``
    (list of ints), the bytes of each bucket DDP all-reduces per step for ``models.ArticleCNN()``
    once it has rebuilt its buckets, in order. Compared with step 2 of a real 2-rank DDP run; the
    weight and bias of a layer may come in either order."""
    ex = "09.3 buckets"
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
    if list(guess) not in layouts:
        near = {len(b): b for b in layouts}.get(len(guess))
        require(
            len(guess) != 1,
            ex,
            "one bucket is DDP's first step, before it knows the order gradients arrive "
            "in; predict the buckets it rebuilds for step 2 and after",
        )
        require(
            list(guess) not in _layouts(cap_bytes, backward=False),
            ex,
            "these are the buckets in forward order, "
            "conv1 first: backward produces the last layer's gradients first (fc2)",
        )
        require(
            near is not None,
            ex,
            f"DDP all-reduced {len(later)} buckets per step from step 2 on, not "
            f"{len(guess)}: a bucket closes as soon as it holds at least {cap_bytes} bytes; a smaller gradient "
            "joins the next one",
        )
        require(
            False,
            ex,
            f"the right count, {len(guess)}, but not DDP's bytes: go from fc2 back to conv1, closing "
            f"a bucket once it holds at least {cap_bytes} bytes",
        )
    layout = layouts[0]
    note = (
        "the same"
        if layout == later
        else f"{layout}: the same, in another order (DDP's is the real arrival order)"
    )
    passed(
        ex,
        f"from step 2 on DDP all-reduces {len(later)} buckets, {later} bytes, as predicted (step 1: one of "
        f"{first:,}); bucket_layout over reversed(parameters()) gives {note}",
    )


# --- 09.4 ---------------------------------------------------------------------------------------


class FakeDevice:
    """A GPU seen from the host, on a fake clock, with a peer rank that is late.

    ``fn()`` *queues* a collective and returns after ``ENQUEUE_S``; the work ends ``durations[i]``
    after it can start, and it can start only once the peer has arrived: the peer arrives
    ``late_s`` after each call unless a ``barrier()`` (which waits for it) came since the last call.
    The barrier waits for the peer only, as gloo's does (it does not touch CUDA streams); NCCL's,
    a one-element all-reduce, also synchronizes the host with the current stream, but no other, so
    a timing function must not rely on it. ``synchronize()`` waits for the queue; ``clock()`` reads
    the fake time. ``events`` records
    every call in order: "fn", "sync", "barrier", "clock".
    """

    ENQUEUE_S = 1e-6

    def __init__(self, durations: list[float], late_s: float):
        self.durations, self.late_s = durations, late_s
        self.now, self.queue_end, self.met, self.events = 0.0, 0.0, False, []

    def fn(self):
        d = self.durations[min(self.events.count("fn"), len(self.durations) - 1)]
        self.events.append("fn")
        start = max(self.now, self.queue_end) + (0.0 if self.met else self.late_s)
        self.queue_end, self.met = start + d, False
        self.now += self.ENQUEUE_S

    def synchronize(self):
        self.events.append("sync")
        self.now = max(self.now, self.queue_end)

    def barrier(self):
        self.events.append("barrier")
        self.now, self.met = self.now + self.late_s, True

    def clock(self) -> float:
        self.events.append("clock")
        return self.now


def _timed_spans(events: list[str], warmup: int) -> list[list[str]]:
    """The events from the warm-up's end to each timed call, and after the last one."""
    calls = [i for i, e in enumerate(events) if e == "fn"]
    bounds = calls[warmup - 1 :] if warmup else [-1] + calls
    return [events[a + 1 : b] for a, b in zip(bounds, bounds[1:] + [len(events)])]


def timing(fn) -> None:
    """09.4: ``fn(op, *, warmup, repeats, clock, barrier, synchronize) -> float``, the median seconds
    per call of ``op()``. Run on a :class:`FakeDevice`: 2 slow warm-up calls, 5 timed ones (one of
    them slow), a peer 3 s late; the calls it makes and their order are checked, then the value."""
    ex = "09.4 timing"
    warmup, timed, late = 2, [1.0, 1.2, 5.0, 0.9, 1.1], 3.0
    dev = FakeDevice([10.0] * warmup + timed, late)
    got = attempt(
        ex,
        fn,
        dev.fn,
        warmup=warmup,
        repeats=len(timed),
        clock=dev.clock,
        barrier=dev.barrier,
        synchronize=dev.synchronize,
    )
    calls = dev.events.count("fn")
    require(
        not isinstance(got, (int, float)) or got > 10 * FakeDevice.ENQUEUE_S,
        ex,
        f"returned {got!r} s per "
        f"call: the time op() takes to queue its work ({FakeDevice.ENQUEUE_S:g} s here), not to run it (about "
        "1 s): on a GPU, kernels and NCCL collectives return before they finish; synchronize() before you "
        "stop the clock",
    )
    require(
        calls == warmup + len(timed),
        ex,
        f"op was called {calls} times, expected warmup + repeats = "
        f"{warmup + len(timed)}: first {warmup} untimed warm-up calls, then {len(timed)} timed ones",
    )
    spans = _timed_spans(dev.events, warmup)
    require(
        "clock" not in spans[0] or "sync" in spans[0][: spans[0].index("clock")],
        ex,
        "no synchronize() between the warm-up and the first clock(): the warm-up's queued work may still "
        "be running when the clock starts. Synchronize before starting the clock, and before stopping "
        "it; don't count on barrier() for that (gloo's does not touch CUDA streams, NCCL's happens to "
        "synchronize the current stream only)",
    )
    for k, (before, after) in enumerate(zip(spans, spans[1:]), 1):
        start = len(before) - before[::-1].index("clock") - 1 if "clock" in before else None
        require(start is not None, ex, f"timed call {k} has no clock() read before it")
        require(
            "barrier" in before[:start],
            ex,
            f"no barrier() before the clock of timed call {k}"
            + (
                ": the barrier came after the clock started, so the wait for the slowest rank was timed"
                if "barrier" in before[start:]
                else f": the call waited {late:g} s for a late peer inside the timed region"
            ),
        )
        stop = after.index("clock") if "clock" in after else None
        require(
            stop is not None, ex, f"no clock() read after timed call {k}: time each call on its own"
        )
        require(
            "sync" in after[:stop],
            ex,
            f"the clock stopped after timed call {k} before synchronize(): on a "
            f"GPU that times the enqueue ({FakeDevice.ENQUEUE_S:g} s here), not the work",
        )
    want = statistics.median(timed)
    require(
        isinstance(got, (int, float)),
        ex,
        f"returned {got!r}: return the median, a float in seconds",
    )
    require(
        close(got, want, rel=1e-9),
        ex,
        f"returned {got!r} s, the median of the timed calls is {want} s"
        + (
            f": that is their mean; one slow repeat ({max(timed)} s) moved it, the median resists it"
            if close(got, statistics.mean(timed), rel=1e-9)
            else ""
        ),
    )
    passed(
        ex,
        "warm-up untimed and synchronized; barrier → clock → op → synchronize → clock per call; median returned",
    )


# --- 09.5 ---------------------------------------------------------------------------------------


def _explorer_efficiency(ports: int = 1, link_gbs: float | None = None) -> float:
    """The explorer's initial setting: Ψ = 1.2 B, DDP, 64 GPUs, one sequence of 2048 tokens per GPU."""
    model = cm.Transformer(layers=24, hidden=int((1.2e9 / (12 * 24)) ** 0.5))
    hw = dataclasses.replace(cm.H100, nics_per_node=ports)
    return cm.predict_step("ddp", model, 64, 2048, hw, link_bw=link_gbs and link_gbs * 1e9)[
        "efficiency"
    ]


def explorer(ports=..., link_gbs=...) -> None:
    """09.5: ``ports`` (int), the fewest InfiniBand ports per node with predicted efficiency ≥ 0.9,
    and ``link_gbs`` (float, GB/s), the bandwidth of every link below which it drops under 0.9
    (within 1 %), in the explorer's initial setting; compared with :func:`costmodel.predict_step`."""
    ex = "09.5 explorer"
    ports, link_gbs = answered(ports, ex, "ports"), answered(link_gbs, ex, "link_gbs")
    require(
        isinstance(ports, int) and 1 <= ports <= 8,
        ex,
        f"ports = {ports!r}: an int from 1 to 8 (a DGX H100 has 8)",
    )
    eff = _explorer_efficiency(ports=ports)
    require(
        eff >= 0.9,
        ex,
        f"with {ports} port(s) per node the predicted efficiency is {eff:.0%}, below 90 %",
    )
    require(
        ports == 1 or _explorer_efficiency(ports=ports - 1) < 0.9,
        ex,
        f"{ports - 1} port(s) already give "
        f"{_explorer_efficiency(ports=ports - 1):.0%}: look for fewer",
    )
    lo, hi = 1.0, 900.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _explorer_efficiency(link_gbs=mid) < 0.9 else (lo, mid)
    require(
        close(link_gbs, hi, rel=0.01),
        ex,
        f"at link_gbs = {link_gbs!r} the predicted efficiency is "
        f"{_explorer_efficiency(link_gbs=float(link_gbs)):.1%}: the threshold is where it crosses 90 %; "
        "bisect between a bandwidth below it and one above"
        if isinstance(link_gbs, (int, float)) and link_gbs > 0
        else f"link_gbs = {link_gbs!r}: a bandwidth in GB/s (> 0)",
    )
    passed(
        ex,
        f"{ports} ports per node keep DDP at ≥ 90 % on 64 GPUs; every link at ≥ {hi:.0f} GB/s does too",
    )
