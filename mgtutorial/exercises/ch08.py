"""Checkers of chapter 08's exercises (notebooks/08_tensor_parallel.ipynb): the collectives of a
split block, Megatron's f and g written by hand, the bias added before g, and the TP degree at
which communication outgrows compute.

The rank-side exercises run :func:`split_mlp_worker`: the chapter's hand-split MLP
(:class:`mgtutorial.tensor_parallel.fg.HandTPMLP`) with the learner's f and g, or the learner's
forward, compared in each rank with the unsplit MLP (output, input gradient, every parameter's
gradient) and with every collective counted (``CommDebugMode``).
"""

from __future__ import annotations

import functools
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from mgtutorial.exercises._common import (
    answered,
    attempt,
    close,
    function_from,
    import_file,
    passed,
    require,
    run_ranks,
)
from mgtutorial.perf import costmodel as cm
from mgtutorial.runtime import env
from mgtutorial.tensor_parallel import fg as tp
from mgtutorial.tensor_parallel import mesh2d as M

# --- 08.1 ---------------------------------------------------------------------------------------


def counts(predicted: dict) -> None:
    """08.1: ``predicted`` = {"forward", "backward": all-reduces of the hand-split block (ints),
    "all_reduce_bytes": bytes of each DTensor all-reduce (int), "all_gather_bytes": [bytes in, out]
    of each sequence-parallel all-gather} for ``TPConfig(h=32, n_heads=8, batch=3, seq=4)`` on 2 ranks.

    Launches the chapter's worker (:func:`mgtutorial.tensor_parallel.mesh2d.worker`) and compares.
    """
    ex = "08.1 counts and bytes"
    guess = {
        k: answered(predicted.get(k), ex, f'predicted["{k}"]')
        for k in ("forward", "backward", "all_reduce_bytes", "all_gather_bytes")
    }
    v = run_ranks(ex, M.worker, M.TPConfig(h=32, n_heads=8, batch=3, seq=4), 2, name="tp").values[0]
    block, dt, sp = (v[k]["counts"] for k in ("hand_block", "dtensor", "sequence_parallel"))
    for phase in ("forward", "backward"):
        got = block[phase].get("all_reduce", 0)
        require(
            guess[phase] == got,
            ex,
            f"the split block issued {got} all-reduces in {phase}, not "
            f"{guess[phase]}: one g (forward) or one f (backward) per sublayer, attention and MLP",
        )
    got = {n for n, _ in dt["bytes"]["all_reduce"]}.pop()
    require(
        guess["all_reduce_bytes"] == got,
        ex,
        f"each all-reduce moved {got} bytes, not "
        f"{guess['all_reduce_bytes']}: one (b, s, h) float32 activation is b·s·h·4 bytes",
    )
    got = sp["bytes"]["all_gather"][0]
    require(
        list(guess["all_gather_bytes"]) == got,
        ex,
        f"each all-gather took and returned {got} bytes, not "
        f"{list(guess['all_gather_bytes'])}: a rank sends its s / tp tokens and receives all s",
    )
    passed(
        ex,
        f"2 + 2 all-reduces of {got[1]} bytes per block; sequence parallelism gathers {got[0]} → {got[1]}",
    )


# --- the rank side of 08.2 and 08.3 -------------------------------------------------------------


@dataclass(kw_only=True)
class SplitMLPConfig:
    """Configuration of :func:`split_mlp_worker`."""

    path: str
    """The learner's module (absolute path)."""
    mode: str = "fg"
    """"fg": the module's ``CopyToTP`` and ``ReduceFromTP`` replace the chapter's in ``HandTPMLP``;
    "forward": the module's ``forward(m, x)`` replaces ``HandTPMLP.forward``."""
    h: int = 16
    """Hidden size."""
    ffn: int = 32
    """MLP inner width (a multiple of the world size)."""
    batch: int = 2
    """Batch size b."""
    seq: int = 8
    """Sequence length s."""
    seed: int = 0
    """Seed of the unsplit MLP's weights and of the input."""
    backend: str = "auto"
    """"auto" | "gloo" | "nccl"."""


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    """The scalar k that makes ``k · b`` closest to ``a`` (least squares)."""
    return float((a * b).sum() / (b * b).sum())


def _spy_all_reduce(group, seen: list):
    """``dist.all_reduce`` that appends to ``seen`` whether each call passed ``group``."""
    real = torch.distributed.all_reduce

    def all_reduce(tensor, *args, **kwargs):  # all_reduce(tensor, op, group, async_op)
        seen.append(kwargs.get("group", args[1] if len(args) > 1 else None) is group)
        return real(tensor, *args, **kwargs)

    return all_reduce


