"""The unsplit transformer block that chapter 08 splits: pre-norm attention and MLP with residuals,
and the refusal of a head count that a TP degree cannot split.

Taught in notebooks/08a_tensor_parallel.ipynb (section 1). Every split of the chapter (by hand in
:mod:`mgtutorial.tensor_parallel.fg`, with DTensor in :mod:`mgtutorial.tensor_parallel.plans`) is
compared with this block, built from the same seed on every rank.

Shapes: activations are ``(b, s, h)`` = (batch, sequence, hidden); the MLP's inner width is ``ffn``;
attention has ``n_heads`` heads of ``h / n_heads`` features.
"""

from __future__ import annotations

from torch import nn
from torch.nn import functional as F


class MLP(nn.Module):
    """``w2(gelu(w1(x)))``: ``(b, s, h) → (b, s, ffn) → (b, s, h)``."""

    def __init__(self, h: int, ffn: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Attention(nn.Module):
    """Multi-head causal self-attention with ``n_heads`` heads: ``(b, s, h) → (b, s, h)``.

    ``forward`` reshapes with ``self.n_heads``: after tensor parallelism it must be the number of
    heads *on this rank* (``n_heads / tp``), which is what
    :func:`mgtutorial.tensor_parallel.plans.fix_heads` sets.
    """

    def __init__(self, h: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, h // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; ``(b, s, h)``
    in and out."""

    def __init__(self, h: int = 16, n_heads: int = 4, ffn: int = 32):
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(h), Attention(h, n_heads)
        self.mlp_norm, self.mlp = nn.LayerNorm(h), MLP(h, ffn)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def check_heads(n_heads: int, h: int, tp: int) -> None:
    """Refuse a split that cannot be made: each rank must hold whole heads.

    Raises:
        ValueError: ``h`` is not divisible by ``n_heads``, or ``n_heads`` by the TP degree ``tp``;
            the message names the values and the nearest head counts that would split.
    """
    if h % n_heads:
        raise ValueError(f"hidden size h={h} is not divisible by n_heads={n_heads}.")
    if n_heads % tp:
        near = " or ".join(str(m) for m in (tp * (n_heads // tp), tp * (n_heads // tp + 1)) if m)
        raise ValueError(
            f"n_heads={n_heads} is not divisible by the tensor-parallel degree tp={tp}: each rank "
            f"must hold whole heads. Use n_heads a multiple of {tp} (e.g. {near}) or a tp that "
            f"divides {n_heads}."
        )
