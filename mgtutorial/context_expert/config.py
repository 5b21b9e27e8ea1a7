"""The configurations of chapter 10's workers, the splits they refuse, and the tensors every rank
draws from them (the same on every rank, so that each split can be compared with one process).

Taught in notebooks/10a_context_parallel.ipynb (:class:`CPConfig`, for
:func:`mgtutorial.context_expert.cp_worker.worker`) and notebooks/10b_expert_parallel.ipynb
(:class:`EPConfig`, for :func:`mgtutorial.context_expert.ep_worker.worker`). Both are checked by
:func:`mgtutorial.launch` before any rank starts, with the world size as ``nprocs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mgtutorial.common.config import Config, at_least, positive
from mgtutorial.runtime.env import BackendChoice


@dataclass(kw_only=True)
class CPConfig(Config):
    """Configuration of :func:`mgtutorial.context_expert.cp_worker.worker`: one attention over a
    sequence split across all ranks (cp = world size)."""

    batch: int = 2
    """Batch size b."""
    heads: int = 2
    """Attention heads."""
    head_dim: int = 8
    """Features per head d (the hidden size is heads × d)."""
    seq: int = 16
    """Sequence length s: a multiple of 2 × cp (zig-zag cuts it into 2·cp chunks)."""
    seed: int = 0
    """Seed of q, k, v and the upstream gradient (the same full tensors on every rank)."""
    backend: BackendChoice = "auto"
    """The process group's backend; "auto" is NCCL with a GPU per rank, else gloo."""

    def validate(self, nprocs: int | None = None) -> None:
        """Called by :func:`mgtutorial.launch` before any rank starts, with ``nprocs`` the CP
        degree: the choices, the sizes, then :func:`check_seq`."""
        super().validate(nprocs)
        at_least(self, 1, "batch", "heads", "head_dim", "seq")
        if nprocs is not None:
            check_seq(self.seq, nprocs)


def check_seq(seq: int, cp: int) -> None:
    """Refuse a sequence length that zig-zag sharding over ``cp`` ranks cannot cut.

    Raises:
        ValueError: naming ``seq``, ``cp`` and the nearest lengths that work.
    """
    if seq % (2 * cp):
        lower = seq // (2 * cp) * 2 * cp
        fix = f"e.g. {lower} or {lower + 2 * cp}" if lower else f"e.g. {2 * cp}"
        raise ValueError(
            f"seq={seq} is not divisible by 2 × cp = {2 * cp}: zig-zag sharding gives each of the "
            f"{cp} ranks two of 2·cp equal chunks. Use seq a multiple of {2 * cp} ({fix})."
        )


def attention_inputs(cfg: CPConfig) -> list[torch.Tensor]:
    """q, k, v and the upstream gradient dout, ``(b, heads, s, d)`` each, drawn on the CPU from
    ``cfg.seed`` (the same full tensors on every rank)."""
    g = torch.Generator().manual_seed(cfg.seed)
    shape = (cfg.batch, cfg.heads, cfg.seq, cfg.head_dim)
    return [torch.randn(shape, generator=g) for _ in range(4)]


@dataclass(kw_only=True)
class EPConfig(Config):
    """Configuration of :func:`mgtutorial.context_expert.ep_worker.worker` and of the one-process
    reference: a mixture-of-experts layer whose experts are split across all ranks (ep = world
    size); each rank routes its own tokens."""

    tokens: int = 12
    """Tokens per rank (one group of the router's capacity)."""
    hidden: int = 8
    """Hidden size h of a token."""
    ffn: int = 16
    """Inner width of each expert's MLP."""
    experts: int = 4
    """Experts E in all, a multiple of the world size (E / ep on each rank)."""
    top_k: int = 2
    """Experts each token is sent to (1 ≤ top_k ≤ experts)."""
    capacity_factor: float = 1.0
    """Slots per expert per group = ⌈capacity_factor · tokens · top_k / experts⌉; tokens past
    that are dropped (their output for that expert is 0)."""
    seed: int = 0
    """Seed of the weights and of the tokens (the same on every rank)."""
    backend: BackendChoice = "auto"
    """The process group's backend; "auto" is NCCL with a GPU per rank, else gloo."""

    def validate(self, nprocs: int | None = None) -> None:
        """Called by :func:`mgtutorial.launch` before any rank starts, with ``nprocs`` the EP
        degree: the choices, the sizes, then :func:`check_experts`."""
        super().validate(nprocs)
        at_least(self, 1, "tokens", "hidden", "ffn", "experts", "top_k")
        positive(self, "capacity_factor")
        check_experts(self.experts, self.top_k, nprocs)


def check_experts(experts: int, top_k: int, ep: int | None = None) -> None:
    """Refuse a top-k larger than the experts, and experts that ``ep`` ranks cannot share.

    Raises:
        ValueError: naming the values and the fix.
    """
    if top_k > experts:
        raise ValueError(
            f"top_k={top_k} is larger than experts={experts}: a token cannot go to more experts "
            f"than there are. Use top_k ≤ {experts} or more experts."
        )
    if ep is not None and experts % ep:
        raise ValueError(
            f"experts={experts} is not divisible by the EP degree ep={ep}: every rank holds "
            f"experts / ep whole experts. Use experts a multiple of {ep} (e.g. "
            f"{max(ep, experts // ep * ep)} or {(experts // ep + 1) * ep})."
        )
