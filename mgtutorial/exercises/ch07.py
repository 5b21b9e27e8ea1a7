"""Checkers of chapter 07's exercises (notebooks/07_sharding.ipynb): how many ranks bring a 13 B model
under 80 GB, per-rank bytes with padding, ZeRO-1's step with clipping by the global gradient norm,
and a per-block ``reshard_after_forward`` policy (its state after forward and its collectives).

The rank-side workers here take a :class:`~mgtutorial.exercises._common.FileWorkerConfig`: they import
the learner's function from ``cfg.path`` inside each rank and run it inside the chapter's own
training loop (:func:`mgtutorial.sharding.zero.train`), next to the chapter's one-process reference.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

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
from mgtutorial.sharding import memory as M
from mgtutorial.sharding import zero as S

LIMIT = 8e10  # 80 GB (10⁹ bytes), model states only
KINDS = ("reduce_scatter", "all_gather", "all_reduce")


def smallest_ranks(
    params: int, scheme: str, limit: float = LIMIT, precision: str = "mixed"
) -> int | None:
    """Smallest N (1 … 4096) at which ``memory_per_rank([(params,)], N, scheme, precision)["total"] < limit``."""
    return next(
        (
            n
            for n in range(1, 4097)
            if M.memory_per_rank([(params,)], n, scheme, precision)["total"] < limit
        ),
        None,
    )


def fits_in_80gb(predicted: dict) -> None:
    """07.1: ``predicted[scheme]`` is the smallest N that brings 13 B parameters under 80 GB per rank.

    ``scheme`` in "zero1", "zero2", "zero3"; the ZeRO paper's mixed precision (2 + 2 + 12 bytes per
    parameter), model states only. Verified with :func:`mgtutorial.sharding.memory.memory_per_rank`.
    """
    ex, psi = "07.1 80 GB per rank", 13_000_000_000
    for scheme in ("zero1", "zero2", "zero3"):
        guess, truth = (
            answered(predicted.get(scheme), ex, f"predicted[{scheme!r}]"),
            smallest_ranks(psi, scheme),
        )
        gb = lambda n: M.memory_per_rank([(psi,)], n, scheme, "mixed")["total"] / 1e9
        require(
            isinstance(guess, int) and guess >= 1,
            ex,
            f"predicted[{scheme!r}] = {guess!r}: give a number of ranks (an int ≥ 1)",
        )
        require(
            guess >= truth,
            ex,
            f"at N = {guess}, {scheme} still holds {gb(guess):.1f} GB per rank, not under 80: "
            f"which of 2Ψ + 2Ψ + 12Ψ does {scheme} divide by N?",
        )
        if guess != truth:
            raise ExerciseError(
                ex,
                f"{scheme} is already under 80 GB at N = {guess - 1} ({gb(guess - 1):.1f} GB): "
                "the question asks for the smallest N",
            )
    passed(ex, "ZeRO-1 needs 6 ranks, ZeRO-2 4, ZeRO-3 3 (13 B parameters, 2 + 2 + 12 bytes each)")


# --- 07.2 ---------------------------------------------------------------------------------------

PAD_HINTS = {
    (
        "zero2",
        "params",
    ): "our ZeRO's full parameters are views of ONE flat buffer of N·⌈Ψ/N⌉ elements (Ψ = 351)",
    ("zero2", "grads"): "ZeRO-2 keeps its slice of the gradients: ⌈Ψ/N⌉ elements of 4 bytes",
    (
        "zero2",
        "optimizer",
    ): "each rank keeps exp_avg and exp_avg_sq (4 + 4 bytes) for its ⌈Ψ/N⌉ elements",
    (
        "zero3",
        "params",
    ): "FSDP2 pads each parameter's shard to ⌈d₀/N⌉ rows on every rank (the head has 3 rows)",
    (
        "zero3",
        "grads",
    ): "the gradient shards are padded like the parameters: ⌈d₀/N⌉ rows of every parameter",
    (
        "zero3",
        "optimizer",
    ): "Adam(W) state is made from the unpadded local shard: only the rows this rank owns",
}


def padded_bytes(predicted: dict) -> None:
    """07.2: ``predicted[(scheme, rank)] = (params, grads, optimizer)`` bytes, ``width=12`` on 2 ranks.

    Keys ``("zero2", 0)``, ``("zero3", 0)``, ``("zero3", 1)``. Launches the chapter's worker
    (parts "zero" and "fsdp") and compares every integer with the bytes the ranks measured.
    """
    ex, parts = "07.2 padding", ("params", "grads", "optimizer")
    keys = (("zero2", 0), ("zero3", 0), ("zero3", 1))
    for key in keys:
        guess = answered(predicted.get(key), ex, f"predicted[{key!r}]")
        require(
            isinstance(guess, (tuple, list)) and len(guess) == 3,
            ex,
            f"predicted[{key!r}] = {guess!r}: give a tuple (params, grads, optimizer) in bytes",
        )
        for i, value in enumerate(guess):
            answered(value, ex, f"predicted[{key!r}][{i}]")
    cfg = S.ShardConfig(width=12, parts=["zero", "fsdp"])
    values = run_ranks(ex, S.worker, cfg, 2, name="ex07-padding").values
    for scheme, rank in keys:
        v = values[rank]
        held = (v["zero"]["memory"] | v["fsdp"]["memory"])[scheme]
        for part, value in zip(parts, predicted[(scheme, rank)]):
            gap = value - held[part] if isinstance(value, int) else None
            what = (
                f"{value!r} is not an int"
                if gap is None
                else f"{abs(gap):,} B = {abs(gap) / 4:g} fp32 element{'s' * (abs(gap) != 4)} {'short' if gap < 0 else 'too many'}"
            )
            require(
                gap == 0, ex, f"rank {rank}, {scheme} {part}: {what}: {PAD_HINTS[scheme, part]}"
            )
    passed(
        ex,
        "width 12 on 2 ranks: ZeRO-2 1408/704/1408 B, FSDP2 728/728/1456 B on rank 0 and "
        "728/728/1352 B on rank 1, as measured",
    )


def run_worker(ex: str, worker, path: str, function: str, options: dict | None = None) -> dict:
    """Run this module's ``worker`` on 2 ranks with the learner's ``function`` from ``path``; per-rank values."""
    function_from(
        path, function, ex
    )  # a missing file or function is reported before any rank starts
    cfg = FileWorkerConfig(path=str(Path(path).resolve()), function=function, options=options or {})
    return run_ranks(ex, worker, cfg, 2, timeout_s=30, name=Path(path).stem).values


# --- 07.3 ---------------------------------------------------------------------------------------


def comm_counts(mode: CommDebugMode) -> dict[str, int]:
    """Collectives a :class:`CommDebugMode` saw, by kind (:data:`KINDS`, plus "other")."""
    out = dict.fromkeys((*KINDS, "other"), 0)
    for op, n in mode.get_comm_counts().items():
        name = str(op).replace("allgather", "all_gather").replace("allreduce", "all_reduce")
        out[next((k for k in KINDS if k in name), "other")] += n
    return out


def clip(g: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Each row of ``g`` scaled as ``clip_grad_norm_`` scales a gradient: by min(1, max_norm / (‖row‖ + 1e-6))."""
    return g * (max_norm / (g.norm(dim=-1, keepdim=True) + 1e-6)).clamp(max=1)


