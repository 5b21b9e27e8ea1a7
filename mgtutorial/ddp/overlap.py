"""What DDP adds to DDP by hand: buckets, their all-reduces overlapping ``backward()``,
communication hooks, and gradient accumulation with ``no_sync``.

Taught in notebooks/03b_ddp_internals.ipynb (sections 1, 2, 4 and 5); notebook 03a runs
:func:`hooks_worker` as its DDP. Follows https://pytorch.org/docs/stable/notes/ddp.html (buckets,
overlap, ``no_sync``) and https://pytorch.org/docs/stable/ddp_comm_hooks.html.

:func:`hooks_worker` is a small diff of :func:`mgtutorial.ddp.worker`: it reads its rank from the
environment, so :func:`mgtutorial.launch` (the notebook) and ``torchrun`` run it alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from mgtutorial import ddp
from mgtutorial.common.compare import counting_mode
from mgtutorial.runtime import env


@dataclass(kw_only=True)
class HooksConfig(ddp.DDPConfig):
    """:class:`~mgtutorial.ddp.DDPConfig` plus the DDP knobs this section turns."""

    bucket_cap_mb: float | None = None
    """DDP's bucket size in MiB (None: DDP's default, 25 MiB, the first bucket capped at
    ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` = 1 MiB)."""
    find_unused_parameters: bool = False
    """Passed to DDP; with it (and no ``static_graph``) DDP never rebuilds its buckets."""
    static_graph: bool = False
    """Passed to DDP: the graph is the same every step (buckets rebuilt once, before step 3)."""
    gradient_as_bucket_view: bool = False
    """Passed to DDP: each ``.grad`` is a view into its bucket instead of a tensor of its own."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step; all but the last run under ``no_sync`` (no
    communication)."""
    autocast: bool = False
    """Run the forward pass under ``torch.autocast`` in bfloat16 (the loss in float32)."""
    count_collectives: bool = False
    """Count each step's collectives with ``CommDebugMode`` (logged as ``collectives``); it adds
    work to every operation, so the timed runs leave it off."""

    def validate(self, world_size: int) -> None:
        """:meth:`DDPConfig.validate` plus ``accumulation_steps`` ≥ 1. Raises ValueError."""
        super().validate(world_size)
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={self.accumulation_steps}: need at least 1.")


def counting_allreduce_hook(state, bucket):
    """A DDP communication hook: records the bucket, then does DDP's usual all-reduce (average),
    and records when the all-reduce's future completes.

    ``(state: dict, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]``; left unannotated
    because DDP checks the annotation's *object*, which ``from __future__ import annotations`` turns
    into a string.

    ``state["buckets"]`` collects one dict per call: ``index``, ``elements``, ``dtype`` (the
    buffer's, as ``str(torch.dtype)``), ``launched`` and
    ``done`` (unix s; ``done`` is set by the future's callback: on gloo when the data has been
    exchanged, on NCCL when the all-reduce is queued on its CUDA stream).
    """
    buffer = bucket.buffer()
    rec = {"index": bucket.index(), "elements": buffer.numel(), "dtype": str(buffer.dtype)}
    rec["launched"] = time.time()
    state["buckets"].append(rec)

    def done(fut):
        rec["done"] = time.time()
        return fut.value()

    return default_hooks.allreduce_hook(None, bucket).then(done)


def grad_storages(model: torch.nn.Module) -> list[int]:
    """Bytes of each distinct storage that holds a parameter's ``.grad`` (in first-seen order):
    one per gradient when each has its own tensor, one per bucket when the gradients are views
    into DDP's buckets (``gradient_as_bucket_view=True``)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        if p.grad is not None:
            storage = p.grad.untyped_storage()
            seen.setdefault(storage.data_ptr(), storage.nbytes())
    return list(seen.values())


class AccumulationTrainer(ddp.Trainer):
    """:class:`~mgtutorial.ddp.Trainer` whose step accumulates gradients over
    ``accumulation_steps`` micro-batches of ``cfg.batch_size`` (its loader deals ``batch_size ×
    accumulation_steps`` samples per step), all but the last under ``model.no_sync()``; each
    micro-batch's loss is divided by their number, so the gradient is the mean over all of them.
    ``max_steps`` counts optimizer steps, as everywhere.

    Logs a ``kind="sync"`` record per step: ``collectives`` (``{name: calls}`` in forward and
    backward, from ``CommDebugMode``, with ``count_collectives``; else None), ``allreduce_calls``
    (the hook's), ``bucket_sizes`` (elements), ``bucket_dtypes``, ``logits_dtype`` (the forward
    pass's output), ``bucket_launched`` and ``bucket_done`` (unix s, per bucket),
    ``backward_start`` and ``backward_end`` (unix s, around the last micro-batch's
    ``backward()``), ``grad_storages`` (:func:`grad_storages`, after the step).
    """

    def __init__(
        self, model, train_set, test_set, optimizer, ctx: env.DistContext, cfg: HooksConfig
    ):
        super().__init__(model, train_set, test_set, optimizer, ctx, cfg)
        big = dataclasses.replace(cfg, batch_size=cfg.batch_size * cfg.accumulation_steps)
        self.loader = ddp.rank_loader(train_set, big, ctx.rank, ctx.world_size)
        self.buckets = {"buckets": []}
        model.register_comm_hook(self.buckets, counting_allreduce_hook)

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        self.buckets["buckets"].clear()
        k, total = self.cfg.accumulation_steps, 0.0
        counting = counting_mode() if self.cfg.count_collectives else contextlib.nullcontext()
        with counting:
            for micro, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):
                with self.model.no_sync() if micro < k - 1 else contextlib.nullcontext():
                    with torch.autocast(xm.device.type, torch.bfloat16, enabled=self.cfg.autocast):
                        logits = self.model(xm)
                    loss = self.loss_fn(logits.float(), ym) / k
                    t0 = time.time()
                    loss.backward()  # DDP all-reduces only in the last micro-batch's backward
                    t1 = time.time()
                total += loss.item()
        self.optimizer.step()
        b = self.buckets["buckets"]
        self.log.write(
            kind="sync",
            step=self.step + 1,
            collectives=counting.counts() if self.cfg.count_collectives else None,
            allreduce_calls=len(b),
            bucket_sizes=[s["elements"] for s in b],
            bucket_dtypes=[s["dtype"] for s in b],
            logits_dtype=str(logits.dtype),
            bucket_launched=[s["launched"] for s in b],
            bucket_done=[s.get("done") for s in b],
            backward_start=t0,
            backward_end=t1,
            grad_storages=grad_storages(self.model),
        )
        return total


def hooks_worker(cfg: HooksConfig) -> dict:
    """DDP with ``bucket_cap_mb`` and :func:`counting_allreduce_hook`, trained by
    :class:`AccumulationTrainer`. Returns the Trainer's summary.

    Raises:
        ValueError: ``accumulation_steps`` < 1 (``cfg.validate``, called before any rank starts).
    """
    with env.distributed(cfg.backend, cfg.timeout_s) as ctx:
        wrap = functools.partial(
            ddp.apply_ddp,
            bucket_cap_mb=cfg.bucket_cap_mb,
            static_graph=cfg.static_graph,
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            find_unused_parameters=cfg.find_unused_parameters,
        )
        model, train_set, test_set, optimizer = ddp.build(cfg, ctx, wrap=wrap)
        return AccumulationTrainer(model, train_set, test_set, optimizer, ctx, cfg).train()


def timeline_figure(runs: dict[str, list[dict]]):
    """One panel per run: for each step's ``kind="sync"`` record, the ``backward()`` call as a grey
    bar (for DDP by hand, up to the end of ``finish_gradient_sync``: ``sync_end``, the wait DDP's
    ``backward()`` includes) and each all-reduce as a line from its launch to its completion, in
    ms since ``backward()`` was called. ``runs`` maps a title to its records (one rank's). Returns a
    matplotlib ``Figure``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 1.2 + 1.3 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, records) in zip(axes, runs.items()):
        for rec in records:
            t0, y = rec["backward_start"], rec["step"]
            end = rec.get("sync_end", rec["backward_end"])  # by hand: up to the wait's end
            ax.barh(y, (end - t0) * 1e3, height=0.7, color="lightgray")
            n = len(rec["bucket_launched"])
            for b, (start, end) in enumerate(zip(rec["bucket_launched"], rec["bucket_done"])):
                end = start if end is None else end
                dy = 0.55 * (b / max(n - 1, 1) - 0.5)
                ax.plot(
                    [(start - t0) * 1e3, (end - t0) * 1e3],
                    [y + dy] * 2,
                    "-|",
                    lw=2,
                    ms=5,
                    color=f"C{b % 10}",
                )
        ax.set_title(
            f"{title}: grey, backward() (by hand, to the end of finish_gradient_sync); lines, "
            "each all-reduce from launch to done",
            loc="left",
            fontsize=9,
        )
        ax.set_ylabel("step")
        ax.set_yticks(sorted({rec["step"] for rec in records}))
    axes[-1].set_xlabel("ms since backward() was called")
    return fig
