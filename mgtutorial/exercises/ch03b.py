"""Checkers of chapter 03b's exercises (notebooks/03b_ddp_internals.ipynb): the bucket layout for a
given ``bucket_cap_mb``, a float16 communication hook, gradient accumulation with ``no_sync``, and
uneven inputs with ``Join`` (a collective timeout of 3 s on DDP's group when it is missing).

The learner's functions (``%%writefile`` modules, imported by path inside the ranks) run inside
chapter 03b's own training: DDP of the article's CNN, trained by :class:`mgtutorial.ddp.Trainer` or
:class:`mgtutorial.ddp.internals.AccumulationTrainer`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mgtutorial import ddp
from mgtutorial.ddp import internals as ddp_internals
from mgtutorial.exercises._common import (
    ExerciseError,
    RankFailed,
    answered,
    function_from,
    passed,
    require,
    run_ranks,
)
from mgtutorial.exercises.ch03a import (
    compare_with_reference,
    load_params,
    max_diff,
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
    guesses = {cap: answered(predicted.get(cap), ex, f"predicted[{cap}]") for cap in (0.001, 0.005)}
    for cap, guess in guesses.items():  # before any rank starts
        require(
            isinstance(guess, (list, tuple)) and all(isinstance(g, int) for g in guess),
            ex,
            f"predicted[{cap}] is {guess!r}: give a list of bucket sizes (integers, elements)",
        )
    for cap, guess in guesses.items():
        cfg = ddp_internals.HooksConfig(bucket_cap_mb=cap, max_steps=2, **TINY)
        records = runlog.of_kind(
            read(run_ranks(ex, ddp_internals.hooks_worker, cfg, 2, name="buckets")), "sync"
        )
        sizes = next(
            rec["bucket_sizes"] for rec in records if rec["rank"] == 0 and rec["step"] == 2
        )
        rule = (
            f"with bucket_cap_mb={cap} ({cap * 2**20 / 4:,.0f} float32 elements) a bucket closes as soon as "
            f"it holds at least that many, and never splits a tensor; from step 2 on DDP fills the buckets in "
            f"the order the gradients become ready in backward() (output layer first), not in "
            f"model.parameters() order"
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
class LearnerConfig(ddp_internals.HooksConfig):
    """Chapter 03b's configuration plus the learner's module, for the workers below."""

    path: str = ""
    """Absolute path of the learner's module."""


def hook_worker(cfg: LearnerConfig) -> dict:
    """DDP with the learner's ``fp16_allreduce_hook`` registered, trained by chapter 02's Trainer;
    saves each rank's parameters. Returns ``{"calls": [...]}``, one dict per hook call: ``elements``
    (the bucket's), ``sent`` (``[dtype, elements, async]`` of each all-reduce the hook made; async:
    it returned a Work) and ``returned`` (``[dtype, elements]`` of the value of the hook's future)."""
    hook = function_from(cfg.path, "fp16_allreduce_hook")
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        model, train_set, test_set, optimizer = ddp.build(cfg, ctx)
        calls = []

        def recorded(state, bucket):  # DDP checks that the second argument is named "bucket"
            call, sent = {"elements": bucket.buffer().numel(), "returned": None}, []
            calls.append(call)
            with patched(sent, ("all_reduce",)):
                future = hook(state, bucket)
            call["sent"] = [[dtype, n, work is not None] for _, dtype, n, work in sent]
            if not callable(getattr(future, "then", None)):
                raise TypeError(
                    f"fp16_allreduce_hook returned {type(future).__name__}, not a torch.futures.Future"
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
    steps on 2 ranks; checks, per hook call, one async float16 all-reduce of the bucket's elements and
    a float32 result of the bucket's size, then the parameters against one process (within 1e-4:
    float16 rounds each averaged gradient to about 5e-4 of its size, so the parameters move ~5e-4 of
    their displacement away from the reference)."""
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
            f"your hook's future returns {call['returned']} (dtype, "
            f"elements), not the bucket's float32 buffer of {n:,}: in the callback, copy fut.value()[0] into "
            f"buffer and return buffer",
        )
    total = sum(p.numel() for p in load_params(result.run_dir, 2)[0].values())
    compare_with_reference(ex, load_params(result.run_dir, 2), cfg, tol=1e-4)
    passed(
        ex,
        f"one asynchronous float16 all-reduce per bucket ({2 * total:,} bytes per step, not {4 * total:,}), "
        f"a float32 result, and the parameters within 1e-4 of one process on the combined batch",
    )


# --- 03b.3 ----------------------------------------------------------------------------------------


class _LearnerAccumulation(ddp_internals.AccumulationTrainer):
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
    """DDP trained with the learner's ``accumulate(model, loss_fn, micro_batches)``; saves each rank's
    parameters. Returns ``{"calls": all-reduces per optimizer step}``."""
    fn = function_from(cfg.path, "accumulate")
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        model, train_set, test_set, optimizer = ddp.build(cfg, ctx)
        trainer = _LearnerAccumulation(model, train_set, test_set, optimizer, ctx, cfg)
        trainer.accumulate, trainer.calls = fn, []
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
    plain = ddp_internals.HooksConfig(max_steps=4, **TINY)
    reference_run = launch(
        ddp_internals.hooks_worker, plain, 2, runs_dir="runs/exercises", name="reference"
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
        f"{k} micro-batches, as many all-reduces per optimizer step as without accumulation, and the "
        f"parameters of one process on the combined data",
    )


# --- 03b.4 ----------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class JoinConfig:
    """The learner's module and the uneven data of :func:`join_worker`."""

    path: str
    """Absolute path of the module defining ``train_uneven(model, optimizer, loss_fn, batches)``."""
    batches: int = 4
    """Batches of rank 0; the last rank has ``extra`` more."""
    extra: int = 2
    """How many more batches the last rank trains."""
    lr: float = 0.1
    """Plain SGD's learning rate."""
    timeout_s: float = 3.0
    """Collective timeout of DDP's process group: a rank alone in an all-reduce fails after this long."""
    start_timeout_s: float = 60.0
    """Timeout of starting the ranks (rendezvous, the default group): a rank that starts late is no error."""


