"""Activation memory and recomputation (activation checkpointing): what backward keeps per block,
predicted and measured from the allocator, and what full and selective recomputation save and
cost; the bytes an attention keeps, eager (its s×s probabilities) and fused
(``F.scaled_dot_product_attention``: its output and a logsumexp per row).

Taught in notebooks/07a_zero_memory.ipynb, section 5. Follows
https://pytorch.org/docs/stable/checkpoint.html (``torch.utils.checkpoint``, non-reentrant, and
selective checkpointing with ``create_selective_checkpoint_contexts``) and torchtitan's use of
``checkpoint_wrapper`` (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``, the
wrapper FSDP2 users put around each block). Measured with ``torch.profiler``'s memory events
(:func:`mgtutorial.sharding.memory.allocator_bytes`) and counted with
``torch.utils.flop_counter.FlopCounterMode``. One process, no process group.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from typing import Literal, get_args

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.nn import functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

from mgtutorial.sharding.memory import allocator_bytes

Recompute = Literal["none", "full", "selective"]
"""What backward recomputes: nothing; every block from its input (full); everything but the
widening matmul's output, which backward needs and costs the most to redo (selective)."""
RECOMPUTE = get_args(Recompute)
SAVED_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
"""The matmul ops; :func:`keep_matmuls` keeps the output of those that widen the activation."""


class MLPBlock(nn.Module):
    """``x + w2(gelu(w1(x)))``: a transformer's MLP sublayer; ``(b, h) → (b, h)``."""

    def __init__(self, h: int, f: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x):
        return x + self.w2(nn.functional.gelu(self.w1(x)))


def keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective policy: keep the output of a matmul that widens the activation (w1, h → f: gelu's
    input, which backward reads), recompute everything else (gelu, and w2, whose output backward
    never reads). ``args[-1]`` is the matmul's (in, out) weight operand."""
    widens = op in SAVED_OPS and args[-1].shape[-1] > args[-1].shape[0]
    return CheckpointPolicy.MUST_SAVE if widens else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(blocks: list[nn.Module], mode: Recompute) -> list[nn.Module]:
    """Wrap each block with ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``):
    "full" recomputes the block in backward, "selective" only the ops :func:`keep_matmuls` does
    not keep; "none" returns the blocks unchanged. ``preserve_rng_state=False`` as torchtitan
    does: these blocks draw no random numbers (a block with dropout needs the default, True, which
    keeps a copy of the RNG state per block)."""
    if mode == "none":
        return blocks
    if mode == "full":
        return [checkpoint_wrapper(b, preserve_rng_state=False) for b in blocks]
    context = functools.partial(create_selective_checkpoint_contexts, keep_matmuls)
    return [checkpoint_wrapper(b, context_fn=context, preserve_rng_state=False) for b in blocks]


def predicted_bytes(batch: int, h: int, f: int, blocks: int, mode: Recompute, elem: int = 4):
    """Activation bytes kept from forward for backward, ``elem`` bytes per element.

    Per block, without recomputation: w1's input (the block's input, ``h``), gelu's input (``f``)
    and w2's input (``f``): ``batch·(h + 2f)``. Full: only each block's input, ``batch·h``.
    Selective (w1's output kept, gelu's output recomputed from it): the block's input and w1's
    output, ``batch·(h + f)``. The loss's scalar is left out.
    """
    per_block = {"none": h + 2 * f, "full": h, "selective": h + f}
    if mode not in per_block:
        raise ValueError(f"mode={mode!r}: use one of {RECOMPUTE}.")
    return blocks * batch * per_block[mode] * elem


def measure(batch: int = 128, h: int = 64, f: int = 256, blocks: int = 4, repeats: int = 5):
    """Per mode of :data:`RECOMPUTE` on one stack of :class:`MLPBlock`: the bytes forward leaves
    allocated (``kept``, the allocator's view), the peak over forward and backward, the FLOPs of one
    forward + backward, the median seconds of ``repeats`` of them, and whether the gradients equal
    those without recomputation. Returns ``{mode: {...}}``."""
    out, reference = {}, None
    for mode in RECOMPUTE:
        torch.manual_seed(0)
        model = nn.Sequential(*apply_recompute([MLPBlock(h, f) for _ in range(blocks)], mode))
        x = torch.randn(batch, h)
        loss, kept = allocator_bytes(lambda: model(x).square().mean())
        _, held = allocator_bytes(loss.backward)
        grads = [p.grad.clone() for p in model.parameters()]
        reference = reference or grads
        with FlopCounterMode(display=False) as flops:
            model(x).square().mean().backward()
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(x).square().mean().backward()
            seconds.append(time.perf_counter() - t0)
        out[mode] = {
            "kept": kept["net"],
            "peak": kept["net"] + held["peak"],
            "predicted": predicted_bytes(batch, h, f, blocks, mode),
            "flops": flops.get_total_flops(),
            "seconds": statistics.median(seconds),
            "same_grads": all(torch.equal(a, b) for a, b in zip(grads, reference)),
        }
    return out


def eager_attention(q, k, v):
    """``softmax(q·kᵀ/√d)·v`` written out: autograd keeps the (b, heads, s, s) probabilities."""
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def attention_saved_bytes(seq: int, heads: int = 4, head_dim: int = 16) -> dict[str, int]:
    """Bytes autograd keeps for backward (``saved_tensors_hooks``, one count per storage) beyond
    q, k and v themselves, for one sequence of ``seq`` tokens (float32, shapes (1, heads, seq,
    head_dim)): ``{"eager": …, "sdpa": …}``, :func:`eager_attention` and
    ``F.scaled_dot_product_attention`` (whose CPU flash kernel, like the CUDA flash and
    memory-efficient ones, keeps its output and one logsumexp per row)."""
    out = {}
    for kind, attend in (("eager", eager_attention), ("sdpa", F.scaled_dot_product_attention)):
        gen = torch.Generator().manual_seed(0)
        qkv = [torch.randn(1, heads, seq, head_dim, generator=gen, requires_grad=True)]
        qkv += [torch.randn_like(qkv[0]).requires_grad_() for _ in range(2)]
        inputs, kept = {t.untyped_storage().data_ptr() for t in qkv}, {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in inputs:
                kept[storage.data_ptr()] = storage.nbytes()
            return t

        with saved_tensors_hooks(pack, lambda t: t):
            attend(*qkv)
        out[kind] = sum(kept.values())
    return out
