"""Exercise 06a.2's checker (the epoch loss over all ranks' samples): the solution passes; a rank's
own sum, the mean of the ranks' means, the mean of the batch losses and a count written into the
function fail with their hint."""

from __future__ import annotations

import pytest

from mgtutorial.exercises import ExerciseError, ch06a

LOSS = """
import torch
import torch.distributed as dist


def epoch_loss(losses, sizes, ctx):
    {body}
"""
RIGHT = """summed = sum(loss * n for loss, n in zip(losses, sizes))
    total = torch.tensor([summed, sum(sizes)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(total)
    return float(total[0] / total[1])"""
WRITTEN_IN = """summed = sum(loss * n for loss, n in zip(losses, sizes))
    total = torch.tensor([summed], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(total)
    return float(total[0] / (13 + 23))  # 4·3 + 1 and 4·5 + 3 samples, written in"""
MEANS = """mean = sum(loss * n for loss, n in zip(losses, sizes)) / sum(sizes)
    mean = torch.tensor([mean], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(mean)
    return float(mean[0] / ctx.world_size)"""
BATCHES = """count = len(losses)
    total = torch.tensor([sum(losses), count], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(total)
    return float(total[0] / total[1])"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "body, hint",
    [
        (RIGHT, None),
        ("return sum(losses)", "each rank's own sum"),
        (MEANS, "the mean of the two ranks' means"),
        (BATCHES, "the mean of all the batch losses"),
        (WRITTEN_IN, "assume how many there are"),
    ],
    ids=["right", "own-sum", "mean-of-means", "mean-of-batches", "count-written-in"],
)
def test_06a2(body, hint, tmp_path, monkeypatch, capsys, no_leftovers):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "ex06a_loss.py"
    path.write_text(LOSS.format(body=body))
    if hint is None:
        ch06a.global_mean_loss(str(path))
        assert capsys.readouterr().out.startswith("✓ 06a.2 global mean loss: both ranks report")
        return
    with pytest.raises(ExerciseError, match="06a.2") as err:
        ch06a.global_mean_loss(str(path))
    assert hint in err.value.hint


def test_06a2_the_three_wrong_means_differ_from_the_right_one():
    # the checker tells the wrong answers apart only if they are different numbers here
    from mgtutorial.exercises.ch06_ranks import sized_batch_losses

    own = [sized_batch_losses(r) for r in (0, 1)]
    losses, sizes = own[0][0] + own[1][0], own[0][1] + own[1][1]
    right = ch06a._mean(losses, sizes)
    wrong = [(ch06a._mean(*own[0]) + ch06a._mean(*own[1])) / 2, sum(losses) / len(losses)]
    assert all(abs(w - right) > 1e-3 for w in wrong)
    assert sizes == [4, 4, 4, 1, 4, 4, 4, 4, 4, 3]


NET = """
import torch
from torch import nn


def flatten_size(image_shape):
    {size}


class Net(nn.Module):
    def __init__(self, image_shape=(3, 32, 32)):
        super().__init__()
        self.conv = nn.Conv2d(image_shape[0], 32, 5, stride={stride}, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.hidden = {hidden}
        self.out = nn.Linear(64, 10)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv(x)))
        x = {flatten}
        return self.out(torch.relu(self.hidden(x)))
"""
RIGHT_SIZE = """_, h, w = image_shape
    h, w = ((n + 2 - 5) // 2 + 1 for n in (h, w))
    return 32 * (h // 2) * (w // 2)"""
GOOD = {
    "size": RIGHT_SIZE,
    "stride": 2,
    "hidden": "nn.Linear(flatten_size(image_shape), 64)",
    "flatten": "x.flatten(1)",
}


@pytest.mark.parametrize(
    "change, hint",
    [
        ({}, None),
        ({"size": "return ..."}, "not written yet"),
        # section 1.1's rule, stride 1 and no padding: not this convolution's
        (
            {"size": "_, h, w = image_shape\n    return 32 * ((h - 4) // 2) * ((w - 4) // 2)"},
            "output-size rule",
        ),
        # padding counted on one side only
        ({"size": RIGHT_SIZE.replace("n + 2 - 5", "n + 1 - 5")}, "output-size rule"),
        ({"size": RIGHT_SIZE.replace("return 32", "return 1.0 * 32")}, "as an int"),
        ({"hidden": "nn.Linear(4608, 64)", "flatten": "x.view(-1, 4608)"}, "fails"),
        ({"flatten": "x.reshape(-1, flatten_size((3, 32, 32)))"}, "fails"),
        ({"hidden": "nn.LazyLinear(64)"}, "uninitialized parameters"),
        ({"stride": 1, "hidden": "nn.Linear(flatten_size(image_shape), 64)"}, "convolution"),
    ],
    ids=[
        "right",
        "starter-size",
        "stride-1-rule",
        "one-sided-padding",
        "float",
        "starter-net",
        "fixed-reshape",
        "lazy",
        "conv-changed",
    ],
)
def test_06a1(change, hint, tmp_path, capsys):
    path = tmp_path / "ex06a_net.py"
    path.write_text(NET.format(**(GOOD | change)))
    if hint is None:
        ch06a.flatten_fix(str(path))
        assert capsys.readouterr().out.startswith("✓ 06a.1 the flatten, reviewed: flatten_size")
        return
    with pytest.raises(ExerciseError, match="06a.1") as err:
        ch06a.flatten_fix(str(path))
    assert hint in err.value.hint
    for size in ch06a.SIZES:  # no hint gives a measured size
        assert f"{ch06a._features(size):,}" not in err.value.hint