def split_mlp_worker(cfg: SplitMLPConfig) -> dict:
    """Run the hand-split MLP with the learner's pieces and the unsplit MLP on the same input.

    The split MLP is built on an explicit group (``dist.new_group`` of all ranks), and every
    ``dist.all_reduce`` call is watched for it. Returns {"output", "x.grad", "w1", "b1", "w2", "b2":
    [max |split − unsplit|, least-squares ratio split / unsplit]}, "partial_sum" (max |output − this
    rank's partial sum + b2|, i.e. the output had g not summed), "local_dx" (max |x.grad − this
    rank's share of it|, i.e. the gradient had f not summed), "bias_copies" (least-squares k in
    output − unsplit = (k − 1)·b2), "other_group" (all-reduce calls not given the group) and
    "counts" ({"forward", "backward": {collective: calls}}, from ``CommDebugMode``).
    """
    from torch.nn import functional as F

    with env.distributed(cfg.backend) as ctx:
        env.seed_everything(cfg.seed)
        group = torch.distributed.new_group(list(range(ctx.world_size)))
        ref = tp.MLP(cfg.h, cfg.ffn).to(ctx.device)
        split = tp.HandTPMLP(ref, ctx.rank, ctx.world_size, group=group)
        x, dy = (t.to(ctx.device) for t in M._inputs(cfg))
        want, want_dx, _ = M._run(ref, x, dy)
        seen = []
        with ExitStack() as stack:
            stack.enter_context(
                mock.patch.object(torch.distributed, "all_reduce", _spy_all_reduce(group, seen))
            )
            if cfg.mode == "fg":
                module = import_file(cfg.path)
                for name in ("CopyToTP", "ReduceFromTP"):
                    stack.enter_context(mock.patch.object(tp, name, getattr(module, name)))
            else:
                split.forward = functools.partial(function_from(cfg.path, "forward"), split)
            out, dx, c = M._run(split, x, dy)
        result = {"output": (out, want), "x.grad": (dx, want_dx)}
        for name, p in split.named_parameters():
            result[name] = (
                p.grad,
                tp.hand_shard(
                    name, ref.get_parameter(tp.unsplit_name(name)).grad, ctx.rank, ctx.world_size
                ),
            )
        xl = x.clone().requires_grad_()
        partial = F.linear(F.gelu(F.linear(xl, split.w1, split.b1)), split.w2)
        (local_dx,) = torch.autograd.grad((partial * dy).sum(), xl)
        return {
            **{k: [float((a - b).abs().max()), _ratio(a, b)] for k, (a, b) in result.items()},
            "partial_sum": float((out - partial - split.b2).abs().max()),
            "local_dx": float((dx - local_dx).abs().max()),
            "bias_copies": 1 + _ratio(out - want, split.b2.detach().expand_as(out)),
            "other_group": seen.count(False),
            "counts": {k: c[k] for k in ("forward", "backward")},
        }


def _run_split(ex: str, path: str, mode: str) -> dict:
    import_file(path, ex)  # a syntax error or a missing file is named before any rank starts
    return run_ranks(
        ex,
        split_mlp_worker,
        SplitMLPConfig(path=str(Path(path).resolve()), mode=mode),
        2,
        name="split_mlp",
    ).values


TOL = 1e-5


# --- 08.2 ---------------------------------------------------------------------------------------


