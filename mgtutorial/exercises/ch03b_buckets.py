"""Checker of chapter 03b's exercise 03b.3 (notebooks/03b_ddp_internals.ipynb): DDP by hand,
overlapped and bucketed. The learner's ``MyBucketedDDP`` (a
:class:`~mgtutorial.ddp.by_hand.BucketsByHand`) and ``train_step`` run in 2 ranks; each step's
all-reduces are recorded (how many, of what size, launched during ``backward()`` or after, waited
for before ``optimizer.step()`` or not) and the parameters compared with one process on the
combined batch. Called as ``ex.ch03b.bucketed_by_hand`` (:mod:`mgtutorial.exercises.ch03b` has the
chapter's other checkers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch import nn

from mgtutorial import ddp
from mgtutorial.ddp import by_hand
from mgtutorial.exercises._common import import_file, passed, require, run_ranks
from mgtutorial.exercises.ddp_checks import compare_with_reference, load_params, save_params
from mgtutorial.runtime import env

TINY = dict(dataset="synthetic", batch_size=8, evaluate=False)  # the chapter's tiny runs


@dataclass(kw_only=True)
class LearnerConfig(by_hand.ByHandConfig):
    """Chapter 03b's DDP by hand, with buckets, plus the learner's module."""

    path: str = ""
    """Absolute path of the learner's module."""


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
    ``in_backward`` (how many were launched before ``finish_gradient_sync``), ``blocking`` (how
    many were called without ``async_op=True``), ``unwaited``
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
            sent.append((tensor.numel(), now["finishing"], out is not None))
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
                    "launched": [n for n, _, _ in sent],
                    "in_backward": sum(not late for _, late, _ in sent),
                    "blocking": sum(not is_async for _, _, is_async in sent),
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
            step["blocking"] == 0,
            ex,
            f"in step {i}, {step['blocking']} all-reduce(s) blocked until done: without "
            "async_op=True the all-reduce runs to its end inside grad_ready, backward() waits for "
            "it, and nothing overlaps",
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


__all__ = ["bucketed_by_hand"]
