"""Checker of exercise 08b.2 (notebooks/08b_tp_mesh_and_cost.ipynb): predict the all-reduces of
the vocabulary-parallel loss (section 4) at another size, and the logit bytes one rank holds,
before the ranks count them. Reached as ``ex.ch08.loss_bytes``.
"""

from __future__ import annotations

from mgtutorial.exercises._answers import entry, is_int
from mgtutorial.exercises._common import passed, require, run_ranks
from mgtutorial.runtime import env
from mgtutorial.tensor_parallel import config, loss

EX = "08b.2 the bytes of loss parallelism"
SIZES = dict(h=32, n_heads=8, batch=3, seq=4)
"""The size the learner predicts for, on 2 ranks."""
VOCAB = 40
"""The vocabulary: unlike h, so that an activation's bytes and the logits' bytes differ."""
LOGITS = {
    "local_logit_bytes": "how many logits does each token have, which dimension of the logits "
    "is sharded, and into how many parts?",
    "full_logit_bytes": "the whole logits are not sharded: how many tokens are there, how many "
    "logits does each have, and how many bytes is one float32?",
}
"""Each logit count → its hint when the prediction is wrong."""


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
    pairs = entry(predicted, "all_reduce_bytes", EX, (list, tuple), "a list of [in, out] pairs")
    require(
        all(isinstance(p, (list, tuple)) and len(p) == 2 and all(map(is_int, p)) for p in pairs),
        EX,
        f"predicted['all_reduce_bytes'] is {pairs!r}: give a list of [bytes in, bytes out], one "
        "pair of ints per all-reduce, in the order they run",
    )
    guess = {k: entry(predicted, k, EX, int, "an int (bytes)") for k in LOGITS}
    cfg = config.TPConfig(**SIZES, backend="gloo")
    v = run_ranks(EX, loss_worker, cfg, 2, name="loss_bytes").values[0]
    got, mine = v["bytes"]["all_reduce"], [list(p) for p in pairs]
    require(
        len(mine) == len(got),
        EX,
        f"you predicted {len(mine)} all-reduces; the loss ran a different number: which tensors "
        "cross the ranks, in forward (the embedding's output; the cross-entropy's per-token "
        "numbers) and in backward (section 4)?",
    )
    for k, (want, have) in enumerate(zip(got, mine), start=1):
        require(
            want == have,
            EX,
            f"you predicted {have} bytes for all-reduce {k} of {len(got)}; it moved other "
            "numbers: which tensor is it, of which shape, (b, s, h) or (b, s), and how wide is "
            "float32?",
        )
    for key, hint in LOGITS.items():
        said = f"you predicted {key} = {guess[key]}"
        require(
            guess[key] * 4 != v[key],  # the logits counted, not their bytes
            EX,
            f"{said}: a number of logits, not of bytes: how many bytes does one float32 take?",
        )
        require(guess[key] == v[key], EX, f"{said}; the ranks hold a different number: {hint}")
    passed(
        EX,
        f"{len(got)} all-reduces of {got[0][0]} and {got[1][0]} bytes; a rank holds "
        f"{v['local_logit_bytes']} of the {v['full_logit_bytes']} logit bytes",
    )
