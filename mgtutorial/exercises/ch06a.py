"""Checkers of chapter 06a's exercises (notebooks/06a_article_ddp.ipynb): the article's CNN with its
flatten reviewed (flaw 1.1), and the loss it prints (flaw 1.7). The sampler (flaw 1.3) and the
global rank (flaw 1.4) are exercises of chapters 02 and 05a.

06a.2's checker runs the learner's file in ranks (the worker of
:mod:`mgtutorial.exercises.ch06_ranks`) and reads what they returned.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mgtutorial.exercises import ch06_ranks
from mgtutorial.exercises._common import (
    ExerciseError,
    RankFailed,
    answered,
    attempt,
    close,
    function_from,
    passed,
    require,
    run_ranks,
)
from mgtutorial.runtime import runlog


def _a(value) -> str:
    """ "a list", "an int": the type of ``value`` with its article."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


SIZES = ((3, 32, 32), (3, 64, 45), (1, 28, 28), (3, 31, 31))
"""06a.1's images (C, H, W): the sample's 32×32 colour images, a non-square one, the 28×28 its
4608 was written for, and an odd size, where the convolution's and the pool's rounding show."""
BATCHES = (1, 4, 36)
"""06a.1's batch sizes."""
CONV = {"out_channels": 32, "kernel_size": (5, 5), "stride": (2, 2), "padding": (1, 1)}
"""06a.1's convolution: the sample's 5×5 to 32 channels, here with stride 2 and padding 1."""


def _features(image_shape) -> int:
    """The features per image after 06a.1's convolution, ReLU and 2×2 max-pool, measured by
    running them on one image of ``image_shape``."""
    conv = torch.nn.Conv2d(image_shape[0], CONV["out_channels"], 5, stride=2, padding=1)
    with torch.no_grad():
        return torch.nn.functional.max_pool2d(conv(torch.zeros(1, *image_shape)), 2)[0].numel()


def flatten_fix(path: str = "ex06a_net.py") -> None:
    """06a.1: in the file ``path``, ``flatten_size(image_shape)`` returns the features per image
    after a 5×5 convolution to 32 channels with stride 2 and padding 1, ReLU and a 2×2 max-pool
    (an int, for images of shape (C, H, W)), and ``Net(image_shape)`` is the sample's CNN with that
    convolution (a hidden layer of 64, 10 outputs) with flaw 1.1 reviewed away: built, it has no
    uninitialized parameter (DDP, the sample's next line, refuses those: ``nn.LazyLinear`` before
    a forward); for every image shape of :data:`SIZES` and batch size of :data:`BATCHES` it maps
    B images to B × 10 logits, and each row depends on its own image only (changing image 0
    changes row 0 only). The checker compares ``flatten_size`` with the size measured by running
    the layers, then builds one ``Net`` per image shape and runs it on random images."""
    ex = "06a.1 the flatten, reviewed"
    size_of = function_from(path, "flatten_size", ex)
    make = function_from(path, "Net", ex)
    for size in SIZES:
        guess = answered(attempt(ex, size_of, size), ex, "flatten_size")
        got = _features(size)
        if not (isinstance(guess, int) and not isinstance(guess, bool)):
            raise ExerciseError(
                ex, f"flatten_size({size}) returns {_a(guess)}: return the features as an int"
            )
        require(
            guess == got,
            ex,
            f"flatten_size({size}) returns {guess:,}, {'more' if guess > got else 'fewer'} "
            "features than the layers give: apply the output-size rule of nn.Conv2d's "
            "documentation (padding on both sides, the stride dividing, rounded down) to height "
            "and width separately, then the pool's, and count the channels",
        )
    for size in SIZES:
        torch.manual_seed(0)
        net = attempt(ex, make, size)
        conv = getattr(net, "conv", None)
        require(
            isinstance(conv, torch.nn.Conv2d)
            and all(getattr(conv, k) == v for k, v in CONV.items()),
            ex,
            "Net.conv is no longer the exercise's convolution (5×5 to 32 channels, stride 2, "
            "padding 1): keep it, and change the two marked lines",
        )
        require(
            not any(torch.nn.parameter.is_lazy(q) for q in net.parameters()),
            ex,
            "Net has uninitialized parameters (nn.LazyLinear): DistributedDataParallel, the "
            "sample's next line, refuses them; size the layer from image_shape instead",
        )
        for b in BATCHES:
            x = torch.randn(b, *size)
            try:
                with torch.no_grad():
                    out = net(x)
            except RuntimeError as err:
                raise ExerciseError(
                    ex,
                    f"a batch of {b} image(s) of {size[1]}×{size[2]} fails: {err}. The features "
                    "per image depend on the image size: keep the batch dimension when you "
                    "flatten, and size the first linear layer from image_shape",
                ) from None
            require(
                tuple(out.shape) == (b, 10),
                ex,
                f"a batch of {b} image(s) of {size[1]}×{size[2]} gives logits of shape "
                f"{tuple(out.shape)}: one row of 10 per image is expected; view(-1, N) with a "
                "fixed N folds images into each other",
            )
        x = torch.randn(4, *size)
        with torch.no_grad():
            before, y = net(x), x.clone()
            y[0] += 1
            after = net(y)
        require(
            torch.equal(before[1:], after[1:]) and not torch.equal(before[0], after[0]),
            ex,
            f"on {size[1]}×{size[2]} images, changing image 0 changed other rows' logits (or not "
            "its own): each row of the flattened features must hold exactly one image",
        )
    passed(
        ex,
        f"flatten_size matches the features measured for {len(SIZES)} image shapes, and Net "
        f"gives one row of 10 logits per image for each and batches of "
        f"{', '.join(map(str, BATCHES))}, each row from its own image, with no parameter DDP "
        "would refuse",
    )