def uneven_batches(
    cfg: JoinConfig, rank: int, world_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches: ``batches`` (+ ``extra`` on the last rank) pairs ``(4, 8)``, ``(4, 2)``."""
    g = torch.Generator().manual_seed(100 + rank)
    n = cfg.batches + (cfg.extra if rank == world_size - 1 else 0)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def join_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 2)


class _Counted(list):
    """A list that counts the items its loops have taken (``taken``)."""

    taken = 0

    def __iter__(self):
        for item in super().__iter__():
            self.taken += 1
            yield item


def join_worker(cfg: JoinConfig) -> dict:
    """DDP of a linear layer, plain SGD, the learner's ``train_uneven`` on uneven batches; gloo,
    DDP (and so ``Join``) on a group of its own with the ``timeout_s`` timeout. Saves each rank's
    parameters. An error in the loop names the training step it came from ("[step k of n]")."""
    fn = function_from(cfg.path, "train_uneven")
    with env.distributed("gloo", cfg.start_timeout_s) as ctx:
        group = dist.new_group(timeout=timedelta(seconds=cfg.timeout_s))
        model = ddp.apply_ddp(join_model(), ctx, process_group=group)
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        batches = _Counted(uneven_batches(cfg, ctx.rank, ctx.world_size))
        try:
            fn(model, optimizer, nn.functional.mse_loss, batches)
        except RuntimeError as e:
            raise RuntimeError(f"[step {batches.taken} of {len(batches)}] {e}") from e
        save_params(model.module, ctx.rank)
        return {}


def join_reference(cfg: JoinConfig, world_size: int) -> dict:
    """One process: at each step, the sum of the gradients of the ranks that still have a batch,
    divided by the world size (``Join``'s default, ``divide_by_initial_world_size=True``), one SGD step."""
    model = join_model()
    data = [uneven_batches(cfg, r, world_size) for r in range(world_size)]
    for step in range(max(map(len, data))):
        grads = [
            torch.autograd.grad(nn.functional.mse_loss(model(x), y), list(model.parameters()))
            for x, y in (d[step] for d in data if step < len(d))
        ]
        with torch.no_grad():
            for p, *gs in zip(model.parameters(), *grads):
                p -= cfg.lr * sum(gs) / world_size
    return model.state_dict()


def join_uneven(path: str = "ex03b_join.py") -> None:
    """03b.4: ``train_uneven(model, optimizer, loss_fn, batches)`` in ``path`` trains every batch
    although the last rank has 2 more; without ``Join`` the ranks fail after the 3 s timeout. Compares
    every rank with :func:`join_reference`."""
    ex = "03b.4 join"
    function_from(path, "train_uneven", ex)
    cfg = JoinConfig(path=str(Path(path).resolve()))
    try:
        result = run_ranks(ex, join_worker, cfg, 2, name="join")
    except RankFailed as e:
        step = re.search(r"\[step (\d+) of (\d+)\] .*time", e.hint, re.I)
        if not step:
            raise
        if (
            e.rank == 1 and int(step[1]) > cfg.batches
        ):  # the last rank, in an extra batch: no partner
            raise ExerciseError(
                ex,
                f"rank 1 gave up after the {cfg.timeout_s:g} s timeout in its step "
                f"{step[1]}: the last rank trains {cfg.extra} batches more, and its "
                f"all-reduce had no partner; wrap the loop in `with Join([model]):`",
            ) from None
        raise ExerciseError(
            ex,
            f"rank {e.rank} timed out in step {step[1]} of {step[2]}, where every rank still "
            f"trains: the machine was too busy for the {cfg.timeout_s:g} s timeout; run the "
            f"checker again",
        ) from None
    ranks, reference = load_params(result.run_dir, 2), join_reference(cfg, 2)
    require(max_diff(ranks[0], ranks[1]) < 1e-6, ex, "the ranks finished with different parameters")
    d = max_diff(ranks[0], reference)
    require(
        d < 1e-5,
        ex,
        f"the parameters differ from the reference by {d:.2g}: in the extra steps the last rank's "
        f"gradient is divided by the full world size (Join's default)",
    )
    passed(
        ex,
        f"the last rank trained {cfg.extra} batches more, nobody timed out, and every rank equals one "
        f"process summing the gradients of the ranks still training ÷ world size",
    )
