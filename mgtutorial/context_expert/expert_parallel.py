"""Expert parallelism by hand: the experts of :class:`mgtutorial.context_expert.moe.MoE` split over
the ranks (E / ep each), tokens sent to their experts' ranks with ``all_to_all_single`` (dispatch)
and their outputs sent back the same way (combine).

Taught in notebooks/10b_expert_parallel.ipynb (section 3; exercise 10b.1 computes
:func:`split_sizes`). Follows GShard's dispatch/combine (Lepikhin et al. 2020,
https://arxiv.org/abs/2006.16668), the token dispatcher of Megatron-LM's MoE
(``megatron/core/transformer/moe/token_dispatcher.py``: per-expert counts exchanged first, then
the tokens, sorted by expert) and
https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_to_all_single. Every
all-to-all is counted in :data:`COUNTS`; :func:`plan` predicts them from the one-process routing.

Shapes: a rank's tokens ``x (T, h)``; the rows it sends: one per kept (token, expert) assignment.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from mgtutorial.context_expert.moe import MoE, balancing_loss, capacity, expert_mlp, route

COUNTS: Counter = Counter()
"""All-to-alls of this process: ``calls``, ``bytes`` (of the input buffers, as handed to
``all_to_all_single``), ``off_rank`` (the bytes of the input that go to another rank)."""


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group=None) -> torch.Tensor:
    """``dist.all_to_all_single``: rows ``x[Σ send[:r] : Σ send[:r+1]]`` go to rank r, and rank
    r's rows for this rank arrive in order; returns the ``(Σ recv, …)`` received rows. Counted."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    row = x[0].numel() * x.element_size() if len(x) else 0
    COUNTS["calls"] += 1
    COUNTS["bytes"] += x.numel() * x.element_size()  # the buffer handed to the collective
    COUNTS["off_rank"] += x.numel() * x.element_size() - send[dist.get_rank(group)] * row
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """:func:`all_to_all` with autograd: the gradient of what was sent comes back by the reverse
    all-to-all (the splits swapped)."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def split_sizes(experts: torch.Tensor, kept: torch.Tensor, num_experts: int, ranks: int):
    """Rows this rank sends to each rank: its kept assignments (``experts[kept]``) counted by the
    rank that holds their expert (expert e lives on rank ``e // (num_experts / ranks)``)."""
    owner = experts[kept] // (num_experts // ranks)
    return torch.bincount(owner, minlength=ranks).tolist()


def ep_moe(router, w1, w2, x, top_k: int, factor: float, group=None):
    """This rank's tokens ``x (T, h)`` through the MoE layer whose local experts are ``w1 (E/ep, h,
    ffn)``, ``w2 (E/ep, ffn, h)`` (rank r holds experts r·E/ep …); ``router (h, E)`` whole.

    1. route locally (capacity per rank: each rank is one group); 2. sort the kept assignments by
    expert, exchange the per-expert counts (an all-to-all of E integers); 3. dispatch the token
    rows (all-to-all); 4. each local expert on its rows; 5. combine (the reverse all-to-all) and
    add each row, times its routing weight, to its token.

    Returns (out ``(T, h)``, {"per_expert": rows each local expert got, "dropped", "aux", "send",
    "recv": rows to/from each rank}).
    """
    n, local = dist.get_world_size(group), w1.shape[0]
    r = route(x @ router, top_k, capacity(len(x), router.shape[1], top_k, factor))
    token, choice = torch.nonzero(r.kept, as_tuple=True)
    order = torch.argsort(r.experts[token, choice], stable=True)
    token, choice = token[order], choice[order]
    counts = torch.bincount(r.experts[token, choice], minlength=router.shape[1])
    got = all_to_all(counts, [local] * n, [local] * n, group).view(n, local)  # source × expert
    send, recv = counts.view(n, local).sum(1).tolist(), got.sum(1).tolist()
    rows = AllToAll.apply(x[token], send, recv, group)
    which = torch.arange(local, device=x.device).repeat(n).repeat_interleave(got.reshape(-1))
    y = torch.zeros_like(rows)
    for j in range(local):
        idx = torch.nonzero(which == j).flatten()
        y = y.index_copy(0, idx, expert_mlp(rows[idx], w1[j], w2[j]))
    back = AllToAll.apply(y, recv, send, group)
    out = torch.zeros_like(x).index_add(0, token, back * r.weights[token, choice][:, None])
    stats = {
        "per_expert": got.sum(0).tolist(),
        "dropped": int((~r.kept).sum()),
        "aux": balancing_loss(r),
        "send": send,
        "recv": recv,
    }
    return out, stats


@torch.no_grad()
def plan(layer: MoE, x: torch.Tensor, ranks: int) -> list[list[int]]:
    """From the one-process routing of ``x`` cut into ``ranks`` groups: ``rows[s][r]``, the token
    rows rank s sends to rank r in the dispatch (and r sends back to s in the combine)."""
    e = layer.w1.shape[0]
    rows = []
    for part in x.chunk(ranks):
        r = route(
            part @ layer.router,
            layer.top_k,
            capacity(len(part), e, layer.top_k, layer.capacity_factor),
        )
        rows.append(split_sizes(r.experts, r.kept, e, ranks))
    return rows


def predicted_bytes(rows: list[list[int]], rank: int, hidden: int, experts: int, elem=4) -> dict:
    """The all-to-alls of ``rank`` in one forward and backward, from :func:`plan`'s ``rows``.

    Forward: the counts (E int64 = 8·E bytes), the dispatch (``Σ rows[rank]`` rows of ``hidden``
    values) and the combine (``Σₛ rows[s][rank]`` rows); backward: the two reversed. Returns
    {"calls": 5, "bytes": input bytes of all five, "off_rank": the part that leaves the rank}.
    """
    row = hidden * elem
    sent, received = sum(rows[rank]), sum(r[rank] for r in rows)
    own = rows[rank][rank]
    ranks = len(rows)
    return {
        "calls": 5,
        "bytes": 8 * experts + 2 * (sent + received) * row,
        "off_rank": 8 * experts * (ranks - 1) // ranks + 2 * (sent + received - 2 * own) * row,
    }
