"""Tensor parallelism on device meshes: the 1-D checks (hand split, DTensor plans, sequence
parallelism, every collective counted, then the pitfalls of :mod:`mgtutorial.tensor_parallel.pitfalls`)
and a 2-D mesh (FSDP2 over ``dp`` × TP over ``tp``) with the layout of its shards.

Taught in notebooks/08_tensor_parallel.ipynb. Follows
https://pytorch.org/docs/stable/distributed.tensor.parallel.html,
https://pytorch.org/docs/stable/distributed.tensor.html (``CommDebugMode``),
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html and
https://pytorch.org/tutorials/intermediate/TP_tutorial.html (2-D parallelism).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch
from torch.testing import assert_close

from mgtutorial import ddp
from mgtutorial.runtime import env, runlog
from mgtutorial.tensor_parallel import fg as tp

TOL = dict(rtol=1e-5, atol=1e-5)


@dataclass(kw_only=True)
class TPConfig:
    """Configuration of :func:`worker` (one block, split over all ranks: tp = world size)."""

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
    backend: str = "auto"
    """"auto" | "gloo" | "nccl"."""

    def validate(self, world_size: int) -> None:
        """Called by :func:`mgtutorial.launch` before any rank starts (see :func:`check`)."""
        check(self, world_size)


def check(cfg, tp_degree: int) -> None:
    """Refuse sizes that TP degree ``tp_degree`` cannot split. Raises ValueError naming the values."""
    tp.check_heads(cfg.n_heads, cfg.h, tp_degree)
    for name in ("ffn", "seq"):
        if getattr(cfg, name) % tp_degree:
            raise ValueError(
                f"{name}={getattr(cfg, name)} is not divisible by the TP degree {tp_degree}."
            )


SHORT = {
    "allreduce_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
}
"""Short names of the collectives counted here (c10d's in-place ``allreduce_`` and funcol's ops)."""


def _short(op) -> str:
    name = str(getattr(op, "_overloadpacket", op)).rsplit(".", 1)[-1]
    return SHORT.get(name, name)


def _nbytes(t) -> int:
    t = t[0] if isinstance(t, (list, tuple)) else t
    return t.numel() * t.element_size()


def count_mode():
    """A ``CommDebugMode`` that also keeps every call's sizes: ``.sizes`` = {name: [[bytes in, out], ...]}."""
    from torch.distributed.tensor.debug import CommDebugMode

    class CommBytes(CommDebugMode):
        def __init__(self):
            super().__init__()
            self.sizes = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if (
                out is not NotImplemented and _short(func) in SHORT.values()
            ):  # c10d's: (tensors, work)
                got = args[0] if isinstance(out, tuple) else out
                self.sizes.setdefault(_short(func), []).append([_nbytes(args[0]), _nbytes(got)])
            return out

    return CommBytes()


def counted(fn, *args):
    """Run ``fn(*args)`` under :func:`count_mode`; returns (its result, {collective: count}, sizes)."""
    with count_mode() as mode:
        out = fn(*args)
    return (
        out,
        {_short(k): v for k, v in sorted(mode.get_comm_counts().items(), key=str)},
        mode.sizes,
    )


def _inputs(cfg: TPConfig):  # the input and the upstream gradient, (b, s, h) each
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return tuple(torch.randn(cfg.batch, cfg.seq, cfg.h, generator=g) for _ in range(2))


def _run(module, x, dy):
    """Forward and backward of ``(module(x) · dy).sum()``, each counted; returns outputs and counts."""
    out, fwd, sizes = counted(module, x := x.clone().requires_grad_())
    _, bwd, _ = counted(lambda: (out * dy).sum().backward())
    return out.detach(), x.grad, {"forward": fwd, "backward": bwd, "bytes": sizes}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _max_diff(pairs) -> float:
    return max(float((_full(a) - b).abs().max()) for a, b in pairs)


