"""Exercise 06a.2's checker (the epoch loss over all ranks): the solution passes; a rank's own
sum, the mean of the ranks' means and a count written into the function fail with their hint."""

from __future__ import annotations

import pytest

from mgtutorial.exercises import ExerciseError, ch06a

LOSS = """
import torch
import torch.distributed as dist


def epoch_loss(losses, ctx):
    {body}
"""
RIGHT = """total = torch.tensor([sum(losses), len(losses)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(total)
    return float(total[0] / total[1])"""
TEN = """total = torch.tensor([sum(losses)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(total)
    return float(total[0] / 10)  # 4 + 6 batches, written in"""
MEANS = """mean = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(mean)
    return float(mean[0] / ctx.world_size)"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "body, hint",
    [
        (RIGHT, None),
        ("return sum(losses)", "each rank's own sum"),
        (MEANS, "the mean of the two ranks' means"),
        (TEN, "does your function count the batches"),
    ],
    ids=["right", "own-sum", "mean-of-means", "count-written-in"],
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
