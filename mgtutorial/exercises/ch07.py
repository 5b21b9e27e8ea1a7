"""Checkers of chapter 07's exercises (notebooks/07_sharding.ipynb): how many ranks bring a 13 B model
under 80 GB, per-rank bytes with padding, ZeRO-1's step written by hand, and the collectives of a
per-block ``reshard_after_forward`` policy.

The rank-side workers here take a :class:`~mgtutorial.exercises._common.FileWorkerConfig`: they import
the learner's function from ``cfg.path`` inside each rank and run it inside the chapter's own
training loop (:func:`mgtutorial.sharding.train`), next to the chapter's one-process reference.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from .. import env
from .. import sharding as S
from .. import sharding_fsdp as F
from .. import sharding_memory as M
from ._common import ExerciseError, FileWorkerConfig, answered, function_from, passed, require, run_ranks

LIMIT = 8e10  # 80 GB (10⁹ bytes), model states only
KINDS = ("reduce_scatter", "all_gather", "all_reduce")


def smallest_ranks(params: int, scheme: str, limit: float = LIMIT, precision: str = "mixed") -> int | None:
    """Smallest N (1 … 4096) at which ``memory_per_rank([(params,)], N, scheme, precision)["total"] < limit``."""
    return next((n for n in range(1, 4097)
                 if M.memory_per_rank([(params,)], n, scheme, precision)["total"] < limit), None)


def fits_in_80gb(predicted: dict) -> None:
    """07.1: ``predicted[scheme]`` is the smallest N that brings 13 B parameters under 80 GB per rank.

    ``scheme`` in "zero1", "zero2", "zero3"; the ZeRO paper's mixed precision (2 + 2 + 12 bytes per
    parameter), model states only. Verified with :func:`mgtutorial.sharding_memory.memory_per_rank`.
    """
    ex, psi = "07.1 80 GB per rank", 13_000_000_000
    for scheme in ("zero1", "zero2", "zero3"):
        guess, truth = answered(predicted.get(scheme), ex, f"predicted[{scheme!r}]"), smallest_ranks(psi, scheme)
        gb = lambda n: M.memory_per_rank([(psi,)], n, scheme, "mixed")["total"] / 1e9
        require(isinstance(guess, int) and guess >= 1, ex,
                f"predicted[{scheme!r}] = {guess!r}: give a number of ranks (an int ≥ 1)")
        require(guess >= truth, ex, f"at N = {guess}, {scheme} still holds {gb(guess):.1f} GB per rank, not under 80: "
                                    f"which of 2Ψ + 2Ψ + 12Ψ does {scheme} divide by N?")
        if guess != truth:
            raise ExerciseError(ex, f"{scheme} is already under 80 GB at N = {guess - 1} ({gb(guess - 1):.1f} GB): "
                                    "the question asks for the smallest N")
    passed(ex, "ZeRO-1 needs 6 ranks, ZeRO-2 4, ZeRO-3 3 (13 B parameters, 2 + 2 + 12 bytes each)")


# --- 07.2 ---------------------------------------------------------------------------------------

PAD_HINTS = {
    ("zero2", "params"): "our ZeRO keeps the full parameters as views of ONE flat buffer of N·⌈Ψ/N⌉ elements "
                         "(Ψ = 351)",
    ("zero2", "grads"): "ZeRO-2 keeps its slice of the gradients: ⌈Ψ/N⌉ elements of 4 bytes",
    ("zero2", "optimizer"): "each rank keeps exp_avg and exp_avg_sq (4 + 4 bytes) for its ⌈Ψ/N⌉ elements",
    ("zero3", "params"): "FSDP2 pads each parameter's shard to ⌈d₀/N⌉ rows on every rank (the head has 3 rows)",
    ("zero3", "grads"): "the gradient shards are padded like the parameters: ⌈d₀/N⌉ rows of every parameter",
    ("zero3", "optimizer"): "Adam(W) state is made from the unpadded local shard: only the rows this rank "
                            "owns (M.rows_owned), 8 bytes per element",
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
        require(isinstance(guess, (tuple, list)) and len(guess) == 3, ex,
                f"predicted[{key!r}] = {guess!r}: give a tuple (params, grads, optimizer) in bytes")
        for i, value in enumerate(guess):
            answered(value, ex, f"predicted[{key!r}][{i}]")
    cfg = S.ShardConfig(width=12, parts=["zero", "fsdp"])
    values = run_ranks(ex, S.worker, cfg, 2, name="ex07-padding").values
    for scheme, rank in keys:
        v = values[rank]
        held = (v["zero"]["memory"] | v["fsdp"]["memory"])[scheme]
        for part, value in zip(parts, predicted[(scheme, rank)]):
            require(value == held[part], ex, f"rank {rank}, {scheme} {part}: measured {held[part]:,} B, you predicted "
                                             f"{value!r}: {PAD_HINTS[scheme, part]}")
    passed(ex, "width 12 on 2 ranks: ZeRO-2 1408/704/1408 B, FSDP2 728/728/1456 B on rank 0 and "
               "728/728/1352 B on rank 1, as measured")


def run_worker(ex: str, worker, path: str, function: str, options: dict | None = None) -> dict:
    """Run this module's ``worker`` on 2 ranks with the learner's ``function`` from ``path``; per-rank values."""
    function_from(path, function, ex)  # a missing file or function is reported before any rank starts
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


def zero_step_worker(cfg: FileWorkerConfig) -> dict:
    """Rank-side: train the chapter's model ``steps`` steps with the learner's ZeRO-1 step.

    Returns max |Δ| to one process inside and outside this rank's slice, the gradient the shard held
    when ``opt.step()`` ran (vs one process's mean and N× it), and the collectives of each step.
    """
    step_fn = function_from(cfg.path, cfg.function)
    scfg = S.ShardConfig(**cfg.options)
    with env.distributed(cfg.backend) as ctx:
        model = S.make_model(scfg).to(ctx.device)
        z = S.ZeRO(model, ctx, 1, lr=scfg.lr)
        seen, counts, after_first = [], [], []
        grad_now = lambda: None if z.slice.grad is None else z.slice.grad.detach().cpu().clone()
        z.opt.register_step_pre_hook(lambda *_: seen.append(grad_now()))  # what opt.step() will use

        def step():
            with CommDebugMode() as mode:
                step_fn(z.flat, z.flat_grad, z.slice, z.opt, ctx)
            counts.append(comm_counts(mode))
            if not after_first:
                after_first.append(z.flat.detach().cpu().clone())

        S.train(model, step, scfg, ctx, z.zero_grad)
        one, n, lo = S.make_model(scfg), ctx.world_size, ctx.rank * z.S
        x, y = S.batch(scfg, 0)
        nn.functional.mse_loss(one(x), y).backward()  # one process, whole batch, first step
        pad = lambda t: torch.cat([t, t.new_zeros(n * z.S - t.numel())])
        mean = pad(torch.cat([p.grad.reshape(-1) for p in one.parameters()]))[lo:lo + z.S]
        flat_ref = lambda steps: pad(torch.cat([p.detach().reshape(-1) for p in S.reference(
            dataclasses.replace(scfg, steps=steps))[0].parameters()]))
        diff = (after_first[0] - flat_ref(1)).abs()  # after the first step: this rank's slice, the others
        first = seen[0] if seen else None
        return {"steps": len(seen), "counts": counts, "grad_none": first is None,
                "grad_vs_mean": None if first is None else (first - mean).abs().max().item(),
                "grad_vs_sum": None if first is None else (first - n * mean).abs().max().item(),
                "own_diff": diff[lo:lo + z.S].max().item(),
                "other_diff": torch.cat([diff[:lo], diff[lo + z.S:]]).max().item() if n > 1 else 0.0,
                "final_diff": (z.flat.detach().cpu() - flat_ref(scfg.steps)).abs().max().item()}


def zero1_step(path: str = "ex07_zero.py") -> None:
    """07.3: ``zero1_step(flat, flat_grad, shard, opt, ctx)`` in ``path``: one ZeRO-1 optimizer step.

    ``flat`` (N·S,) the padded flat parameters, ``flat_grad`` (N·S,) this rank's gradients,
    ``shard`` the parameter view ``flat[r·S:(r+1)·S]``, ``opt`` AdamW over ``[shard]``. Runs 3 steps
    on 2 ranks; verifies the gradient ``shard`` held at ``opt.step()`` (the average over ranks), the
    parameters against one process, and the collectives of each step (``CommDebugMode``).
    """
    ex = "07.3 ZeRO-1 by hand"
    values = run_worker(ex, zero_step_worker, path, "zero1_step", options={"steps": 3})
    for rank, v in sorted(values.items()):
        require(v["steps"] == 3, ex, f"rank {rank} called opt.step() {v['steps']} times in 3 steps: "
                                     "call it once per step")
        require(not v["grad_none"], ex, f"rank {rank}: shard.grad was None when opt.step() ran, so AdamW stepped "
                                        "nothing: set it to this rank's slice of the averaged gradient first")
        require(v["grad_vs_sum"] > 1e-6 or v["grad_vs_mean"] < 1e-6, ex,
                f"rank {rank}: shard.grad is the SUM over ranks, N× the average: divide by ctx.world_size")
        require(v["grad_vs_mean"] < 1e-6, ex, f"rank {rank}: shard.grad differs from one process's gradient slice by "
                                              f"{v['grad_vs_mean']:.2g}: rank r needs slice r of flat_grad, summed over "
                                              "ranks (reduce_scatter_tensor) and ÷ N")
        require(v["own_diff"] < 1e-6, ex, f"rank {rank}: after the first step its own slice differs from one process "
                                          f"by {v['own_diff']:.2g}: step opt once, after setting shard.grad")
        require(v["other_diff"] < 1e-6, ex, f"rank {rank}: after the first step the parameters outside its slice differ "
                                            f"from one process by {v['other_diff']:.2g}: all-gather every rank's "
                                            "updated slice into flat")
        require(v["final_diff"] < 1e-5, ex, f"rank {rank}: after 3 steps the parameters differ from one process by "
                                            f"{v['final_diff']:.2g}: does every step do the same thing?")
        for step, counts in enumerate(v["counts"]):
            kinds = {k: n for k, n in counts.items() if n}
            require(sum(kinds.values()) == 2 and kinds.get("all_gather") == 1, ex,
                    f"rank {rank} ran {kinds or 'no collectives'} in step {step}: ZeRO-1 needs one reduction of the "
                    "gradients (reduce-scatter, or all-reduce) and one all-gather of the parameters")
    how = ("1 reduce-scatter + 1 all-gather per step (the bytes of DDP's all-reduce)" if "reduce_scatter" in kinds
           else "1 all-reduce + 1 all-gather per step (1.5× the bytes of DDP's all-reduce)")
    passed(ex, f"averaged gradient slice, parameters equal one process after 3 steps on 2 ranks, {how}")


# --- 07.4 ---------------------------------------------------------------------------------------

def asked_policy(model: nn.Module, mesh) -> nn.Module:
    """07.4's policy: every block but the last resharded after forward, the last kept, the root default."""
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=i < last)
    return fully_shard(model, mesh=mesh)