def worker(cfg: TPConfig) -> dict:
    """Split one :class:`~mgtutorial.tensor_parallel.fg.Block` over all ranks, by hand and with DTensor
    plans, and check each split against the unsplit block (``assert_close``: a mismatch fails the rank).

    Returns per split (``hand_mlp``, ``hand_attention``, ``hand_block``, ``dtensor``,
    ``dtensor_unprepared``, ``sequence_parallel``): ``counts`` (collectives in forward and in
    backward, from ``CommDebugMode``), ``max_diff`` (largest |difference| of outputs, input
    gradient and parameter gradients); the hand splits also ``fg_counts`` (from the counting
    wrapper); the DTensor ones ``norm_grad`` (``attn_norm.weight.grad``'s placements: ``Partial(sum)``
    under sequence parallelism); ``dtensor`` also ``placements`` {parameter: [class, placements, local shape]}.
    Then ``pitfalls``: see :func:`mgtutorial.tensor_parallel.pitfalls.pitfalls`.
    """
    from torch.distributed.device_mesh import init_device_mesh

    with env.distributed(cfg.backend) as ctx:
        r, n = ctx.rank, ctx.world_size
        check(cfg, n)
        env.seed_everything(cfg.seed)
        ref = tp.Block(cfg.h, cfg.n_heads, cfg.ffn).to(ctx.device)
        (x, dy), results = (t.to(ctx.device) for t in _inputs(cfg)), {}

        def hand(name, unsplit, split):
            want, want_dx, _ = _run(unsplit, x, dy)
            tp.COUNTS.clear()
            out, dx, c = _run(split, x, dy)
            grads = {
                k: unsplit.get_parameter(tp.unsplit_name(k)).grad
                for k, _ in split.named_parameters()
            }
            pairs = [(out, want), (dx, want_dx)] + [
                (p.grad, tp.hand_shard(k, grads[k], r, n)) for k, p in split.named_parameters()
            ]
            for a, b in pairs:
                assert_close(a, b, **TOL)
            results[name] = {
                "counts": c,
                "fg_counts": dict(tp.COUNTS),
                "max_diff": _max_diff(pairs),
            }
            unsplit.zero_grad()
            return out

        hand("hand_mlp", ref.mlp, tp.HandTPMLP(ref.mlp, r, n))
        hand("hand_attention", ref.attn, tp.HandTPAttention(ref.attn, r, n))
        hand_out = hand("hand_block", ref, tp.HandTPBlock(ref, r, n))
        want, want_dx, _ = _run(ref, x, dy)
        mesh = init_device_mesh(ctx.device.type, (n,), mesh_dim_names=("tp",))
        for name, sp, prepare in (
            ("dtensor", False, True),
            ("dtensor_unprepared", False, False),
            ("sequence_parallel", True, True),
        ):
            block = tp.apply_tp(copy.deepcopy(ref), mesh, sp, prepare)
            block.zero_grad()
            part = (lambda t: t.chunk(n, dim=1)[r]) if sp else (lambda t: t)
            out, dx, c = _run(block, part(x), part(dy))
            pairs = [(out, part(want)), (dx, part(want_dx))] + [
                (_full(p.grad), ref.get_parameter(k).grad) for k, p in block.named_parameters()
            ]
            if not sp:
                pairs.append((out, hand_out))
            for a, b in pairs:
                assert_close(a, b, **TOL)
            results[name] = {
                "counts": c,
                "max_diff": _max_diff(pairs),
                "norm_grad": [
                    repr(pl) for pl in getattr(block.attn_norm.weight.grad, "placements", ())
                ],
            }
            if name == "dtensor":
                results[name]["placements"] = {
                    k: [
                        type(p).__name__,
                        [repr(pl) for pl in getattr(p, "placements", ())],
                        list(p.to_local().shape if hasattr(p, "to_local") else p.shape),
                    ]
                    for k, p in block.named_parameters()
                }
        from mgtutorial.tensor_parallel.pitfalls import pitfalls

        results["pitfalls"] = pitfalls(cfg, ctx, mesh)
        return results


# --- A 2-D mesh: FSDP2 over "dp", TP over "tp" ------------------------------------------------


