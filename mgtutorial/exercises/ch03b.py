"""Checkers of chapter 03b's exercises (notebooks/03b_ddp_internals.ipynb): the bucket layout for a
given ``bucket_cap_mb`` (03b.1), a float16 communication hook (03b.2), and DDP by hand,
overlapped and bucketed (03b.3, in :mod:`mgtutorial.exercises.ch03b_buckets`).

The learner's code (``%%writefile`` modules, imported by path inside the ranks) runs inside
chapter 03b's own training: DDP of the article's CNN trained by :class:`mgtutorial.ddp.Trainer`,
or the learner's :class:`~mgtutorial.ddp.by_hand.BucketsByHand` with their ``train_step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mgtutorial import ddp
from mgtutorial.common.compare import float32_tolerance
from mgtutorial.ddp import overlap
from mgtutorial.exercises._common import (
    answered,
    function_from,
    passed,
    require,
    run_ranks,
)
from mgtutorial.exercises.ch03b_buckets import bucketed_by_hand
from mgtutorial.exercises.ddp_checks import (
    compare_with_reference,
    load_params,
    patched,
    save_params,
)
from mgtutorial.runtime import env, runlog

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
            len(guess) == len(sizes),
            ex,
            f"with bucket_cap_mb={cap} DDP did not make {len(guess)} buckets: {rule}",
        )
        for i, (g, s) in enumerate(zip(guess, sizes)):
            require(
                g == s,
                ex,
                f"with bucket_cap_mb={cap}, bucket {i} does not hold {g!r} elements: {rule}",
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
    10 × chapter 02's float32 tolerance: float16 rounds each averaged gradient to about 5e-4 of
    its size, so the parameters move ~5e-4 of their displacement away from the reference)."""
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
    gpus = env.resolve_backend(cfg.backend, 2) == "nccl"
    tol = 10 * float32_tolerance("cuda" if gpus else "cpu")  # float16 rounds more than float32
    compare_with_reference(ex, load_params(result.run_dir, 2), cfg, tol=tol)
    passed(
        ex,
        f"one asynchronous float16 all-reduce per bucket ({2 * total:,} bytes per step, not "
        f"{4 * total:,}), a float32 result, and the parameters within 10 × the float32 tolerance "
        f"({tol:.0e}) of one process on the combined batch",
    )


__all__ = ["bucket_layout", "bucketed_by_hand", "fp16_hook"]