def count_step(model: nn.Module, cfg: S.ShardConfig, ctx) -> tuple[int, int, int]:
    """(all-gathers in forward, all-gathers in backward, reduce-scatters) of one training step."""
    x, y = (t.to(ctx.device) for t in S.batch(cfg, 0, ctx.rank, ctx.world_size))
    with CommDebugMode() as fwd:
        loss = nn.functional.mse_loss(model(x), y)
    with CommDebugMode() as bwd:
        loss.backward()
    f, b = comm_counts(fwd), comm_counts(bwd)
    return f["all_gather"], b["all_gather"], f["reduce_scatter"] + b["reduce_scatter"]


def policy_worker(cfg: FileWorkerConfig) -> dict:
    """Rank-side: for B = 1, 2, 3 blocks, the learner's ``shard_model`` and :func:`asked_policy`, counted."""
    shard = function_from(cfg.path, cfg.function)
    scfg = S.ShardConfig()
    with env.distributed(cfg.backend) as ctx:
        mesh, out = F.mesh_for(scfg, ctx), {}
        for blocks in (1, 2, 3):
            for who, apply in (("yours", shard), ("asked", asked_policy)):
                model = S.make_model(scfg, blocks).to(ctx.device)
                apply(model, mesh)
                plain = [k for k, p in model.named_parameters() if not isinstance(p, DTensor)]
                out[f"{who}{blocks}"] = {"plain": plain, "counts": None if plain else count_step(model, scfg, ctx)}
        return out


