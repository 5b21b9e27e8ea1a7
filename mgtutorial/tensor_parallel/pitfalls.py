"""Tensor-parallel pitfalls a learner will hit, each reproduced and fixed: the head count not
divided, ``clip_grad_norm_`` and foreach optimizers over a mix of DTensors and plain tensors, and
dropout randomness that must agree (replicated activations) or differ (sharded ones) across TP
ranks.

Taught in notebooks/08b_tp_mesh_and_cost.ipynb (section 3). Follows
https://pytorch.org/docs/stable/distributed.tensor.parallel.html,
https://pytorch.org/docs/stable/generated/torch.nn.utils.clip_grad_norm_.html and Megatron-LM's
``model_parallel_cuda_manual_seed`` (one seed shared by a TP group, one per TP rank for sharded
regions).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from mgtutorial.common.compare import counted, max_abs_diff
from mgtutorial.runtime import env
from mgtutorial.tensor_parallel.config import TPConfig, inputs
from mgtutorial.tensor_parallel.plans import apply_tp, fix_heads, tp_plan
from mgtutorial.tensor_parallel.transformer import Block


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` for a mix of plain tensors and DTensors on different meshes: one norm
    per mesh (a DTensor norm made whole with ``full_tensor``), combined, then every group scaled.
    Returns the total 2-norm (a plain scalar tensor)."""
    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in ps]) for ps in groups.values()]
    norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for ps in groups.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


def dropout(x: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
    """Inverted dropout whose mask comes from ``generator`` (so the seed that drew it is
    explicit): each element kept with probability ``1 − p`` and scaled by ``1 / (1 − p)``."""
    keep = torch.rand(x.shape, generator=generator, device=x.device) >= p
    return x * keep.to(x.dtype) / (1 - p)


def raised(fn, *args) -> str | None:
    """``"Type: first line of the message"`` of what ``fn(*args)`` raises, or None."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the pitfall is the error; the notebook prints it
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


def _gathered(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous())
    return parts


def pitfalls(cfg: TPConfig, ctx: env.DistContext, mesh) -> dict:
    """Each pitfall, then its fix, on the 1-D TP ``mesh`` over all ranks. Called by
    :func:`mgtutorial.tensor_parallel.worker.worker` inside its process group (every rank calls
    it). Returns :func:`mixed_plan` ∪ :func:`all_dtensor_plan` ∪ {"dropout": :func:`dropout_seeds`}.
    """
    env.seed_everything(cfg.seed)
    ref = Block(cfg.h, cfg.n_heads, cfg.ffn).to(ctx.device)
    x, dy = (t.to(ctx.device) for t in inputs(cfg))
    start = copy.deepcopy(ref)
    out = mixed_plan(ref, mesh, x, dy)
    out.update(all_dtensor_plan(start, ref, mesh, x, dy))
    out["dropout"] = dropout_seeds(cfg, ctx)
    return out


def mixed_plan(ref: Block, mesh, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """The plan of 08a's section 4 (LayerNorms left plain tensors) on a copy of ``ref``; ``ref`` is
    then trained one SGD step (its gradients kept) like the copy.

    Returns {"forgot_heads", "clip_error", "foreach_error": the error (:func:`raised`),
    "clip_norm_rel_diff": |:func:`clip_grad_norm` − unsplit norm| / unsplit norm,
    "for_loop_param_diff": max |param − unsplit| after one ``SGD(foreach=False)`` step}.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    block = copy.deepcopy(ref)
    parallelize_module(block, mesh, tp_plan())
    out = {"forgot_heads": raised(block, x)}  # still reshapes into all n_heads heads
    fix_heads(block, mesh.size())  # the fix: n_heads / tp heads on each rank
    for m in (block, ref):
        (m(x) * dy).sum().backward()
    out["clip_error"] = raised(torch.nn.utils.clip_grad_norm_, block.parameters(), 1e9)
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    out["clip_norm_rel_diff"] = float((clip_grad_norm(block.parameters(), 1e9) - want).abs() / want)
    out["foreach_error"] = raised(
        lambda: torch.optim.SGD(block.parameters(), lr=0.1, foreach=True).step()
    )
    for m in (block, ref):
        torch.optim.SGD(m.parameters(), lr=0.1, foreach=False).step()
    out["for_loop_param_diff"] = max_abs_diff(list(block.parameters()), list(ref.parameters()))
    return out


def all_dtensor_plan(start: Block, ref: Block, mesh, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """The other fix: the sequence-parallel plan makes every parameter a DTensor, and torch's own
    ``clip_grad_norm_`` and ``SGD(foreach=True)`` work. ``start`` is the unsplit block before
    training, ``ref`` after :func:`mixed_plan`'s step (its gradients kept).

    Returns {"sp_all_dtensor": bool, "sp_clip_norm_rel_diff" (torch's ``clip_grad_norm_`` against
    the unsplit norm), "sp_foreach_param_diff" (max |param − unsplit| after the foreach step),
    "sp_clip_counts", "sp_step_counts" ({collective: calls} they issue: the LayerNorms'
    ``Partial`` gradients)}.
    """
    rank, tp = mesh.get_local_rank(), mesh.size()
    sp = apply_tp(start, mesh, sequence_parallel=True)
    (sp(x.chunk(tp, dim=1)[rank]) * dy.chunk(tp, dim=1)[rank]).sum().backward()
    out = {"sp_all_dtensor": all(hasattr(p, "placements") for p in sp.parameters())}
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    clip = torch.nn.utils.clip_grad_norm_  # torch's own
    sp_norm, out["sp_clip_counts"], _ = counted(clip, sp.parameters(), 1e9)
    out["sp_clip_norm_rel_diff"] = max_abs_diff(sp_norm, want) / want.item()
    step = torch.optim.SGD(sp.parameters(), lr=0.1, foreach=True).step
    _, out["sp_step_counts"], _ = counted(step)
    out["sp_foreach_param_diff"] = max_abs_diff(list(sp.parameters()), list(ref.parameters()))
    return out


def dropout_seeds(cfg: TPConfig, ctx: env.DistContext) -> dict:
    """Each rank draws p = 0.5 dropout masks with an explicit generator, and the ranks compare.

    Returns {"replicated_diff_per_rank_seed", "replicated_diff_shared_seed" (max |difference|
    between TP ranks of an activation that should be replicated), "sharded_agree_shared_seed",
    "sharded_agree_per_rank_seed" (fraction of equal mask entries between TP ranks' slices)}.
    """
    r, n, dev = ctx.rank, ctx.world_size, ctx.device
    rep, shard = (torch.ones(cfg.batch, cfg.seq, w, device=dev) for w in (cfg.h, cfg.ffn // n))
    drop = {}
    for name, seed in (("per_rank_seed", cfg.seed + r), ("shared_seed", cfg.seed)):
        parts = _gathered(dropout(rep, 0.5, torch.Generator(dev).manual_seed(seed)), n)
        drop[f"replicated_diff_{name}"] = max(float((p - parts[0]).abs().max()) for p in parts)
    for name, seed in (("shared_seed", cfg.seed), ("per_rank_seed", cfg.seed + 2718 + r)):
        parts = _gathered(dropout(shard, 0.5, torch.Generator(dev).manual_seed(seed)), n)
        drop[f"sharded_agree_{name}"] = float((parts[0] == parts[-1]).float().mean())
    return drop
