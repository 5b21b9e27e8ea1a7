"""A 2-D device mesh: FSDP2 over ``dp`` × tensor parallelism over ``tp``, trained and compared with
one process, and the layout of each rank's shards (which elements of each weight it holds, and a
figure of it).

Taught in notebooks/08b_tp_mesh_and_cost.ipynb (section 1). Follows
https://pytorch.org/docs/stable/distributed.tensor.parallel.html,
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html and
https://pytorch.org/tutorials/intermediate/TP_tutorial.html (2-D parallelism).
"""

from __future__ import annotations

import itertools

import torch

from mgtutorial import ddp
from mgtutorial.common.finite import check_loss
from mgtutorial.runtime import env, runlog
from mgtutorial.tensor_parallel.config import MeshConfig, batches
from mgtutorial.tensor_parallel.pitfalls import clip_grad_norm, raised
from mgtutorial.tensor_parallel.plans import apply_tp
from mgtutorial.tensor_parallel.transformer import Block


def reference(cfg: MeshConfig) -> tuple[Block, list[float]]:
    """One process, the whole block, whole batches, ``clip_grad_norm_``: what the mesh must
    reproduce. Returns (the trained block, the loss of each step)."""
    env.seed_everything(cfg.seed)
    block = Block(cfg.h, cfg.n_heads, cfg.ffn)
    opt, losses = torch.optim.SGD(block.parameters(), lr=cfg.lr), []
    for x, y in batches(cfg):
        loss = torch.nn.functional.mse_loss(block(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(block.parameters(), cfg.max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return block, losses


def mesh_worker(cfg: MeshConfig) -> dict:
    """Train one block on a ``(dp, tp)`` mesh: ``apply_tp`` over ``tp``, then ``fully_shard`` over
    ``dp``; each dp rank takes its share of every batch, and gradients are clipped with
    :func:`mgtutorial.tensor_parallel.pitfalls.clip_grad_norm`. Rank 0 writes the final whole
    parameters to ``<run dir>/final.pt``.

    Returns {"coords": [dp rank, tp rank], "losses" (this rank's, per step), "layout"
    (:func:`shard_layout`), "torch_clip_error" (what torch's ``clip_grad_norm_`` raises here)}.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with env.distributed(cfg.backend) as ctx, runlog.RunLog() as log:
        tp = ctx.world_size // cfg.dp
        mesh = init_device_mesh(ctx.device.type, (cfg.dp, tp), mesh_dim_names=("dp", "tp"))
        env.seed_everything(cfg.seed)
        block = apply_tp(Block(cfg.h, cfg.n_heads, cfg.ffn).to(ctx.device), mesh["tp"])
        fully_shard(block, mesh=mesh["dp"])
        opt = torch.optim.SGD(block.parameters(), lr=cfg.lr)
        dp, losses = mesh["dp"].get_local_rank(), []
        for step, (x, y) in enumerate(batches(cfg), start=1):
            x, y = (t.chunk(cfg.dp)[dp].to(ctx.device) for t in (x, y))
            loss = torch.nn.functional.mse_loss(block(x), y)
            loss.backward()
            if step == 1:  # what torch's clip_grad_norm_ raises on these mixed meshes (in its norm)
                clip = torch.nn.utils.clip_grad_norm_
                torch_clip = raised(clip, block.parameters(), cfg.max_norm)
            clip_grad_norm(block.parameters(), cfg.max_norm)
            opt.step()
            opt.zero_grad()
            samples = step * len(x)
            record = ddp.log_step(log, ctx, step=step, epoch=0, loss=loss.item(), samples=samples)
            check_loss(record["global_loss"], step=step, cfg=cfg)
            losses.append(record["loss"])
        full = {k: p.full_tensor().detach().cpu() for k, p in block.named_parameters()}
        if ctx.is_main:
            torch.save(full, runlog.run_dir() / "final.pt")
        return {
            "coords": [dp, mesh["tp"].get_local_rank()],
            "losses": losses,
            "layout": shard_layout(block),
            "torch_clip_error": torch_clip,
        }


def index_runs(indices: list[int]) -> list[list[int]]:
    """Sorted indices as runs ``[first, last]``: ``[0, 1, 2, 5]`` → ``[[0, 2], [5, 5]]``."""
    groups = (list(g) for _, g in itertools.groupby(enumerate(indices), lambda t: t[1] - t[0]))
    return [[g[0][1], g[-1][1]] for g in groups]


def shard_layout(module) -> dict:
    """Which elements of each parameter this rank holds, found by sharding a tensor of element
    indices exactly like the parameter: {name: {"rows", "cols": :func:`index_runs` of global
    indices, "placements": [repr of each placement]}}."""
    from torch.distributed.tensor import distribute_tensor

    layout = {}
    for name, p in module.named_parameters():
        index = torch.arange(p.numel(), dtype=torch.float64).view(p.shape).to(p.device)
        if hasattr(p, "placements"):
            index = distribute_tensor(index, p.device_mesh, p.placements).to_local()
        local = index.long().cpu()
        cols = p.shape[1] if p.dim() == 2 else 1
        layout[name] = {
            "rows": index_runs(sorted(set((local // cols).flatten().tolist()))),
            "cols": index_runs(sorted(set((local % cols).flatten().tolist()))),
            "placements": [repr(pl) for pl in getattr(p, "placements", ())],
        }
    return layout


FIGURE_NAMES = ("attn.wq.weight", "attn.wo.weight", "mlp.w1.weight", "mlp.w2.weight")
"""The parameters :func:`layout_figure` draws by default."""


def layout_figure(values: dict, names=FIGURE_NAMES):
    """One panel per parameter in ``names``: each rank's rectangle(s) of rows × columns, from
    :func:`mesh_worker`'s returned values ({rank: {"coords", "layout", …}}). Returns a matplotlib
    ``Figure`` (not attached to pyplot)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    fig = Figure(figsize=(3.2 * len(names), 3.4), layout="constrained")
    for ax, name in zip(fig.subplots(1, len(names), squeeze=False)[0], names):
        for rank, v in sorted(values.items()):
            label = f"rank {rank}\ndp{v['coords'][0]} tp{v['coords'][1]}"
            for r0, r1 in v["layout"][name]["rows"]:
                for c0, c1 in v["layout"][name]["cols"]:
                    box = (c0, r0), c1 - c0 + 1, r1 - r0 + 1  # corner, width, height
                    ax.add_patch(Rectangle(*box, fc=f"C{rank}", alpha=0.55, ec="k"))
                    center = ((c0 + c1 + 1) / 2, (r0 + r1 + 1) / 2)
                    ax.text(*center, label, ha="center", va="center", fontsize=8)
        rows = max(r[1] for v in values.values() for r in v["layout"][name]["rows"]) + 1
        cols = max(c[1] for v in values.values() for c in v["layout"][name]["cols"]) + 1
        title = f"{name} ({rows}×{cols})"
        ax.set(xlim=(0, cols), ylim=(rows, 0), title=title, xlabel="column", ylabel="row")
    return fig
