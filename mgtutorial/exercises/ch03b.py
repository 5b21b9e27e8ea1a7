"""Checkers of chapter 03b's exercises (notebooks/03b_ddp_internals.ipynb): the bucket layout for a
given ``bucket_cap_mb`` (03b.1), a float16 communication hook (03b.2), gradient accumulation with
``no_sync`` (03b.3), and, from :mod:`mgtutorial.exercises.ch03b_join`, uneven inputs with ``Join``
(03b.4).

The learner's functions (``%%writefile`` modules, imported by path inside the ranks) run inside
chapter 03b's own training: DDP of the article's CNN, trained by :class:`mgtutorial.ddp.Trainer`
or :class:`mgtutorial.ddp.overlap.AccumulationTrainer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mgtutorial import ddp
from mgtutorial.ddp import overlap
from mgtutorial.exercises._common import (
    ExerciseError,
    answered,
    function_from,
    passed,
    require,
    run_ranks,
)
from mgtutorial.exercises.ch03b_join import join_uneven
from mgtutorial.exercises.ddp_checks import (
    compare_with_reference,
    load_params,
    patched,
    save_params,
)
from mgtutorial.runtime import env, runlog
from mgtutorial.runtime.launcher import launch
from mgtutorial.runtime.run import WorkerFailed

TINY = dict(dataset="synthetic", batch_size=8, evaluate=False)  # the chapter's tiny runs


# --- 03b.1 ----------------------------------------------------------------------------------------


def bucket_layout(predicted: dict) -> None:
    """03b.1: ``predicted[cap]`` is the list of bucket sizes (elements, in launch order) DDP
    all-reduces from step 2 on with ``bucket_cap_mb=cap``, for cap 0.001 and 0.005. Runs
    ``hooks_worker`` for 2 steps with each and reads rank 0's ``sync`` record of step 2."""
    ex = "03b.1 bucket layout"
    caps = (0.001, 0.005)
    guesses = {cap: answered(predicted.get(cap), ex, f"predicted[{cap}]") for cap in caps}
    for cap, guess in guesses.items():  # before any rank starts
        require(
            isinstance(guess, (list, tuple)) and all(isinstance(g, int) for g in guess),
            ex,
            f"predicted[{cap}] is {guess!r}: give a list of bucket sizes (integers, elements)",
        )
    for cap, guess in guesses.items():
        cfg = overlap.HooksConfig(bucket_cap_mb=cap, max_steps=2, **TINY)
        records = runlog.of_kind(
            read(run_ranks(ex, overlap.hooks_worker, cfg, 2, name="buckets")), "sync"
        )
        sizes = next(
            rec["bucket_sizes"] for rec in records if rec["rank"] == 0 and rec["step"] == 2
        )
        rule = (
            f"with bucket_cap_mb={cap} ({cap * 2**20 / 4:,.0f} float32 elements) a bucket closes "
            f"as soon as it holds at least that many, and never splits a tensor; from step 2 on "
            f"DDP fills the buckets in the order the gradients become ready in backward() (output "
            f"layer first), not in model.parameters() order"
        )
        require(
            len(guess) == len(sizes), ex, f"DDP made {len(sizes)} buckets, not {len(guess)}: {rule}"
        )
        for i, (g, s) in enumerate(zip(guess, sizes)):
            require(
                g == s,
                ex,
                f"with bucket_cap_mb={cap}, bucket {i} holds {s:,} elements, not {g!r}: {rule}",
            )
    passed(ex, "the bucket sizes from step 2 on match DDP's for bucket_cap_mb 0.001 and 0.005")


def read(result) -> list[dict]:
    """Every record of a finished run."""
    return runlog.read_run(result.run_dir)


# --- 03b.2 ----------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class LearnerConfig(overlap.HooksConfig):
    """Chapter 03b's configuration plus the learner's module, for the workers below."""

    path: str = ""
    """Absolute path of the learner's module."""


