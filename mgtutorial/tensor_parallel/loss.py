"""Vocabulary-parallel embedding and head, and loss parallelism: the cross-entropy computed on
logits sharded over the vocabulary, never gathered, equal to one process.

Taught in notebooks/08b_tp_mesh_and_cost.ipynb (section 4). Follows
https://pytorch.org/docs/stable/distributed.tensor.parallel.html (``loss_parallel``,
``RowwiseParallel`` on an ``nn.Embedding`` shards its vocabulary rows, ``ColwiseParallel`` with
``output_layouts=Shard(-1)`` keeps the logits sharded) and torchtitan's plan for the token
embedding and the output head. :func:`check_loss_parallel` runs inside
:func:`mgtutorial.tensor_parallel.worker.worker`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from mgtutorial.common import compare


class TinyLM(nn.Module):
    """Token embedding (vocab → h) then the output head (h → vocab): ``(b, s)`` token ids →
    ``(b, s, vocab)`` logits. The two layers whose size grows with the vocabulary."""

    def __init__(self, vocab: int, h: int):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, h), nn.Linear(h, vocab, bias=False)

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def vocab_plan() -> dict:
    """The embedding's rows (one per token) sharded over the ranks, its output all-reduced
    (``RowwiseParallel``); the head's output features sharded and its logits kept sharded on
    the vocabulary dimension (``ColwiseParallel(output_layouts=Shard(-1))``, a DTensor)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }


def lm_loss(model, tokens, targets, parallel: bool):
    """Mean cross-entropy of the next tokens; ``parallel``: under ``loss_parallel()``, backward
    included, on logits sharded over the vocabulary."""
    from torch.distributed.tensor.parallel import loss_parallel

    logits = model(tokens)
    if not parallel:
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        return loss, logits
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    return loss, logits


def check_loss_parallel(cfg, ctx, mesh, vocab: int = 32) -> dict:
    """Unsplit ``TinyLM`` on one rank vs the vocabulary-parallel one under ``loss_parallel``:
    loss and every gradient equal (``assert_close``), the collectives of forward + loss + backward
    (``CommDebugMode``), the local logits' shape and the bytes of the logits one rank holds,
    against gathering them whole."""
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(cfg.seed)
    ref = TinyLM(vocab, cfg.h).to(ctx.device)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    tokens, targets = (torch.randint(vocab, (cfg.batch, cfg.seq), generator=g) for _ in range(2))
    tokens, targets = tokens.to(ctx.device), targets.to(ctx.device)
    split = parallelize_module(copy.deepcopy(ref), mesh, vocab_plan())  # the same weights, sharded
    want, _ = lm_loss(ref, tokens, targets, parallel=False)
    (got, logits), counts, sizes = compare.counted(lm_loss, split, tokens, targets, True)
    pairs = [(got.full_tensor(), want)] + [
        (p.grad, q.grad) for p, q in zip(split.parameters(), ref.parameters())
    ]
    compare.all_close(pairs)
    return {
        "loss": float(want),
        "max_diff": max(compare.max_abs_diff(a, b) for a, b in pairs),
        "counts": counts,
        "bytes": sizes,
        "logits_placements": [str(p) for p in logits.placements],
        "local_logits": list(logits.to_local().shape),
        "local_logit_bytes": logits.to_local().numel() * 4,
        "full_logit_bytes": logits.numel() * 4,
    }