def f_and_g(path: str = "ex08_fg.py") -> None:
    """08.2: ``CopyToTP`` (f) and ``ReduceFromTP`` (g) in ``path``, ``torch.autograd.Function``s
    called as ``f.apply(x, group)``. Run in ``HandTPMLP`` on 2 ranks, built on an explicit group; the
    output, the input's gradient and every parameter's gradient must equal the unsplit MLP's, with
    one all-reduce in forward and one in backward, each given that group."""
    ex = "08.2 f and g"
    for cls in ("CopyToTP", "ReduceFromTP"):
        fn = getattr(import_file(path, ex), cls, None)
        require(
            isinstance(fn, type) and issubclass(fn, torch.autograd.Function),
            ex,
            f"{path} defines no torch.autograd.Function `{cls}`",
        )
    for rank, v in sorted(_run_split(ex, path, "fg").items()):
        (out, _), (dx, k_dx) = v["output"], v["x.grad"]
        if out > TOL:
            require(
                v["partial_sum"] > TOL,
                ex,
                f"rank {rank}'s output is its own partial sum: ReduceFromTP "
                "(g) must add the partial outputs of all ranks in forward (dist.all_reduce)",
            )
            require(
                False,
                ex,
                f"rank {rank}'s output differs from the unsplit MLP's by up to {out:.2g}: "
                "CopyToTP's forward must return x unchanged, ReduceFromTP's forward must sum (all-reduce) once",
            )
        for name in ("w2", "b1", "w1"):
            diff, k = v[name]
            require(
                diff <= TOL,
                ex,
                f"output right, but rank {rank}'s gradient of {name} is {k:.2g}× the unsplit "
                "one's: "
                + (
                    "ReduceFromTP's backward must be the identity (every rank already holds the "
                    "whole gradient of the output)"
                    if close(k, 2, rel=1e-3)
                    else "check what ReduceFromTP's backward returns"
                ),
            )
        require(
            dx <= TOL,
            ex,
            f"output and weight gradients right, but rank {rank}'s gradient of the input x is "
            + (
                "only this rank's share: CopyToTP (f) must add the shares of all ranks in backward (dist.all_reduce)"
                if v["local_dx"] <= TOL
                else f"{k_dx:.2g}× the unsplit one's: did you average? f sums the ranks' shares "
                "(all_reduce's default op, SUM), with no division by the world size"
                if close(k_dx, 0.5, rel=1e-3)
                else "not the sum of the ranks' shares: CopyToTP (f) must all-reduce the gradient in backward"
            ),
        )
        require(
            v["other_group"] == 0,
            ex,
            f"right results, but {v['other_group']} all-reduce(s) of rank {rank} "
            "did not get the group passed to apply: pass it on, dist.all_reduce(t, group=group); without "
            "it they run on all ranks, and on a 2-D mesh (section 6) the TP group is only some of them",
        )
        for phase, calls in v["counts"].items():
            require(
                calls == {"all_reduce": 1},
                ex,
                f"right results, but rank {rank} issued {calls or 'no collectives'} "
                f"in {phase}: Megatron's f and g need exactly one all-reduce each way",
            )
    passed(
        ex,
        "your f and g split the MLP exactly: output and all gradients == unsplit, 1 all-reduce each way on the given group",
    )


# --- 08.3 ---------------------------------------------------------------------------------------

NAMES = ("output", "x.grad", "w1", "b1", "w2", "b2")


def bias_before_g(path: str = "ex08_bias.py", predicted: dict | None = None) -> None:
    """08.3: ``forward(m, x)`` in ``path`` adds ``m.b2`` *before* g; ``predicted`` = {"wrong": the set
    of :data:`NAMES` that then differ from the unsplit MLP, "bias_copies": how many b2 the output
    holds (int)}. Runs the forward in ``HandTPMLP`` on 2 ranks, and the backward of
    ``(out · dy).sum()`` with a fixed ``dy``, and compares."""
    ex = "08.3 bias before g"
    v = _run_split(ex, path, "forward")[0]
    require(
        v["output"][0] > TOL,
        ex,
        "your forward gives the unsplit output: it still adds b2 after g; add it "
        "to the partial sum, inside ReduceFromTP.apply(...)",
    )
    got = round(v["bias_copies"])
    require(
        v["partial_sum"] > TOL and close(v["bias_copies"], got, rel=1e-4),
        ex,
        "the output differs from the unsplit one by something other than a multiple of b2: change only where b2 is added",
    )
    predicted = predicted or {}
    wrong, copies = (
        answered(predicted.get(k), ex, f'predicted["{k}"]') for k in ("wrong", "bias_copies")
    )
    unknown = set(wrong) - set(NAMES)
    require(
        not unknown, ex, f"predicted['wrong'] names {sorted(unknown)}: choose among {list(NAMES)}"
    )
    measured = {name for name in NAMES if v[name][0] > TOL}
    require(
        set(wrong) == measured,
        ex,
        f"measured wrong: {sorted(measured)}, you predicted {sorted(wrong)}: "
        "the loss is (out · dy).sum() with a fixed dy, and g's backward is the identity: "
        "what does b2 + partial change in backward?",
    )
    require(
        copies == got,
        ex,
        f"the output holds {got} copies of b2, not {copies}: every rank adds its own "
        "before the sum",
    )
    passed(
        ex,
        f"with a fixed dy only the output is wrong, by (tp − 1)·b2: it holds {got} copies of b2 on 2 ranks",
    )


