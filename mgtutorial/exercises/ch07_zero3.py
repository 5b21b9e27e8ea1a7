"""Checker of chapter 07's exercise 07b.2 (notebooks/07b_fsdp2.ipynb): ZeRO-3 by hand for one
linear layer, reached as ``ex.ch07.zero3_layer``.

The learner writes ``Zero3Linear``, a ``torch.autograd.Function`` that computes ``x · Wᵀ`` from this
rank's rows of ``W``: it all-gathers the rows before forward and keeps only its shard for backward;
backward all-gathers ``W`` again for the input's gradient and reduce-scatters the weight's
gradient, averaged over ranks. The rank-side worker (:func:`zero3_worker`) trains that layer with
AdamW on each rank's shard, next to one process that trains the whole ``W`` on the whole batch, and
returns what the checker compares: the shard's gradient at every step, the input's gradient, what
autograd saved, the collectives of forward and backward, and the parameters after the last step.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.nn import functional as F

from mgtutorial.common.compare import counting_mode
from mgtutorial.exercises._common import (
    ExerciseError,
    FileWorkerConfig,
    import_file,
    passed,
    require,
    run_ranks,
)
from mgtutorial.runtime import env

OUT, IN, BATCH, STEPS, LR = 6, 5, 8, 3, 0.05
"""The layer ``W`` (OUT, IN), the batch (split evenly over the ranks), the steps, AdamW's rate."""

TOL = 1e-5


def data(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``W`` (OUT, IN) at the start, and the whole batch ``x`` (BATCH, IN), ``y`` (BATCH, OUT) of
    ``step``; the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(7))
    return w, torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def one_process() -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """One process on the whole batch: the gradients of ``W`` and of ``x`` at each step, and ``W``
    after :data:`STEPS` AdamW steps."""
    w = torch.nn.Parameter(data(0)[0])
    opt = torch.optim.AdamW([w], lr=LR)
    grads, dxs = [], []
    for step in range(STEPS):
        _, x, y = data(step)
        x.requires_grad_()
        F.mse_loss(x @ w.T, y).backward()
        grads.append(w.grad.clone())
        dxs.append(x.grad.clone())
        opt.step()
        opt.zero_grad()
    return grads, dxs, w.detach().clone()


def zero3_worker(cfg: FileWorkerConfig) -> dict:
    """Rank-side: :data:`STEPS` AdamW steps of the learner's ``Zero3Linear`` on this rank's rows of
    ``W`` and this rank's slice of the batch. Max |Δ| of each step's shard gradient to the ways a
    mistake leads to, of the input's gradient, and of ``W`` after the last step, to one process."""
    fn = import_file(cfg.path).Zero3Linear
    with env.distributed(cfg.backend) as ctx:
        n, r = ctx.world_size, ctx.rank
        rows, b = OUT // n, BATCH // n
        shard = torch.nn.Parameter(data(0)[0][r * rows : (r + 1) * rows].clone())
        opt = torch.optim.AdamW([shard], lr=LR)
        ref_grads, ref_dxs, ref_w = one_process()
        out = {"ways": [], "dx": [], "counts": [], "saved_full": False, "grad_none": False}

        gathered: set[int] = set()  # storages the all-gathers of forward wrote into
        real_gather = dist.all_gather_single

        def spy_gather(output, *args, **kwargs):
            gathered.add(output.untyped_storage().data_ptr())
            return real_gather(output, *args, **kwargs)

        def keeps_w(t) -> bool:  # W itself, a view of it, or its storage
            return isinstance(t, torch.Tensor) and (
                t.untyped_storage().data_ptr() in gathered or tuple(t.shape) == (OUT, IN)
            )

        def pack(t):
            out["saved_full"] |= keeps_w(t)
            return t

        for step in range(STEPS):
            _, x, y = data(step)
            x, y = x[r * b : (r + 1) * b].clone().requires_grad_(), y[r * b : (r + 1) * b]
            with (
                counting_mode() as fwd,
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
                mock.patch.object(dist, "all_gather_single", spy_gather),
            ):
                pred = fn.apply(x, shard)
            # W stashed on the Function's ctx (ctx.full = …) is kept for backward as well
            stash = getattr(pred.grad_fn, "__dict__", {}).values()
            out["saved_full"] |= any(keeps_w(t) for t in stash)
            with counting_mode() as bwd:
                F.mse_loss(pred, y).backward()
            out["counts"].append((fwd.counts(), bwd.counts()))
            if shard.grad is None or x.grad is None:
                out["grad_none"] = True
                break
            whole = ref_grads[step]
            xs, ys = data(step)[1][r * b : (r + 1) * b], data(step)[2][r * b : (r + 1) * b]
            w_now = torch.empty(OUT, IN)
            dist.all_gather_single(w_now, shard.detach().contiguous())
            mine = 2 * (xs @ w_now.T - ys).T @ xs / (b * OUT)  # this rank's own batch only
            ways = {
                "mean": whole[r * rows : (r + 1) * rows],
                "sum": n * whole[r * rows : (r + 1) * rows],
                "local": mine[r * rows : (r + 1) * rows],
                "other_rows": whole[(1 - r) * rows : (2 - r) * rows] if n == 2 else whole[:0],
            }
            got = shard.grad.detach()
            out["ways"].append(
                {
                    k: (got - w).abs().max().item() if w.shape == got.shape else 1.0
                    for k, w in ways.items()
                }
            )
            # one process's x.grad is the mean over BATCH; a rank's is over its b = BATCH / N
            out["dx"].append((x.grad / n - ref_dxs[step][r * b : (r + 1) * b]).abs().max().item())
            opt.step()
            opt.zero_grad()
        final = torch.empty(OUT, IN)
        dist.all_gather_single(final, shard.detach().contiguous())
        out["final_diff"] = (final - ref_w).abs().max().item()
        return out


