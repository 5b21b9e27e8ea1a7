"""Checkers of chapter 03a's exercises (notebooks/03a_collectives.ipynb): what rank 2 holds after a
reduce-scatter and a ring step on 4 ranks, averaging the gradients by hand in one all-reduce, a ring
all-reduce from send/recv, and computing while an asynchronous all-reduce is in flight.

The workers here run the learner's function (from a ``%%writefile`` module, imported by path) inside
the ranks, with ``torch.distributed``'s calls recorded or refused (:func:`patched`), so that the
checkers can count calls and elements, not only compare values.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mgtutorial import ddp
from mgtutorial.ddp import collectives
from mgtutorial.exercises._common import (
    ExerciseError,
    answered,
    function_from,
    passed,
    require,
    run_ranks,
)
from mgtutorial.runtime import env, runlog

# --- shared by the workers of 03a and 03b --------------------------------------------------------


@contextlib.contextmanager
def patched(record: list | None = None, names: tuple[str, ...] = (), refuse: tuple[str, ...] = ()):
    """Inside the block, each ``torch.distributed.<name>`` appends ``(name, dtype, elements, returned)``
    of its first (tensor) argument to ``record`` before calling through; each name in ``refuse``
    raises RuntimeError naming it. The originals are restored on leaving."""
    originals = {n: getattr(dist, n) for n in (*names, *refuse)}

    def recorder(name, fn):
        def call(tensor, *args, **kwargs):
            entry = [name, str(tensor.dtype).removeprefix("torch."), tensor.numel(), None]
            record.append(entry)
            entry[3] = fn(tensor, *args, **kwargs)
            return entry[3]

        return call

    def refuser(name):
        def call(*args, **kwargs):
            raise RuntimeError(f"dist.{name} is not allowed in this exercise")

        return call

    for n in names:
        setattr(dist, n, recorder(n, originals[n]))
    for n in refuse:
        setattr(dist, n, refuser(n))
    try:
        yield record
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


def save_params(module: torch.nn.Module, rank: int) -> None:
    """Rank-side: save ``module``'s state dict as ``rank<r>.params.pt`` in the run's directory."""
    torch.save(module.state_dict(), runlog.run_dir() / f"rank{rank}.params.pt")


def load_params(run_dir: Path, nprocs: int) -> list[dict]:
    """The state dicts :func:`save_params` wrote, rank 0 first."""
    return [
        torch.load(Path(run_dir) / f"rank{r}.params.pt", weights_only=True) for r in range(nprocs)
    ]


def max_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two state dicts with the same keys."""
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def compare_with_reference(
    ex: str,
    ranks: list[dict],
    cfg: ddp.DDPConfig,
    tol: float = 1e-5,
    what: str = "the mean of the ranks' gradients",
    unsynced: str = "",
) -> float:
    """Require every rank's parameters equal (< 1e-6) and rank 0's equal (< ``tol``) to
    ``ddp.combined_batch_reference(cfg)``; the hint says how far they moved against the reference
    (2× on 2 ranks: a sum, not a mean). ``unsynced`` ends the hint when the ranks differ (default:
    all-reduce the gradients). Returns the largest difference to the reference."""
    for r, state in enumerate(ranks[1:], 1):
        d = max_diff(ranks[0], state)
        require(
            d < 1e-6,
            ex,
            f"after {cfg.max_steps} steps rank 0's and rank {r}'s parameters differ by up to "
            f"{d:.2g}: each stepped with its own gradient; "
            + (unsynced or f"all-reduce the gradients so that every rank steps with {what}"),
        )
    plain = env.DistContext.single_process()
    init = ddp.build(cfg, plain)[0].state_dict()
    reference = ddp.combined_batch_reference(cfg, len(ranks)).state_dict()
    d = max_diff(ranks[0], reference)
    if d >= tol:
        norm = lambda s: (
            torch.cat([(s[k].float() - init[k].float()).flatten() for k in init]).norm().item()
        )
        moved = norm(ranks[0]) / norm(reference)
        if abs(moved - len(ranks)) < 0.25 * len(ranks):
            hint = (
                f"the parameters moved {moved:.1f}× as far as one process's on the combined batch: "
                f"the all-reduce sums; divide by the world size"
            )
        else:
            hint = (
                f"rank 0's parameters differ from one process on the combined batch by up to {d:.2g} "
                f"(they moved {moved:.2f}× as far): every rank must step with {what}"
            )
        raise ExerciseError(ex, hint)
    return d


