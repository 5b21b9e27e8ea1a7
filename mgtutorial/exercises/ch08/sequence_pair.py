"""Checker of exercise 08a.2 (notebooks/08a_tensor_parallel.ipynb): the sequence-parallel pair
of operators written as ``torch.autograd.Function``s, reached as ``ex.ch08.sequence_pair``.

``GatherFromSeq`` all-gathers the tokens in forward (``(b, s / tp, h) → (b, s, h)``) and
reduce-scatters the gradient in backward; ``ScatterToSeq`` reduce-scatters in forward (sum the
partial outputs, keep this rank's tokens) and all-gathers the gradient in backward. They take
the places of f and g in the chapter's hand-split MLP
(:class:`mgtutorial.tensor_parallel.fg.HandTPMLP`), and the result is compared in each rank with
the unsplit MLP (one process) and with the library's sequence-parallel split of the same MLP
(``parallelize_module`` with ``ColwiseParallel(input_layouts=Shard(1))`` and
``RowwiseParallel(output_layouts=Shard(1))``), collectives counted. Follows
Megatron-LM's ``_GatherFromSequenceParallelRegion`` and ``_ReduceScatterToSequenceParallelRegion``
(megatron/core/tensor_parallel/mappings.py) and PyTorch's
test/distributed/tensor/parallel/test_tp_style.py.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch.nn import functional as F

from mgtutorial.exercises._common import (
    ExerciseError,
    FileWorkerConfig,
    import_file,
    passed,
    require,
    run_ranks,
)
from mgtutorial.runtime import env
from mgtutorial.tensor_parallel import config, fg
from mgtutorial.tensor_parallel.transformer import MLP
from mgtutorial.tensor_parallel.worker import forward_backward

EX = "08a.2 the sequence-parallel pair"
TOL = 1e-5
CLASSES = ("GatherFromSeq", "ScatterToSeq")


def hand_forward(m: fg.HandTPMLP, x: torch.Tensor, gather, scatter) -> torch.Tensor:
    """``HandTPMLP``'s forward with the pair in place of f and g: ``(b, s / tp, h)`` in and out."""
    x = gather.apply(x, m.group)  # (b, s, h): all of the tokens
    local = F.gelu(F.linear(x, m.w1, m.b1))  # (b, s, ffn / tp)
    return scatter.apply(F.linear(local, m.w2), m.group) + m.b2  # this rank's tokens, summed