def clipped_reference(cfg: S.ShardConfig, max_norm: float) -> torch.Tensor:
    """Flat parameters (Ψ,) of one process after ``cfg.steps`` steps of ``clip_grad_norm_`` then AdamW."""
    model, one = S.make_model(cfg), env.DistContext.single_process()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    S.train(
        model,
        lambda: (nn.utils.clip_grad_norm_(model.parameters(), max_norm), opt.step()),
        cfg,
        one,
        opt.zero_grad,
    )
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def clip_step_worker(cfg: FileWorkerConfig) -> dict:
    """Rank-side: ``steps`` steps of the chapter's model with the learner's clipped ZeRO-1 step. Per step: max |Δ|
    between ``shard.grad`` at ``opt.step()`` and each way of clipping (:data:`WAYS`) this run's averaged gradients,
    and the collectives; max |Δ| to one process (:func:`clipped_reference`) after the first step and the last."""
    step_fn, steps, max_norm = (
        function_from(cfg.path, cfg.function),
        cfg.options["steps"],
        cfg.options["max_norm"],
    )
    scfg = S.ShardConfig(steps=steps)
    with env.distributed(cfg.backend) as ctx:
        model = S.make_model(scfg).to(ctx.device)
        z = S.ZeRO(model, ctx, 1, lr=scfg.lr)
        seen, given, counts, after_first = [], [], [], []
        z.opt.register_step_pre_hook(
            lambda *_: seen.append(
                None if (g := z.slice.grad) is None else g.detach().cpu().clone()
            )
        )

        def step():
            given.append(
                z.flat_grad.detach().clone()
            )  # this rank's gradients, before the learner's step
            with CommDebugMode() as mode:
                step_fn(z.flat, z.flat_grad, z.slice, z.opt, ctx, max_norm)
            counts.append(comm_counts(mode))
            after_first[:] = after_first or [z.flat.detach().cpu().clone()]

        S.train(model, step, scfg, ctx, z.zero_grad)
        n, lo = ctx.world_size, ctx.rank * z.S
        dist.all_reduce(
            mean := torch.stack(given)
        )  # outside CommDebugMode: summed over ranks, (steps, N·S)
        mean, mine = mean.cpu() / n, lambda g: g[:, lo : lo + z.S]
        ways = {
            "clipped": mine(clip(mean, max_norm)),
            "local": clip(mine(mean), max_norm),
            "unclipped": mine(mean),
            "before_divide": mine(clip(n * mean, max_norm)) / n,
            "no_divide": mine(clip(n * mean, max_norm)),
            "sum": mine(n * mean),
        }
        got = (
            None
            if (none := any(g is None for g in seen)) or len(seen) != steps
            else torch.stack(seen)
        )
        pad = lambda t: torch.cat([t, t.new_zeros(n * z.S - t.numel())])
        diff = (
            after_first[0] - pad(clipped_reference(dataclasses.replace(scfg, steps=1), max_norm))
        ).abs()
        return {
            "steps": len(seen),
            "counts": counts,
            "grad_none": none,
            "norms": mean.norm(dim=-1).tolist(),
            "ways": None
            if got is None
            else {k: (got - w).abs().amax(dim=1).tolist() for k, w in ways.items()},
            "other_diff": torch.cat([diff[:lo], diff[lo + z.S :]]).max().item(),
            "final_diff": (z.flat.detach().cpu() - pad(clipped_reference(scfg, max_norm)))
            .abs()
            .max()
            .item(),
        }


