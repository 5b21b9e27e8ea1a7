"""A small mixture-of-experts layer on one process: a router picks top-k experts per token, each
expert takes at most ``capacity`` tokens per group (the rest are dropped), and a load-balancing loss
pushes the router towards equal loads.

Taught in notebooks/10b_expert_parallel.ipynb (sections 1–2); the same layer with its experts split
over ranks is :mod:`mgtutorial.context_expert.expert_parallel`. Follows GShard (Lepikhin et al.
2020, https://arxiv.org/abs/2006.16668: groups, capacity, first choices served first) and the Switch
Transformer (Fedus et al. 2021, https://arxiv.org/abs/2101.03961: capacity factor, the balancing
loss ``E · Σₑ fₑ · Pₑ``).

Shapes: tokens ``x (T, h)``; router logits ``(T, E)``; per token its ``top_k`` experts and weights
``(T, k)``; each expert an MLP ``h → ffn → h`` stored as ``w1 (E, h, ffn)``, ``w2 (E, ffn, h)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from mgtutorial.context_expert.config import EPConfig


class MoE(nn.Module):
    """The router and all E experts, built from ``cfg.seed`` (the same weights on every rank)."""

    def __init__(self, cfg: EPConfig):
        super().__init__()
        g = torch.Generator().manual_seed(cfg.seed)
        h, f, e = cfg.hidden, cfg.ffn, cfg.experts
        self.router = nn.Parameter(torch.randn(h, e, generator=g) * h**-0.5)
        self.w1 = nn.Parameter(torch.randn(e, h, f, generator=g) * h**-0.5)
        self.w2 = nn.Parameter(torch.randn(e, f, h, generator=g) * f**-0.5)
        self.top_k, self.capacity_factor = cfg.top_k, cfg.capacity_factor


def capacity(tokens: int, experts: int, top_k: int, factor: float) -> int:
    """Slots per expert in a group of ``tokens``: ``⌈factor · tokens · top_k / experts⌉``."""
    return math.ceil(factor * tokens * top_k / experts)


@dataclass
class Routing:
    """Where each token of one group goes: ``experts``, ``weights``, ``slot`` (its place in the
    expert's queue) and ``kept`` (slot < capacity), each ``(T, k)``; ``probs (T, E)`` the
    router's softmax."""

    experts: torch.Tensor
    weights: torch.Tensor
    slot: torch.Tensor
    kept: torch.Tensor
    probs: torch.Tensor


def route(logits: torch.Tensor, top_k: int, slots: int) -> Routing:
    """Top-k routing with a capacity of ``slots`` per expert. Queues fill in GShard's order: every
    token's first choice, in token order, then every token's second choice, and so on."""
    probs = logits.softmax(-1)
    weights, experts = probs.topk(top_k, dim=-1)
    choice_major = F.one_hot(experts.t().reshape(-1), probs.shape[-1])  # (k·T, E)
    slot = ((choice_major.cumsum(0) - 1) * choice_major).sum(-1).view(top_k, -1).t()
    return Routing(experts, weights, slot, slot < slots, probs)


def balancing_loss(r: Routing) -> torch.Tensor:
    """Switch's load-balancing loss of one group, ``E · Σₑ fₑ · Pₑ``: fₑ the fraction of the
    (token, choice) assignments routed to e (before capacity), Pₑ the mean router probability of e.
    1.0 when both are uniform; only Pₑ carries a gradient."""
    e = r.probs.shape[-1]
    f = torch.bincount(r.experts.reshape(-1), minlength=e).to(r.probs.dtype) / r.experts.numel()
    return e * (f * r.probs.mean(0)).sum()


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: ``gelu(x · w1) · w2``, ``(n, h) → (n, h)``."""
    return F.gelu(x @ w1) @ w2


def moe_group(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The layer on one group of tokens ``x (T, h)``: each kept (token, expert) assignment adds
    ``weight · expert(x)`` to the token's output; a dropped one adds nothing.

    Returns (out ``(T, h)``, {"per_expert": kept assignments per expert, "dropped": assignments
    past capacity, "aux": :func:`balancing_loss`}).
    """
    e = layer.w1.shape[0]
    r = route(
        x @ layer.router, layer.top_k, capacity(len(x), e, layer.top_k, layer.capacity_factor)
    )
    out = torch.zeros_like(x)
    per_expert = []
    for j in range(e):
        token, choice = torch.nonzero((r.experts == j) & r.kept, as_tuple=True)
        y = expert_mlp(x[token], layer.w1[j], layer.w2[j])
        out = out.index_add(0, token, y * r.weights[token, choice][:, None])
        per_expert.append(len(token))
    stats = {"per_expert": per_expert, "dropped": int((~r.kept).sum()), "aux": balancing_loss(r)}
    return out, stats


def moe(layer: MoE, x: torch.Tensor, groups: int) -> tuple[torch.Tensor, dict]:
    """The layer on ``x (G·T, h)`` cut into ``groups`` groups of T tokens, each with its own
    capacity (as each rank is one group under expert parallelism).

    Returns (out, {"per_expert": summed over groups, "dropped": summed, "aux": the mean}).
    """
    outs, stats = zip(*(moe_group(layer, part) for part in x.chunk(groups)))
    return torch.cat(outs), {
        "per_expert": [sum(c) for c in zip(*(s["per_expert"] for s in stats))],
        "dropped": sum(s["dropped"] for s in stats),
        "aux": torch.stack([s["aux"] for s in stats]).mean(),
    }


def tokens(cfg: EPConfig, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens ``x`` and the upstream gradient ``dy`` of every comparison, ``(groups · T, h)``
    each, drawn from ``cfg.seed + 1`` (the same on every rank; rank r takes group r)."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    shape = (groups * cfg.tokens, cfg.hidden)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def train_router(
    cfg: EPConfig, aux_coef: float, steps: int = 12, lr: float = 0.3, skew: float = 0.3
) -> list[dict]:
    """A few SGD steps of the layer on one group, from a router skewed towards expert 0 (by
    ``skew`` on each of its weights, tokens offset by 1), on
    ``loss = mse(out, target) + aux_coef · aux`` (target: a fixed random map of x).

    Returns one row per step, before its update: {"step", "per_expert", "dropped", "aux"}.
    """
    layer = MoE(cfg)
    x = tokens(cfg, 1)[0] + 1.0  # tokens share a direction, all ones …
    with torch.no_grad():
        layer.router -= layer.router.mean(0)  # … which the router maps to no expert …
        layer.router[:, 0] += skew  # … but expert 0
    target = x @ torch.randn(cfg.hidden, cfg.hidden, generator=torch.Generator().manual_seed(7))
    opt = torch.optim.SGD(layer.parameters(), lr=lr)
    rows = []
    for step in range(steps):
        out, s = moe_group(layer, x)
        loss = F.mse_loss(out, target) + aux_coef * s["aux"]
        rows.append({"step": step, **s, "aux": s["aux"].item()})
        opt.zero_grad()
        loss.backward()
        opt.step()
    return rows
