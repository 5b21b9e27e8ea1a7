"""Tensor-parallel pitfalls a learner will hit, each reproduced and fixed: the head count not
divided, ``clip_grad_norm_`` and foreach optimizers over a mix of DTensors and plain tensors, and
dropout randomness that must agree (replicated activations) or differ (sharded ones) across TP ranks.

Taught in notebooks/08_tensor_parallel.ipynb. Follows
https://pytorch.org/docs/stable/distributed.tensor.parallel.html,
https://pytorch.org/docs/stable/generated/torch.nn.utils.clip_grad_norm_.html and Megatron-LM's
``model_parallel_cuda_manual_seed`` (one seed shared by a TP group, one per TP rank for sharded regions).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from mgtutorial.runtime import env
from mgtutorial.tensor_parallel import fg as tp
from mgtutorial.tensor_parallel.mesh2d import TPConfig, _full, _inputs, counted


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` for a mix of plain tensors and DTensors on different meshes: one norm
    per mesh (a DTensor norm made whole with ``full_tensor``), combined, then every group scaled."""
    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [_full(torch.nn.utils.get_total_norm([p.grad for p in ps])) for ps in groups.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for ps in groups.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


def dropout(x: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
    """Inverted dropout whose mask comes from ``generator`` (so the seed that drew it is explicit)."""
    return (
        x * (torch.rand(x.shape, generator=generator, device=x.device) >= p).to(x.dtype) / (1 - p)
    )


def _error(fn, *args) -> str | None:
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
    :func:`mgtutorial.tensor_parallel.mesh2d.worker` inside its process group (every rank calls it).

    Returns {"forgot_heads": error, "clip_error": error,
    "clip_norm_rel_diff": |fixed norm − unsplit| / unsplit,
    "foreach_error": error, "for_loop_param_diff": max |param − unsplit| after one SGD step,
    the same with the sequence-parallel plan (every parameter a DTensor): "sp_all_dtensor",
    "sp_clip_norm_rel_diff" (torch's ``clip_grad_norm_``), "sp_foreach_param_diff" (``foreach=True``),
    "sp_clip_counts", "sp_step_counts" (collectives they issue: the LayerNorms' ``Partial`` gradients),
    "dropout": {"replicated_diff_per_rank_seed", "replicated_diff_shared_seed" (max |difference|
    between TP ranks of an activation that should be replicated), "sharded_agree_shared_seed",
    "sharded_agree_per_rank_seed" (fraction of equal mask entries between TP ranks' slices)}}.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    r, n, dev = ctx.rank, ctx.world_size, ctx.device
    env.seed_everything(cfg.seed)
    ref, (x, dy) = tp.Block(cfg.h, cfg.n_heads, cfg.ffn).to(dev), (t.to(dev) for t in _inputs(cfg))
    block, start = copy.deepcopy(ref), copy.deepcopy(ref)
    parallelize_module(block, mesh, tp.tp_plan())
    out = {"forgot_heads": _error(block, x)}  # still reshapes into all n_heads heads
    tp.fix_heads(block, n)  # the fix: n_heads / tp heads on each rank
    for m in (block, ref):
        (m(x) * dy).sum().backward()
    out["clip_error"] = _error(torch.nn.utils.clip_grad_norm_, block.parameters(), 1e9)
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    out["clip_norm_rel_diff"] = float((clip_grad_norm(block.parameters(), 1e9) - want).abs() / want)
    out["foreach_error"] = _error(
        lambda: torch.optim.SGD(block.parameters(), lr=0.1, foreach=True).step()
    )
    for m in (block, ref):
        torch.optim.SGD(m.parameters(), lr=0.1, foreach=False).step()
    out["for_loop_param_diff"] = max(
        float((_full(p) - q).abs().max()) for p, q in zip(block.parameters(), ref.parameters())
    )
    sp = tp.apply_tp(
        start, mesh, sequence_parallel=True
    )  # the other fix: every parameter a DTensor
    (sp(x.chunk(n, dim=1)[r]) * dy.chunk(n, dim=1)[r]).sum().backward()
    out["sp_all_dtensor"] = all(hasattr(p, "placements") for p in sp.parameters())
    sp_norm, out["sp_clip_counts"], _ = counted(
        torch.nn.utils.clip_grad_norm_, sp.parameters(), 1e9
    )  # torch's
    out["sp_clip_norm_rel_diff"] = float((_full(sp_norm) - want).abs() / want)
    _, out["sp_step_counts"], _ = counted(
        torch.optim.SGD(sp.parameters(), lr=0.1, foreach=True).step
    )
    out["sp_foreach_param_diff"] = max(
        float((_full(p) - q).abs().max()) for p, q in zip(sp.parameters(), ref.parameters())
    )
    rep, shard = (torch.ones(cfg.batch, cfg.seq, w, device=dev) for w in (cfg.h, cfg.ffn // n))
    drop = {}
    for name, seed in (("per_rank_seed", cfg.seed + r), ("shared_seed", cfg.seed)):
        parts = _gathered(dropout(rep, 0.5, torch.Generator(dev).manual_seed(seed)), n)
        drop[f"replicated_diff_{name}"] = max(float((p - parts[0]).abs().max()) for p in parts)
    for name, seed in (("shared_seed", cfg.seed), ("per_rank_seed", cfg.seed + 2718 + r)):
        parts = _gathered(dropout(shard, 0.5, torch.Generator(dev).manual_seed(seed)), n)
        drop[f"sharded_agree_{name}"] = float((parts[0] == parts[-1]).float().mean())
    out["dropout"] = drop
    return out