WAYS = {  # a way of clipping that a mistake leads to → the hint it gets
    "local": "rank {r} clipped by its own slice's norm: every rank must scale by the WHOLE gradient's norm; "
    "all-reduce the squared norms of the slices (one number per rank), then take the square root",
    "unclipped": "shard.grad is the averaged slice, not clipped: the gradient's norm was {norm:.2f} > max_norm = "
    "{max_norm}; scale the slice by min(1, max_norm / (norm + 1e-6)), as clip_grad_norm_ does",
    "before_divide": "the slice was clipped by the norm of the SUM over ranks, then ÷ N: divide by ctx.world_size "
    "first, then take the norm",
    "no_divide": "shard.grad is the clipped SUM over ranks; here the average's norm ({norm:.2f}) is under max_norm, so "
    "clipping does not hide it: divide by ctx.world_size before the norm",
    "sum": "shard.grad is the SUM over ranks, N× the average: divide by ctx.world_size",
}


def zero1_clipped(path: str = "ex07_zero.py", max_norm: float = 1.5) -> None:
    """07.3: ``zero1_clip_step(flat, flat_grad, shard, opt, ctx, max_norm)`` in ``path``: ZeRO-1 with clipping.

    ``flat`` (N·S,) the padded flat parameters, ``flat_grad`` (N·S,) this rank's gradients,
    ``shard`` the parameter view ``flat[r·S:(r+1)·S]``, ``opt`` AdamW over ``[shard]``, ``ctx`` the
    rank's :class:`~mgtutorial.runtime.env.DistContext`, ``max_norm`` the bound on the global gradient norm.
    4 steps on 2 ranks (the norm is above 1.5 at three, under it at one); verifies ``shard.grad`` at
    every ``opt.step()`` (the average, clipped by the global norm), the parameters against one process
    (``clip_grad_norm_`` + AdamW) and the collectives of each step (``CommDebugMode``).
    """
    ex = "07.3 ZeRO-1 with clipping"
    values = run_worker(
        ex, clip_step_worker, path, "zero1_clip_step", options={"steps": 4, "max_norm": max_norm}
    )
    for rank, v in sorted(values.items()):
        require(
            v["steps"] == 4,
            ex,
            f"rank {rank} called opt.step() {v['steps']} times in 4 steps: once per step",
        )
        require(
            not v["grad_none"],
            ex,
            f"rank {rank}: shard.grad was None when opt.step() ran, so AdamW stepped "
            "nothing: set it to this rank's slice of the averaged, clipped gradient first",
        )
    for k, norm in enumerate(values[0]["norms"]):
        errors = {
            way: max(v["ways"][way][k] for v in values.values()) for way in ("clipped", *WAYS)
        }
        if errors["clipped"] < 1e-5:
            continue
        way = next(
            (w for w in WAYS if errors[w] < 1e-5), None
        )  # the mistake that explains every rank
        bad = next(r for r, v in sorted(values.items()) if v["ways"]["clipped"][k] >= 1e-5)
        raise ExerciseError(
            ex,
            f"step {k}: "
            + (
                WAYS[way].format(r=bad, norm=norm, max_norm=max_norm)
                if way
                else f"rank {bad}'s shard.grad differs from one process's clipped gradient slice by "
                f"{errors['clipped']:.2g}: reduce-scatter, ÷ N, all-reduce the squared norm, scale"
            ),
        )
    for rank, v in sorted(values.items()):
        require(
            v["other_diff"] < 1e-6,
            ex,
            f"rank {rank}: after the first step the parameters outside its slice differ "
            f"from one process by {v['other_diff']:.2g}: all-gather every rank's "
            "updated slice into flat",
        )
        require(
            v["final_diff"] < 1e-5,
            ex,
            f"rank {rank}: after 4 steps the parameters differ from one process by "
            f"{v['final_diff']:.2g}: does every step do the same thing?",
        )
        for step, counts in enumerate(v["counts"]):
            kinds = {k: n for k, n in counts.items() if n}
            require(
                kinds
                in (
                    {"reduce_scatter": 1, "all_reduce": 1, "all_gather": 1},
                    {"all_reduce": 2, "all_gather": 1},
                ),
                ex,
                f"rank {rank} ran {kinds or 'no collectives'} in step {step}: clipped ZeRO-1 needs one reduction "
                "of the gradients (reduce-scatter), one all-reduce of the squared norm (one number) and one "
                "all-gather of the parameters",
            )
    how = (
        "1 reduce-scatter + 1 all-reduce of the squared norm + 1 all-gather per step"
        if "reduce_scatter" in kinds
        else "2 all-reduces (gradients, squared norm) + 1 all-gather per step (1.5× the bytes)"
    )
    passed(
        ex,
        f"averaged gradient slice clipped by the global norm (it binds at steps "
        f"{[k for k, norm in enumerate(values[0]['norms']) if norm > max_norm]}, not at the others), "
        f"parameters equal one process (clip_grad_norm_ + AdamW) after 4 steps on 2 ranks, {how}",
    )