# --- 06a.2: the epoch loss, over all ranks -------------------------------------------------------


def _mean(losses, sizes) -> float:
    """The mean loss over every sample of ``losses`` (each a batch's mean) of ``sizes`` samples."""
    return sum(loss * n for loss, n in zip(losses, sizes)) / sum(sizes)


def global_mean_loss(path: str = "ex06a_loss.py") -> None:
    """06a.2: ``epoch_loss(losses, sizes, ctx)`` in ``path`` turns this rank's batch losses (floats,
    each the mean over its batch) and batch sizes (ints) into the epoch's loss over *every sample*
    of *all* ranks (a float, the same on every rank): what one process computes over the whole
    data set.

    Run on 2 ranks with 4 and 6 batches, each rank's last batch shorter
    (:func:`~mgtutorial.exercises.ch06_ranks.loss_worker`), then with each rank's last 1 and 3;
    verified against the one-process mean of the same samples. Each wrong number the checker
    recognises (a rank's own sum, the mean of the ranks' means, the mean of the batch losses)
    gets its own hint.
    """
    ex = "06a.2 global mean loss"
    function_from(path, "epoch_loss", ex)
    for keep in (None, [1, 3]):  # the second run: a count written into the function shows here
        cfg = ch06_ranks.LossExerciseConfig(path=str(Path(path).resolve()), keep=keep)
        try:
            result = run_ranks(ex, ch06_ranks.loss_worker, cfg, 2, name="epoch-loss")
        except RankFailed as failed:
            if "device type cpu" in failed.hint.lower():  # NCCL ("auto" with a GPU per rank)
                raise ExerciseError(
                    ex,
                    f"{failed.hint}: NCCL all-reduces CUDA tensors only; create the tensor "
                    "on ctx.device (torch.tensor(..., device=ctx.device))",
                ) from None
            raise
        recs = {r["rank"]: r for r in runlog.of_kind(runlog.read_run(result.run_dir), "epoch_loss")}
        got = {r: recs[r]["reported"] for r in (0, 1)}
        own = {}  # each rank's losses and sizes, computed again in this one process
        for r in (0, 1):
            losses, sizes = ch06_ranks.sized_batch_losses(r, cfg.seed)
            n = keep[r] if keep else len(sizes)
            own[r] = (losses[-n:], sizes[-n:])
            if own[r] != (recs[r]["losses"], recs[r]["sizes"]):
                raise RuntimeError(f"rank {r} saw other batches than the one-process reference")
        every = [sum((own[r][i] for r in (0, 1)), []) for i in (0, 1)]  # all losses, all sizes
        reference = _mean(*every)  # one process, every sample
        counts = f"{len(own[0][0])} and {len(own[1][0])} batches"
        if not close(got[0], got[1], rel=1e-6):
            which = (
                " (each rank's own sum, as the article prints)"
                if all(close(got[r], sum(own[r][0])) for r in (0, 1))
                else ""
            )
            raise ExerciseError(
                ex,
                f"rank 0 reports {got[0]:.4f} and rank 1 {got[1]:.4f}{which}: a number that "
                "differs between ranks was computed from something only one rank has; check every "
                "term of your division",
            )
        if close(got[0], reference, rel=1e-5):
            continue
        means = (_mean(*own[0]) + _mean(*own[1])) / 2
        require(
            not close(got[0], means, rel=1e-5),
            ex,
            f"with {counts}, both ranks report the mean of the two ranks' means: does each "
            "rank's mean count as much as the other's when the ranks hold different numbers of "
            "samples?",
        )
        require(
            not close(got[0], sum(every[0]) / len(every[0]), rel=1e-5),
            ex,
            f"with {counts}, both ranks report the mean of all the batch losses: each is a "
            "mean over its own batch, and the last batch of each rank is shorter. How much of "
            "the epoch's loss does one sample of a short batch carry?",
        )
        raise ExerciseError(
            ex,
            f"with {counts}, both ranks report {got[0]:.4f}, not the mean loss over every "
            "sample of both ranks that one process computes"
            + (
                ": does your function count the batches and samples, or assume how many there are?"
                if keep
                else ": what must every rank contribute so that the division is over all samples?"
            ),
        )
    passed(
        ex,
        "both ranks report the mean loss over every sample of both ranks (4 and 6 batches, each "
        "rank's last one shorter), equal to the one-process reference, and again with each "
        "rank's last 1 and 3",
    )
