"""The configurations of chapter 08's workers, the splits they refuse, and the tensors every rank
draws from them (the same on every rank, so that each split can be compared with the unsplit block).

Taught in notebooks/08a_tensor_parallel.ipynb and notebooks/08b_tp_mesh_and_cost.ipynb:
:class:`TPConfig` for the 1-D worker (:func:`mgtutorial.tensor_parallel.worker.worker`, 08a's
sections 2–5 and 08b's 3–4), :class:`MeshConfig` for the 2-D mesh
(:func:`mgtutorial.tensor_parallel.mesh2d.mesh_worker`, 08b's section 1). Both are checked by
:func:`mgtutorial.launch` before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mgtutorial.common.config import Config, at_least
from mgtutorial.runtime.env import BackendChoice
from mgtutorial.tensor_parallel.transformer import check_heads


@dataclass(kw_only=True)
class TPConfig(Config):
    """Configuration of :func:`mgtutorial.tensor_parallel.worker.worker` (one block, split over all
    ranks: tp = world size)."""

    h: int = 16
    """Hidden size."""
    n_heads: int = 4
    """Attention heads (a multiple of the TP degree)."""
    ffn: int = 32
    """MLP inner width (a multiple of the TP degree)."""
    batch: int = 2
    """Batch size b."""
    seq: int = 8
    """Sequence length s (a multiple of the TP degree, for sequence parallelism)."""
    seed: int = 0
    """Seed of the weights (every rank builds the same unsplit block, then takes its slices)."""
    backend: BackendChoice = "auto"
    """The process group's backend; "auto" is NCCL with a GPU per rank, else gloo."""
    extras: bool = True
    """Also run the pitfalls and loss parallelism (08b's sections 3–4) after the splits; exercise
    08a.1's checker, which reads only the splits' counts, turns them off."""

    def validate(self, nprocs: int) -> None:
        """Called by :func:`mgtutorial.launch` before any rank starts, with ``nprocs`` the TP
        degree: the choices, then :func:`check`."""
        super().validate(nprocs)
        check(self, nprocs)


def check(cfg: TPConfig, tp_degree: int) -> None:
    """Refuse sizes that TP degree ``tp_degree`` cannot split.

    Raises:
        ValueError: naming the values: the heads (see
            :func:`mgtutorial.tensor_parallel.transformer.check_heads`), ``ffn`` or ``seq`` not
            divisible by ``tp_degree``.
    """
    check_heads(cfg.n_heads, cfg.h, tp_degree)
    for name in ("ffn", "seq"):
        if getattr(cfg, name) % tp_degree:
            raise ValueError(
                f"{name}={getattr(cfg, name)} is not divisible by the TP degree {tp_degree}."
            )


def inputs(cfg: TPConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The input ``x`` and the upstream gradient ``dy`` of every comparison, ``(b, s, h)`` each,
    drawn on the CPU from ``cfg.seed + 1`` (the same on every rank)."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return tuple(torch.randn(cfg.batch, cfg.seq, cfg.h, generator=g) for _ in range(2))


@dataclass(kw_only=True)
class MeshConfig(TPConfig):
    """Configuration of :func:`mgtutorial.tensor_parallel.mesh2d.mesh_worker` and
    :func:`mgtutorial.tensor_parallel.mesh2d.reference`: :class:`TPConfig` plus training."""

    dp: int = 2
    """Data-parallel degree (FSDP2 shards over it); the TP degree is world size / dp."""
    batch: int = 4
    """Samples per step for the whole job; each dp rank takes batch / dp of them."""
    steps: int = 3
    """Optimizer steps (SGD)."""
    lr: float = 0.1
    """SGD learning rate."""
    max_norm: float = 0.5
    """Gradient clipping threshold (total 2-norm over all parameters)."""

    def validate(self, nprocs: int) -> None:
        """The world size ``nprocs`` and the batch must be multiples of ``dp``; then
        :meth:`TPConfig.validate` with the TP degree ``nprocs / dp``."""
        at_least(self, 1, "dp")
        if nprocs % self.dp or self.batch % self.dp:
            raise ValueError(
                f"world size {nprocs} and batch={self.batch} must be multiples of dp={self.dp}."
            )
        super().validate(nprocs // self.dp)


def batches(cfg: MeshConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``cfg.steps`` (input, target) pairs of shape ``(batch, seq, h)`` every rank agrees on,
    drawn on the CPU from ``cfg.seed + 2``."""
    g, shape = torch.Generator().manual_seed(cfg.seed + 2), (cfg.batch, cfg.seq, cfg.h)
    return [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(cfg.steps)
    ]
