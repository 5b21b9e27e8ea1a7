"""Tensor parallelism: one transformer block split across ranks, by hand (Megatron's f and g) and
with DTensor (``parallelize_module``, ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``),
with every collective counted.

Taught in notebooks/08_tensor_parallel.ipynb. Follows Megatron-LM (Shoeybi et al., 2019, §3:
the operators f and g), https://pytorch.org/docs/stable/distributed.tensor.parallel.html and
https://pytorch.org/tutorials/intermediate/TP_tutorial.html. The workers that run these splits
(and the 2-D mesh) are in :mod:`mgtutorial.tensor_parallel.mesh2d`, the pitfalls in
:mod:`mgtutorial.tensor_parallel.pitfalls`.

Shapes: activations are ``(b, s, h)`` = (batch, sequence, hidden); the MLP's inner width is ``ffn``;
attention has ``n_heads`` heads of ``h / n_heads`` features. With TP degree ``tp`` each rank holds
``ffn / tp`` MLP features and ``n_heads / tp`` heads.
"""

from __future__ import annotations

import collections
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

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
# The unsplit block: pre-norm attention and MLP with residuals


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
    heads *on this rank* (``n_heads / tp``), which is what :func:`fix_heads` sets.
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
    """A pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; ``(b, s, h)``."""

    def __init__(self, h: int = 16, n_heads: int = 4, ffn: int = 32):
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(h), Attention(h, n_heads)
        self.mlp_norm, self.mlp = nn.LayerNorm(h), MLP(h, ffn)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def check_heads(n_heads: int, h: int, tp: int) -> None:
    """Refuse a split that cannot be made. Raises ValueError naming the values and the fix."""
    if h % n_heads:
        raise ValueError(f"hidden size h={h} is not divisible by n_heads={n_heads}.")
    if n_heads % tp:
        near = " or ".join(str(m) for m in (tp * (n_heads // tp), tp * (n_heads // tp + 1)) if m)
        raise ValueError(
            f"n_heads={n_heads} is not divisible by the tensor-parallel degree tp={tp}: each rank must "
            f"hold whole heads. Use n_heads a multiple of {tp} (e.g. {near}) or a tp that divides {n_heads}."
        )


# ---------------------------------------------------------------------------------------------
# By hand: slices of the unsplit weights, f before the column-parallel layers, g after the row one


def shard_rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Slice ``rank`` of ``tp`` along dim 0 (a column-parallel weight's output features), as a leaf."""
    return t.detach().chunk(tp, dim=0)[rank].clone().requires_grad_()


def shard_cols(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Slice ``rank`` of ``tp`` along dim 1 (a row-parallel weight's input features), as a leaf."""
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
    output projection row-parallel, f at the input and g at the output. ``(b, s, h) → (b, s, h)``."""

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
    """:class:`Block` with :class:`HandTPAttention` and :class:`HandTPMLP`; the LayerNorms replicated."""

    def __init__(self, block: Block, rank: int, tp: int, group=None):
        super().__init__()
        self.attn_norm, self.mlp_norm = (
            copy.deepcopy(block.attn_norm),
            copy.deepcopy(block.mlp_norm),
        )
        self.attn, self.mlp = (
            HandTPAttention(block.attn, rank, tp, group),
            HandTPMLP(block.mlp, rank, tp, group),
        )

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
    """The part of an unsplit tensor (e.g. a gradient) that the hand modules' parameter ``name`` holds."""
    last = name.rsplit(".", 1)[-1]
    if last in ("wq", "wk", "wv", "q_bias", "k_bias", "v_bias", "w1", "b1"):
        return full.chunk(tp, dim=0)[rank]
    return full.chunk(tp, dim=1)[rank] if last in ("wo", "w2") else full


# ---------------------------------------------------------------------------------------------
# The library version: the same split as a plan of parallel styles on a 1-D device mesh


def tp_plan(sequence_parallel: bool = False, prepare_inputs: bool = True) -> dict:
    """``parallelize_module`` plan for :class:`Block`: q/k/v and w1 ``ColwiseParallel``, wo and w2
    ``RowwiseParallel`` (an all-reduce after each row-parallel layer).

    ``prepare_inputs``: turn the input of ``attn`` and ``mlp`` into a replicated DTensor once
    (``PrepareModuleInput``), so that its gradient is all-reduced once, as *f* does; without it q, k
    and v each all-reduce their own input gradient. ``sequence_parallel``: the LayerNorms run on
    sequence shards (``SequenceParallel``, ``Shard(1)``), the block's input and output are sequence
    shards, and each all-reduce becomes an all-gather (before the column-parallel layers) and a
    reduce-scatter (after the row-parallel one).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=seq),
        "mlp.w1": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=seq),
    }
    if prepare_inputs or sequence_parallel:
        for name in ("attn", "mlp"):
            plan[name] = PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=False
            )
    if sequence_parallel:
        plan.update(attn_norm=SequenceParallel(), mlp_norm=SequenceParallel())
    return plan


def fix_heads(block: Block, tp: int) -> Block:
    """After parallelizing: each rank's attention reshapes into ``n_heads / tp`` local heads."""
    check_heads(block.attn.n_heads, block.attn.wq.in_features, tp)
    block.attn.n_heads //= tp
    return block


def apply_tp(
    block: Block, tp_mesh, sequence_parallel: bool = False, prepare_inputs: bool = True
) -> Block:
    """Parallelize ``block`` in place over the 1-D ``tp_mesh`` with :func:`tp_plan`; returns it."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(block, tp_mesh, tp_plan(sequence_parallel, prepare_inputs))
    return fix_heads(block, tp_mesh.size())


def comm_bytes(b: int, s: int, h: int, ffn: int, tp: int, layers: int = 1, elem: int = 2) -> dict:
    """What one training step moves, from the sizes (``elem`` bytes per element; 2 for bf16).

    TP: per block, one all-reduce of a ``(b, s, h)`` activation after attention and one after the
    MLP in forward, two more in backward: ``tp_forward = 2·b·s·h·elem·layers``. DDP: one all-reduce
    of every gradient per step: ``ddp_step = params·elem``. A ring all-reduce sends
    ``2·(n − 1)/n`` times the tensor's bytes from each rank (``*_per_rank``).
    """
    params = layers * (4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h)
    tp_forward = 2 * b * s * h * elem * layers
    return {
        "tp_forward": tp_forward,
        "tp_step": 2 * tp_forward,
        "ddp_step": params * elem,
        "params": params,
        "tp_step_per_rank": 2 * tp_forward * 2 * (tp - 1) // tp,
    }
