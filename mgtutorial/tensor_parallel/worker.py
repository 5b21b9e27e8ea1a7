"""Chapter 08's 1-D worker: one transformer block split over all ranks (tp = world size), by hand
(:mod:`mgtutorial.tensor_parallel.fg`) and with DTensor plans
(:mod:`mgtutorial.tensor_parallel.plans`, sequence parallelism included), each split checked in
the rank against the unsplit block with every collective counted; then the pitfalls
(:mod:`mgtutorial.tensor_parallel.pitfalls`) on the same mesh.

Taught in notebooks/08a_tensor_parallel.ipynb (sections 2–5) and
notebooks/08b_tp_mesh_and_cost.ipynb (its first run; sections 3 and 4). Follows
https://pytorch.org/docs/stable/distributed.tensor.parallel.html and
https://pytorch.org/docs/stable/distributed.tensor.html#debugging (``CommDebugMode``, through
:func:`mgtutorial.common.compare.counted`). Started from a notebook on two ranks with
``launch(worker.worker, config.TPConfig(), 2)``.
"""

from __future__ import annotations

import copy

import torch

from mgtutorial.common import compare
from mgtutorial.runtime import env
from mgtutorial.tensor_parallel import fg, loss, pitfalls, plans
from mgtutorial.tensor_parallel.config import TPConfig, check, inputs
from mgtutorial.tensor_parallel.transformer import Block

TOL = dict(rtol=1e-5, atol=1e-5)
"""How close a split must come to the unsplit block (float32, a different order of summation)."""

PLANS = (
    ("dtensor", False, True),
    ("dtensor_unprepared", False, False),
    ("sequence_parallel", True, True),
)
"""The DTensor splits checked: (name, ``sequence_parallel``, ``prepare_inputs``) of
:func:`mgtutorial.tensor_parallel.plans.tp_plan`."""


def forward_backward(module, x: torch.Tensor, dy: torch.Tensor):
    """Forward and backward of ``(module(x) · dy).sum()``, each counted.

    Returns (output, gradient of ``x``, {"forward", "backward": {collective: calls}, "bytes":
    {collective: [[bytes in, bytes out], …]} of each forward call, in order}).
    """
    out, fwd, sizes = compare.counted(module, x := x.clone().requires_grad_())
    _, bwd, _ = compare.counted(lambda: (out * dy).sum().backward())
    return out.detach(), x.grad, {"forward": fwd, "backward": bwd, "bytes": sizes}


def placement_names(t) -> list[str]:
    """``["Shard(dim=0)", …]``: a DTensor's placements, one per mesh dimension; ``[]`` otherwise."""
    return [repr(pl) for pl in getattr(t, "placements", ())]


def check_hand_split(unsplit, split, x, dy, rank: int, tp: int) -> tuple[dict, torch.Tensor]:
    """Run ``unsplit`` and its hand split on the same ``x`` and ``dy``; the output, the input's
    gradient and each parameter's gradient (the matching slice of the unsplit one) must agree
    (``assert_close``: a mismatch raises ``AssertionError`` in the rank).

    Returns ({"counts", "fg_counts" (the all-reduces counted by :func:`fg.all_reduce`), "max_diff"},
    the split's output). Leaves ``unsplit`` without gradients.
    """
    want, want_dx, _ = forward_backward(unsplit, x, dy)
    fg.COUNTS.clear()
    out, dx, counts = forward_backward(split, x, dy)
    got, expected = [out, dx], [want, want_dx]
    for name, p in split.named_parameters():
        got.append(p.grad)
        full = unsplit.get_parameter(fg.unsplit_name(name)).grad
        expected.append(fg.hand_shard(name, full, rank, tp))
    compare.all_close(zip(got, expected), **TOL)
    result = {
        "counts": counts,
        "fg_counts": dict(fg.COUNTS),
        "max_diff": compare.max_abs_diff(got, expected),
    }
    unsplit.zero_grad()
    return result, out


