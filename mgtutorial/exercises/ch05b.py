"""Checkers of chapter 05b's exercises (notebooks/05b_elastic_and_hangs.ipynb): restoring a snapshot
after a rank is killed, a collective only one rank calls found with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``,
and what a rank that skips the last collective looks like with and without DETAIL.

05b.1 replays the elastic restart of the chapter's section 1 with :func:`mgtutorial.launch` (warm
ranks, seconds instead of torchrun's fresh interpreters): attempt 0, in which rank 1 SIGKILLs itself,
then attempt 1 with ``TORCHELASTIC_RESTART_COUNT=1``, resuming from the same snapshot file, as
``torchrun --max-restarts 1`` would start it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from mgtutorial import ddp
from mgtutorial.common.compare import max_abs_diff
from mgtutorial.exercises._common import (
    ExerciseError,
    RankFailed,
    answered,
    function_from,
    passed,
    require,
    run_file,
)
from mgtutorial.runtime import env, runlog
from mgtutorial.runtime.launcher import launch
from mgtutorial.runtime.run import WorkerFailed
from mgtutorial.scale import torchrun as scale

STEPS, EVERY, FAIL_STEP = 12, 4, 10  # snapshots at steps 4 and 8; rank 1 is killed after step 10
PROGRESS = (
    "epoch",
    "step",
    "batch",
    "samples",
)  # what ``restore`` returns, as save_checkpoint stores it


@dataclasses.dataclass(kw_only=True)
class RestoreConfig(ddp.DDPConfig):
    """:class:`mgtutorial.ddp.DDPConfig` of 05b.1's ranks, with the learner's file."""

    path: str = ""
    """The file holding ``restore(path, model, optimizer, device)`` (imported in each rank)."""


def restore_config(checkpoint: str, path: str = "") -> RestoreConfig:
    """Chapter 02's tiny job of 05b (digits, ``STEPS`` steps), a snapshot every ``EVERY`` steps and
    rank 1 SIGKILL-ed after step ``FAIL_STEP`` of the first attempt."""
    return RestoreConfig(
        dataset="digits",
        epochs=1,
        max_steps=STEPS,
        evaluate=False,
        backend="gloo",
        checkpoint=checkpoint,
        checkpoint_every=EVERY,
        fail_rank=1,
        fail_step=FAIL_STEP,
        fail_how="sigkill",
        timeout_s=30,
        path=path,
    )


class RestoringTrainer(ddp.Trainer):
    """:class:`mgtutorial.ddp.Trainer` that resumes with the learner's
    ``restore(path, model, optimizer, device) -> {"epoch", "step", "batch", "samples"}`` when a
    snapshot exists. Raises ValueError (in the rank) if the progress lacks one of those keys."""

    def __init__(self, *args, restore):
        super().__init__(*args)  # cfg.resume is False: the Trainer restored nothing itself
        if Path(self.cfg.checkpoint).exists():
            progress = restore(self.cfg.checkpoint, self.model, self.optimizer, self.ctx.device)
            missing = [
                k for k in PROGRESS if k not in (progress if isinstance(progress, dict) else {})
            ]
            if missing:
                raise ValueError(
                    f"restore returned {progress!r}, without {missing}: return the progress "
                    f"the snapshot holds, a dict with {list(PROGRESS)}"
                )
            self.first_epoch, self.step, self.skip, self.samples = (
                int(progress[k]) for k in PROGRESS
            )
            self.first_samples = self.samples
            self.log.resume(
                step=self.step, epoch=self.first_epoch, batch=self.skip, attempt=self.attempt
            )


def restore_worker(cfg: RestoreConfig) -> dict:
    """One rank of 05b.1: chapter 02's training, resumed by ``restore`` from the file ``cfg.path``."""
    restore = function_from(cfg.path, "restore", "05b.1")
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        model, train_set, test_set, optimizer = ddp.build(cfg, ctx)
        return RestoringTrainer(
            model, train_set, test_set, optimizer, ctx, cfg, restore=restore
        ).train()


def _attempt(
    ex: str, cfg: RestoreConfig, runs_dir: str, restart: int
) -> tuple[list[dict], WorkerFailed | None]:
    """Run attempt ``restart`` of 05b.1's job (2 ranks); return its records and its failure, if any.
    Every rank is ended before it returns."""
    run = launch(
        restore_worker,
        cfg,
        2,
        runs_dir=runs_dir,
        name=f"ex05b-restore-attempt{restart}",
        extra_env={"TORCHELASTIC_RESTART_COUNT": str(restart)},
    )
    failure = None
    try:
        run.wait(timeout=120)
    except WorkerFailed as e:
        failure = e
    except TimeoutError:
        raise ExerciseError(
            ex,
            f"attempt {restart} did not finish within 120 s (stopped): does `restore` "
            f"block, or load a file other than `path`?",
        ) from None
    finally:
        run.stop()
    return sorted(runlog.read_run(run.run_dir), key=lambda rec: rec["time"]), failure


