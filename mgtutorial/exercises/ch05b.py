"""Checkers of chapter 05b's exercises (notebooks/05b_elastic_restarts.ipynb): restoring a
snapshot after a rank is killed.

05b.1's ranks run :class:`mgtutorial.scale.elastic.ElasticTrainer` with the learner's ``restore``;
its checker replays ``torchrun --max-restarts 1`` with :func:`mgtutorial.launch` (warm ranks): three
nodes, one of them lost, the restart on the two left (a world size the snapshot was not counted
at), each rank with the restart count its own node's agent gives it (section 1 of the notebook).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from mgtutorial import ddp
from mgtutorial.common import compare
from mgtutorial.exercises._common import (
    ExerciseError,
    function_from,
    passed,
    require,
)
from mgtutorial.runtime import env, runlog
from mgtutorial.runtime.launcher import launch
from mgtutorial.runtime.run import WorkerFailed
from mgtutorial.scale import elastic
from mgtutorial.scale.output import short

STEPS, EVERY, FAIL_STEP = 12, 4, 10  # snapshots at steps 4 and 8; rank 2 is killed after step 10
FAIL_RANK = 2  # the rank killed in attempt 0; its node does not come back
WORLD = {0: 3, 1: 2}
"""Attempt -> its world size: three nodes of one rank, then the two that are left (``--nnodes 2:3``:
the job goes on without the lost node, section 2's membership change the other way)."""
PROGRESS = ("epoch", "step", "batch", "samples")  # what ``restore`` returns, as saved
RESTART_COUNTS = {0: (0, 0, 0), 1: (0, 1)}
"""Attempt -> the ``TORCHELASTIC_RESTART_COUNT`` of each rank, one rank per node: in the restart,
one surviving agent saw its rank fail first and counts it (1), the other restarts its healthy rank
for the membership change and does not (0), the race of section 1 of the notebook."""


@dataclasses.dataclass(kw_only=True)
class RestoreConfig(elastic.ElasticConfig):
    """:class:`mgtutorial.scale.elastic.ElasticConfig` of 05b.1's ranks, with the learner's file."""

    path: str = ""
    """The file holding ``restore(path, model, optimizer, device)`` (imported in each rank)."""
    restart_counts: tuple[int, ...] = ()
    """``TORCHELASTIC_RESTART_COUNT`` per rank, as each rank's node's agent would set it (empty:
    the launcher's, the same for every rank)."""


def restore_config(checkpoint: str, path: str = "") -> RestoreConfig:
    """05b's tiny elastic job (digits, ``STEPS`` steps), a snapshot every ``EVERY`` steps and rank
    ``FAIL_RANK`` SIGKILL-ed after step ``FAIL_STEP`` of the first attempt."""
    job = dict(dataset="digits", epochs=1, max_steps=STEPS, evaluate=False, backend="gloo")
    fault = dict(
        checkpoint_every=EVERY, fail_rank=FAIL_RANK, fail_step=FAIL_STEP, fail_how="sigkill"
    )
    return RestoreConfig(**job, **fault, timeout_s=15, checkpoint=checkpoint, path=path)


class RestoringTrainer(elastic.ElasticTrainer):
    """:class:`mgtutorial.scale.elastic.ElasticTrainer` that resumes with the learner's
    ``restore(path, model, optimizer, device) -> {"epoch", "step", "batch", "samples"}`` when a
    snapshot exists. Raises ValueError (in the rank) if the progress lacks one of those keys, or
    counts no samples for a snapshot taken after step 0."""

    def __init__(self, *args, restore):
        super().__init__(*args)  # cfg.resume is False: the Trainer restored nothing itself
        if Path(self.cfg.checkpoint).exists():
            progress = restore(self.cfg.checkpoint, self.model, self.optimizer, self.ctx.device)
            got = progress if isinstance(progress, dict) else {}
            if missing := [k for k in PROGRESS if k not in got]:
                raise ValueError(
                    f"restore returned {progress!r}, without {missing}: return the progress "
                    f"the snapshot holds, a dict with {list(PROGRESS)}"
                )
            progress = [int(progress[k]) for k in PROGRESS]
            if progress[1] > 0 and progress[3] == 0:  # a run that resumed has trained samples
                raise ValueError(
                    f"restore returned 'samples': 0 for a snapshot of step {progress[1]}: return "
                    "the samples the snapshot holds (the records count on from it, and a rank "
                    "with 0 counts as not resumed)"
                )
            self.first_epoch, self.step, self.skip, self.samples = progress
            self.first_samples = self.samples
            self.log.resume(
                step=self.step, epoch=self.first_epoch, batch=self.skip, attempt=self.attempt
            )


WITHHELD = (
    "checkpoint.load_checkpoint is withheld in 05b.1: write the load yourself (what it does is "
    "section 1's, the snapshot's keys printed there)"
)


def withhold_loader() -> None:
    """In this rank, make the package's own loader (``checkpoint.load_checkpoint``, also under the
    name chapter 02's Trainer imported) raise RuntimeError: 05b.1 asks for that load itself. The
    Trainer does not call it here (``cfg.resume`` is False: ``restore`` resumes)."""
    from mgtutorial.common import checkpoint
    from mgtutorial.ddp import trainer

    def withheld(*args, **kwargs):
        raise RuntimeError(WITHHELD)

    checkpoint.load_checkpoint = trainer.load_checkpoint = withheld


def restore_worker(cfg: RestoreConfig) -> dict:
    """One rank of 05b.1: the elastic job, resumed by ``restore`` from the file ``cfg.path``."""
    withhold_loader()  # before the learner's file is imported: a name it imports is withheld too
    restore = function_from(cfg.path, "restore", "05b.1")
    if cfg.restart_counts:  # one node per rank: each agent's own count
        count = cfg.restart_counts[int(os.environ["RANK"])]
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(count)
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        model, train_set, test_set, optimizer = ddp.build(cfg, ctx)
        trainer = RestoringTrainer(model, train_set, test_set, optimizer, ctx, cfg, restore=restore)
        return trainer.train()


def resized_reference(cfg: RestoreConfig, resized: int):
    """One plain process trained on what the ranks trained together: the first ``resized`` steps on
    the combined batches of ``WORLD[0]`` ranks, the rest on those of ``WORLD[1]``. Every
    DistributedSampler deals the same shuffled order of the epoch to its ranks in turn, so a step
    of W ranks trains the next ``W × batch_size`` samples of that order (a world-size-1 sampler's);
    returns the model (CPU) after ``cfg.max_steps`` steps, all in epoch 0."""
    import torch
    from torch import nn
    from torch.utils.data import default_collate

    from mgtutorial.ddp import setup

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank computes: 12 steps amplify a reduction's rounding
    try:
        return _resized_steps(cfg, resized, nn, default_collate, setup)
    finally:
        torch.set_num_threads(threads)


def _resized_steps(cfg: RestoreConfig, resized: int, nn, default_collate, setup):
    model, train_set, _, optimizer = ddp.build(cfg, env.DistContext.single_process())
    order = list(setup.rank_loader(train_set, cfg, 0, 1).sampler)  # epoch 0's order
    start = 0
    for step in range(cfg.max_steps):
        w, b = WORLD[0 if step < resized else 1], cfg.batch_size
        # rank r's batch is the order's start + r, start + r + w, …: concatenated in rank order
        x, y = default_collate(
            [train_set[order[start + r + w * j]] for r in range(w) for j in range(b)]
        )
        start += w * b
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model


def wait_failure(ex: str, run, timeout: float, hint: str) -> WorkerFailed | None:
    """Wait for ``run``: its :class:`WorkerFailed`, or None if every rank finished. A run still
    going after ``timeout`` seconds raises ExerciseError with ``hint``. Its ranks are ended."""
    try:
        run.wait(timeout=timeout)
    except WorkerFailed as e:
        return e
    except TimeoutError:
        raise ExerciseError(ex, f"still running after {timeout:g} s (stopped): {hint}") from None
    finally:
        run.stop()
    return None


def _attempt(ex: str, cfg: RestoreConfig, runs_dir: str, restart: int):
    """Run attempt ``restart`` of 05b.1's job (:data:`WORLD` ranks, each with its agent's count of
    :data:`RESTART_COUNTS`); return its records (by time) and its :class:`WorkerFailed`, or None."""
    name = f"ex05b-restore-attempt{restart}"
    cfg = dataclasses.replace(cfg, restart_counts=RESTART_COUNTS[restart])
    if restart:  # the killed rank is gone (the fault acts only in a run that did not resume)
        cfg = dataclasses.replace(cfg, fail_rank=-1)
    run = launch(restore_worker, cfg, WORLD[restart], runs_dir=runs_dir, name=name)
    hint = f"attempt {restart}: does `restore` block, or load a file other than `path`?"
    failure = wait_failure(ex, run, 120, hint)
    return sorted(runlog.read_run(run.run_dir), key=lambda rec: rec["time"]), failure


def resume_after_kill(path: str = "ex05b_restore.py", runs_dir: str = "runs/exercises") -> None:
    """05b.1: ``restore(path, model, optimizer, device)`` in the file ``path`` loads a snapshot of
    :func:`mgtutorial.common.checkpoint.save_checkpoint` into the (DDP) model and the optimizer and
    returns its progress ``{"epoch", "step", "batch", "samples"}`` (ints), without the package's
    own loader (:func:`withhold_loader`: ``checkpoint.load_checkpoint`` raises in the ranks).

    Replays ``torchrun --max-restarts 1`` with :func:`mgtutorial.launch`: attempt 0 on 3 ranks
    (one per node) with rank 2 killed after step 10, then attempt 1 on the 2 ranks left, on the same
    snapshot file, where rank 0 gets ``TORCHELASTIC_RESTART_COUNT=0`` and rank 1 gets 1
    (:data:`RESTART_COUNTS`: each node's agent counts for itself). Verifies from the records that
    both restarted ranks resumed at the last snapshot (step 8) at its position converted to world
    size 2 (batch 8 × 3 // 2), whatever their count, counted the samples of the steps trained twice
    as the first attempt did, trained steps 9 … 12, and that the final parameters equal one process
    trained on the same samples (:func:`resized_reference`).
    """
    import torch

    ex = "05b.1 resume after a kill"
    function_from(path, "restore", ex)  # a missing file or a syntax error, before anything starts
    ckpt = Path(runs_dir).resolve() / "ex05b-restore.pt"
    ckpt.unlink(missing_ok=True)
    cfg = restore_config(str(ckpt), str(Path(path).resolve()))
    before, killed = _attempt(ex, cfg, runs_dir, 0)
    steps = {rec["step"] for rec in before if rec["kind"] == "train" and rec["rank"] == FAIL_RANK}
    require(
        killed is not None and killed.rank == FAIL_RANK and max(steps, default=0) == FAIL_STEP,
        ex,
        f"attempt 0 did not end with rank {FAIL_RANK} killed after step {FAIL_STEP} (its steps: "
        f"{sorted(steps)}; {killed or 'no failure'}): is ElasticTrainer's fault injection "
        "unchanged in mgtutorial.scale.elastic?",
    )
    after, failure = _attempt(ex, cfg, runs_dir, 1)
    require(
        failure is None,
        ex,
        f"attempt 1 (the restart) failed: rank {failure and failure.rank} raised "
        f"{failure and failure.exc_type}: {failure and short(failure.message)}: "
        f"look at `restore` in {Path(path).name}",
    )
    resumes = [rec for rec in after if rec["kind"] == "resume"]
    require(resumes, ex, "the restarted ranks logged no resume: did the snapshot file exist?")
    counts = {rec["rank"]: rec["attempt"] for rec in resumes}
    if counts != dict(enumerate(RESTART_COUNTS[1])):  # the replay itself, not the learner's code
        raise RuntimeError(f"05b.1's replay gave the ranks the restart counts {counts}")
    snap = [rec for rec in before if rec["kind"] == "checkpoint"][-1]
    last, batch = snap["step"], snap["batch"] * WORLD[0] // WORLD[1]  # the same samples done
    for rec in resumes:
        require(
            (rec["step"], rec["batch"]) == (last, batch),
            ex,
            f"rank {rec['rank']} resumed at step {rec['step']}, batch {rec['batch']} of the epoch: "
            f"the last snapshot before the kill was taken at step {last}, after "
            f"{snap['batch']} batches per rank at world size {WORLD[0]}, and the restart runs at "
            f"world size {WORLD[1]}: return the progress it holds ({', '.join(PROGRESS)}), with "
            "'batch' counted in the batches per rank of the world this rank is in",
        )
    first = {(rec["rank"], rec["step"]): rec["samples"] for rec in before if rec["kind"] == "train"}
    train = [rec for rec in after if rec["kind"] == "train"]
    for rec in train:
        was = first.get((rec["rank"], rec["step"]), rec["samples"])
        require(
            rec["samples"] == was,
            ex,
            f"after the restart rank {rec['rank']} logged {rec['samples']} samples at step "
            f"{rec['step']}, the first attempt {was}: 'samples' counts the samples this rank "
            "trained before the snapshot",
        )
    redone = sorted({rec["step"] for rec in train})
    require(
        redone == list(range(last + 1, STEPS + 1)),
        ex,
        f"after the restart the ranks trained steps {redone}, not {last + 1} … {STEPS}: "
        f"the 'batch' of the progress says how many batches of the epoch are done",
    )
    final = torch.load(ckpt, map_location="cpu", weights_only=True)
    reference = resized_reference(dataclasses.replace(cfg, fail_rank=-1), last)
    diff = compare.max_abs_diff(reference.state_dict(), final["model"])
    require(
        diff < 1e-5,
        ex,
        f"after step {final['step']} the parameters differ from an uninterrupted run's by "
        f"{diff:.1e}: restore the optimizer's state too (SGD's momentum buffers)",
    )
    passed(
        ex,
        f"rank {FAIL_RANK} of {WORLD[0]} killed after step {FAIL_STEP}, the {WORLD[1]} ranks left "
        f"resumed at step {last}, batch {batch} (restart counts 0 and 1), and the parameters "
        f"after step {STEPS} equal one process's on the same samples",
    )
