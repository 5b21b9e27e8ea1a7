"""Checkers of chapter 02's exercises (notebooks/02_ddp.ipynb): a failing rank, chapter 01's loop
made a DDP rank, the last, shorter batch of an epoch on 3 ranks, and the linear scaling
rule."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from mgtutorial import ddp
from mgtutorial.common import data
from mgtutorial.common.compare import float32_tolerance, max_abs_diff
from mgtutorial.exercises import ch02_ranks
from mgtutorial.exercises._common import (
    ExerciseError,
    answered,
    attempt,
    close,
    function_from,
    passed,
    require,
    run_ranks,
)
from mgtutorial.runtime import env
from mgtutorial.runtime.launcher import launch
from mgtutorial.runtime.run import WorkerFailed
from mgtutorial.runtime.runlog import read_run
from mgtutorial.scale.elastic import ElasticConfig, elastic_worker


def failing_rank(cfg: ElasticConfig, predicted: dict) -> None:
    """02.1: ``cfg`` makes rank 1 fail with ``fail_rank=1, fail_step=5``: after 5 completed, logged
    steps, before step 6. ``predicted["rank"]`` is the rank the error names and
    ``predicted["steps_logged"]`` the number of steps rank 0's log holds when the job stops.
    Launches :func:`mgtutorial.scale.elastic.elastic_worker` (chapter 02's worker with the fault
    injection) on 2 ranks and reads the run's logs."""
    ex = "02.1 a failing rank"
    guess = {
        k: answered(predicted.get(k), ex, f"predicted[{k!r}]") for k in ("rank", "steps_logged")
    }
    require(
        (cfg.fail_rank, cfg.fail_step) == (1, 5),
        ex,
        f"cfg has fail_rank={cfg.fail_rank}, fail_step="
        f"{cfg.fail_step}: set fail_rank=1, fail_step=5 (rank 1 "
        "then raises after 5 completed, logged steps, before step 6)",
    )
    run = launch(elastic_worker, cfg, 2, runs_dir="runs/exercises", name="ex02_fail")
    try:
        run.wait(timeout=60)
    except WorkerFailed as e:
        failed = e
    except TimeoutError:
        run.stop()
        raise ExerciseError(
            ex, "the job did not stop within 60 s: is cfg.max_steps small?"
        ) from None
    else:
        raise ExerciseError(
            ex,
            f"every rank finished: cfg.max_steps={cfg.max_steps} ends the run before "
            "step 5; allow more steps",
        )
    logged = sum(1 for rec in read_run(run.run_dir) if rec["kind"] == "train" and rec["rank"] == 0)
    require(
        guess["rank"] == failed.rank,
        ex,
        f"the error does not name rank {guess['rank']}: launch names the rank whose error came "
        "first, not the ranks that failed because of it",
    )
    require(
        guess["steps_logged"] == logged,
        ex,
        f"rank 0 did not log {guess['steps_logged']} steps: every logged step ends in an "
        "all-reduce (the global loss), so no rank can log a step that the other did not",
    )
    err = Path(failed.log_path).read_text().strip().splitlines()[-1]
    passed(
        ex,
        f"rank {failed.rank} failed; rank 0 logged {logged} steps, then failed in its next "
        f"collective (gloo) or was stopped (NCCL) because of it; rank{failed.rank}.err ends with "
        f"'{err}'",
    )


