"""Checkers of chapter 08's exercises (notebooks/08_tensor_parallel.ipynb): the collectives of a
split block, Megatron's f and g written by hand, the bias added before g, and the TP degree at
which communication outgrows compute.

The rank-side exercises run :func:`split_mlp_worker`: the chapter's hand-split MLP
(:class:`mgtutorial.tensor_parallel.HandTPMLP`) with the learner's f and g, or the learner's
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

from .. import env
from .. import tensor_parallel as tp
from .. import tensor_parallel_mesh as M
from ._common import answered, attempt, close, function_from, import_file, passed, require, run_ranks

# --- 08.1 ---------------------------------------------------------------------------------------


def counts(predicted: dict) -> None:
    """08.1: ``predicted`` = {"forward", "backward": all-reduces of the hand-split block (ints),
    "all_reduce_bytes": bytes of each DTensor all-reduce (int), "all_gather_bytes": [bytes in, out]
    of each sequence-parallel all-gather} for ``TPConfig(h=32, n_heads=8, batch=3, seq=4)`` on 2 ranks.

    Launches the chapter's worker (:func:`mgtutorial.tensor_parallel_mesh.worker`) and compares.
    """
    ex = "08.1 counts and bytes"
    guess = {k: answered(predicted.get(k), ex, f'predicted["{k}"]')
             for k in ("forward", "backward", "all_reduce_bytes", "all_gather_bytes")}
    v = run_ranks(ex, M.worker, M.TPConfig(h=32, n_heads=8, batch=3, seq=4), 2, name="tp").values[0]
    block, dt, sp = (v[k]["counts"] for k in ("hand_block", "dtensor", "sequence_parallel"))
    for phase in ("forward", "backward"):
        got = block[phase].get("all_reduce", 0)
        require(guess[phase] == got, ex, f"the split block issued {got} all-reduces in {phase}, not "
                f"{guess[phase]}: one g (forward) or one f (backward) per sublayer, attention and MLP")
    got = {n for n, _ in dt["bytes"]["all_reduce"]}.pop()
    require(guess["all_reduce_bytes"] == got, ex, f"each all-reduce moved {got} bytes, not "
            f"{guess['all_reduce_bytes']}: one (b, s, h) float32 activation is b·s·h·4 bytes")
    got = sp["bytes"]["all_gather"][0]
    require(list(guess["all_gather_bytes"]) == got, ex, f"each all-gather took and returned {got} bytes, not "
            f"{list(guess['all_gather_bytes'])}: a rank sends its s / tp tokens and receives all s")
    passed(ex, f"2 + 2 all-reduces of {got[1]} bytes per block; sequence parallelism gathers {got[0]} → {got[1]}")


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


def split_mlp_worker(cfg: SplitMLPConfig) -> dict:
    """Run the hand-split MLP with the learner's pieces and the unsplit MLP on the same input.

    Returns {"output", "x.grad", "w1", "b1", "w2", "b2": [max |split − unsplit|, least-squares
    ratio split / unsplit]}, "partial_sum" (max |output − this rank's partial sum + b2|, i.e. the
    output had g not summed), "bias_copies" (least-squares k in output − unsplit = (k − 1)·b2) and
    "counts" ({"forward", "backward": {collective: calls}}, from ``CommDebugMode``).
    """
    from torch.nn import functional as F

    with env.distributed(cfg.backend) as ctx:
        env.seed_everything(cfg.seed)
        ref = tp.MLP(cfg.h, cfg.ffn).to(ctx.device)
        split = tp.HandTPMLP(ref, ctx.rank, ctx.world_size)
        x, dy = (t.to(ctx.device) for t in M._inputs(cfg))
        want, want_dx, _ = M._run(ref, x, dy)
        with ExitStack() as stack:
            if cfg.mode == "fg":
                module = import_file(cfg.path)
                for name in ("CopyToTP", "ReduceFromTP"):
                    stack.enter_context(mock.patch.object(tp, name, getattr(module, name)))
            else:
                split.forward = functools.partial(function_from(cfg.path, "forward"), split)
            out, dx, c = M._run(split, x, dy)
        result = {"output": (out, want), "x.grad": (dx, want_dx)}
        for name, p in split.named_parameters():
            result[name] = (p.grad, tp.hand_shard(name, ref.get_parameter(tp.unsplit_name(name)).grad,
                                                  ctx.rank, ctx.world_size))
        partial = F.linear(F.gelu(F.linear(x, split.w1, split.b1)), split.w2) + split.b2
        return {**{k: [float((a - b).abs().max()), _ratio(a, b)] for k, (a, b) in result.items()},
                "partial_sum": float((out - partial).abs().max()),
                "bias_copies": 1 + _ratio(out - want, split.b2.detach().expand_as(out)),
                "counts": {k: c[k] for k in ("forward", "backward")}}


def _run_split(ex: str, path: str, mode: str) -> dict:
    import_file(path, ex)  # a syntax error or a missing file is named before any rank starts
    return run_ranks(ex, split_mlp_worker, SplitMLPConfig(path=str(Path(path).resolve()), mode=mode), 2, name="split_mlp").values


TOL = 1e-5


# --- 08.2 ---------------------------------------------------------------------------------------


def f_and_g(path: str = "ex08_fg.py") -> None:
    """08.2: ``CopyToTP`` (f) and ``ReduceFromTP`` (g) in ``path``, ``torch.autograd.Function``s
    called as ``f.apply(x, group)``. Run in ``HandTPMLP`` on 2 ranks; the output, the input's
    gradient and every parameter's gradient must equal the unsplit MLP's, with one all-reduce in
    forward and one in backward."""
    ex = "08.2 f and g"
    for cls in ("CopyToTP", "ReduceFromTP"):
        fn = getattr(import_file(path, ex), cls, None)
        require(isinstance(fn, type) and issubclass(fn, torch.autograd.Function), ex,
                f"{path} defines no torch.autograd.Function `{cls}`")
    for rank, v in sorted(_run_split(ex, path, "fg").items()):
        (out, _), (dx, k_dx) = v["output"], v["x.grad"]
        if out > TOL:
            require(v["partial_sum"] > TOL, ex, f"rank {rank}'s output is its own partial sum: ReduceFromTP "
                    "(g) must add the partial outputs of all ranks in forward (dist.all_reduce)")
            require(False, ex, f"rank {rank}'s output differs from the unsplit MLP's by up to {out:.2g}: "
                    "CopyToTP's forward must return x unchanged, ReduceFromTP's forward must sum (all-reduce) once")
        for name in ("w2", "b1", "w1"):
            diff, k = v[name]
            require(diff <= TOL, ex, f"output right, but rank {rank}'s gradient of {name} is {k:.2g}× the unsplit "
                    "one's: " + ("ReduceFromTP's backward must be the identity (every rank already holds the "
                                 "whole gradient of the output)" if close(k, 2, rel=1e-3) else
                                 "check what ReduceFromTP's backward returns"))
        require(dx <= TOL, ex, f"output and weight gradients right, but rank {rank}'s gradient of the input x "
                f"is {k_dx:.2g}× the unsplit one's: it is not the sum over ranks; CopyToTP (f) must "
                "all-reduce the gradient in backward")
        for phase, calls in v["counts"].items():
            require(calls == {"all_reduce": 1}, ex, f"right results, but rank {rank} issued {calls or 'no collectives'} "
                    f"in {phase}: Megatron's f and g need exactly one all-reduce each way")
    passed(ex, "your f and g split the MLP exactly: output and all gradients == unsplit, 1 all-reduce each way")


# --- 08.3 ---------------------------------------------------------------------------------------

NAMES = ("output", "x.grad", "w1", "b1", "w2", "b2")


def bias_before_g(path: str = "ex08_bias.py", predicted: dict | None = None) -> None:
    """08.3: ``forward(m, x)`` in ``path`` adds ``m.b2`` *before* g; ``predicted`` = {"wrong": the set
    of :data:`NAMES` that then differ from the unsplit MLP, "bias_copies": how many b2 the output
    holds (int)}. Runs the forward in ``HandTPMLP`` on 2 ranks and compares."""
    ex = "08.3 bias before g"
    v = _run_split(ex, path, "forward")[0]
    require(v["output"][0] > TOL, ex, "your forward gives the unsplit output: it still adds b2 after g; add it "
            "to the partial sum, inside ReduceFromTP.apply(...)")
    got = round(v["bias_copies"])
    require(v["partial_sum"] > TOL and close(v["bias_copies"], got, rel=1e-4), ex,
            "the output differs from the unsplit one by something other than a multiple of b2: change only where b2 is added")
    predicted = predicted or {}
    wrong, copies = (answered(predicted.get(k), ex, f'predicted["{k}"]') for k in ("wrong", "bias_copies"))
    unknown = set(wrong) - set(NAMES)
    require(not unknown, ex, f"predicted['wrong'] names {sorted(unknown)}: choose among {list(NAMES)}")
    measured = {name for name in NAMES if v[name][0] > TOL}
    require(set(wrong) == measured, ex, f"measured wrong: {sorted(measured)}, you predicted {sorted(wrong)}: "
            "g's backward is the identity, so what does b2 + partial change in backward?")
    require(copies == got, ex, f"the output holds {got} copies of b2, not {copies}: every rank adds its own "
            "before the sum")
    passed(ex, f"only the output is wrong, by (tp − 1)·b2: it holds {got} copies of b2 on 2 ranks")


# --- 08.4 ---------------------------------------------------------------------------------------


def _reference_ratio(tp_degree: int) -> float:
    """Section 7's ratio: one block's forward communication per rank over NVLink / its matmuls at peak."""
    s, h = 2048, 12288
    big = tp.comm_bytes(b=1, s=s, h=h, ffn=4 * h, tp=tp_degree, elem=2)
    comm_s = big["tp_forward"] * 2 * (tp_degree - 1) / tp_degree / 450e9
    return comm_s / (2 * big["params"] * s / tp_degree / 990e12)


def crossover(ratio, smallest_tp=...) -> None:
    """08.4: ``ratio(tp) -> float`` (communication / compute of one block's forward over NVLink at
    the GPT-3-like size of section 7) and ``smallest_tp`` (int), the smallest TP degree with
    ``ratio > 1``. Compared with the section's arithmetic at tp = 2, 4, 8, 16, 32."""
    ex = "08.4 crossover"
    for n in (8, 2, 4, 16, 32):
        got, want = attempt(ex, ratio, n), _reference_ratio(n)
        if close(got, want, rel=1e-6):
            continue
        fixes = [(2 * (n - 1) / n, "a ring all-reduce sends 2(n − 1)/n of the tensor from each rank"),
                 (n, "each rank computes 1/tp of the matmuls"),
                 (2 * (n - 1), "count the ring's 2(n − 1)/n, and each rank computes only 1/tp of the matmuls")]
        why = next((text for k, text in fixes if close(got * k, want, rel=1e-6)), "compare with section 7's cell")
        require(False, ex, f"ratio({n}) = {got:.3g}, section 7's arithmetic gives {want:.3g}: {why}")
    guess = answered(smallest_tp, ex, "smallest_tp")
    want = next(n for n in range(2, 1025) if _reference_ratio(n) > 1)
    require(isinstance(guess, int) and guess >= 2, ex, f"smallest_tp = {guess!r}: give an int ≥ 2")
    require(_reference_ratio(guess) > 1, ex, f"ratio({guess}) = {_reference_ratio(guess):.3g} ≤ 1: at tp = "
            f"{guess} the communication still takes less time than the matmuls; try larger degrees")
    require(guess == want, ex, f"ratio({guess - 1}) = {_reference_ratio(guess - 1):.3g} is already > 1: "
            "look for a smaller tp")
    passed(ex, f"ratio(8) = {_reference_ratio(8):.2f}, growing with tp − 1; communication wins from tp = {want}")