@dataclass(kw_only=True)
class MeshConfig(TPConfig):
    """Configuration of :func:`mesh_worker` and :func:`reference`: :class:`TPConfig` plus training."""

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

    def validate(self, world_size: int) -> None:
        if world_size % self.dp or self.batch % self.dp:
            raise ValueError(
                f"world size {world_size} and batch={self.batch} must be multiples of dp={self.dp}."
            )
        check(self, world_size // self.dp)


def batches(cfg: MeshConfig):
    """The ``cfg.steps`` (input, target) pairs of shape ``(batch, seq, h)`` every rank agrees on."""
    g, shape = torch.Generator().manual_seed(cfg.seed + 2), (cfg.batch, cfg.seq, cfg.h)
    return [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(cfg.steps)
    ]


def reference(cfg: MeshConfig) -> tuple[tp.Block, list[float]]:
    """One process, the whole block, whole batches, ``clip_grad_norm_``: what the mesh must reproduce."""
    env.seed_everything(cfg.seed)
    block = tp.Block(cfg.h, cfg.n_heads, cfg.ffn)
    opt, losses = torch.optim.SGD(block.parameters(), lr=cfg.lr), []
    for x, y in batches(cfg):
        loss = torch.nn.functional.mse_loss(block(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(block.parameters(), cfg.max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return block, losses


def _runs(indices: list[int]) -> list[list[int]]:  # [0, 1, 2, 5] → [[0, 2], [5, 5]]
    groups = (list(g) for _, g in itertools.groupby(enumerate(indices), lambda t: t[1] - t[0]))
    return [[g[0][1], g[-1][1]] for g in groups]


def shard_layout(module) -> dict:
    """Which elements of each parameter this rank holds: {name: {"rows", "cols", "placements"}}, rows
    and cols as runs of global indices ``[first, last]``, found by sharding an index tensor like it."""
    from torch.distributed.tensor import distribute_tensor

    layout = {}
    for name, p in module.named_parameters():
        index = torch.arange(p.numel(), dtype=torch.float64).view(p.shape).to(p.device)
        local = (
            (
                distribute_tensor(index, p.device_mesh, p.placements).to_local()
                if hasattr(p, "placements")
                else index
            )
            .long()
            .cpu()
        )
        cols = p.shape[1] if p.dim() == 2 else 1
        layout[name] = {
            "rows": _runs(sorted(set((local // cols).flatten().tolist()))),
            "cols": _runs(sorted(set((local % cols).flatten().tolist()))),
            "placements": [repr(pl) for pl in getattr(p, "placements", ())],
        }
    return layout


def mesh_worker(cfg: MeshConfig) -> dict:
    """Train one block on a ``(dp, tp)`` mesh: ``apply_tp`` over ``tp``, then ``fully_shard`` over
    ``dp``; each dp rank takes its share of every batch. Rank 0 writes the final whole parameters
    to ``<run dir>/final.pt``. Returns {"coords": [dp rank, tp rank], "losses", "layout", "torch_clip_error"}."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mgtutorial.tensor_parallel.pitfalls import _error, clip_grad_norm

    with env.distributed(cfg.backend) as ctx, runlog.RunLog() as log:
        mesh = init_device_mesh(
            ctx.device.type, (cfg.dp, ctx.world_size // cfg.dp), mesh_dim_names=("dp", "tp")
        )
        env.seed_everything(cfg.seed)
        block = tp.apply_tp(tp.Block(cfg.h, cfg.n_heads, cfg.ffn).to(ctx.device), mesh["tp"])
        fully_shard(block, mesh=mesh["dp"])
        opt, dp, losses = (
            torch.optim.SGD(block.parameters(), lr=cfg.lr),
            mesh["dp"].get_local_rank(),
            [],
        )
        for step, (x, y) in enumerate(batches(cfg), start=1):
            x, y = (t.chunk(cfg.dp)[dp].to(ctx.device) for t in (x, y))
            loss = torch.nn.functional.mse_loss(block(x), y)
            loss.backward()
            if step == 1:  # what torch's clip_grad_norm_ raises on these mixed meshes (in its norm)
                torch_clip = _error(
                    torch.nn.utils.clip_grad_norm_, block.parameters(), cfg.max_norm
                )
            clip_grad_norm(block.parameters(), cfg.max_norm)
            opt.step()
            opt.zero_grad()
            losses.append(
                ddp.log_step(log, ctx, step=step, epoch=0, loss=loss.item(), samples=step * len(x))[
                    "loss"
                ]
            )
        full = {k: _full(p).detach().cpu() for k, p in block.named_parameters()}
        if ctx.is_main:
            torch.save(full, runlog.run_dir() / "final.pt")
        return {
            "coords": [dp, mesh["tp"].get_local_rank()],
            "losses": losses,
            "layout": shard_layout(block),
            "torch_clip_error": torch_clip,
        }


def layout_figure(
    values: dict, names=("attn.wq.weight", "attn.wo.weight", "mlp.w1.weight", "mlp.w2.weight")
):
    """One panel per parameter: each rank's rectangle(s), from :func:`mesh_worker`'s returned layouts."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    fig = Figure(figsize=(3.2 * len(names), 3.4), layout="constrained")
    for ax, name in zip(fig.subplots(1, len(names), squeeze=False)[0], names):
        for rank, v in sorted(values.items()):
            for r0, r1 in v["layout"][name]["rows"]:
                for c0, c1 in v["layout"][name]["cols"]:
                    ax.add_patch(
                        Rectangle(
                            (c0, r0), c1 - c0 + 1, r1 - r0 + 1, fc=f"C{rank}", alpha=0.55, ec="k"
                        )
                    )
                    ax.text(
                        (c0 + c1 + 1) / 2,
                        (r0 + r1 + 1) / 2,
                        f"rank {rank}\ndp{v['coords'][0]} tp{v['coords'][1]}",
                        ha="center",
                        va="center",
                        fontsize=8,
                    )
        rows = max(r[1] for v in values.values() for r in v["layout"][name]["rows"]) + 1
        cols = max(c[1] for v in values.values() for c in v["layout"][name]["cols"]) + 1
        ax.set(
            xlim=(0, cols),
            ylim=(rows, 0),
            title=f"{name} ({rows}×{cols})",
            xlabel="column",
            ylabel="row",
        )
    return fig