def reshard_policy(path: str = "ex07_fsdp.py", predicted: dict | None = None) -> None:
    """07.4: ``shard_model(model, mesh)`` in ``path`` applies the asked policy; ``predicted[B]`` its counts.

    ``predicted[B] = (all-gathers in forward, all-gathers in backward, reduce-scatters)`` per step for
    B = 1, 2, 3 blocks. Verified by counting with ``CommDebugMode`` on 2 ranks, for the learner's
    ``shard_model`` and for :func:`asked_policy`.
    """
    ex, predicted = "07.4 reshard policy", predicted or {}
    for b in (1, 2, 3):
        guess = answered(predicted.get(b), ex, f"predicted[{b}]")
        require(isinstance(guess, (tuple, list)) and len(guess) == 3, ex,
                f"predicted[{b}] = {guess!r}: give (all-gathers forward, all-gathers backward, reduce-scatters)")
        for i, value in enumerate(guess):
            answered(value, ex, f"predicted[{b}][{i}]")
    values = run_worker(ex, policy_worker, path, "shard_model")[0]
    names = ("all-gathers in forward", "all-gathers in backward", "reduce-scatters")
    for b in (1, 2, 3):
        yours, asked = values[f"yours{b}"], values[f"asked{b}"]["counts"]
        if yours["plain"]:
            raise ExerciseError(ex, f"with B = {b}, {yours['plain'][0]} is not sharded (not a DTensor): "
                                    "fully_shard every block, then the root")
        for name, mine, truth in zip(names, yours["counts"], asked):
            require(mine == truth, ex, f"with B = {b} blocks, {name}: your shard_model runs {mine}, the asked "
                                       f"policy {truth}: only the LAST block keeps its parameters "
                                       "(reshard_after_forward=False); the other blocks reshard (True), the root "
                                       "keeps fully_shard's default")
        for name, guess, truth in zip(names, predicted[b], asked):
            require(guess == truth, ex, f"with B = {b} blocks, {name}: {truth} counted, you predicted {guess}: "
                                        "backward gathers again only the units resharded after forward")
    passed(ex, "your policy and your predictions match: per step B + 1 all-gathers forward, B − 1 backward, "
               "B + 1 reduce-scatters (B = 1, 2, 3)")