# --- 07.4 ---------------------------------------------------------------------------------------


def asked_policy(model: nn.Module, mesh) -> nn.Module:
    """07.4's policy: every block but the last resharded after forward, the last kept, the root default."""
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=i < last)
    return fully_shard(model, mesh=mesh)


def count_step(model: nn.Module, cfg: S.ShardConfig, ctx) -> dict:
    """One training step: ``counts`` (all-gathers forward, all-gathers backward, reduce-scatters) and
    ``gathered``, per unit (blocks, then the root), whether its weight was unsharded between forward and backward."""
    x, y = (t.to(ctx.device) for t in S.batch(cfg, 0, ctx.rank, ctx.world_size))
    with CommDebugMode() as fwd:
        loss = nn.functional.mse_loss(model(x), y)
    gathered = [
        not isinstance(m.weight, DTensor) for m in (*(b.lin for b in model.blocks), model.head)
    ]
    with CommDebugMode() as bwd:
        loss.backward()
    f, b = comm_counts(fwd), comm_counts(bwd)
    return {
        "counts": (f["all_gather"], b["all_gather"], f["reduce_scatter"] + b["reduce_scatter"]),
        "gathered": gathered,
    }


def policy_worker(cfg: FileWorkerConfig) -> dict:
    """Rank-side: for B = 1, 2, 3 blocks, the learner's ``shard_model`` and :func:`asked_policy`, counted."""
    shard = function_from(cfg.path, cfg.function)
    scfg = S.ShardConfig()
    with env.distributed(
        cfg.backend
    ) as ctx:  # named: a mesh fully_shard makes itself (no mesh=) differs from it
        mesh, out = (
            init_device_mesh(
                S.mesh_device_type(ctx.backend), (ctx.world_size,), mesh_dim_names=("shard",)
            ),
            {},
        )
        for blocks in (1, 2, 3):
            for who, apply in (("yours", shard), ("asked", asked_policy)):
                model = S.make_model(scfg, blocks).to(ctx.device)
                apply(model, mesh)
                plain = [k for k, p in model.named_parameters() if not isinstance(p, DTensor)]
                other = [
                    k
                    for k, p in model.named_parameters()
                    if isinstance(p, DTensor) and p.device_mesh != mesh
                ]
                out[f"{who}{blocks}"] = {
                    "plain": plain,
                    "other_mesh": other,
                    "step": None if plain or other else count_step(model, scfg, ctx),
                }
        return out


