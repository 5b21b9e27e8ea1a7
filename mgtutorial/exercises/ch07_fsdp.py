"""Checker of chapter 07's exercise 07b.1 (notebooks/07b_fsdp2.ipynb): a per-block
``reshard_after_forward`` policy, its state after forward and its collectives, reached as
``ex.ch07.reshard_policy``.

The rank-side worker takes a :class:`~mgtutorial.exercises._common.FileWorkerConfig`: it imports
the learner's ``shard_model`` from ``cfg.path`` inside each rank and applies it to the chapter's
:class:`~mgtutorial.sharding.model.BlockStack`, next to the asked policy.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mgtutorial.common.compare import counting_mode
from mgtutorial.exercises._common import (
    ExerciseError,
    FileWorkerConfig,
    answered,
    function_from,
    passed,
    require,
    run_ranks,
)
from mgtutorial.runtime import env
from mgtutorial.sharding import fsdp, model
from mgtutorial.sharding.worker import ShardConfig


def asked_policy(net: nn.Module, mesh) -> nn.Module:
    """07b.1's policy: every block but the last resharded after forward, the last kept, the root
    at its default."""
    last = len(net.blocks) - 1
    for i, block in enumerate(net.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=i < last)
    return fully_shard(net, mesh=mesh)


def count_step(net: nn.Module, cfg: ShardConfig, ctx) -> dict:
    """One training step: ``counts`` (all-gathers forward, all-gathers backward, reduce-scatters)
    and ``gathered``, per unit (blocks, then the root), whether its weight was unsharded between
    forward and backward."""
    x, y = (t.to(ctx.device) for t in model.batch(cfg, 0, ctx.rank, ctx.world_size))
    with counting_mode() as fwd:
        loss = nn.functional.mse_loss(net(x), y)
    units = (*(b.lin for b in net.blocks), net.head)
    gathered = [not isinstance(m.weight, DTensor) for m in units]
    with counting_mode() as bwd:
        loss.backward()
    f, b = fwd.counts(), bwd.counts()
    reduce_scatters = f.get("reduce_scatter", 0) + b.get("reduce_scatter", 0)
    return {
        "counts": (f.get("all_gather", 0), b.get("all_gather", 0), reduce_scatters),
        "gathered": gathered,
    }


def policy_worker(cfg: FileWorkerConfig) -> dict:
    """Rank-side: for B = 1, 2, 3 blocks, the learner's ``shard_model`` and
    :func:`asked_policy`, counted."""
    shard = function_from(cfg.path, cfg.function)
    scfg = ShardConfig()
    with env.distributed(cfg.backend) as ctx:
        # named: a mesh fully_shard makes itself (no mesh=) differs from it
        device_type = fsdp.mesh_device_type(ctx.backend)
        mesh = init_device_mesh(device_type, (ctx.world_size,), mesh_dim_names=("shard",))
        out = {}
        for blocks in (1, 2, 3):
            for who, apply in (("yours", shard), ("asked", asked_policy)):
                net = model.make_model(scfg, blocks).to(ctx.device)
                apply(net, mesh)
                params = dict(net.named_parameters())
                plain = [k for k, p in params.items() if not isinstance(p, DTensor)]
                other = [
                    k for k, p in params.items() if isinstance(p, DTensor) and p.device_mesh != mesh
                ]
                out[f"{who}{blocks}"] = {
                    "plain": plain,
                    "other_mesh": other,
                    "step": None if plain or other else count_step(net, scfg, ctx),
                }
        return out


def not_sharded_hint(b: int, yours: dict) -> str:
    """What 07b.1 says when a parameter is a plain tensor or on a mesh of its own."""
    if yours["plain"]:
        return (
            f"with B = {b}, {yours['plain'][0]} is not sharded (not a DTensor): fully_shard "
            "every block, then the root"
        )
    return (
        f"with B = {b}, {yours['other_mesh'][0]} is sharded over a mesh fully_shard made "
        "itself, not the one given: pass mesh=mesh to every fully_shard (without it, it builds "
        "one on the default accelerator: CUDA on a GPU machine, which a gloo process group "
        "cannot drive)"
    )


def reshard_policy(path: str = "ex07_fsdp.py", predicted: dict | None = None) -> None:
    """07b.1: ``shard_model(model, mesh)`` in ``path`` applies the asked policy; ``predicted[B]``
    its counts.

    ``predicted[B] = (all-gathers in forward, all-gathers in backward, reduce-scatters)`` per step
    for B = 1, 2, 3 blocks. Verified on 2 ranks, for the learner's ``shard_model`` and
    :func:`asked_policy`: every parameter a DTensor on the given mesh, which units are still
    gathered after forward, and the collectives counted with ``CommDebugMode``.
    """
    ex, predicted = "07b.1 reshard policy", predicted or {}
    for b in (1, 2, 3):
        guess = answered(predicted.get(b), ex, f"predicted[{b}]")
        require(
            isinstance(guess, (tuple, list)) and len(guess) == 3,
            ex,
            f"predicted[{b}] = {guess!r}: give (all-gathers forward, all-gathers backward, "
            "reduce-scatters)",
        )
        for i, value in enumerate(guess):
            answered(value, ex, f"predicted[{b}][{i}]")
    function_from(path, "shard_model", ex)  # a missing file or function: before any rank
    cfg = FileWorkerConfig(path=str(Path(path).resolve()), function="shard_model")
    values = run_ranks(ex, policy_worker, cfg, 2, timeout_s=30, name=Path(path).stem).values[0]
    names = ("all-gathers in forward", "all-gathers in backward", "reduce-scatters")
    for b in (1, 2, 3):
        yours, asked = values[f"yours{b}"], values[f"asked{b}"]["step"]
        if yours["plain"] or yours["other_mesh"]:
            raise ExerciseError(ex, not_sharded_hint(b, yours))
        mine = yours["step"]
        diffs = [
            f"{f'block {i}' if i < b else 'the root'} {'is still gathered' if m else 'was freed'}"
            for i, (m, t) in enumerate(zip(mine["gathered"], asked["gathered"]))
            if m != t
        ]
        require(
            not diffs,
            ex,
            f"with B = {b} blocks, after forward {' and '.join(diffs)}: keep only the LAST block "
            "(reshard_after_forward=False), reshard the others (True), the root at the default",
        )
        require(
            mine["counts"] == asked["counts"],
            ex,
            f"with B = {b} blocks, your shard_model runs {mine['counts']} "
            "(all-gathers forward, backward, reduce-scatters), not what the asked policy runs: "
            "fully_shard each block once, then the root",
        )
        for name, guess, truth in zip(names, predicted[b], asked["counts"]):
            require(
                guess == truth,
                ex,
                f"with B = {b} blocks, {name}: you predicted {guess}, "
                f"{'too many' if guess > truth else 'too few'}: backward gathers again only the "
                "units resharded after forward",
            )
    passed(
        ex,
        "after forward your policy keeps only the last block and the root gathered, as asked, "
        "and your predictions match: per step B + 1 all-gathers forward, B − 1 backward, "
        "B + 1 reduce-scatters (B = 1, 2, 3)",
    )