# --- 03a.1 ----------------------------------------------------------------------------------------


def four_ranks(predicted: dict) -> None:
    """03a.1: ``predicted["reduce_scatter"]`` and ``predicted["send/recv"]`` are the lists rank 2 holds
    after those steps of ``collectives.collectives_tour`` on 4 ranks with ``size=8`` (rank r starts
    with ``[10r, …, 10r + 7]``). Launches the tour and compares with rank 2's logged tensors."""
    ex = "03a.1 four ranks"
    hints = {
        "reduce_scatter": "rank r keeps piece r (elements 2r and 2r + 1) of the sum over the 4 ranks",
        "send/recv": "each rank sends to rank + 1, so rank 2 receives from rank 1",
    }
    guesses = {k: answered(predicted.get(k), ex, f'predicted["{k}"]') for k in hints}
    cfg = collectives.TourConfig(size=8, barrier_delay_s=0.0)
    records = run_ranks(ex, collectives.collectives_tour, cfg, 4, name="tour").values[2]
    for key, hint in hints.items():
        held = next(rec["after"] for rec in records if rec["op"].startswith(key))
        try:
            guess = [float(v) for v in guesses[key]]
        except (TypeError, ValueError):
            raise ExerciseError(
                ex, f'predicted["{key}"] is {guesses[key]!r}: give a list of numbers'
            ) from None
        require(
            len(guess) == len(held),
            ex,
            f"after {key} rank 2 holds {len(held)} numbers, not {len(guess)}: {hint}",
        )
        require(guess == held, ex, f"after {key} rank 2 does not hold {guesses[key]}: {hint}")
    passed(
        ex,
        "rank 2 holds piece 2 of the sum after reduce_scatter, and rank 1's tensor after the ring step",
    )


# --- 03a.2 ----------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class AverageConfig(ddp.DDPConfig):
    """Chapter 02's configuration plus the learner's module, for :func:`average_worker`."""

    path: str = ""
    """Absolute path of the module defining ``average_gradients(model, world_size)``."""


class _LearnerDDP(collectives.FromScratchDDP):
    """:class:`FromScratchDDP` whose gradient averaging is the learner's function; counts all-reduces."""

    def __init__(self, module, ctx, fn):
        super().__init__(module, ctx)
        self.fn, self.calls_per_step = fn, []

    def average_gradients(self) -> int:
        with patched([], ("all_reduce",)) as calls:
            self.fn(self.module, self.world_size)
        self.calls_per_step.append(len(calls))
        return len(calls)


def average_worker(cfg: AverageConfig) -> dict:
    """03a's ``scratch_worker`` with the learner's ``average_gradients``; saves each rank's
    parameters (:func:`save_params`). Returns ``{"calls_per_step"}`` (all-reduce calls)."""
    fn = function_from(cfg.path, "average_gradients")
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        wrap = lambda m, c: _LearnerDDP(m.to(c.device), c, fn)  # noqa: E731
        model, train_set, test_set, optimizer = ddp.build(cfg, ctx, wrap=wrap)
        collectives.ScratchTrainer(model, train_set, test_set, optimizer, ctx, cfg).train()
        save_params(model.module, ctx.rank)
        return {"calls_per_step": model.calls_per_step}


_UNSEEN = (
    "no dist.all_reduce call was seen: call it as dist.all_reduce(...) (import torch.distributed as dist), "
    "not a name imported from it: the checker counts the calls made through torch.distributed"
)


