"""Checkers of chapter 03b's exercises (notebooks/03b_ddp_internals.ipynb): the bucket layout for a
given ``bucket_cap_mb`` (03b.1), a float16 communication hook (03b.2), and DDP by hand,
overlapped and bucketed (03b.3).

The learner's code (``%%writefile`` modules, imported by path inside the ranks) runs inside
chapter 03b's own training: DDP of the article's CNN trained by :class:`mgtutorial.ddp.Trainer`,
or the learner's :class:`~mgtutorial.ddp.by_hand.BucketsByHand` with their ``train_step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch import nn

from mgtutorial import ddp
from mgtutorial.ddp import overlap
from mgtutorial.exercises._common import (
    answered,
    function_from,
    import_file,
    passed,
    require,
    run_ranks,
)
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


class _Watched:
    """A ``Work`` handle that notes when ``wait()`` was called (``waited``)."""

    def __init__(self, work):
        self.work, self.waited = work, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


def bucketed_worker(cfg: LearnerConfig) -> dict:
    """The learner's ``MyBucketedDDP`` (buckets of ``cfg.bucket_cap_mb``) trained with their
    ``train_step``; saves each rank's parameters. Returns ``{"steps": [...]}``, per step:
    ``buckets`` (elements per bucket), ``launched`` (elements of each all-reduce, in order),
    ``in_backward`` (how many were launched before ``finish_gradient_sync``), ``unwaited``
    (how many were not yet waited for when ``optimizer.step()`` ran, None if it never ran)."""
    module = import_file(cfg.path, "03b.3 bucketed DDP by hand")
    cls, train_step = module.MyBucketedDDP, module.train_step
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        wrap = lambda m, c: cls(m.to(c.device), c, bucket_cap_mb=cfg.bucket_cap_mb)  # noqa: E731
        model, train_set, _, optimizer = ddp.build(cfg, ctx, wrap=wrap)
        loader = ddp.rank_loader(train_set, cfg, ctx.rank, ctx.world_size)
        steps, sent, step_fn, finish = [], [], optimizer.step, model.finish_gradient_sync
        works: list[_Watched] = []
        original = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            sent.append((tensor.numel(), now["finishing"]))
            if out is not None:
                out = _Watched(out)
                works.append(out)
            return out

        def finishing(*args, **kwargs):
            now["finishing"] = True
            return finish(*args, **kwargs)

        def stepping(*args, **kwargs):
            now["unwaited"] = sum(not w.waited for w in works)
            return step_fn(*args, **kwargs)

        model.finish_gradient_sync, optimizer.step = finishing, stepping
        for (x, y), _ in zip(loader, range(cfg.max_steps)):
            now = {"finishing": False, "unwaited": None}
            sent.clear()
            works.clear()
            dist.all_reduce = all_reduce
            try:
                train_step(model, nn.CrossEntropyLoss(), optimizer, x, y)
            finally:
                dist.all_reduce = original
            steps.append(
                {
                    "buckets": [sum(p.numel() for p in b) for b in model.buckets],
                    "launched": [n for n, _ in sent],
                    "in_backward": sum(not late for _, late in sent),
                    "unwaited": now["unwaited"],
                }
            )
        save_params(model.module, ctx.rank)
        return {"steps": steps}


def bucketed_by_hand(path: str = "ex03b_buckets.py") -> None:
    """03b.3: ``MyBucketedDDP`` (a :class:`~mgtutorial.ddp.by_hand.BucketsByHand`) in ``path``
    launches one asynchronous all-reduce per bucket from ``grad_ready`` during ``backward()``,
    and ``finish_gradient_sync`` waits, averages and copies back; ``train_step`` calls it before
    ``optimizer.step()``. Trains 4 steps on 2 ranks with 1 MiB buckets; checks each step's
    launches and waits, then the parameters against one process on the combined batch."""
    ex = "03b.3 bucketed DDP by hand"
    module = import_file(path, ex)
    require(
        hasattr(module, "MyBucketedDDP") and callable(getattr(module, "train_step", None)),
        ex,
        f"{Path(path).name} must define the class MyBucketedDDP and the function train_step",
    )
    cfg = LearnerConfig(path=str(Path(path).resolve()), bucket_cap_mb=1.0, max_steps=4, **TINY)
    result = run_ranks(ex, bucketed_worker, cfg, 2, name="buckets-by-hand")
    for i, step in enumerate(result.values[0]["steps"], 1):
        buckets, launched = step["buckets"], step["launched"]
        missing = [b for b, n in enumerate(buckets) if n not in launched]
        require(
            not missing or len(launched) > len(buckets),
            ex,
            f"in step {i} the all-reduce of bucket(s) {missing} was never launched: count each "
            f"ready gradient in self.ready[b], and launch bucket b when the count reaches "
            f"len(self.buckets[b])"
            + (" (and set the counts back to 0 for the next step)" if i > 1 else ""),
        )
        require(
            len(launched) == len(buckets),
            ex,
            f"step {i} made {len(launched)} all-reduces for {len(buckets)} buckets: launch one "
            f"per bucket, of its gradients flattened into one buffer, once all are ready",
        )
        require(
            step["in_backward"] == len(buckets),
            ex,
            f"in step {i}, {len(buckets) - step['in_backward']} all-reduce(s) started in "
            "finish_gradient_sync, after backward(): launch each from grad_ready, with "
            "async_op=True, so that it runs while backward() goes on",
        )
        require(
            step["unwaited"] is not None,
            ex,
            f"step {i} never called optimizer.step(): train_step must step the optimizer",
        )
        require(
            step["unwaited"] == 0,
            ex,
            f"in step {i} optimizer.step() ran while {step['unwaited']} all-reduce(s) were "
            "still in flight: call model.finish_gradient_sync() (which waits for them) after "
            "loss.backward() and before optimizer.step()",
        )
    compare_with_reference(
        ex,
        load_params(result.run_dir, 2),
        cfg,
        unsynced="copy each bucket's reduced buffer back into the .grad of its parameters",
    )
    steps = result.values[0]["steps"]
    passed(
        ex,
        f"{len(steps[0]['buckets'])} buckets, each all-reduced once per step, launched during "
        f"backward() and waited for before the step; after {len(steps)} steps both ranks equal "
        "one process on the combined batch",
    )


__all__ = ["bucket_layout", "bucketed_by_hand", "fp16_hook"]
