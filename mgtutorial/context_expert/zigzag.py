"""Which tokens each rank of a context-parallel group holds: contiguous shards, or zig-zag shards
that give every rank the same share of a causal mask; and the work each rank then has.

Taught in notebooks/10a_context_parallel.ipynb (section 4). Zig-zag is what PyTorch calls the
head-tail load balancer (``_HeadTailLoadBalancer`` in
``torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py``, the default of
``context_parallel`` for causal attention) and what Megatron-LM's context parallelism and
zhuzilin/ring-flash-attention's ``zigzag_ring_flash_attn`` use: cut the sequence into 2·cp
chunks and give rank r chunks r and 2·cp − 1 − r.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

Layout = Literal["contiguous", "zigzag"]
"""How the sequence is cut across the cp ranks."""
LAYOUTS = get_args(Layout)


def positions(rank: int, cp: int, seq: int, layout: Layout) -> torch.Tensor:
    """The global token indices rank ``rank`` of ``cp`` holds, in order: ``(seq / cp,)`` int64.

    contiguous: ``[r·s/cp, (r+1)·s/cp)``; zigzag: chunk r and chunk 2·cp − 1 − r of 2·cp chunks.

    Raises:
        ValueError: unknown ``layout``, or ``seq`` not divisible by cp (contiguous) or 2·cp
            (zigzag).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {LAYOUTS}.")
    parts = cp if layout == "contiguous" else 2 * cp
    if seq % parts:
        raise ValueError(f"seq={seq} is not divisible by {parts} ({layout} over cp={cp}).")
    chunks = torch.arange(seq).chunk(parts)
    if layout == "contiguous":
        return chunks[rank]
    return torch.cat([chunks[rank], chunks[parts - 1 - rank]])


def shard(x: torch.Tensor, rank: int, cp: int, layout: Layout, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``x`` along ``dim`` (the sequence dimension; 2 for
    ``(b, heads, s, d)``), per :func:`positions`."""
    return x.index_select(dim, positions(rank, cp, x.shape[dim], layout).to(x.device))


def unshard(parts: list[torch.Tensor], layout: Layout, dim: int = 2) -> torch.Tensor:
    """Put every rank's shard (``parts[r]`` from :func:`shard`) back in sequence order."""
    cp, seq = len(parts), sum(p.shape[dim] for p in parts)
    order = torch.cat([positions(r, cp, seq, layout) for r in range(cp)])
    return torch.cat(parts, dim).index_select(dim, torch.argsort(order).to(parts[0].device))


def block_work(rank: int, cp: int, seq: int, layout: Layout, causal: bool = True) -> int:
    """(query, key) products rank ``rank`` computes in ring attention's forward, when each block
    is trimmed to the rows and columns the causal mask leaves visible
    (:func:`mgtutorial.context_expert.ring_attention.trim`); with c = seq / cp tokens per rank:

    * no mask: cp blocks of c², on every rank;
    * contiguous: rank r sees the blocks of ranks 0 … r, whole: ``(r + 1)·c²``;
    * zig-zag: its own block whole, and from every other rank half a block (an earlier rank's
      first chunk of keys, or its own second chunk of queries against a later rank's keys):
      ``c² + (cp − 1)·c²/2`` on every rank, the same total as contiguous.

    Proportional to the rank's attention FLOPs (forward and backward)."""
    c = seq // cp
    if not causal:
        return cp * c * c
    if layout == "contiguous":
        return (rank + 1) * c * c
    return c * c + (cp - 1) * c * c // 2


def imbalance(cp: int, seq: int, layout: Layout) -> float:
    """The busiest rank's causal work (:func:`block_work`) over the mean: 1.0 is balanced. The
    step waits for the busiest rank, so this is the slow-down against a perfect split;
    ``2·cp / (cp + 1)`` for contiguous shards."""
    work = [block_work(r, cp, seq, layout) for r in range(cp)]
    return max(work) * cp / sum(work)
