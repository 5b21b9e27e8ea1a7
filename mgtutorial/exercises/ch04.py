"""Checkers of chapter 04's exercises (notebooks/04_model_parallel.ipynb): the bubble formula, the
micro-batches of activations a stage holds under GPipe and 1F1B, a balanced split of the MLP into
stages, and the weighting of micro-batch losses."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from .. import models
from .. import pipeline as P
from .. import timeline as T
from ._common import ExerciseError, answered, attempt, close, passed, require, run_ranks


def _simulated_bubble(p: int, m: int, schedule: str, forward: float = 1.0, backward: float = 2.0) -> float:
    """Idle fraction of one step of ``schedule`` ("gpipe" | "1f1b") on ``p`` stages with ``m``
    micro-batches, every forward lasting ``forward`` and every backward ``backward`` (no cost between
    boxes): each box starts when its inputs are ready and its stage is free, in the schedule's order."""
    order = {}  # stage -> its boxes in the order the schedule runs them
    for s in range(p):
        if schedule == "gpipe":
            order[s] = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
        else:  # 1F1B: p − s forwards of warm-up, then one backward, one forward, …, then the backwards
            warm = min(p - s, m)
            ops = [("F", i) for i in range(warm)]
            for i in range(m):
                ops.append(("B", i))
                if warm + i < m:
                    ops.append(("F", warm + i))
            order[s] = ops
    end, free, pending = {}, [0.0] * p, {s: list(ops) for s, ops in order.items()}
    while any(pending.values()):
        progressed = False
        for s in range(p):
            while pending[s]:
                kind, i = pending[s][0]
                dep = (s - 1, "F", i) if kind == "F" else ((s + 1, "B", i) if s < p - 1 else (s, "F", i))
                if kind == "F" and s == 0:
                    ready = 0.0
                elif dep in end:
                    ready = end[dep]
                else:
                    break
                start = max(ready, free[s])
                free[s] = end[s, kind, i] = start + (forward if kind == "F" else backward)
                pending[s].pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError(f"the simulated {schedule} schedule deadlocks (p={p}, m={m})")
    span = max(end.values())
    return 1 - m * (forward + backward) / span


def bubble(predicted: dict) -> None:
    """04.1: ``predicted[(p, m, v)]`` is the ideal bubble fraction (a float) for p ranks, m micro-batches
    and v stages per rank. Verified against :func:`mgtutorial.timeline.bubble_formula` and, for
    v = 1, against a simulation of GPipe and 1F1B steps whose boxes have no cost between them."""
    ex = "04.1 bubble formula"
    for (p, m, v) in ((2, 1, 1), (2, 8, 1), (4, 8, 1), (4, 8, 2)):
        guess = answered(predicted.get((p, m, v)), ex, f"predicted[{(p, m, v)}]")
        truth = T.bubble_formula(p, m, stages_per_rank=v)
        if v == 1:
            for schedule in ("gpipe", "1f1b"):
                simulated = _simulated_bubble(p, m, schedule)
                assert close(simulated, truth), f"simulated {schedule} {simulated} != formula {truth}"
        require(close(guess, truth, rel=1e-3, abs_=1e-3), ex,
                f"for p={p}, m={m}, v={v} the idle fraction is {truth:.3f}, you predicted {guess!r}: "
                + ("the pipeline fills and drains in p − 1 slots out of m + p − 1" if v == 1 else
                   "with v stages per rank a slot is v times shorter: (p − 1) / (v·m + p − 1)"))
    passed(ex, "4 predictions equal (p−1)/(v·m+p−1), and a simulated GPipe and 1F1B step agree")


