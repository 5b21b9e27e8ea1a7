"""Checker of chapter 09's exercise 09a.2 (notebooks/09a_cost_model.ipynb): what a sloppy timer
and a synchronize per call report for a short GPU kernel, and a timer that is right, reached as
``ex.ch09.timing``.

Nothing here measures a duration: the timers run against a :class:`FakeGPU`, a simulated GPU on a
fake clock (a queue that returns at once and finishes later), and the values they return are
compared with the kernel's own time.
"""

from __future__ import annotations

import statistics

from mgtutorial.exercises._common import answered, attempt, close, passed, require

GPU = dict(launch_s=5e-6, sync_s=20e-6, warmup_calls=3, warmup_s=500e-6, kernel_s=40e-6)
"""09a.2's simulated GPU (assumed values): each call costs the host ``launch_s`` and queues a
kernel; the first ``warmup_calls`` kernels take ``warmup_s`` each, the others ``kernel_s``;
``synchronize()`` returns ``sync_s`` after the queue is empty."""
OTHER_GPUS = ((GPU["kernel_s"], GPU["launch_s"], GPU["sync_s"]), (250e-6, 8e-6, 50e-6))
"""(kernel, launch, synchronize) seconds of the devices ``time_it`` is checked on: :data:`GPU`'s,
and one the learner does not know, so that subtracting :data:`GPU`'s constants cannot pass."""
WARMUP, REPEATS = 3, 50
"""The warm-up calls and timed calls the checker asks of every timer."""


class FakeGPU:
    """A GPU seen from the host, on a fake clock: ``op()`` queues a kernel and returns after
    ``launch_s``; the kernel starts when it is queued and the previous one has finished, and runs
    ``warmup_s`` (first ``warmup_calls`` calls) or ``kernel_s``. ``synchronize()`` waits for the
    queue, then ``sync_s`` more (the round trip); ``clock()`` reads the host's fake time (s).
    ``events`` records "op", "sync", "clock" in order."""

    def __init__(self, **kw):
        self.p = GPU | kw
        self.now, self.free, self.events = 0.0, 0.0, []

    def op(self):
        p, calls = self.p, self.events.count("op")
        self.events.append("op")
        self.now += p["launch_s"]
        run = p["warmup_s"] if calls < p["warmup_calls"] else p["kernel_s"]
        self.free = max(self.free, self.now) + run

    def synchronize(self):
        self.events.append("sync")
        self.now = max(self.now, self.free) + self.p["sync_s"]

    def clock(self) -> float:
        self.events.append("clock")
        return self.now


def sloppy_time(op, *, warmup, repeats, clock, synchronize):
    """09a.2's timer to judge: warm-up, then one clock span over all calls, synchronized at the
    end. Seconds per call of ``op()``."""
    for _ in range(warmup):
        op()
    t0 = clock()
    for _ in range(repeats):
        op()
    synchronize()
    return (clock() - t0) / repeats


def per_call_time(op, *, warmup, repeats, clock, synchronize):
    """``timing.time_op``'s pattern: warm-up, synchronize, then each call timed on its own,
    synchronized before the clock stops; the median."""
    for _ in range(warmup):
        op()
    synchronize()
    times = []
    for _ in range(repeats):
        t0 = clock()
        op()
        synchronize()
        times.append(clock() - t0)
    return statistics.median(times)


def run_timer(timer, exercise: str = "09a.2 timing", **gpu) -> tuple[float, FakeGPU]:
    """``timer`` run on a fresh :class:`FakeGPU` (``gpu`` overrides :data:`GPU`) with
    :data:`WARMUP` and :data:`REPEATS`: (its value, the device)."""
    dev = FakeGPU(**gpu)
    got = attempt(
        exercise,
        timer,
        dev.op,
        warmup=WARMUP,
        repeats=REPEATS,
        clock=dev.clock,
        synchronize=dev.synchronize,
    )
    return got, dev


def _why(got: float, kernel_s: float, dev: FakeGPU) -> str:
    """What a timer that returned ``got`` on ``dev`` (kernel ``kernel_s``) most likely missed."""
    p, ev = dev.p, dev.events
    if got < kernel_s / 2:
        return (
            "the clock stopped before the queued kernels were done: op() returns once its kernel "
            "is queued; synchronize() before you read the clock the second time"
        )
    if close(got, p["launch_s"] + kernel_s + p["sync_s"], rel=0.02):
        return (
            "each timed call pays its launch and a synchronize's round trip on top of the kernel: "
            "beside a kernel this short, they are not small; how could the calls share them?"
        )
    first_clock = ev.index("clock") if "clock" in ev else len(ev)
    if ev[:first_clock].count("op") < p["warmup_calls"]:
        return (
            "the first calls are slow (they are what a warm-up is for): keep them out of the clock"
        )
    if "sync" not in ev[:first_clock]:
        return (
            "the warm-up's kernels were still queued when the clock started: synchronize before "
            "starting it too"
        )
    return "compare the events your timer's calls produce with the device's rules above"


def timing(time_it, predicted: dict | None = None) -> None:
    """09a.2: ``predicted`` = {"sloppy", "per call": seconds}, what :func:`sloppy_time` and
    :func:`per_call_time` return on the :data:`GPU` device (within 1 %), and ``time_it(op, *,
    warmup, repeats, clock, synchronize) -> float``, seconds per call, within 5 % of the kernel's
    own time on the devices of :data:`OTHER_GPUS` (the second unknown to the learner)."""
    ex = "09a.2 timing"
    predicted = predicted or {}
    explain = {
        "sloppy": "the warm-up's kernels were queued, not finished, when the clock started: "
        "how much of their time is still ahead of the host then?",
        "per call": "what does the host wait for between the two clock reads of one timed call?",
    }
    for name, timer in (("sloppy", sloppy_time), ("per call", per_call_time)):
        guess = answered(predicted.get(name), ex, f'predicted["{name}"]')
        want = run_timer(timer, ex)[0]
        if close(guess, want, rel=0.01):
            continue
        if close(guess, GPU["kernel_s"], rel=0.01):
            why = f"that is the kernel's own time; {explain[name]}"
        elif close(guess, want * 1e6, rel=0.01):
            why = "that looks like µs: answer in seconds (1 µs = 1e-6 s)"
        else:
            why = explain[name]
        direction = "too large" if guess > want else "too small"
        require(False, ex, f'predicted["{name}"] = {guess!r} s is {direction}: {why}')
    errors = {}
    for kernel_s, launch_s, sync_s in OTHER_GPUS:
        got, dev = run_timer(time_it, ex, kernel_s=kernel_s, launch_s=launch_s, sync_s=sync_s)
        require(
            isinstance(got, (int, float)),
            ex,
            f"`time_it` returned {got!r}: return seconds per call, a float",
        )
        errors[kernel_s] = got / kernel_s - 1
        if abs(errors[kernel_s]) > 0.05:
            us = f"{kernel_s * 1e6:.0f} µs"
            require(
                False,
                ex,
                f"on a device whose kernel takes {us}, `time_it` returned {got * 1e6:.1f} µs: "
                + _why(got, kernel_s, dev),
            )
    want = {k: run_timer(t, ex)[0] for k, t in (("sloppy", sloppy_time), ("per", per_call_time))}
    passed(
        ex,
        f"the sloppy timer reports {want['sloppy'] * 1e6:.1f} µs and a synchronize per call "
        f"{want['per'] * 1e6:.1f} µs for a {GPU['kernel_s'] * 1e6:.0f} µs kernel; yours is off by "
        + " and ".join(f"{e:+.1%}" for e in errors.values())
        + " on the 40 and 250 µs kernels",
    )