def average_by_hand(path: str = "ex03a_average.py") -> None:
    """03a.2: ``average_gradients(model, world_size)`` in ``path`` leaves in every ``p.grad`` the mean
    over the ranks, with one all-reduce. Trains 3 steps on 2 ranks; compares both ranks with one
    process on the combined batch and counts the all-reduce calls per step."""
    ex = "03a.2 average by hand"
    function_from(path, "average_gradients", ex)
    cfg = AverageConfig(
        path=str(Path(path).resolve()),
        dataset="synthetic",
        batch_size=8,
        max_steps=3,
        evaluate=False,
    )
    result = run_ranks(ex, average_worker, cfg, 2, name="average")
    compare_with_reference(
        ex,
        load_params(result.run_dir, 2),
        cfg,
        unsynced="if you all-reduced a flat copy of "
        "the gradients, copy the reduced pieces back into the p.grad tensors (g.copy_(...))",
    )
    calls = result.values[0]["calls_per_step"]
    require(any(calls), ex, _UNSEEN)
    require(
        calls == [1] * cfg.max_steps,
        ex,
        f"the values are right, with {calls} all-reduce calls per step: one "
        f"per parameter tensor; put every gradient in one flat tensor "
        f"(torch.cat of p.grad.flatten()), all-reduce it once, copy it back",
    )
    passed(
        ex,
        "one all-reduce per step, and after 3 steps both ranks equal one process on the combined batch",
    )


# --- 03a.3 ----------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class FileConfig:
    """The learner's module for a 03a worker."""

    path: str
    """Absolute path of the learner's module."""
    size: int = 8
    """Elements of each rank's tensor (rank r starts with ``[10r, 10r + 1, …]``)."""
    backend: str = "auto"
    """"auto" | "gloo" | "nccl"."""
    head_start_s: float = 2.0
    """03a.4: the last rank calls the learner's function once rank 0's ``compute()`` has finished,
    or after this long if it does not (a blocking all-reduce waits for the last rank first)."""
    compute_s: float = 0.3
    """03a.4: how long ``compute()`` computes."""


def ring_worker(cfg: FileConfig) -> dict:
    """Rank-side: the learner's ``ring_all_reduce(t, rank, world_size)`` with ``dist.isend``/``dist.send``
    recorded and the built-in collectives refused. Returns ``result``, ``expected`` (dist.all_reduce's
    answer) and ``sent`` (elements this rank sent)."""
    fn = function_from(cfg.path, "ring_all_reduce")
    with env.distributed(cfg.backend) as ctx:
        t = collectives._start_tensor(ctx.rank, cfg.size, ctx.device)
        expected = t.clone()
        dist.all_reduce(expected)
        with patched(
            [], ("isend", "send"), ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
        ) as sent:
            out = fn(t, ctx.rank, ctx.world_size)
        return {
            "result": (t if out is None else out).tolist(),
            "expected": expected.tolist(),
            "sent": sum(entry[2] for entry in sent),
        }


def ring_all_reduce(path: str = "ex03a_ring.py", nprocs: int = 4) -> None:
    """03a.3: ``ring_all_reduce(t, rank, world_size)`` in ``path`` sums ``t`` ``(8,)`` over ``nprocs``
    ranks with send/recv only, sending 2(N−1)/N of the tensor per rank (counted)."""
    ex = "03a.3 ring all-reduce"
    function_from(path, "ring_all_reduce", ex)
    cfg = FileConfig(path=str(Path(path).resolve()))
    values = run_ranks(ex, ring_worker, cfg, nprocs, name="ring").values
    for rank, v in sorted(values.items()):
        require(
            v["result"] == v["expected"],
            ex,
            f"rank {rank} holds {v['result']}, not the sum {v['expected']}",
        )
    ideal = 2 * (nprocs - 1) * cfg.size // nprocs
    for rank, v in sorted(values.items()):
        require(
            v["sent"] == ideal,
            ex,
            f"every rank holds the sum, but rank {rank} sent {v['sent']} elements for "
            f"its tensor of {cfg.size} ({v['sent'] / cfg.size:.2f}×); a ring sends "
            f"2(N−1)/N = {ideal / cfg.size:.2f}×: one chunk of size/N per step, N−1 "
            f"steps that add (reduce-scatter), then N−1 that copy (all-gather)",
        )
    passed(
        ex,
        f"{nprocs} ranks hold the sum, and each sent {ideal} elements for {cfg.size} (2(N−1)/N = "
        f"{ideal / cfg.size:g}×)",
    )