def reshard_policy(path: str = "ex07_fsdp.py", predicted: dict | None = None) -> None:
    """07.4: ``shard_model(model, mesh)`` in ``path`` applies the asked policy; ``predicted[B]`` its counts.

    ``predicted[B] = (all-gathers in forward, all-gathers in backward, reduce-scatters)`` per step for
    B = 1, 2, 3 blocks. Verified on 2 ranks, for the learner's ``shard_model`` and :func:`asked_policy`:
    every parameter a DTensor on the given mesh, which units are still gathered after forward, and
    the collectives counted with ``CommDebugMode``.
    """
    ex, predicted = "07.4 reshard policy", predicted or {}
    for b in (1, 2, 3):
        guess = answered(predicted.get(b), ex, f"predicted[{b}]")
        require(
            isinstance(guess, (tuple, list)) and len(guess) == 3,
            ex,
            f"predicted[{b}] = {guess!r}: give (all-gathers forward, all-gathers backward, reduce-scatters)",
        )
        for i, value in enumerate(guess):
            answered(value, ex, f"predicted[{b}][{i}]")
    values = run_worker(ex, policy_worker, path, "shard_model")[0]
    names = ("all-gathers in forward", "all-gathers in backward", "reduce-scatters")
    for b in (1, 2, 3):
        yours, asked = values[f"yours{b}"], values[f"asked{b}"]["step"]
        if yours["plain"] or yours["other_mesh"]:
            raise ExerciseError(
                ex,
                f"with B = {b}, "
                + (
                    f"{yours['plain'][0]} is not sharded (not a DTensor): fully_shard every block, then the root"
                    if yours["plain"]
                    else f"{yours['other_mesh'][0]} is sharded over a mesh fully_shard made itself, "
                    "not the one given: pass mesh=mesh to every fully_shard (without it, it builds one on the default "
                    "accelerator: CUDA on a GPU machine, which a gloo process group cannot drive)"
                ),
            )
        unit, mine = (lambda i: f"block {i}" if i < b else "the root"), yours["step"]
        diffs = [
            f"{unit(i)} {'is still gathered' if m else 'was freed'}"
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
            f"(all-gathers forward, backward, reduce-scatters), the asked "
            f"policy {asked['counts']}: fully_shard each block once, then the root",
        )
        for name, guess, truth in zip(names, predicted[b], asked["counts"]):
            require(
                guess == truth,
                ex,
                f"with B = {b} blocks, {name}: {truth} counted, you predicted {guess}: "
                "backward gathers again only the units resharded after forward",
            )
    passed(
        ex,
        "after forward your policy keeps only the last block and the root gathered, as asked, and your "
        "predictions match: per step B + 1 all-gathers forward, B − 1 backward, "
        "B + 1 reduce-scatters (B = 1, 2, 3)",
    )
