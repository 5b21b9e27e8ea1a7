"""Attention one key/value block at a time: the partial result of a block, the online-softmax merge
of two partial results, and the gradients of one block (the flash-attention recurrences).

Taught in notebooks/10a_context_parallel.ipynb (section 2; exercise 10a.1 writes :func:`merge`).
The merge is the "online softmax" of Milakov & Gimelshein (2018,
https://arxiv.org/abs/1805.02867) that FlashAttention (Dao et al. 2022,
https://arxiv.org/abs/2205.14135) and ring attention (Liu et al. 2023,
https://arxiv.org/abs/2310.01889) are built on; it is written here with the log-sum-exp
``lse = m + log l`` (running max m, running sum l), as PyTorch's own ring attention does
(``torch/distributed/tensor/experimental/_context_parallel/_attention.py``, ``_SDPAMerger``).

Shapes: q ``(b, heads, s_q, d)``, k and v ``(b, heads, s_k, d)``, an output ``(b, heads, s_q, d)``,
its lse ``(b, heads, s_q)``; positions are the global token indices ``(s_q,)`` and ``(s_k,)``.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> torch.Tensor | None:
    """``(s_q, s_k)`` bool: which keys each query may see (a key at or before it) when ``causal``;
    None (all of them) otherwise."""
    return k_pos[None, :] <= q_pos[:, None] if causal else None


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with −inf (a row that saw no key) replaced by 0, so that ``exp(score − lse)`` is 0
    there instead of NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def block_attention(q, k, v, mask: torch.Tensor | None, scale: float):
    """Attention of ``q`` over one key/value block alone: ``(out, lse)``.

    ``out = softmax(q·kᵀ·scale) · v`` over this block's keys only, and ``lse`` the log of the
    softmax's denominator, ``log Σⱼ exp(q·kⱼ·scale)``, which :func:`merge` needs to put blocks
    together. ``mask`` (see :func:`visible`): keys a query may not see are left out; a row that
    sees none of this block's keys gets ``out = 0`` and ``lse = −inf``.
    """
    scores = q @ k.transpose(-2, -1) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse)[..., None])
    return probs @ v, lse


def merge(out, lse, block_out, block_lse):
    """Merge two partial attentions of the same queries over disjoint key blocks: ``(out, lse)``
    of the union, as if the softmax had seen both blocks at once.

    With ``m = max(lse₁, lse₂)``, each partial output is weighted by its share of the total
    denominator, ``exp(lseᵢ − lse)``, where ``lse = m + log(exp(lse₁ − m) + exp(lse₂ − m))``
    (``torch.logaddexp``). A row that saw no key in either has ``lse = −inf`` and ``out = 0``.
    """
    new = torch.logaddexp(lse, block_lse)
    keep = _finite(new)
    return (
        out * torch.exp(lse - keep)[..., None] + block_out * torch.exp(block_lse - keep)[..., None],
        new,
    )


def block_grads(q, k, v, mask, scale: float, lse, dout, delta):
    """Gradients ``(dq, dk, dv)`` of the *whole* attention that come through one key/value block.

    ``lse`` is the final log-sum-exp over all blocks (from the forward), so ``p = exp(s − lse)``
    are this block's entries of the full softmax; ``delta = Σ dout ⊙ out`` per query row (of the
    full output). Then ``dv = pᵀ·dout``, ``ds = p ⊙ (dout·vᵀ − delta)``, ``dq = ds·k·scale``,
    ``dk = dsᵀ·q·scale`` (FlashAttention's backward, Dao et al. 2022, algorithm 4).
    """
    scores = q @ k.transpose(-2, -1) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF)
    probs = torch.exp(scores - lse[..., None])
    dv = probs.transpose(-2, -1) @ dout
    ds = probs * (dout @ v.transpose(-2, -1) - delta[..., None])
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv
