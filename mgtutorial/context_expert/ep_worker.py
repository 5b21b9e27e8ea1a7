"""Chapter 10b's worker: the MoE layer with its experts split over all ranks (ep = world size),
each rank routing its own group of tokens, checked in the rank against the one-process layer on
all groups (output, the gradients of the tokens, the router and every local expert), with every
all-to-all counted twice (by :data:`expert_parallel.COUNTS` and by ``CommDebugMode``) and
predicted from the one-process routing.

Taught in notebooks/10b_expert_parallel.ipynb (section 3). Started from a notebook with
``launch(ep_worker.worker, config.EPConfig(), 2)``; the same function runs under ``torchrun``.
"""

from __future__ import annotations

import torch.distributed as dist

from mgtutorial.common import compare
from mgtutorial.context_expert import expert_parallel as ep
from mgtutorial.context_expert.config import EPConfig
from mgtutorial.context_expert.moe import MoE, moe, tokens
from mgtutorial.runtime import env

TOL = dict(rtol=1e-5, atol=1e-5)
"""How close the split layer must come to one process (float32, another order of summation)."""
NAMES = ("out", "d tokens", "d router", "d w1", "d w2")
"""What the worker compares with one process, in the order of ``diffs``."""
AUX = 0.01
"""Weight of the balancing loss in the loss of both runs: ``(out · dy).sum() + AUX · aux``."""


def reference(cfg: EPConfig, ranks: int, device) -> tuple[MoE, dict, list]:
    """The whole layer on one process, on all ``ranks`` groups; forward and backward.

    Returns (the layer with its gradients, its stats, [x with its gradient, dy, out])."""
    layer = MoE(cfg).to(device)
    x, dy = (t.to(device) for t in tokens(cfg, ranks))
    x.requires_grad_()
    out, stats = moe(layer, x, ranks)
    ((out * dy).sum() + AUX * stats["aux"]).backward()
    return layer, stats, [x, dy, out.detach()]


def worker(cfg: EPConfig) -> dict:
    """Run the split layer on this rank's group and compare it with :func:`reference`
    (``assert_close``: a mismatch raises in the rank).

    Returns {"max_diff", "diffs" (max |Δ| per :data:`NAMES`), "per_expert" (rows of each local
    expert), "ref_per_expert" (all experts, one process), "dropped", "ref_dropped", "send",
    "recv", "counted" (:data:`ep.COUNTS`), "predicted" (:func:`ep.predicted_bytes`), "comm"
    {"forward", "backward": CommDebugMode's counts}}.
    """
    with env.distributed(cfg.backend) as ctx:
        n, rank = ctx.world_size, ctx.rank
        layer, ref_stats, (x, dy, ref_out) = reference(cfg, n, ctx.device)
        local = cfg.experts // n
        lo, hi = rank * local, (rank + 1) * local
        router, w1, w2 = (
            p.detach().clone().requires_grad_()
            for p in (layer.router, layer.w1[lo:hi], layer.w2[lo:hi])
        )
        rows = slice(rank * cfg.tokens, (rank + 1) * cfg.tokens)
        xr = x[rows].detach().clone().requires_grad_()
        ep.COUNTS.clear()
        with compare.counting_mode() as fwd:
            out, stats = ep.ep_moe(router, w1, w2, xr, cfg.top_k, cfg.capacity_factor)
        with compare.counting_mode() as bwd:
            ((out * dy[rows]).sum() + AUX * stats["aux"] / n).backward()
        dist.all_reduce(router.grad)  # the router is replicated: its gradient is summed, as DDP
        got = [out, xr.grad, router.grad, w1.grad, w2.grad]
        want = [
            ref_out[rows],
            x.grad[rows],
            layer.router.grad,
            layer.w1.grad[lo:hi],
            layer.w2.grad[lo:hi],
        ]
        compare.all_close(zip(got, want), **TOL)
        plan = ep.plan(layer, x.detach(), n)
        return {
            "max_diff": compare.max_abs_diff(got, want),
            "diffs": {n: compare.max_abs_diff(a, b) for n, a, b in zip(NAMES, got, want)},
            "per_expert": stats["per_expert"],
            "ref_per_expert": ref_stats["per_expert"],
            "dropped": stats["dropped"],
            "ref_dropped": ref_stats["dropped"],
            "send": stats["send"],
            "recv": stats["recv"],
            "plan": plan,
            "counted": dict(ep.COUNTS),
            "predicted": ep.predicted_bytes(plan, rank, cfg.hidden, cfg.experts),
            "comm": {"forward": fwd.counts(), "backward": bwd.counts()},
        }