RIGHT = ({"all_gather": 1}, {"all_gather": 1, "reduce_scatter": 1})
"""The collectives of one ZeRO-3 step of one layer: forward, backward."""


def _first_step(ex: str, values: dict) -> None:
    """The hint for the first wrong shard gradient or input gradient, if any."""
    for rank, v in sorted(values.items()):
        require(
            not v["grad_none"],
            ex,
            f"rank {rank}: after backward the shard's gradient or the input's gradient is None: "
            "backward must return one gradient per input of forward (x, shard)",
        )
        w = v["ways"][0]
        if w["mean"] < TOL:
            continue
        if w["sum"] < TOL:
            raise ExerciseError(
                ex,
                f"rank {rank}: the shard's gradient is the SUM of the ranks' gradients, N× the "
                "one-process gradient: divide by the world size (each rank's loss is a mean over "
                "its own slice of the batch)",
            )
        if w["local"] < TOL:
            raise ExerciseError(
                ex,
                f"rank {rank}: the shard's gradient is this rank's own gradient of its rows, from "
                "its slice of the batch only: the gradients of all ranks must be summed "
                "(reduce-scatter), then averaged",
            )
        if w["other_rows"] < TOL:
            raise ExerciseError(
                ex,
                f"rank {rank} received the gradient of another rank's rows: rank r's shard is "
                "rows r·out/N … (r+1)·out/N, and reduce-scatter gives rank r chunk r",
            )
        raise ExerciseError(
            ex,
            f"rank {rank}: the shard's gradient at the first step differs from one process's "
            f"(rows of W) by {w['mean']:.2g}: the weight's gradient is dyᵀ · x (out, in) on "
            "each rank, then reduce-scattered and divided by N",
        )
    for rank, v in sorted(values.items()):
        require(
            v["dx"][0] < TOL,
            ex,
            f"rank {rank}: the shard's gradient is right but the input's gradient is not "
            f"(off by {v['dx'][0]:.2g}): x's gradient is dy · W with the WHOLE W, not only "
            "this rank's rows",
        )


def zero3_layer(path: str = "ex07_zero3.py") -> None:
    """07b.2: ``Zero3Linear`` in ``path``, a ``torch.autograd.Function`` called as
    ``Zero3Linear.apply(x, shard)``: ``x`` (b, in) this rank's slice of the batch, ``shard``
    (out / N, in) this rank's rows of ``W``; returns ``x · Wᵀ`` (b, out). 3 AdamW steps on 2 gloo
    ranks (gloo on any machine; ``W`` 6 × 5, a batch of 8) against one process; verifies the
    shard's gradient (the average over ranks of this rank's rows), the input's gradient, ``W``
    after the last step, that the gathered ``W`` (or a view of it) is not kept for backward
    (saved, or stashed on ``ctx``), and the collectives (``CommDebugMode``): one
    all-gather in forward, one all-gather and one reduce-scatter in backward.
    """
    ex = "07b.2 ZeRO-3 by hand"
    module = import_file(path, ex)
    fn = getattr(module, "Zero3Linear", None)
    require(
        isinstance(fn, type) and issubclass(fn, torch.autograd.Function),
        ex,
        f"{Path(path).name} defines no torch.autograd.Function `Zero3Linear`",
    )
    cfg = FileWorkerConfig(path=str(Path(path).resolve()), function="Zero3Linear", backend="gloo")
    values = run_ranks(ex, zero3_worker, cfg, 2, timeout_s=30, name=Path(path).stem).values
    _first_step(ex, values)
    for rank, v in sorted(values.items()):
        fwd, bwd = v["counts"][0]
        require(
            fwd.get("all_gather", 0) == 1,
            ex,
            f"rank {rank} ran {fwd or 'no collectives'} in forward: gather the shards into W "
            "with one all-gather",
        )
        require(
            bwd.get("all_reduce", 0) == 0,
            ex,
            f"rank {rank} all-reduced in backward: every rank then receives the whole gradient "
            "and keeps a slice; on a ring (NCCL) that sends twice a reduce-scatter's bytes. gloo "
            "happens to run both as an all-reduce, but the call states what you need: each rank "
            "only its rows",
        )
        gathers = bwd.get("all_gather", 0)
        why = (
            "it saved the gathered W for backward"
            if v["saved_full"]
            else f"it ran {gathers} all-gathers in backward, not one"
        )
        require(
            not v["saved_full"] and gathers == 1,
            ex,
            f"rank {rank} kept the gathered W from forward to backward ({why}): ZeRO-3 frees W "
            "when forward returns and gathers it again in backward; save only x and the shard",
        )
        require(
            (fwd, bwd) == RIGHT,
            ex,
            f"rank {rank} ran {fwd} in forward and {bwd} in backward: one all-gather forward, "
            "one all-gather and one reduce-scatter backward",
        )
        require(
            v["final_diff"] < TOL,
            ex,
            f"rank {rank}: after {STEPS} steps W differs from one process by "
            f"{v['final_diff']:.2g}: does every step do the same thing?",
        )
    worst = max(v["final_diff"] for v in values.values())
    passed(
        ex,
        f"W after {STEPS} AdamW steps on 2 ranks equals one process (max |Δ| {worst:.1e}); "
        "1 all-gather forward, 1 all-gather + 1 reduce-scatter backward; W not kept for backward",
    )