# --- 03a.4 ----------------------------------------------------------------------------------------


def overlap_worker(cfg: FileConfig) -> dict:
    """Rank-side, on gloo (where a blocking all-reduce returns only once it is done; on NCCL it
    returns once queued): the learner's ``reduce_while_computing(t, compute)``; the last rank calls
    it once rank 0's ``compute()`` has finished (a store key), at most ``head_start_s`` late.
    ``compute()`` notes whether the all-reduce was in flight when it started; the result is read
    as soon as the function returns."""
    fn = function_from(cfg.path, "reduce_while_computing")
    with env.distributed("gloo") as ctx:
        t = collectives._start_tensor(ctx.rank, cfg.size, ctx.device)
        store, seen = dist.distributed_c10d._get_default_store(), {"computed": 0}

        def compute():
            seen["computed"] += 1
            seen["in_flight"] = (
                bool(calls) and calls[-1][3] is not None and not calls[-1][3].is_completed()
            )
            x, start = torch.randn(128, 128), time.time()
            while time.time() - start < cfg.compute_s:
                x = torch.tanh(x @ x)
            store.set(f"computed{ctx.rank}", "1")
            return x.sum().item()

        dist.barrier()
        if ctx.rank == ctx.world_size - 1:
            for key, wait_s in (("computed0", cfg.head_start_s), ("returned0", 0.5)):
                # after rank 0's compute(), and after rank 0 returned if it returns without waiting
                with contextlib.suppress(dist.DistStoreError):  # it did not: go anyway
                    store.wait([key], timedelta(seconds=wait_s))
        with patched([], ("all_reduce",)) as calls:
            fn(t, compute)
        result = t.tolist()  # what the function left in t when it returned
        if ctx.rank == 0:
            store.set("returned0", "1")
        for call in calls:  # an all-reduce left in flight must finish before the group goes
            if call[3] is not None:
                call[3].wait()
        return {"result": result, "calls": len(calls), **seen}


def overlap(path: str = "ex03a_overlap.py") -> None:
    """03a.4: ``reduce_while_computing(t, compute)`` in ``path`` all-reduces ``t`` and calls
    ``compute()`` once while the all-reduce is in flight. Verified on rank 0: the last rank joins the
    all-reduce only once rank 0's ``compute()`` has finished."""
    ex = "03a.4 overlap"
    function_from(path, "reduce_while_computing", ex)
    values = run_ranks(
        ex, overlap_worker, FileConfig(path=str(Path(path).resolve())), 2, name="overlap"
    ).values
    first = values[0]
    require(first["calls"] != 0, ex, _UNSEEN)
    require(
        first["calls"] == 1,
        ex,
        f"rank 0 called dist.all_reduce {first['calls']} times: call it once",
    )
    require(
        first["computed"] == 1,
        ex,
        f"rank 0 called compute() {first['computed']} times: call it once",
    )
    require(
        first["in_flight"],
        ex,
        "when compute() started on rank 0 its all-reduce had already finished: call "
        "dist.all_reduce(t, async_op=True), then compute(), then work.wait()",
    )
    total = [
        sum(v) for v in zip(*(collectives._start_tensor(r, 8, "cpu").tolist() for r in range(2)))
    ]
    for rank, v in sorted(values.items()):
        require(
            v["result"] == total,
            ex,
            f"after your function returned, rank {rank} held {v['result']}, not the "
            f"sum {total}: call work.wait() before returning",
        )
    passed(
        ex,
        "rank 0 computed while its all-reduce was in flight, and every rank returned holding the sum",
    )
