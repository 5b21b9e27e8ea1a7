"""Checker of chapter 09's exercise 09a.2 (notebooks/09a_cost_model.ipynb): a timing function that
is right on a GPU, reached as ``ex.ch09.timing``.

Nothing here measures a duration: the learner's function runs against a :class:`FakeDevice`, a
simulated GPU on a fake clock whose every call is recorded, and the calls, their order and the
returned value are checked.
"""

from __future__ import annotations

import statistics

from mgtutorial.exercises._common import attempt, close, passed, require


class FakeDevice:
    """A GPU seen from the host, on a fake clock, with a peer rank that is late.

    ``fn()`` *queues* a collective and returns after ``ENQUEUE_S``; the work ends ``durations[i]``
    after it can start, and it can start only once the peer has arrived: the peer arrives
    ``late_s`` after each call unless a ``barrier()`` (which waits for it) came since the last call.
    The barrier waits for the peer only, as gloo's does (it does not touch CUDA streams); NCCL's,
    a one-element all-reduce, also synchronizes the host with the current stream, but no other, so
    a timing function must not rely on it. ``synchronize()`` waits for the queue; ``clock()`` reads
    the fake time. ``events`` records every call in order: "fn", "sync", "barrier", "clock".
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
    """09a.2: ``fn(op, *, warmup, repeats, clock, barrier, synchronize) -> float``, the median
    seconds per call of ``op()``. Run on a :class:`FakeDevice`: 2 slow warm-up calls, 5 timed
    ones (one of them slow), a peer 3 s late; the calls it makes and their order are checked,
    then the value."""
    ex = "09a.2 timing"
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
        f"returned {got!r} s per call: the time op() takes to queue its work "
        f"({FakeDevice.ENQUEUE_S:g} s here), not to run it (about 1 s): on a GPU, kernels and "
        "NCCL collectives return before they finish; synchronize() before you stop the clock",
    )
    require(
        calls == warmup + len(timed),
        ex,
        f"op was called {calls} times, expected warmup + repeats = {warmup + len(timed)}: first "
        f"{warmup} untimed warm-up calls, then {len(timed)} timed ones",
    )
    spans = _timed_spans(dev.events, warmup)
    require(
        "clock" not in spans[0] or "sync" in spans[0][: spans[0].index("clock")],
        ex,
        "no synchronize() between the warm-up and the first clock(): the warm-up's queued work "
        "may still be running when the clock starts. Synchronize before starting the clock, and "
        "before stopping it; don't count on barrier() for that (gloo's does not touch CUDA "
        "streams, NCCL's happens to synchronize the current stream only)",
    )
    for k, (before, after) in enumerate(zip(spans, spans[1:]), 1):
        start = len(before) - before[::-1].index("clock") - 1 if "clock" in before else None
        require(start is not None, ex, f"timed call {k} has no clock() read before it")
        if "barrier" in before[start:]:
            why = (
                "the barrier came after the clock started: the wait for the slowest rank was timed"
            )
        else:
            why = f"the call waited {late:g} s for a late peer inside the timed region"
        require(
            "barrier" in before[:start],
            ex,
            f"no barrier() before the clock of timed call {k}: {why}",
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
    robust = {"median": statistics.median(timed), "fastest call": min(timed)}
    require(
        isinstance(got, (int, float)),
        ex,
        f"returned {got!r}: return the median (or the fastest call), a float in seconds",
    )
    mean = (
        ": that is their mean; one slow repeat moved it, the median and the minimum resist it"
        if close(got, statistics.mean(timed), rel=1e-9)
        else ""
    )
    which = next((k for k, v in robust.items() if close(got, v, rel=1e-9)), None)
    require(
        which is not None,
        ex,
        f"returned {got!r} s, neither the median nor the fastest of the timed calls{mean}",
    )
    passed(
        ex,
        "warm-up untimed and synchronized; barrier → clock → op → synchronize → clock per call; "
        f"the {which} returned",
    )
