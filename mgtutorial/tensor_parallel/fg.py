"""Tensor parallelism by hand: Megatron's operators f and g, and the transformer block of
:mod:`mgtutorial.tensor_parallel.transformer` split with them (the MLP by its inner features,
attention by heads), every all-reduce counted.

Taught in notebooks/08a_tensor_parallel.ipynb (sections 2 and 3). Follows Megatron-LM (Shoeybi et
al., 2019, §3: the operators f and g) and
https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_reduce. The same split with
DTensor is in :mod:`mgtutorial.tensor_parallel.plans`; the worker that checks both against the
unsplit block is :func:`mgtutorial.tensor_parallel.worker.worker`.

Shapes: activations are ``(b, s, h)``; with TP degree ``tp`` each rank holds ``ffn / tp`` MLP
features and ``n_heads / tp`` heads.
"""

from __future__ import annotations

import collections
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from mgtutorial.tensor_parallel.transformer import MLP, Attention, Block, check_heads

COUNTS: collections.Counter = collections.Counter()
"""How many all-reduces :func:`all_reduce` issued, by ``"forward"`` / ``"backward"``."""


def all_reduce(t: torch.Tensor, group, phase: str) -> torch.Tensor:
    """``dist.all_reduce`` (SUM, in place) that counts itself in :data:`COUNTS` under ``phase``."""
    COUNTS[phase] += 1
    dist.all_reduce(t, group=group)
    return t


class CopyToTP(torch.autograd.Function):
    """Megatron's *f*: identity in forward, all-reduce of the gradient in backward.

    Placed where a replicated activation enters the column-parallel layer: every rank uses the same
    input, and each rank's gradient with respect to it is only its slice's share.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(), ctx.group, "backward"), None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's *g*: all-reduce in forward (sum the partial outputs), identity in backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ---------------------------------------------------------------------------------------------
# Slices of the unsplit weights: f before the column-parallel layers, g after the row-parallel one


def shard_rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Slice ``rank`` of ``tp`` along dim 0 (a column-parallel weight's output features), as a
    leaf: ``(out, in) → (out / tp, in)``, or ``(out,) → (out / tp,)`` for a bias."""
    return t.detach().chunk(tp, dim=0)[rank].clone().requires_grad_()


def shard_cols(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Slice ``rank`` of ``tp`` along dim 1 (a row-parallel weight's input features), as a leaf:
    ``(out, in) → (out, in / tp)``."""
    return t.detach().chunk(tp, dim=1)[rank].clone().requires_grad_()


class HandTPMLP(nn.Module):
    """The MLP split in two: w1 column-parallel (``ffn / tp`` output features per rank), gelu on the
    local features, w2 row-parallel (the matching ``ffn / tp`` input features), one all-reduce (g).
    w2's bias is added once, after the sum. ``(b, s, h) → (b, s, h)`` on every rank."""

    def __init__(self, mlp: MLP, rank: int, tp: int, group=None):
        super().__init__()
        self.group = group
        self.w1 = nn.Parameter(shard_rows(mlp.w1.weight, rank, tp))
        self.b1 = nn.Parameter(shard_rows(mlp.w1.bias, rank, tp))
        self.w2 = nn.Parameter(shard_cols(mlp.w2.weight, rank, tp))
        self.b2 = nn.Parameter(mlp.w2.bias.detach().clone())

    def forward(self, x):
        x = CopyToTP.apply(x, self.group)  # f: identity; all-reduce in backward
        local = F.gelu(F.linear(x, self.w1, self.b1))  # (b, s, ffn/tp): no communication
        partial = F.linear(local, self.w2)  # (b, s, h): this rank's share of the sum
        return ReduceFromTP.apply(partial, self.group) + self.b2  # g: all-reduce in forward


class HandTPAttention(nn.Module):
    """Attention split by heads: q, k, v column-parallel (``n_heads / tp`` heads per rank), the
    output projection row-parallel, f at the input and g at the output; ``(b, s, h) → (b, s, h)``
    on every rank. Raises ValueError (:func:`check_heads`) when ``tp`` does not divide the heads."""

    def __init__(self, attn: Attention, rank: int, tp: int, group=None):
        super().__init__()
        check_heads(attn.n_heads, attn.wq.in_features, tp)
        self.group, self.n_heads, self.head_dim = group, attn.n_heads // tp, attn.head_dim
        for name in ("wq", "wk", "wv"):
            lin = getattr(attn, name)
            self.register_parameter(name, nn.Parameter(shard_rows(lin.weight, rank, tp)))
            self.register_parameter(name[1] + "_bias", nn.Parameter(shard_rows(lin.bias, rank, tp)))
        self.wo = nn.Parameter(shard_cols(attn.wo.weight, rank, tp))
        self.o_bias = nn.Parameter(attn.wo.bias.detach().clone())

    def forward(self, x):
        b, s, _ = x.shape
        x = CopyToTP.apply(x, self.group)
        q, k, v = (
            F.linear(x, getattr(self, n), getattr(self, n[1] + "_bias"))
            .view(b, s, self.n_heads, self.head_dim)
            .transpose(1, 2)
            for n in ("wq", "wk", "wv")
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # this rank's heads only
        partial = F.linear(out.transpose(1, 2).reshape(b, s, -1), self.wo)
        return ReduceFromTP.apply(partial, self.group) + self.o_bias


class HandTPBlock(nn.Module):
    """:class:`~mgtutorial.tensor_parallel.transformer.Block` with :class:`HandTPAttention` and
    :class:`HandTPMLP`; the LayerNorms replicated. Its ``forward`` is the unsplit block's."""

    def __init__(self, block: Block, rank: int, tp: int, group=None):
        super().__init__()
        self.attn_norm = copy.deepcopy(block.attn_norm)
        self.mlp_norm = copy.deepcopy(block.mlp_norm)
        self.attn = HandTPAttention(block.attn, rank, tp, group)
        self.mlp = HandTPMLP(block.mlp, rank, tp, group)

    forward = Block.forward


UNSPLIT_NAME = {
    "w1": "w1.weight",
    "b1": "w1.bias",
    "w2": "w2.weight",
    "b2": "w2.bias",
    "wq": "wq.weight",
    "q_bias": "wq.bias",
    "wk": "wk.weight",
    "k_bias": "wk.bias",
    "wv": "wv.weight",
    "v_bias": "wv.bias",
    "wo": "wo.weight",
    "o_bias": "wo.bias",
}
"""Hand modules' parameter name → the unsplit module's (``"w1"`` is ``"w1.weight"``'s slice)."""


def unsplit_name(name: str) -> str:
    """``"mlp.b1"`` → ``"mlp.w1.bias"``; LayerNorm names are unchanged."""
    head, _, last = name.rpartition(".")
    return (head + "." if head else "") + UNSPLIT_NAME.get(last, last)


def hand_shard(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """The part of an unsplit tensor (e.g. a gradient) that the hand modules' parameter ``name``
    holds: rows for q, k, v and w1 (and their biases), columns for wo and w2, else all of it."""
    last = name.rsplit(".", 1)[-1]
    if last in ("wq", "wk", "wv", "q_bias", "k_bias", "v_bias", "w1", "b1"):
        return full.chunk(tp, dim=0)[rank]
    return full.chunk(tp, dim=1)[rank] if last in ("wo", "w2") else full