def own_rank(path: str = "ex02_rank.py") -> None:
    """02.2: ``train(cfg, ctx)`` in ``path`` is chapter 01's loop made one rank of DDP, run in the
    rank's process group (``ctx``: :class:`~mgtutorial.runtime.env.DistContext`); it returns the
    model (wrapped or not). Runs it on 2 ranks
    (:func:`~mgtutorial.exercises.ch02_ranks.rank_worker`: 2 epochs of the digits, batch 32 per
    rank, SGD) and compares each rank's parameters with one
    process trained on the ranks' combined batches
    (:func:`~mgtutorial.exercises.ch02_ranks.one_process`), within ``float32_tolerance``."""
    ex = "02.2 your own DDP rank"
    function_from(path, "train", ex)  # a missing file or a syntax error, before any rank starts
    cfg = ch02_ranks.RankExerciseConfig(path=str(Path(path).resolve()))
    run_dir = run_ranks(ex, ch02_ranks.rank_worker, cfg, 2, timeout_s=120, name="ex02_rank").run_dir
    got = [torch.load(run_dir / f"params{r}.pt", weights_only=True) for r in (0, 1)]
    tol = float32_tolerance("cuda" if env.resolve_backend("auto", 2) == "nccl" else "cpu")
    require(
        max_abs_diff(got[1], got[0]) < tol,
        ex,
        "the two ranks end with different models: each stepped on its own gradients. Which of "
        "the changes of 'What changed from chapter 01' makes every rank take the same step?",
    )
    if max_abs_diff(got[0], ch02_ranks.one_process(cfg)) < tol:
        return passed(
            ex,
            f"2 ranks trained {cfg.epochs} epochs on their own shares and equal one process on "
            f"the combined batches (within {tol:g})",
        )
    for ref, why in (
        (
            dict(ranks=(0, 0)),
            "the model of rank 0's share only: both ranks drew the same samples. Tell the "
            "sampler which rank this is",
        ),
        (
            dict(set_epoch=False),
            "right in epoch 0, but epoch 1 repeated epoch 0's order: what does the sampler need "
            "at the start of every epoch?",
        ),
    ):
        # a diagnosis, not a pass: float32 sums in another order drift apart over 2 epochs of
        # momentum SGD, so a wrong answer is recognised within a looser bound than the pass
        require(max_abs_diff(got[0], ch02_ranks.one_process(cfg, **ref)) >= 100 * tol, ex, why)
    raise ExerciseError(
        ex,
        "the ranks agree, but not with one process on the combined batches: does each rank train "
        "on its own share of every epoch? Compare your rank with the five changes of 'What "
        "changed from chapter 01' (the seed, the loss and the optimizer stay chapter 01's)",
    )


def last_batch(predicted: dict, nprocs: int = 3, batch_size: int = 100) -> None:
    """02.3: predictions for DDP on ``nprocs`` ranks with ``batch_size`` per rank over the whole
    first epoch of the digits: ``"samples_per_rank"``, ``"steps"`` (batches per rank),
    ``"last_batch"`` (samples in each rank's last batch), and ``"equal"`` (bool: DDP's parameters
    equal one process trained on the combined batches, largest difference < 1e-5; < 1e-4 with GPU
    ranks).

    Launches ``ddp.worker`` for that epoch (full float32: ``tf32=False``) and trains the reference
    here with ``ddp.combined_batch_reference``.
    """
    ex = "02.3 the last, shorter batch"
    keys = ("samples_per_rank", "steps", "last_batch", "equal")
    guess = {k: answered(predicted.get(k), ex, f"predicted[{k!r}]") for k in keys}
    train_set = data.load_digits()[0]
    loaders = [data.train_loader(train_set, batch_size, r, nprocs) for r in range(nprocs)]
    per_rank, steps = len(loaders[0].sampler), len(loaders[0])
    last = {len(list(loader)[-1][1]) for loader in loaders}
    require(
        guess["samples_per_rank"] == per_rank,
        ex,
        f'predicted["samples_per_rank"] = {guess["samples_per_rank"]}: the sampler pads '
        f"{len(train_set)} samples up to a multiple of {nprocs} ranks, then deals them out",
    )
    require(
        guess["steps"] == steps,
        ex,
        f'predicted["steps"] = {guess["steps"]}: how many batches of {batch_size} does one '
        "rank's share make, when the loader keeps a last, shorter one (drop_last=False)?",
    )
    require(
        {guess["last_batch"]} == last,
        ex,
        f'predicted["last_batch"] = {guess["last_batch"]}: the last batch holds what the '
        "full batches leave of one rank's share",
    )
    checkpoint = Path("runs/exercises/ex02_last_batch.pt").resolve()
    cfg = ddp.DDPConfig(
        dataset="digits",
        epochs=1,
        batch_size=batch_size,
        max_steps=steps,
        evaluate=False,
        tf32=False,
        checkpoint=str(checkpoint),
    )
    run_ranks(ex, ddp.worker, cfg, nprocs, name="ex02_last_batch")
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    diff = max_abs_diff(ddp.combined_batch_reference(cfg, nprocs).state_dict(), state)
    gpus = env.resolve_backend("auto", nprocs) == "nccl"
    equal = diff < float32_tolerance("cuda" if gpus else "cpu")  # chapter 02's tolerance
    require(
        guess["equal"] == equal,
        ex,
        f'predicted["equal"] = {guess["equal"]}: not what the run and the reference show. At the '
        "last step, does every rank's batch have the same size, and what does DDP average?",
    )
    passed(
        ex,
        f"{per_rank} samples per rank, {steps} steps, the last of {last.pop()} on every rank: "
        + ("DDP still equals one process on the combined batches" if equal else "DDP differs"),
    )


