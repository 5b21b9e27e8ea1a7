"""What attention costs as the sequence grows: FLOPs and the bytes autograd keeps, predicted and
measured; the activations of a whole layer per GPU under tensor, sequence and context parallelism.

Taught in notebooks/10a_context_parallel.ipynb (section 1; exercise 10a.2 uses
:func:`layer_activation_bytes`). FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode``
(2 per multiply-add), saved bytes by ``torch.autograd.graph.saved_tensors_hooks``
(https://pytorch.org/docs/stable/autograd.html#hooks-for-saved-tensors). The per-layer activation
formula is Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (https://arxiv.org/abs/2205.05198), section 4: ``s·b·h·(34 + 5·a·s/h)`` bytes with 16-bit
activations, divided by t under tensor + sequence parallelism.

Units: FLOPs, bytes.
"""

from __future__ import annotations

import torch


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q·kᵀ/√d)·v`` written out, the score matrix materialised: ``(b, heads, s, d)``."""
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    return scores.softmax(-1) @ v


def predicted(b: int, heads: int, s: int, d: int, elem: int = 4) -> dict:
    """Forward FLOPs of the two matmuls, ``2 · 2·b·heads·s²·d``, and the bytes autograd keeps for
    :func:`plain_attention`: q, k, v (``3·b·s·heads·d``) and the softmax's output
    (``b·heads·s²``), ``elem`` bytes each. Returns {"flops", "saved_bytes", "scores_bytes"}."""
    scores = b * heads * s * s * elem
    return {
        "flops": 4 * b * heads * s * s * d,
        "saved_bytes": 3 * b * heads * s * d * elem + scores,
        "scores_bytes": scores,
    }


def measured(b: int, heads: int, s: int, d: int) -> dict:
    """Forward of :func:`plain_attention` on random float32 inputs: FLOPs counted by
    ``FlopCounterMode``, and the bytes of the distinct tensors autograd saved for backward.
    Returns {"flops", "saved_bytes"}."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = (torch.randn(b, heads, s, d, requires_grad=True) for _ in range(3))
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with FlopCounterMode(display=False) as counter:
            plain_attention(q, k, v)
    return {"flops": counter.get_total_flops(), "saved_bytes": sum(kept.values())}


def scores_per_rank(b: int, heads: int, s: int, tp: int = 1, cp: int = 1, elem: int = 2) -> int:
    """Bytes of the score matrix one rank materialises for a whole attention: tensor parallelism
    (with or without chapter 08a's sequence parallelism) splits the heads, ``heads / tp``, but every
    rank still scores all s queries against all s keys; context parallelism gives each rank s / cp
    of the queries. ``b·(heads/tp)·(s/cp)·s·elem``."""
    return b * (heads // tp) * (s // cp) * s * elem


def layer_activation_bytes(
    s: int, b: int, h: int, heads: int, tp: int = 1, cp: int = 1, flash: bool = True
) -> float:
    """Activation bytes of one transformer layer per GPU (16-bit, Korthikanti et al. 2022):
    ``(s/cp)·b·h·(34 + 5·heads·s/h) / tp``; ``flash=True`` drops the ``5·heads·s/h`` term (the
    score matrix, which FlashAttention-style kernels never store). Tensor + sequence parallelism
    divide all of it by tp; context parallelism divides the tokens of each rank by cp."""
    per_token = 34 + (0 if flash else 5 * heads * s / h)
    return (s / cp) * b * h * per_token / tp
