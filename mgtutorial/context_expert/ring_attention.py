"""Ring attention by hand: each rank keeps its queries and passes key/value blocks around a ring
of ranks with send/recv, merging one block at a time (:mod:`.online_softmax`); backward passes the
blocks round again, their gradients travelling with them back to the rank that owns them.

Taught in notebooks/10a_context_parallel.ipynb (section 3). Follows Liu et al. 2023, "Ring
Attention with Blockwise Transformers" (https://arxiv.org/abs/2310.01889), the forward and
backward loops of zhuzilin/ring-flash-attention (``ring_flash_attn.py``) and
https://pytorch.org/docs/stable/distributed.html#torch.distributed.batch_isend_irecv (the
send/recv pairs, batched so that NCCL runs them together). Every send is counted in
:data:`COUNTS` and every block's work in :data:`WORK`; :func:`ring_bytes` predicts the bytes.

Shapes: q, k, v, out ``(b, heads, s / cp, d)`` on each rank (its shard of the sequence);
``positions[r]`` the global token indices rank r holds (:func:`mgtutorial.context_expert.zigzag.
positions`), the same list on every rank.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from mgtutorial.context_expert.online_softmax import block_attention, block_grads, merge, visible

COUNTS: Counter = Counter()
"""Sends of this process, by phase: ``forward_sends``, ``forward_bytes``, ``backward_sends``,
``backward_bytes``."""
WORK: Counter = Counter()
"""Blocks of this process's forward: ``blocks`` computed, ``skipped`` (fully masked), ``pairs``
(the (query, key) products it computed: rows × columns of each trimmed block, see :func:`trim`)."""


def reset_counts() -> None:
    """Empty :data:`COUNTS` and :data:`WORK`."""
    COUNTS.clear()
    WORK.clear()


def ring_pass(t: torch.Tensor, group, phase: str):
    """Start sending ``t`` to the next rank of the ring and receiving the previous rank's into a
    new buffer; return ``(buffer, works)``: wait on every work before reading the buffer.
    Counted in :data:`COUNTS` under ``phase``."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(t)
    ops = [
        dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % n),
        dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % n),
    ]
    COUNTS[f"{phase}_sends"] += 1
    COUNTS[f"{phase}_bytes"] += t.numel() * t.element_size()
    return received, dist.batch_isend_irecv(ops)


def trim(mask: torch.Tensor | None):
    """``(rows, cols)``: the queries that see some key of a block and the keys that some query
    sees; the rest of the block is masked and need not be computed. All of it (``slice(None)``)
    without a mask. Under zig-zag shards this is the half block of ring-flash-attention's
    ``zigzag_ring_flash_attn``: the first half of an earlier rank's keys, or the second half of
    the queries against a later rank's keys."""
    if mask is None:
        return slice(None), slice(None)
    return mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()


def ring_forward(q, k, v, positions, causal: bool, group=None, merge_fn=merge):
    """The forward ring: ``(out, lse)`` of this rank's queries over every rank's keys.

    Step t computes the block that started on rank ``rank − t`` while the next block is already
    on its way (the transfer overlaps the compute); only the rows and columns the causal mask
    leaves visible are computed (:func:`trim`), a block it hides entirely is skipped.
    ``merge_fn`` merges partial results (:func:`merge`; anything else is a wrong answer, which
    is how the chapter shows that the comparison can fail).
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    scale = q.shape[-1] ** -0.5
    positions = [p.to(q.device) for p in positions]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    kv = torch.stack([k, v])
    for step in range(n):
        if step < n - 1:
            nxt, works = ring_pass(kv, group, "forward")
        mask = visible(positions[rank], positions[(rank - step) % n], causal)
        if mask is None or mask.any():
            rows, cols = trim(mask)
            kb, vb = kv[..., cols, :]
            part = block_attention(q[..., rows, :], kb, vb, _cut(mask, rows, cols), scale)
            out[..., rows, :], lse[..., rows] = merge_fn(out[..., rows, :], lse[..., rows], *part)
            WORK["blocks"] += 1
            WORK["pairs"] += part[1].shape[-1] * kb.shape[-2]
        else:
            WORK["skipped"] += 1
        if step < n - 1:
            for w in works:
                w.wait()
            kv = nxt
    return out, lse


def _cut(mask, rows, cols):
    """``mask`` restricted to the trimmed block (None stays None)."""
    return None if mask is None else mask[rows][:, cols]


def ring_backward(q, k, v, out, lse, dout, positions, causal: bool, group=None):
    """The backward ring: ``(dq, dk, dv)`` of this rank's shard.

    The key/value blocks go round as in the forward (n − 1 passes); each block's gradient
    accumulator travels with it, every rank adding what its queries contribute, and takes one
    more step home (n passes), so each rank ends with the gradient of its own keys and values.
    The accumulator's hop overlaps the next block's gradients: it is waited for only when they
    are ready to be added.
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    scale = q.shape[-1] ** -0.5
    positions = [p.to(q.device) for p in positions]
    delta = (dout * out).sum(-1)
    dq, kv = torch.zeros_like(q), torch.stack([k, v])
    dkv, home = torch.zeros_like(kv), []
    for step in range(n):
        if step < n - 1:
            nxt, works = ring_pass(kv, group, "backward")
        mask = visible(positions[rank], positions[(rank - step) % n], causal)
        grads = None
        if mask is None or mask.any():
            rows, cols = trim(mask)
            kb, vb = kv[..., cols, :]
            at = (lse[..., rows], dout[..., rows, :], delta[..., rows])
            grads = block_grads(q[..., rows, :], kb, vb, _cut(mask, rows, cols), scale, *at)
            dq[..., rows, :] += grads[0]
        for w in home:  # the accumulator of this step's block, from the previous rank
            w.wait()
        if grads is not None:
            dkv[..., cols, :] += torch.stack(grads[1:])
        if step < n - 1:
            for w in works:
                w.wait()
            kv = nxt
        if n > 1:
            dkv, home = ring_pass(dkv, group, "backward")
    for w in home:
        w.wait()
    return dq, dkv[0], dkv[1]


class RingAttention(torch.autograd.Function):
    """Ring attention as an autograd operation: :func:`ring_forward` in forward, saving only q, k,
    v, the output and its lse (no score matrix), and :func:`ring_backward` in backward."""

    @staticmethod
    def forward(ctx, q, k, v, positions, causal, group):
        out, lse = ring_forward(q, k, v, positions, causal, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.positions, ctx.causal, ctx.group = positions, causal, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = ring_backward(q, k, v, out, lse, dout, ctx.positions, ctx.causal, ctx.group)
        return *grads, None, None, None


def ring_attention(q, k, v, positions, causal: bool = False, group=None) -> torch.Tensor:
    """``softmax(q·kᵀ/√d)·v`` of this rank's queries over the whole sequence, with gradients for
    q, k and v (see :class:`RingAttention`); ``group``: the cp ranks (default: all)."""
    return RingAttention.apply(q, k, v, positions, causal, group)


def ring_bytes(b: int, heads: int, seq: int, d: int, cp: int, elem: int = 4) -> dict:
    """What :func:`ring_attention` sends from each rank, predicted: one k/v block is
    ``2·b·heads·(s/cp)·d·elem`` bytes. Forward: cp − 1 blocks; backward: cp − 1 blocks and cp
    gradient blocks. The forward moves what an all-gather of k and v would (each rank receives
    the cp − 1 blocks it lacks), one block per step.

    Returns {"block", "forward", "backward" (bytes), "forward_sends", "backward_sends"}.
    """
    block = 2 * b * heads * (seq // cp) * d * elem
    return {
        "block": block,
        "forward": (cp - 1) * block,
        "backward": (2 * cp - 1) * block,
        "forward_sends": cp - 1,
        "backward_sends": 2 * cp - 1 if cp > 1 else 0,
    }
