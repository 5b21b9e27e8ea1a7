"""Exercises 02.1, 02.2, 02.3 and 02.4's checkers: the solution passes, wrong answers fail with
their hint, and no hint prints the answer."""

from __future__ import annotations

import math

import pytest

from mgtutorial.exercises import ExerciseError, ch02


def _lr(step, *, base_lr, base_batch, batch_size, world_size, warmup_steps):
    scaled = base_lr * batch_size * world_size / base_batch
    if step >= warmup_steps:
        return scaled
    return base_lr + (scaled - base_lr) * step / warmup_steps


def test_02_4_the_rule_passes(capsys):
    ch02.linear_scaling(_lr)
    assert capsys.readouterr().out.startswith("✓ 02.4 linear scaling rule:")


def _cosine(step, **kw):  # right at steps 0, warmup/2 and after warmup; wrong in between
    end, base, warmup = _lr(10**9, **kw), kw["base_lr"], kw["warmup_steps"]
    if step >= warmup:
        return end
    return base + (end - base) * (1 - math.cos(math.pi * step / warmup)) / 2


def _nonsense(step, **kw):  # right at the steps the checker once sampled, 123 elsewhere
    w = kw["warmup_steps"]
    return _lr(step, **kw) if step in (0, w // 2, w + 1) else 123.0


def _decays(step, **kw):  # right until warmup + 1, then decays
    return _lr(step, **kw) * (0.5 if step > kw["warmup_steps"] + 1 else 1)


@pytest.mark.parametrize("fn", [_cosine, _nonsense, _decays], ids=["cosine", "nonsense", "decay"])
def test_02_4_a_wrong_warm_up_fails(fn):
    with pytest.raises(ExerciseError, match="02.4") as err:
        ch02.linear_scaling(fn)
    assert "off the rule: a straight line" in err.value.hint


def test_02_4_the_starter_fails():
    with pytest.raises(ExerciseError, match="after warm-up"):
        ch02.linear_scaling(lambda step, *, base_lr, **_: base_lr)


RIGHT = {"samples_per_rank": 479, "steps": 5, "last_batch": 79, "equal": True}


@pytest.mark.parametrize(
    "change, hint",
    [
        ({"samples_per_rank": 719}, "pads 1437 samples up to a multiple of 3 ranks"),
        ({"steps": 4}, "how many batches of 100"),
        ({"last_batch": 100}, "the last batch holds what the full batches leave"),
    ],
)
def test_02_3_wrong_counts_fail_without_the_answer(change, hint):
    with pytest.raises(ExerciseError, match="02.3") as err:
        ch02.last_batch(RIGHT | change)
    assert hint in err.value.hint
    for answer in ("479", "79"):
        assert answer not in err.value.hint.replace("1437", "")


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_02_3_right_passes_and_a_wrong_equal_fails(tmp_path, monkeypatch, capsys, no_leftovers):
    monkeypatch.chdir(tmp_path)
    ch02.last_batch(dict(RIGHT))
    assert "479 samples per rank, 5 steps, the last of 79 on every rank" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match="not what the run and the reference show"):
        ch02.last_batch(RIGHT | {"equal": False})


def _predict(fail_rank, fail_step, fail_how):  # 02.1's right prediction
    raised = [fail_rank] if fail_how == "raise" else []
    return {
        "named": fail_rank,
        "steps_logged": [fail_step, fail_step],
        "python_errors": sorted(raised + [1 - fail_rank]),
    }


def _named_first_error(fail_rank, fail_step, fail_how):  # the rank whose error came first
    return _predict(fail_rank, fail_step, fail_how) | {"named": 0}


def _other_waits(fail_rank, fail_step, fail_how):  # gloo's other rank would wait, not raise
    return _predict(fail_rank, fail_step, fail_how) | {
        "python_errors": [fail_rank] if fail_how == "raise" else []
    }


def _killed_raises(fail_rank, fail_step, fail_how):  # a SIGKILLed rank recording an exception
    return _predict(fail_rank, fail_step, fail_how) | {"python_errors": [0, 1]}


def _one_step_more(fail_rank, fail_step, fail_how):  # the other rank logs the next step too
    steps = [fail_step + 1, fail_step + 1]
    steps[fail_rank] = fail_step
    return _predict(fail_rank, fail_step, fail_how) | {"steps_logged": steps}