def resume_after_kill(path: str = "ex05b_restore.py", runs_dir: str = "runs/exercises") -> None:
    """05b.1: ``restore(path, model, optimizer, device)`` in the file ``path`` loads a snapshot of
    :func:`mgtutorial.common.checkpoint.save_checkpoint` into the (DDP) model and the optimizer and returns
    its progress ``{"epoch", "step", "batch", "samples"}`` (ints).

    Replays ``torchrun --max-restarts 1`` with :func:`mgtutorial.launch`: attempt 0 with rank 1
    killed after step 10, then attempt 1 (``TORCHELASTIC_RESTART_COUNT=1``) on the same snapshot
    file. Verifies from the records that both restarted ranks resumed at the last snapshot (step 8,
    its batch), counted the samples of the steps trained twice as the first attempt did, trained
    steps 9 … 12, and that the final parameters equal a single process trained on the combined batches.
    """
    import torch

    ex = "05b.1 resume after a kill"
    function_from(path, "restore", ex)  # a missing file or a syntax error, before anything starts
    ckpt = Path(runs_dir).resolve() / "ex05b-restore.pt"
    ckpt.unlink(missing_ok=True)
    cfg = restore_config(str(ckpt), str(Path(path).resolve()))
    before, killed = _attempt(ex, cfg, runs_dir, 0)
    steps = {rec["step"] for rec in before if rec["kind"] == "train" and rec["rank"] == 1}
    require(
        killed is not None and killed.rank == 1 and max(steps, default=0) == FAIL_STEP,
        ex,
        f"attempt 0 did not end with rank 1 killed after step {FAIL_STEP} (its steps: {sorted(steps)}; "
        f"{killed or 'no failure'}): is DDPConfig's fault injection unchanged in mgtutorial.ddp?",
    )
    after, failure = _attempt(ex, cfg, runs_dir, 1)
    require(
        failure is None,
        ex,
        f"attempt 1 (the restart) failed: rank {failure and failure.rank} raised "
        f"{failure and failure.exc_type}: {failure and scale.short(failure.message)}: "
        f"look at `restore` in {Path(path).name}",
    )
    resumes = [rec for rec in after if rec["kind"] == "resume"]
    require(resumes, ex, "the restarted ranks logged no resume: did the snapshot file exist?")
    snaps = [rec for rec in before if rec["kind"] == "checkpoint"]
    last = snaps[-1]["step"]
    for rec in resumes:
        require(
            rec["step"] == last,
            ex,
            f"rank {rec['rank']} resumed at step {rec['step']}, but the last snapshot before the kill was "
            f"taken at step {last}: return the progress the snapshot holds (its {', '.join(PROGRESS)})",
        )
        require(
            rec["batch"] == snaps[-1]["batch"],
            ex,
            f"rank {rec['rank']} resumed at batch {rec['batch']} of the epoch, but the snapshot of step "
            f"{last} was taken after batch {snaps[-1]['batch']}: 'batch' says how many batches of the "
            f"epoch are done",
        )
    first = {(rec["rank"], rec["step"]): rec["samples"] for rec in before if rec["kind"] == "train"}
    train = [rec for rec in after if rec["kind"] == "train"]
    for rec in (rec for rec in train if (rec["rank"], rec["step"]) in first):
        require(
            rec["samples"] == first[rec["rank"], rec["step"]],
            ex,
            f"after the restart rank {rec['rank']} logged {rec['samples']} samples at step {rec['step']}, "
            f"the first attempt {first[rec['rank'], rec['step']]}: 'samples' counts the samples this "
            f"rank trained before the snapshot",
        )
    redone = sorted({rec["step"] for rec in train})
    require(
        redone == list(range(last + 1, STEPS + 1)),
        ex,
        f"after the restart the ranks trained steps {redone}, not {last + 1} … {STEPS}: "
        f"the 'batch' of the progress says how many batches of the epoch are done",
    )
    final = torch.load(ckpt, map_location="cpu", weights_only=True)
    reference = ddp.combined_batch_reference(dataclasses.replace(cfg, fail_rank=-1), 2)
    diff = max_abs_diff(reference.state_dict(), final["model"])
    require(
        diff < 1e-5,
        ex,
        f"after step {final['step']} the parameters differ from an uninterrupted run's by "
        f"{diff:.1e}: restore the optimizer's state too (SGD's momentum buffers)",
    )
    passed(
        ex,
        f"rank 1 killed after step {FAIL_STEP}, both ranks resumed at step {last}, and the "
        f"parameters after step {STEPS} equal an uninterrupted run's",
    )