def check_plan(ref: Block, want, mesh, x, dy, sp: bool, prepare: bool, hand_out=None) -> dict:
    """Parallelize a copy of ``ref`` over the 1-D ``mesh`` (:func:`plans.apply_tp` with
    ``sequence_parallel=sp``, ``prepare_inputs=prepare``) and compare its output, input gradient
    and every parameter's gradient with ``want`` = (output, input gradient) and ``ref``'s
    gradients, and with ``hand_out`` (the hand-split output) when given. Under sequence
    parallelism the input and output are this rank's ``s / tp`` tokens.

    Returns {"counts", "max_diff", "norm_grad" (``attn_norm.weight.grad``'s placements:
    ``Partial(sum)`` under sequence parallelism), "placements" {parameter: [class, placements,
    local shape]}}.
    """
    rank, tp = mesh.get_local_rank(), mesh.size()
    block = plans.apply_tp(copy.deepcopy(ref), mesh, sp, prepare)
    block.zero_grad()
    part = (lambda t: t.chunk(tp, dim=1)[rank]) if sp else (lambda t: t)
    out, dx, counts = forward_backward(block, part(x), part(dy))
    got, expected = [out, dx], [part(want[0]), part(want[1])]
    for name, p in block.named_parameters():
        got.append(p.grad)
        expected.append(ref.get_parameter(name).grad)
    if hand_out is not None:
        got.append(out)
        expected.append(hand_out)
    compare.all_close(zip(got, expected), **TOL)
    return {
        "counts": counts,
        "max_diff": compare.max_abs_diff(got, expected),
        "norm_grad": placement_names(block.attn_norm.weight.grad),
        "placements": {
            name: [
                type(p).__name__,
                placement_names(p),
                list(p.to_local().shape if hasattr(p, "to_local") else p.shape),
            ]
            for name, p in block.named_parameters()
        },
    }


def worker(cfg: TPConfig) -> dict:
    """Split one :class:`~mgtutorial.tensor_parallel.transformer.Block` over all ranks, by hand and
    with DTensor plans, and check each split against the unsplit block in the rank.

    Returns per split: ``hand_mlp``, ``hand_attention``, ``hand_block`` (see
    :func:`check_hand_split`), ``dtensor``, ``dtensor_unprepared``, ``sequence_parallel`` (see
    :func:`check_plan`); ``counts`` are {"forward", "backward": {collective: calls}, "bytes"} from
    ``CommDebugMode``, ``max_diff`` the largest |difference| of outputs, input gradient and
    parameter gradients. Then, with ``cfg.extras``, ``pitfalls``: see
    :func:`mgtutorial.tensor_parallel.pitfalls.pitfalls`; ``loss_parallel``: see
    :func:`mgtutorial.tensor_parallel.loss.check_loss_parallel`.

    Raises:
        ValueError: sizes the world size cannot split
            (:func:`mgtutorial.tensor_parallel.config.check`).
        AssertionError: a split differs from the unsplit block.
    """
    from torch.distributed.device_mesh import init_device_mesh

    with env.distributed(cfg.backend) as ctx:
        r, n = ctx.rank, ctx.world_size
        check(cfg, n)
        env.seed_everything(cfg.seed)
        ref = Block(cfg.h, cfg.n_heads, cfg.ffn).to(ctx.device)
        x, dy = (t.to(ctx.device) for t in inputs(cfg))
        results = {}
        hand = {
            "hand_mlp": (ref.mlp, fg.HandTPMLP(ref.mlp, r, n)),
            "hand_attention": (ref.attn, fg.HandTPAttention(ref.attn, r, n)),
            "hand_block": (ref, fg.HandTPBlock(ref, r, n)),
        }
        for name, (unsplit, split) in hand.items():
            results[name], hand_out = check_hand_split(unsplit, split, x, dy, r, n)
        want = forward_backward(ref, x, dy)[:2]  # and ref keeps the unsplit block's gradients
        mesh = init_device_mesh(ctx.device.type, (n,), mesh_dim_names=("tp",))
        for name, sp, prepare in PLANS:
            results[name] = check_plan(
                ref, want, mesh, x, dy, sp, prepare, None if sp else hand_out
            )
        if cfg.extras:
            results["pitfalls"] = pitfalls.pitfalls(cfg, ctx, mesh)
            results["loss_parallel"] = loss.check_loss_parallel(cfg, ctx, mesh)
        return results