def library_mlp(ref: MLP, mesh):
    """The library's sequence-parallel split of ``ref`` (a copy) over ``mesh``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    return parallelize_module(copy.deepcopy(ref), mesh, plan)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.shape == b.shape else float("inf")


def pair_worker(cfg: FileWorkerConfig) -> dict:
    """Rank-side: the hand-split MLP with the learner's pair on this rank's ``s / tp`` tokens,
    against the unsplit MLP and the library's split, on the same input.

    Returns {"hand", "library": {"output", "x.grad", "w1", "b1", "w2", "b2": max |split −
    unsplit|}, with b2's gradient summed over the ranks first (each rank's holds its tokens'
    share)}, "shape" (the hand output's shape), "own_tokens" (max |hand output − the unsplit
    output's tokens of this rank, had the partial sums not been summed|), "counts" and
    "library_counts" ({"forward", "backward": {collective: calls}}), or {"error": …} when the
    learner's pair fails in forward or backward."""
    from torch.distributed.device_mesh import init_device_mesh

    module = import_file(cfg.path)
    gather, scatter = (getattr(module, name) for name in CLASSES)
    with env.distributed(cfg.backend) as ctx:
        r, tp = ctx.rank, ctx.world_size
        tp_cfg = config.TPConfig()
        env.seed_everything(tp_cfg.seed)
        ref = MLP(tp_cfg.h, tp_cfg.ffn).to(ctx.device)
        x, dy = (t.to(ctx.device) for t in config.inputs(tp_cfg))
        want, want_dx, _ = forward_backward(ref, x, dy)

        def mine(t):  # this rank's s / tp tokens
            return t.chunk(tp, dim=1)[r]

        mesh = init_device_mesh(ctx.device.type, (tp,))
        lib = library_mlp(ref, mesh)
        lib_out, lib_dx, lib_counts = forward_backward(lib, mine(x), mine(dy))
        library = {"output": _diff(lib_out, mine(want)), "x.grad": _diff(lib_dx, mine(want_dx))}
        for name, p in lib.named_parameters():
            library[name] = _diff(p.grad.full_tensor(), ref.get_parameter(name).grad)

        split = fg.HandTPMLP(ref, r, tp, group=torch.distributed.new_group(list(range(tp))))
        try:
            out, dx, counts = forward_backward(
                lambda t: hand_forward(split, t, gather, scatter), mine(x), mine(dy)
            )
        except Exception as e:  # the learner's pair: report it, do not fail the rank
            return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        torch.distributed.all_reduce(split.b2.grad)  # each rank's share: its tokens' gradient
        hand = {"output": _diff(out, mine(want)), "x.grad": _diff(dx, mine(want_dx))}
        for name, p in split.named_parameters():
            full = ref.get_parameter(fg.unsplit_name(name)).grad
            hand[name] = _diff(p.grad, fg.hand_shard(name, full, r, tp))
        partial = F.linear(F.gelu(F.linear(x, split.w1, split.b1)), split.w2) + split.b2
        return {
            "hand": hand,
            "library": library,
            "shape": list(out.shape),
            "own_tokens": _diff(out, mine(partial)),
            "counts": {k: counts[k] for k in ("forward", "backward")},
            "library_counts": {k: lib_counts[k] for k in ("forward", "backward")},
        }


def sequence_pair(path: str = "ex08a_sp.py") -> None:
    """08a.2: ``GatherFromSeq`` and ``ScatterToSeq`` in ``path``, ``torch.autograd.Function``s
    called as ``Op.apply(x, group)``. Run in place of f and g in ``HandTPMLP`` on 2 gloo ranks,
    each rank given its ``s / tp`` tokens: the output (this rank's tokens), the input's gradient
    and every parameter's gradient must equal the unsplit MLP's (one process) and the library's
    sequence-parallel split, with the library's collectives: 1 all-gather and 1 reduce-scatter in
    forward, the same in backward."""
    for cls in CLASSES:
        op = getattr(import_file(path, EX), cls, None)
        require(
            isinstance(op, type) and issubclass(op, torch.autograd.Function),
            EX,
            f"{path} defines no torch.autograd.Function `{cls}`",
        )
    cfg = FileWorkerConfig(path=str(Path(path).resolve()), function="", backend="gloo")
    values = run_ranks(EX, pair_worker, cfg, 2, name="sequence_pair").values
    for rank, v in sorted(values.items()):
        _check_rank(rank, v)
    passed(
        EX,
        "your pair splits the MLP over the tokens: output and every gradient == one process "
        "and == DTensor's split, 1 all-gather + 1 reduce-scatter each way, as the library's",
    )


def _check_rank(rank: int, v: dict) -> None:
    if "error" in v:
        raise ExerciseError(
            EX,
            f"rank {rank}: your pair fails in forward or backward ({v['error']}): backward "
            "returns one gradient per input of forward (x, group), each of that input's shape; "
            "what shape did each operator receive?",
        )
    lib = v["library"]
    require(
        max(lib.values()) <= TOL,
        EX,
        f"rank {rank}: the library's split differs from one process ({lib}): a problem of this "
        "installation of torch, not of your pair",
    )
    hand = v["hand"]
    require(
        v["shape"] == [2, 4, 16],
        EX,
        f"rank {rank}: your output has shape {tuple(v['shape'])}, not this rank's tokens "
        "(2, 4, 16): GatherFromSeq returns every rank's tokens along the sequence (dim 1), "
        "ScatterToSeq keeps this rank's s / tp of them",
    )
    require(
        hand["output"] <= TOL or v["own_tokens"] > TOL,
        EX,
        f"rank {rank}: your output is this rank's partial sum alone: ScatterToSeq must add "
        "the partial outputs of all ranks in forward, then keep this rank's tokens",
    )
    require(
        hand["output"] <= TOL,
        EX,
        f"rank {rank}: your output differs from one process's by up to {hand['output']:.2g}: "
        "are the tokens gathered in rank order, and each rank's share the same chunk of dim 1?",
    )
    wrong = sorted(k for k in ("w1", "b1", "w2", "b2") if hand[k] > TOL)
    require(
        not wrong,
        EX,
        f"rank {rank}: output right, but the gradients of {wrong} differ from one process's: "
        "look at ScatterToSeq's backward: which of w2's output tokens need a gradient on this "
        "rank, and where are those gradients?",
    )
    require(
        hand["x.grad"] <= TOL,
        EX,
        f"rank {rank}: output and weight gradients right, but the gradient of this rank's "
        f"tokens differs by up to {hand['x.grad']:.2g}: look at GatherFromSeq's backward: "
        "every rank used your tokens, so which ranks' gradients hold a share of theirs, and how "
        "do you combine them?",
    )
    for phase in ("forward", "backward"):
        got, want = v["counts"][phase], v["library_counts"][phase]
        require(
            got == want,
            EX,
            f"rank {rank}: right results, but {phase} ran {got or 'no collectives'}, where "
            f"DTensor's split runs {want}: a reduce-scatter returns only this rank's part, "
            "which an all-reduce followed by a chunk computes in full on every rank",
        )
