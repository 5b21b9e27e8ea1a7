"""Checkers of chapter 10a's exercises (notebooks/10a_context_parallel.ipynb): the online-softmax
merge of two blocks (10a.1) and the smallest context-parallel degree for a context length and a
memory budget (10a.2).

10a.1 compares the learner's merge with ``scaled_dot_product_attention`` over both blocks at once;
10a.2 with :func:`mgtutorial.context_expert.attention_cost.layer_activation_bytes`. No hint prints
the expected answer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mgtutorial.context_expert import attention_cost
from mgtutorial.context_expert.online_softmax import block_attention, visible
from mgtutorial.exercises._common import answered, attempt, passed, require

# --- 10a.1 --------------------------------------------------------------------------------------


def _blocks(causal: bool, seed: int, size: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    q = q * size  # size 100: scores in the hundreds, past float32's exp (inf beyond 88)
    pos = torch.arange(6)
    halves = [
        block_attention(q, k[..., i, :], v[..., i, :], visible(pos, pos[i], causal), 0.5)
        for i in (slice(0, 3), slice(3, 6))
    ]
    return halves, F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.5)


def combine(fn) -> None:
    """10a.1: ``fn(o1, lse1, o2, lse2) -> (o, lse)`` merges two partial attentions of the same
    queries over two key blocks; checked non-causal, causal (where the queries of the first
    block see none of the second block's keys: ``lse2 = −inf`` there) and with scores in the
    hundreds (``exp(lse)`` overflows float32: the merge must stay in logs)."""
    ex = "10a.1 combine"
    for causal, size in ((False, 1.0), (True, 1.0), (False, 100.0)):
        halves, want = _blocks(causal, seed=int(causal), size=size)
        (o1, l1), (o2, l2) = halves
        got = attempt(ex, fn, o1.clone(), l1.clone(), o2.clone(), l2.clone())
        require(
            isinstance(got, tuple) and len(got) == 2,
            ex,
            "return a pair (o, lse): the merged output and its log-sum-exp",
        )
        o, lse = got
        require(o.shape == o1.shape and lse.shape == l1.shape, ex, "o and lse keep their shapes")
        if causal and o.isnan().any():
            require(
                False,
                ex,
                "NaN where a query sees no key of block 2 (lse2 = −inf): exp(−inf − (−inf)) is "
                "NaN; weight each block by exp(lseᵢ − lse) with lse the merged one, which is "
                "finite",
            )
        if size > 1 and not (o.isfinite().all() and lse.isfinite().all()):
            require(
                False,
                ex,
                "inf or NaN with large scores: exp(lse) overflows float32 beyond 88; never "
                "exponentiate an lse alone, only differences (torch.logaddexp, exp(lseᵢ − lse))",
            )
        if not torch.allclose(torch.logaddexp(l1, l2), lse, atol=1e-5, rtol=1e-5):
            require(
                False, ex, "lse is wrong: the merged denominator is exp(lse1) + exp(lse2), in logs"
            )
        if not torch.allclose(o, want, atol=1e-5):
            require(
                False,
                ex,
                "o is wrong: each block's output was normalised by its own denominator; weight "
                "it by its share of the total, exp(lseᵢ − lse)",
            )
    passed(ex, "your merge of two blocks == softmax over all keys (non-causal, causal, large)")


# --- 10a.2 --------------------------------------------------------------------------------------

MODEL = dict(layers=32, h=4096, heads=32, seq=131072, b=1, tp=8)
"""10a.2's model and job: a Llama-2-7B-sized stack at a 128k-token context, tp = 8."""
BUDGET = 20e9
"""Bytes of activations one GPU may hold in 10a.2."""


def activations(cp: int, flash: bool) -> float:
    """Activation bytes per GPU of 10a.2's whole stack at context-parallel degree ``cp``."""
    m = MODEL
    per_layer = attention_cost.layer_activation_bytes(
        m["seq"], m["b"], m["h"], m["heads"], m["tp"], cp, flash
    )
    return m["layers"] * per_layer


def smallest_cp(answer: dict) -> None:
    """10a.2: ``answer = {"flash": cp, "materialised": cp}``, the smallest power-of-two cp whose
    activations (:func:`activations`) fit in :data:`BUDGET`, with and without flash attention."""
    ex = "10a.2 smallest cp"
    for key in ("flash", "materialised"):
        cp = answered(answer.get(key), ex, f'answer["{key}"]')
        require(
            isinstance(cp, int) and cp >= 1 and cp & (cp - 1) == 0,
            ex,
            f'answer["{key}"] = {cp!r}: cp is a power of two (it must divide 2·cp chunks of '
            f"{MODEL['seq']} tokens)",
        )
        flash = key == "flash"
        gb = activations(cp, flash) / 1e9
        require(
            gb <= BUDGET / 1e9,
            ex,
            f'answer["{key}"] = {cp}: one GPU then holds {gb:.1f} GB of activations, over the '
            f"{BUDGET / 1e9:.0f} GB budget",
        )
        require(
            cp == 1 or activations(cp // 2, flash) > BUDGET,
            ex,
            f'answer["{key}"] = {cp}: half of it fits too; the smallest degree is asked for',
        )
    passed(
        ex,
        "with flash attention a few ranks hold 128k tokens; with the score matrix materialised, "
        "about a thousand",
    )
