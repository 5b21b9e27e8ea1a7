"""Chapter 10a's worker: ring attention over all ranks (cp = world size), non-causal and causal,
contiguous and zig-zag shards, each checked in the rank against full attention on one process
(outputs and the gradients of q, k and v), with every send and every block counted; a wrong merge
as the negative control; and torch's ``context_parallel`` where this device can run it.

Taught in notebooks/10a_context_parallel.ipynb (sections 3–5). The reference is
``torch.nn.functional.scaled_dot_product_attention`` on the whole sequence
(https://pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html).
Started from a notebook with ``launch(cp_worker.worker, config.CPConfig(), 2)``; the same function
runs under ``torchrun`` (it reads its rank from the environment).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mgtutorial.common import compare
from mgtutorial.context_expert import ring_attention as ring
from mgtutorial.context_expert import zigzag
from mgtutorial.context_expert.config import CPConfig, attention_inputs
from mgtutorial.runtime import env

TOL = dict(rtol=1e-5, atol=1e-5)
"""How close ring attention must come to one process (float32, another order of summation)."""

CASES = (("full", False, "contiguous"), ("causal", True, "contiguous"), ("zigzag", True, "zigzag"))
"""The checks of the worker: (name, causal, layout)."""


def reference(q, k, v, dout, causal: bool) -> list[torch.Tensor]:
    """Full attention on one process, on the CPU: ``[out, dq, dk, dv]`` for the upstream gradient
    ``dout``, on the inputs' device."""
    device = q.device
    q, k, v = (t.detach().cpu().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout.cpu())
    return [t.to(device) for t in (out.detach(), q.grad, k.grad, v.grad)]


def check_ring(full: list, rank: int, cp: int, causal: bool, layout: str) -> dict:
    """Ring attention on this rank's shard of ``full`` = [q, k, v, dout] against the matching
    shard of :func:`reference` (``assert_close``: a mismatch raises in the rank).

    Returns {"max_diff", "diffs" (max |Δ| of out, dq, dk, dv), "counts" (:data:`ring.COUNTS`),
    "work" (:data:`ring.WORK`)}.
    """
    want = [zigzag.shard(t, rank, cp, layout) for t in reference(*full, causal)]
    q, k, v, dout = (zigzag.shard(t, rank, cp, layout) for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    positions = [zigzag.positions(r, cp, full[0].shape[2], layout) for r in range(cp)]
    ring.reset_counts()
    out = ring.ring_attention(q, k, v, positions, causal)
    out.backward(dout)
    got = [out.detach(), q.grad, k.grad, v.grad]
    compare.all_close(zip(got, want), **TOL)
    return {
        "max_diff": compare.max_abs_diff(got, want),
        "diffs": {
            n: compare.max_abs_diff(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)
        },
        "counts": dict(ring.COUNTS),
        "work": dict(ring.WORK),
    }


def summed(out, lse, block_out, block_lse):
    """A wrong merge (the negative control): adds the blocks' outputs, each normalised over its
    own block only."""
    return out + block_out, torch.logaddexp(lse, block_lse)


def wrong_merge_diff(full: list, rank: int, cp: int) -> float:
    """max |ring attention with :func:`summed` − one process| on this rank (no check)."""
    q, k, v, _ = (zigzag.shard(t, rank, cp, "contiguous") for t in full)
    positions = [zigzag.positions(r, cp, full[0].shape[2], "contiguous") for r in range(cp)]
    out, _ = ring.ring_forward(q, k, v, positions, False, merge_fn=summed)
    want = zigzag.shard(reference(*full, False)[0], rank, cp, "contiguous")
    return compare.max_abs_diff(out, want)


def try_context_parallel(full: list, ctx) -> dict:
    """torch's ``context_parallel`` on a 1-D mesh of all ranks, causal, with its default head-tail
    (zig-zag) load balancing; compared with the zig-zag shard of :func:`reference` where it runs.

    Returns {"ran": bool, and "max_diff" or "error" ("<type>: <first line>")}. On CPU,
    ``scaled_dot_product_attention`` dispatches to ``aten._scaled_dot_product_flash_attention_for_
    cpu``, which ``context_parallel`` does not replace (it replaces the flash, efficient and cuDNN
    CUDA kernels) and DTensor has no sharding rule for: a NotImplementedError on every rank,
    before any collective. Only the causal call is made there: the non-causal one does not raise,
    DTensor derives a rule from the op's decomposition instead, for minutes of CPU time.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    q, k, v, dout = (t.to(ctx.device) for t in full)
    want = [zigzag.shard(t, ctx.rank, ctx.world_size, "zigzag") for t in reference(*full, True)]
    try:
        with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]):
            a, b, c = (t.clone().requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(a, b, c, is_causal=True)
            out.backward(dout)
            got = [t.detach().cpu() for t in (out, a.grad, b.grad, c.grad)]
    except NotImplementedError as e:
        return {"ran": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    return {"ran": True, "max_diff": compare.max_abs_diff(got, want)}


def worker(cfg: CPConfig) -> dict:
    """Check ring attention for every case of :data:`CASES` on this rank; then the negative
    control and ``context_parallel``.

    Returns {case: :func:`check_ring`'s dict, "wrong_merge": max |Δ|, "context_parallel":
    :func:`try_context_parallel`'s dict, "positions": {layout: this rank's token indices}}.
    """
    with env.distributed(cfg.backend) as ctx:
        full = [t.to(ctx.device) for t in attention_inputs(cfg)]
        result = {
            name: check_ring(full, ctx.rank, ctx.world_size, causal, layout)
            for name, causal, layout in CASES
        }
        result["wrong_merge"] = wrong_merge_diff(full, ctx.rank, ctx.world_size)
        result["positions"] = {
            layout: zigzag.positions(ctx.rank, ctx.world_size, cfg.seq, layout).tolist()
            for layout in zigzag.LAYOUTS
        }
        result["context_parallel"] = try_context_parallel(attention_inputs(cfg), ctx)
        return result