# --- 08.4 ---------------------------------------------------------------------------------------


LINKS = {"nvlink": cm.H100.intra_bw, "infiniband": cm.H100.inter_bw}
"""08.4's links (B/s per direction): NVLink 4 and one NDR InfiniBand port per GPU (``cm.H100``)."""
N_HEADS = 96
"""08.4's head count (GPT-3: 96 heads of 128 features, h = 12288): a TP degree must divide it."""


def _reference_ratio(tp_degree: int, link_bw: float) -> float:
    """Section 7's ratio: one block's forward communication per rank over ``link_bw`` / its matmuls
    at ``cm.H100.peak_flops``."""
    s, h = 2048, 12288
    big = tp.comm_bytes(b=1, s=s, h=h, ffn=4 * h, tp=tp_degree, elem=2)
    comm_s = big["tp_forward"] * 2 * (tp_degree - 1) / tp_degree / link_bw
    return comm_s / (2 * big["params"] * s / tp_degree / cm.H100.peak_flops)


def _check_ratio(ex: str, ratio) -> None:
    for bw in LINKS.values():
        for n in (8, 2, 3, 4, 16, 24):
            got, want = attempt(ex, ratio, n, bw), _reference_ratio(n, bw)
            if close(got, want, rel=1e-6):
                continue
            fixes = [
                (
                    2 * (n - 1) / n,
                    "a ring all-reduce sends 2(n − 1)/n of the tensor from each rank",
                ),
                (n, "each rank computes 1/tp of the matmuls"),
                (
                    2 * (n - 1),
                    "count the ring's 2(n − 1)/n, and each rank computes only 1/tp of the matmuls",
                ),
                (
                    989 / 990,
                    f"take the peak from cm.H100.peak_flops ({cm.H100.peak_flops:.4g} FLOP/s)",
                ),
                (
                    LINKS["nvlink"] / bw,
                    "divide by link_bw, the link asked for, not a fixed NVLink bandwidth",
                ),
            ]
            why = next(
                (text for k, text in fixes if close(got * k, want, rel=1e-6)),
                "compare with section 7's cell",
            )
            require(
                False,
                ex,
                f"ratio({n}, {bw:.3g}) = {got:.3g}, section 7's arithmetic gives {want:.3g}: {why}",
            )


def crossover(ratio, smallest_tp: dict | None = None) -> None:
    """08.4: ``ratio(tp, link_bw) -> float`` (communication / compute of one block's forward at the
    GPT-3-like size of section 7, ``link_bw`` in B/s, peak ``cm.H100.peak_flops``) and
    ``smallest_tp`` = {"nvlink", "infiniband": int}, per link of :data:`LINKS` the smallest TP degree
    dividing :data:`N_HEADS` with ``ratio > 1``. ``ratio`` is compared with the section's
    arithmetic at tp = 2, 3, 4, 8, 16, 24 on both links."""
    ex = "08.4 crossover"
    _check_ratio(ex, ratio)
    smallest_tp = smallest_tp or {}
    found = {}
    for link, bw in LINKS.items():
        guess = answered(smallest_tp.get(link), ex, f'smallest_tp["{link}"]')
        want = found[link] = next(
            n for n in range(2, N_HEADS + 1) if N_HEADS % n == 0 and _reference_ratio(n, bw) > 1
        )
        name = f'smallest_tp["{link}"] = {guess!r}'
        require(isinstance(guess, int) and guess >= 2, ex, f"{name}: give an int ≥ 2")
        require(
            N_HEADS % guess == 0,
            ex,
            f"{name} does not divide the {N_HEADS} heads: each rank must hold "
            "whole heads, and tp.check_heads refuses such a degree (section 3); look among the divisors of 96",
        )
        require(
            _reference_ratio(guess, bw) > 1,
            ex,
            f"{name}: ratio = {_reference_ratio(guess, bw):.3g} ≤ 1, "
            "the communication still takes less time than the matmuls; try larger divisors of 96",
        )
        require(
            guess == want, ex, f"{name}: a smaller divisor of 96 already has ratio > 1 on this link"
        )
    nv, ib = (_reference_ratio(8, bw) for bw in LINKS.values())
    passed(
        ex,
        f"ratio(8) = {nv:.2f} over NVLink, {ib:.2f} over InfiniBand, growing with tp − 1; among divisors "
        f"of {N_HEADS} heads, communication wins from tp = {found['nvlink']} (NVLink) and {found['infiniband']} (InfiniBand)",
    )