@pytest.mark.parametrize(
    "predict, hint",
    [
        (lambda *a: [1, 5], "returns list: return a dict"),
        (lambda *a: {"named": 1, "steps_logged": ..., "python_errors": []}, "still `...`"),
    ],
    ids=["not-a-dict", "starter"],
)
def test_02_1_an_unanswered_prediction_fails_before_any_run(predict, hint):
    with pytest.raises(ExerciseError, match="02.1") as err:
        ch02.failing_rank(predict)
    assert hint in err.value.hint


@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.parametrize(
    "predict, hint",
    [
        (_predict, None),
        (_named_first_error, "launch names the rank whose failure started it"),
        (_one_step_more, "can it log a step whose all-reduces miss a rank?"),
        (_other_waits, "What does gloo do with an all-reduce"),
        (_killed_raises, "Can a process that SIGKILL ends run an except clause?"),
    ],
    ids=["right", "first-error", "one-step-more", "other-waits", "killed-raises"],
)
def test_02_1_failing_rank(predict, hint, tmp_path, monkeypatch, capsys, no_leftovers):
    monkeypatch.chdir(tmp_path)
    out = _passes_or_hints(ch02.failing_rank, predict, hint, capsys)
    assert hint or "rank 1 raising after step 5" in out and "[0, 1], then [1], as you" in out


def _passes_or_hints(check, answer, hint, capsys) -> str:
    """Run ``check(answer)``: it passes (hint None; returns what it printed) or fails with
    ``hint``."""
    if hint is None:
        check(answer)
        out = capsys.readouterr().out
        assert out.startswith("✓ 02.")
        return out
    with pytest.raises(ExerciseError, match="02.") as err:
        check(answer)
    assert hint in err.value.hint
    return ""


AUGMENT = """
import torch


def augment(x, index, epoch):
    {body}
"""
RIGHT_AUGMENT = """g = torch.Generator()
    seeds = [10**6 * epoch + int(i) for i in index]
    noise = [torch.randn(x.shape[1:], generator=g.manual_seed(s)) for s in seeds]
    return x + 0.1 * torch.stack(noise)"""
RANK_VAR = "__import__('os').environ.get('RANK', 0)"
STARTER_AUGMENT = "return x + 0.1 * torch.randn_like(x)"  # each rank's own random stream


@pytest.mark.parametrize(
    "body, hint",
    [
        ("return x", "a standard deviation of 0: add Gaussian noise"),
        ("return x + torch.randn_like(x)", "add Gaussian noise of standard deviation 0.1"),
        ("return x[:1]", "return the batch, shape (32, 3, 32, 32)"),
        (  # a sample's noise from its index alone: the same every epoch
            RIGHT_AUGMENT.replace("10**6 * epoch + ", ""),
            "epoch 1 adds the same noise to these samples as epoch 0",
        ),
        (  # sample i's noise in epoch 1 is sample i + 1's in epoch 0
            RIGHT_AUGMENT.replace("10**6 * epoch + int(i)", "epoch + int(i)"),
            "two (epoch, index) pairs lead to the same draw",
        ),
        (  # collides past index 1000 only: sample 405 in epoch 1 is sample 1405 in epoch 0
            RIGHT_AUGMENT.replace("10**6 * epoch", "1000 * epoch"),
            "two (epoch, index) pairs lead to the same draw",
        ),
    ],
    ids=[
        "no-noise",
        "too-much",
        "wrong-shape",
        "same-every-epoch",
        "epoch-shifts-index",
        "epoch-times-1000",
    ],
)
def test_02_2_a_wrong_noise_fails_before_any_run(body, hint, tmp_path):
    path = tmp_path / "ex02_augment.py"
    path.write_text(AUGMENT.format(body=body))
    with pytest.raises(ExerciseError, match="02.2") as err:
        ch02.augmentation(str(path))
    assert hint in err.value.hint


@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.parametrize(
    "body, hint",
    [
        (RIGHT_AUGMENT, None),
        (STARTER_AUGMENT, "both ranks added the same noise to different samples"),
        (  # right in one process, where RANK is unset; rank 1 draws other noise
            RIGHT_AUGMENT.replace("int(i)", f"int(i) + 7 * int({RANK_VAR})"),
            "the ranks added different noise, which is right for training",
        ),
    ],
    ids=["right", "starter", "rank-dependent"],
)
def test_02_2_augmentation(body, hint, tmp_path, monkeypatch, capsys, no_leftovers):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "ex02_augment.py"
    path.write_text(AUGMENT.format(body=body))
    out = _passes_or_hints(ch02.augmentation, str(path), hint, capsys)
    assert hint or "augmentation on several ranks: noise of standard deviation 0.1" in out