def hook_worker(cfg: LearnerConfig) -> dict:
    """DDP with the learner's ``fp16_allreduce_hook`` registered, trained by chapter 02's
    Trainer; saves each rank's parameters. Returns ``{"calls": [...]}``, one dict per hook call:
    ``elements`` (the bucket's), ``sent`` (``[dtype, elements, async]`` of each all-reduce the hook
    made; async: it returned a Work) and ``returned`` (``[dtype, elements]`` of the value of the
    hook's future)."""
    hook = function_from(cfg.path, "fp16_allreduce_hook")
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        model, train_set, test_set, optimizer = ddp.build(cfg, ctx)
        calls = []

        def recorded(state, bucket):  # DDP checks that the second argument is named "bucket"
            call = {"elements": bucket.buffer().numel(), "returned": None}
            sent = []
            calls.append(call)
            with patched(sent, ("all_reduce",)):
                future = hook(state, bucket)
            call["sent"] = [[dtype, n, work is not None] for _, dtype, n, work in sent]
            if not callable(getattr(future, "then", None)):
                raise TypeError(
                    f"fp16_allreduce_hook returned {type(future).__name__}, not a "
                    "torch.futures.Future"
                )

            def returned(fut):
                value = fut.value()
                t = value[0] if isinstance(value, (list, tuple)) else value
                call["returned"] = [str(t.dtype).removeprefix("torch."), t.numel()]
                return value

            return future.then(returned)

        model.register_comm_hook(None, recorded)
        ddp.Trainer(model, train_set, test_set, optimizer, ctx, cfg).train()
        save_params(model.module, ctx.rank)
        return {"calls": calls}


def fp16_hook(path: str = "ex03b_hook.py") -> None:
    """03b.2: ``fp16_allreduce_hook(state, bucket)`` in ``path`` averages each bucket with one
    asynchronous all-reduce of a float16 copy and returns a Future of the float32 buffer. Trains 4
    steps on 2 ranks; checks, per hook call, one async float16 all-reduce of the bucket's elements
    and a float32 result of the bucket's size, then the parameters against one process (within
    1e-4: float16 rounds each averaged gradient to about 5e-4 of its size, so the parameters move
    ~5e-4 of their displacement away from the reference)."""
    ex = "03b.2 float16 hook"
    function_from(path, "fp16_allreduce_hook", ex)
    cfg = LearnerConfig(path=str(Path(path).resolve()), max_steps=4, **TINY)
    result = run_ranks(ex, hook_worker, cfg, 2, name="fp16-hook")
    calls = result.values[0]["calls"]
    for call in calls:
        n, sent = call["elements"], call["sent"]
        require(
            len(sent) == 1,
            ex,
            f"for a bucket of {n:,} elements your hook called dist.all_reduce {len(sent)} "
            f"times: all-reduce the bucket's whole flat buffer (bucket.buffer()) once",
        )
        dtype, elements, is_async = sent[0]
        require(
            elements == n,
            ex,
            f"for a bucket of {n:,} elements your hook all-reduced {elements:,}: "
            f"all-reduce a float16 copy of the whole bucket.buffer()",
        )
        require(
            dtype == "float16",
            ex,
            f"your hook all-reduced {dtype}: cast the bucket's buffer to "
            f"torch.float16 before the all-reduce, copy the result back after",
        )
        require(
            is_async,
            ex,
            "your all-reduce blocked until done (it returned None): call it with async_op=True "
            "and return work.get_future().then(...), so that DDP goes on with backward()",
        )
        require(
            call["returned"] == ["float32", n],
            ex,
            f"your hook's future returns {call['returned']} (dtype, elements), not the bucket's "
            f"float32 buffer of {n:,}: in the callback, copy fut.value()[0] into buffer and "
            "return buffer",
        )
    total = sum(p.numel() for p in load_params(result.run_dir, 2)[0].values())
    compare_with_reference(ex, load_params(result.run_dir, 2), cfg, tol=1e-4)
    passed(
        ex,
        f"one asynchronous float16 all-reduce per bucket ({2 * total:,} bytes per step, not "
        f"{4 * total:,}), a float32 result, and the parameters within 1e-4 of one process on the "
        "combined batch",
    )


