"""Checker of exercise 08b.2 (notebooks/08b_tp_mesh_and_cost.ipynb): predict the all-reduces of
the vocabulary-parallel loss (section 4) at another size, and the logit bytes one rank holds,
before the ranks count them. Reached as ``ex.ch08.loss_bytes``.
"""

from __future__ import annotations

from mgtutorial.exercises._common import answered, passed, require, run_ranks
from mgtutorial.runtime import env
from mgtutorial.tensor_parallel import config, loss

EX = "08b.2 the bytes of loss parallelism"
SIZES = dict(h=32, n_heads=8, batch=3, seq=4)
"""The size the learner predicts for, on 2 ranks."""
VOCAB = 40
"""The vocabulary: unlike h, so that an activation's bytes and the logits' bytes differ."""


def loss_worker(cfg: config.TPConfig) -> dict:
    """Rank-side: :func:`mgtutorial.tensor_parallel.loss.check_loss_parallel` over a 1-D mesh of
    all ranks (it asserts the split loss and gradients equal one process's)."""
    from torch.distributed.device_mesh import init_device_mesh

    with env.distributed(cfg.backend) as ctx:
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        return loss.check_loss_parallel(cfg, ctx, mesh, vocab=VOCAB)


def loss_bytes(predicted: dict) -> None:
    """08b.2: ``predicted`` = {"all_reduce_bytes": [[bytes in, bytes out] of each all-reduce of the
    vocabulary-parallel model's forward, loss and backward, in order], "local_logit_bytes": the
    float32 logits one rank holds (int), "full_logit_bytes": the same gathered whole (int)} for
    ``TPConfig(h=32, n_heads=8, batch=3, seq=4)`` and a vocabulary of :data:`VOCAB` (40) on 2
    ranks.

    Runs :func:`loss_worker` on 2 gloo ranks and compares with what ``CommDebugMode`` recorded."""
    guess = {
        k: answered(predicted.get(k), EX, f'predicted["{k}"]')
        for k in ("all_reduce_bytes", "local_logit_bytes", "full_logit_bytes")
    }
    pairs = guess["all_reduce_bytes"]
    require(
        isinstance(pairs, (list, tuple))
        and all(isinstance(p, (list, tuple)) and len(p) == 2 and ... not in p for p in pairs),
        EX,
        f'predicted["all_reduce_bytes"] is {pairs!r}: give a list of [bytes in, bytes out], one '
        "pair of ints per all-reduce, in the order they run",
    )
    cfg = config.TPConfig(**SIZES, backend="gloo")
    v = run_ranks(EX, loss_worker, cfg, 2, name="loss_bytes").values[0]
    got, mine = v["bytes"]["all_reduce"], [list(p) for p in guess["all_reduce_bytes"]]
    require(
        len(mine) == len(got),
        EX,
        f"the loss did not run {len(mine)} all-reduces: which tensors cross the ranks, in "
        "forward (the embedding's output; the cross-entropy's per-token numbers) and in "
        "backward (section 4)?",
    )
    for k, (want, have) in enumerate(zip(got, mine), start=1):
        require(
            want == have,
            EX,
            f"all-reduce {k} of {len(got)} did not move {have} bytes in and out: which tensor "
            "is it, of which shape, (b, s, h) or (b, s), and how wide is float32?",
        )
    for key in ("local_logit_bytes", "full_logit_bytes"):
        require(
            guess[key] == v[key],
            EX,
            f"{key} is not {guess[key]}: how many logits does each token have, which dimension "
            "of the logits is sharded, and into how many parts?",
        )
    passed(
        EX,
        f"{len(got)} all-reduces of {got[0][0]} and {got[1][0]} bytes; a rank holds "
        f"{v['local_logit_bytes']} of the {v['full_logit_bytes']} logit bytes",
    )