def _fingerprint(message: str) -> str:
    """What a DETAIL mismatch error says of the failing rank's own call (the peer's side is garbled:
    the peer is inside DETAIL's own check by then)."""
    m = re.search(
        r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+),? ?OpType=(\w+)",
        message,
    )
    return (
        (
            f"rank {m[1]} was calling {m[3]} as its collective #{m[2]} while its peer called another one "
            f"(a BARRIER is env.distributed's, when the worker returns)"
        )
        if m
        else ""
    )


def rank_zero_metric(path: str = "ex05b_metric.py") -> None:
    """05b.2: ``worker(cfg)`` in ``path`` returns, on rank 0, ``[(step, mean over ranks of
    rank + step)]`` for steps 0 and 2 of 4, and ``[]`` on the other ranks.

    Runs 2 ranks with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` and a 3-s collective timeout
    (``cfg.options["timeout_s"]``); compares with the means computed here.
    """
    ex = "05b.2 a metric only rank 0 logs"
    try:
        values = run_file(
            ex,
            path,
            "worker",
            2,
            options={"timeout_s": 3},
            timeout_s=60,
            extra_env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
        ).values
    except RankFailed as e:
        seen = _fingerprint(e.hint) or scale.short(e.hint)[:300]
        raise ExerciseError(
            ex,
            f"DETAIL stopped the job: {seen}. Every rank must call the same "
            f"collectives in the same order: no all_reduce under `if ctx.rank == 0`",
        ) from None
    want = [[step, (0 + step + 1 + step) / 2] for step in (0, 2)]
    got = [[int(s), float(m)] for s, m in values[0]] if isinstance(values[0], list) else values[0]
    require(
        got == want,
        ex,
        f"rank 0 returned {values[0]!r}, not {want}: the mean is the all-reduced "
        f"sum divided by the world size",
    )
    require(
        values[1] == [],
        ex,
        f"rank 1 returned {values[1]!r}: only rank 0 logs (returns [] elsewhere)",
    )
    passed(
        ex, "under DETAIL both ranks made the same all-reduces; rank 0 logged the means 0.5 and 2.5"
    )


def last_step_skipped(predicted: dict) -> None:
    """05b.3: predictions for ``HangConfig(skip_step=2)`` (rank 1 skips the last all-reduce, then works
    alone 6 s) with a 2-s timeout: ``predicted["failing_rank"]`` and ``predicted["error_type"]``
    (the rank the launcher names and its exception type, without DETAIL) and
    ``predicted["detail_names_rank"]`` (the rank DETAIL's error says is missing).

    Runs both jobs at once and reads the launcher's errors.
    """
    ex = "05b.3 the last step skipped"
    guess = {
        k: answered(predicted.get(k, ...), ex, f"predicted[{k!r}]")
        for k in ("failing_rank", "error_type", "detail_names_rank")
    }
    cfg = scale.HangConfig(skip_step=2, timeout_s=2, rank_work_s=6, backend="gloo")
    runs = [
        launch(scale.hang_worker, cfg, 2, runs_dir="runs/exercises", name=name, extra_env=extra)
        for name, extra in (
            ("ex05b-last", {}),
            ("ex05b-last-detail", {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
        )
    ]
    errors = []
    try:
        for run in runs:
            try:
                run.wait(timeout=60)
                errors.append(None)
            except WorkerFailed as e:
                errors.append(e)
    except TimeoutError as e:
        raise ExerciseError(
            ex,
            f"a job was still running after 60 s ({e}): its 2-s timeout should end it "
            f"long before; the machine may be busy, run the checker again",
        ) from e
    finally:
        for run in runs:  # both, whatever happened
            run.stop()
    plain, detail = errors
    require(
        plain is not None and detail is not None,
        ex,
        "a job finished without an error: is HangConfig unchanged in mgtutorial.scale.torchrun?",
    )
    missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", detail.message)
    require(
        missing, ex, f"DETAIL reported something unexpected: {scale.short(detail.message)[:200]}"
    )
    named = int(missing[1].split(",")[0])
    require(
        guess["failing_rank"] == plain.rank,
        ex,
        f"the launcher named rank {plain.rank}, not {guess['failing_rank']}: which rank is left inside "
        f"an all-reduce when the other one skips it and works alone?",
    )
    require(
        guess["error_type"] == plain.exc_type,
        ex,
        f"rank {plain.rank} failed with {plain.exc_type}, not {guess['error_type']!r}: its peer never "
        f"came, so what ended the wait? (a string, e.g. 'ValueError')",
    )
    require(
        guess["detail_names_rank"] == named,
        ex,
        f"DETAIL's error names rank {named} as missing, not {guess['detail_names_rank']}: before each "
        f"collective DETAIL waits in a monitored barrier and names the ranks that did not arrive",
    )
    passed(
        ex,
        f"rank {plain.rank} failed with {plain.exc_type}, and DETAIL named rank {named} as the one "
        f"that never arrived",
    )
