"""Tensor parallelism with DTensor: the split of :mod:`mgtutorial.tensor_parallel.fg` written as a
plan of parallel styles (``ColwiseParallel``, ``RowwiseParallel``, ``PrepareModuleInput``,
``SequenceParallel``) that ``parallelize_module`` applies over a 1-D device mesh.

Taught in notebooks/08a_tensor_parallel.ipynb (sections 4 and 5). Follows
https://pytorch.org/docs/stable/distributed.tensor.parallel.html and
https://pytorch.org/tutorials/intermediate/TP_tutorial.html. After ``parallelize_module`` each
weight is a DTensor: ``Shard(0)`` for the column-parallel ones, ``Shard(1)`` for the row-parallel
ones, ``Replicate()`` for the row-parallel biases.
"""

from __future__ import annotations

from mgtutorial.tensor_parallel.transformer import Block, check_heads


def tp_plan(sequence_parallel: bool = False, prepare_inputs: bool = True) -> dict:
    """``parallelize_module`` plan for :class:`~mgtutorial.tensor_parallel.transformer.Block`: q/k/v
    and w1 ``ColwiseParallel``, wo and w2 ``RowwiseParallel`` (an all-reduce after each
    row-parallel layer). Returns {submodule name: parallel style}.

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
    """After parallelizing: each rank's attention reshapes into ``n_heads / tp`` local heads.
    Raises ValueError (:func:`~mgtutorial.tensor_parallel.transformer.check_heads`) otherwise."""
    check_heads(block.attn.n_heads, block.attn.wq.in_features, tp)
    block.attn.n_heads //= tp
    return block


def apply_tp(
    block: Block, tp_mesh, sequence_parallel: bool = False, prepare_inputs: bool = True
) -> Block:
    """Parallelize ``block`` in place over the 1-D ``tp_mesh`` (a ``DeviceMesh``) with
    :func:`tp_plan`, then :func:`fix_heads`; returns it."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(block, tp_mesh, tp_plan(sequence_parallel, prepare_inputs))
    return fix_heads(block, tp_mesh.size())