# --- 03b.3 ----------------------------------------------------------------------------------------


class _LearnerAccumulation(overlap.AccumulationTrainer):
    """AccumulationTrainer whose micro-batch loop is the learner's ``accumulate``; counts the
    buckets the counting hook saw per optimizer step."""

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        self.buckets["buckets"].clear()
        k = self.cfg.accumulation_steps
        loss = self.accumulate(self.model, self.loss_fn, list(zip(x.chunk(k), y.chunk(k))))
        self.optimizer.step()
        self.calls.append(len(self.buckets["buckets"]))
        return float(loss)


def accumulation_worker(cfg: LearnerConfig) -> dict:
    """DDP trained with the learner's ``accumulate(model, loss_fn, micro_batches)``; saves each
    rank's parameters. Returns ``{"calls": all-reduces per optimizer step}``."""
    fn = function_from(cfg.path, "accumulate")
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        model, train_set, test_set, optimizer = ddp.build(cfg, ctx)
        trainer = _LearnerAccumulation(model, train_set, test_set, optimizer, ctx, cfg)
        trainer.accumulate = fn
        trainer.calls = []
        trainer.train()
        save_params(model.module, ctx.rank)
        return {"calls": trainer.calls}


def no_sync_accumulation(path: str = "ex03b_accumulate.py", k: int = 3) -> None:
    """03b.3: ``accumulate(model, loss_fn, micro_batches)`` in ``path`` runs forward and backward on
    each of the ``k`` micro-batches, DDP all-reducing only in the last. Counts all-reduces per
    optimizer step against the same run without accumulation, and compares the parameters with one
    process on the combined data (per-rank batch k × 8)."""
    ex = "03b.3 no_sync"
    function_from(path, "accumulate", ex)
    plain = overlap.HooksConfig(max_steps=4, **TINY)
    reference_run = launch(
        overlap.hooks_worker, plain, 2, runs_dir="runs/exercises", name="reference"
    )
    try:  # the two runs side by side
        cfg = LearnerConfig(
            path=str(Path(path).resolve()), accumulation_steps=k, max_steps=4, **TINY
        )
        result = run_ranks(ex, accumulation_worker, cfg, 2, name="no-sync")
        try:
            reference = reference_run.wait(timeout=60)
        except (WorkerFailed, TimeoutError) as e:
            why = (
                f"rank {e.rank} failed with {e.exc_type}: {e.message[:200]}"
                if isinstance(e, WorkerFailed)
                else "it did not finish within 60 s"
            )
            raise ExerciseError(
                ex,
                f"the reference run failed ({why}): this is not your code; rerun the "
                f"checker, and if it persists, tell the instructor",
            ) from e
        expected = [
            rec["allreduce_calls"]
            for rec in runlog.of_kind(read(reference), "sync")
            if rec["rank"] == 0
        ]
    finally:
        reference_run.stop()  # ends it if run_ranks or the wait raised
    calls = result.values[0]["calls"]
    require(
        calls == expected,
        ex,
        f"DDP all-reduced {calls} times per optimizer step with {k} micro-batches, "
        f"{expected} without accumulation: run every micro-batch but the last "
        f"inside `with model.no_sync():`",
    )
    combined = ddp.DDPConfig(max_steps=4, **{**TINY, "batch_size": k * TINY["batch_size"]})
    compare_with_reference(
        ex,
        load_params(result.run_dir, 2),
        combined,
        what="the mean gradient of all micro-batches",
        unsynced="the backward outside no_sync must be the last micro-batch's: its all-reduce "
        "averages what .grad holds by then, the gradients of every micro-batch",
    )
    passed(
        ex,
        f"{k} micro-batches, as many all-reduces per optimizer step as without accumulation, and "
        "the parameters of one process on the combined data",
    )


__all__ = ["bucket_layout", "fp16_hook", "join_uneven", "no_sync_accumulation"]
