"""Exercises 02.2, 02.3 and 02.4's checkers: the solution passes, wrong answers fail with their
hint, and no hint prints the answer."""

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


RANK = """
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mgtutorial import load_dataset
from mgtutorial.common.data import train_loader
from mgtutorial.common.models import ArticleCNN


def train(cfg, ctx):
    train_set, _ = load_dataset("digits")
    torch.manual_seed(0)
    model = ArticleCNN(tuple(train_set[0][0].shape)).to(ctx.device)
    model = {wrap}
    loader = train_loader(train_set, cfg.batch_size, {rank}, ctx.world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    for epoch in range(cfg.epochs):
        loader.sampler.set_epoch({epoch})
        for X, y in loader:
            X, y = X.to(ctx.device), y.to(ctx.device)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(X), y).backward()
            optimizer.step()
    return model
"""
STARTER = """
import torch
from torch import nn
from torch.utils.data import DataLoader

from mgtutorial import load_dataset
from mgtutorial.common.models import ArticleCNN


def train(cfg, ctx):
    train_set, _ = load_dataset("digits")
    torch.manual_seed(0)
    model = ArticleCNN(tuple(train_set[0][0].shape))
    loader = DataLoader(train_set, cfg.batch_size, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    for epoch in range(cfg.epochs):
        for X, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(X), y).backward()
            optimizer.step()
    return model
"""
GOOD = dict(
    wrap='DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)',
    rank="ctx.rank",
    epoch="epoch",
)


@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.parametrize(
    "change, hint",
    [
        ({}, None),
        ({"wrap": "model"}, "the two ranks end with different models"),
        ({"rank": "0"}, "both ranks drew the same samples"),
        ({"epoch": "0"}, "epoch 1 repeated epoch 0's order"),
        (None, "does each rank train on its own share"),  # the starter: chapter 01's loop
    ],
    ids=["right", "no-ddp", "rank-0", "no-set-epoch", "starter"],
)
def test_02_2_own_rank(change, hint, tmp_path, monkeypatch, capsys, no_leftovers):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "ex02_rank.py"
    path.write_text(STARTER if change is None else RANK.format(**(GOOD | change)))
    if hint is None:
        ch02.own_rank(str(path))
        assert capsys.readouterr().out.startswith("✓ 02.2 your own DDP rank: 2 ranks trained 2")
        return
    with pytest.raises(ExerciseError, match="02.2") as err:
        ch02.own_rank(str(path))
    assert hint in err.value.hint