def _stage_bytes(cfg: P.PipelineConfig, stage: int) -> tuple[int, int]:
    """(bytes held once per step, bytes per micro-batch held) of ``stage`` of a 2-stage pipeline of
    ``sizes=[w] * 5``: stage 0 keeps the input batch and two ReLU outputs per micro-batch; stage 1 the
    int64 targets and, per micro-batch, its input, one ReLU output, the log-softmax output and
    ``nll_loss``'s 4-byte total weight (notebook section 5)."""
    w, rows = cfg.sizes[0], cfg.batch_size // cfg.n_microbatches
    if stage == 0:
        return cfg.batch_size * w * 4, rows * 2 * w * 4
    return cfg.batch_size * 8, rows * 3 * w * 4 + 4


def held_microbatches(predicted: dict) -> None:
    """04.2: ``predicted[(schedule, stage)]`` (an int) is the number of micro-batches whose activations
    stage 0 or 1 holds at its peak, schedule "gpipe" or "1f1b", p = 2 ranks, m = 8.

    Runs both schedules on 2 ranks (a small MLP, one step) and converts each stage's measured peak
    (``ActivationMeter``, each storage counted once) into micro-batches.
    """
    ex = "04.2 activations held"
    guesses = {key: answered(predicted.get(key), ex, f"predicted[{key!r}]")
               for key in itertools.product(("gpipe", "1f1b"), (0, 1))}
    for schedule in ("gpipe", "1f1b"):
        cfg = P.PipelineConfig(schedule=schedule, n_microbatches=8, batch_size=64, steps=1,
                               sizes=[128] * 5, save_params=False)
        values = run_ranks(ex, P.worker, cfg, 2, name=f"held-{schedule}", threads_per_rank=1).values
        for s, value in sorted(values.items()):
            fixed, per_mb = _stage_bytes(cfg, s)
            held, rest = divmod(value["peak_activation_bytes"] - fixed, per_mb)
            assert rest == 0, f"stage {s} peak {value['peak_activation_bytes']} is not {fixed} + k·{per_mb}"
            require(guesses[schedule, s] == held, ex,
                    f"under {schedule} stage {s} held {held} micro-batches at its peak, you predicted "
                    f"{guesses[schedule, s]!r}: " + (
                        "GPipe runs every forward before the first backward" if schedule == "gpipe" else
                        "under 1F1B stage s runs p − s forwards before its first backward, then one "
                        "backward frees a micro-batch for every forward that adds one"))
    passed(ex, "GPipe holds 8 micro-batches on both stages, 1F1B holds 2 on stage 0 and 1 on stage 1")