def _reference_lr(
    step: int, base_lr: float, base_batch: int, batch_size: int, world_size: int, warmup_steps: int
) -> float:
    target = base_lr * batch_size * world_size / base_batch
    return target if step >= warmup_steps else base_lr + (target - base_lr) * step / warmup_steps


def _shown(kw: dict) -> str:
    return "lr_at(step, " + ", ".join(f"{k}={v}" for k, v in kw.items()) + ")"


CASES = (  # (base_lr, base_batch, batch_size, world_size, warmup_steps)
    (0.01, 16, 16, 2, 10),
    (0.01, 16, 32, 4, 20),
    (0.1, 256, 32, 8, 100),
    (0.1, 256, 64, 8, 0),
)


def linear_scaling(lr_at: Callable) -> None:
    """02.4: ``lr_at(step, *, base_lr, base_batch, batch_size, world_size, warmup_steps) ->
    float`` is the learning rate at optimizer ``step`` (0, 1, …) under the linear scaling rule with
    a linear warm-up from ``base_lr``. Compared with the rule on a few configurations and steps."""
    ex = "02.4 linear scaling rule"
    cases = [
        dict(zip(("base_lr", "base_batch", "batch_size", "world_size", "warmup_steps"), c))
        for c in CASES
    ]
    for kw in cases:  # first the rate after warm-up, then the warm-up itself
        base_lr, base_batch, warmup = kw["base_lr"], kw["base_batch"], kw["warmup_steps"]
        where = _shown(kw)
        target = _reference_lr(warmup, **kw)
        effective = kw["batch_size"] * kw["world_size"]
        got = attempt(ex, lr_at, warmup + 1, **kw)
        require(
            not close(got, base_lr * kw["world_size"]) or close(target, got),
            ex,
            f"after warm-up {where} is {got:g}: you scaled by the number of ranks only; the "
            f"effective batch is batch_size × world_size = {effective}, "
            f"{effective / base_batch:g}× base_batch",
        )
        require(
            close(got, target),
            ex,
            f"after warm-up {where} is {got:g}: multiply base_lr by the factor the batch grew, "
            f"(batch_size × world_size) / base_batch = {effective}/{base_batch}",
        )
    for kw in cases:  # the whole line, not only the points above: every step, and a late one
        warmup, where = kw["warmup_steps"], _shown(kw)
        for step in [*range(warmup + 4), 10 * warmup + 1000]:
            got = attempt(ex, lr_at, step, **kw)
            require(
                close(got, _reference_lr(step, **kw)),
                ex,
                f"{where} at step {step} is {got:g}, off the rule: a straight line from base_lr "
                "at step 0 (the warm-up's start) to the scaled rate at step warmup_steps, and the "
                "scaled rate from there on",
            )
    example = _reference_lr(10, *CASES[0])
    passed(
        ex,
        f"lr_at follows the rule on {len(CASES)} configurations, e.g. 2 ranks of 16 against a "
        f"base batch of 16: 0.01 rising to {example:g}",
    )