def _best_largest_stage(counts: list[int], k: int) -> int:
    """The smallest possible parameter count of the largest of ``k`` consecutive non-empty stages."""
    n = len(counts)
    return min(max(sum(counts[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
               for cuts in itertools.combinations(range(1, n), k - 1))


def balanced_split(split_fn) -> None:
    """04.3: ``split_fn(mlp, k)`` returns ``k`` modules, the consecutive sub-networks of ``mlp`` (an
    :class:`~mgtutorial.models.ArticleMLP`) with the largest stage's parameter count as small as possible.

    Verified on the article's MLP (k = 2, 3) and on a 5-block MLP (k = 2, 3, 4): k stages, each with
    parameters, that share the model's parameters (no copies), whose counts add up to the model's,
    whose forward one after the other equals the unsplit model's, and whose largest stage is the
    smallest possible (found by trying every cut).
    """
    ex = "04.3 balanced split"
    for sizes, k in (((1024, 512, 256, 100), 2), ((1024, 512, 256, 100), 3),
                     ((64, 256, 256, 64, 32, 10), 2), ((64, 256, 256, 64, 32, 10), 3),
                     ((64, 256, 256, 64, 32, 10), 4)):
        torch.manual_seed(0)
        mlp = models.ArticleMLP(sizes)
        stages = attempt(ex, split_fn, mlp, k)
        where = f"split_fn(ArticleMLP({sizes}), {k})"
        require(isinstance(stages, (list, tuple)) and len(stages) == k and
                all(isinstance(st, nn.Module) for st in stages), ex,
                f"{where} returned {type(stages).__name__} of {len(stages) if hasattr(stages, '__len__') else '?'} "
                f"items: return a list of {k} modules (e.g. nn.Sequential of sub-networks)")
        counts = [models.count_parameters(st) for st in stages]
        whole = models.count_parameters(mlp)
        require(all(counts), ex, f"{where} has an empty stage (parameters {counts}): every stage needs "
                                 "at least one sub-network")
        require(sum(counts) == whole, ex, f"{where}: the stages hold {sum(counts):,} parameters, the "
                                          f"model {whole:,}: is a sub-network missing or repeated?")
        own = {id(p) for p in mlp.parameters()}
        require(all(id(p) in own for st in stages for p in st.parameters()), ex,
                f"{where}: the stages hold copies, not the model's parameters: wrap mlp.subnets[a:b], "
                "do not build new layers")
        x = torch.randn(5, sizes[0])
        out = x
        with torch.no_grad():
            for st in stages:
                out = st(out)
            want = mlp(x)
        require(out.shape == want.shape and torch.allclose(out, want, atol=1e-6), ex,
                f"{where}: the stages applied in order do not compute the model's output: keep the "
                "sub-networks in order, each exactly once")
        best = _best_largest_stage([models.count_parameters(sn) for sn in mlp.subnets], k)
        require(max(counts) == best, ex,
                f"{where}: the largest stage holds {max(counts):,} parameters, but a split whose largest "
                f"stage holds {best:,} exists (yours: {counts}): count each sub-network's parameters "
                "and choose the cuts that make the largest stage smallest")
    passed(ex, "5 splits have the model's parameters, its output and the smallest largest stage")


def loss_weighting(accumulate) -> None:
    """04.4: ``accumulate(model, x, y, m)`` cuts ``(x, y)`` into ``m`` micro-batches
    (``torch.tensor_split``), runs forward and backward on each, and leaves in ``.grad`` the gradient
    of the full batch's mean cross-entropy.

    Verified against one full-batch backward with batch 33 in m = 4 (sizes 9, 8, 8, 8) and batch 32
    in m = 3 (11, 11, 10), where equal weights 1/m (what torch.distributed.pipelining's
    ``scale_grads`` does) give the wrong gradient.
    """
    ex = "04.4 loss weighting"
    for batch, m in ((33, 4), (32, 3), (32, 4)):
        g = torch.Generator().manual_seed(batch + m)
        x, y = torch.randn(batch, 16, generator=g), torch.randint(0, 10, (batch,), generator=g)
        torch.manual_seed(0)
        model = models.ArticleMLP((16, 32, 10))
        want = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(model.parameters()))
        equal = [torch.zeros_like(w) for w in want]
        for xi, yi in zip(torch.tensor_split(x, m), torch.tensor_split(y, m)):
            for acc, gi in zip(equal, torch.autograd.grad(nn.functional.cross_entropy(model(xi), yi),
                                                          list(model.parameters()))):
                acc += gi / m
        model.zero_grad(set_to_none=True)
        attempt(ex, accumulate, model, x, y, m)
        got = [p.grad for p in model.parameters()]
        sizes = [len(c) for c in torch.tensor_split(y, m)]
        require(all(gr is not None for gr in got), ex,
                f"batch {batch}, m={m}: some parameters have no .grad: call backward() on each micro-batch's loss")
        if all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want)):
            continue
        if all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, equal)):
            hint = "you weighted every micro-batch by 1/m; weight each by its share n_i / batch"
        elif all(torch.allclose(a, m * b, atol=1e-6) for a, b in zip(got, equal)):
            hint = "you summed the micro-batch means unweighted (m times too large); weight each by n_i / batch"
        else:
            hint = "compare with one backward of the full batch's mean loss; do not zero .grad between micro-batches"
        raise ExerciseError(ex, f"batch {batch} in m={m} micro-batches of {sizes}: the gradient differs "
                                f"from the full batch's by up to "
                                f"{max((a - b).abs().max().item() for a, b in zip(got, want)):.1e}: {hint}")
    passed(ex, "batch 33 in 4 and 32 in 3 micro-batches give the full batch's gradient")
