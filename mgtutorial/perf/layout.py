"""Memory per GPU of a (dp, tp, pp, recompute, attention) layout of a transformer: the model a
layout must fit.

Taught in notebooks/09a_cost_model.ipynb (exercise 09a.3). Pure arithmetic, like
:mod:`mgtutorial.perf.costmodel`, whose dtype table (:class:`~mgtutorial.perf.costmodel.Dtypes`)
prices the parameters, gradients and Adam(W) state (chapter 07a's 16 bytes per parameter with
fp32 gradients), and :class:`mgtutorial.perf.scaling.Transformer`'s Ψ = 12·L·h². Activations
follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(https://arxiv.org/abs/2205.05198), §4, in bytes per layer for a micro-batch of b sequences of s
tokens, 16-bit activations, a heads, tensor-parallel degree t, no sequence parallelism:

* none, eager attention (``softmax(q·kᵀ)·v`` written out, which keeps its s×s probabilities,
  dropout mask and output): ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``;
* none, ``attention="sdpa"`` (``F.scaled_dot_product_attention``'s flash and memory-efficient
  kernels keep only q, k, v, the output and one fp32 logsumexp per row and head; chapter 07a
  measures both): ``s·b·h·(10 + 24/t) + 4·a·s·b/t``, no s² term;
* selective (attention's s²-sized softmax and dropout recomputed; with SDPA, the kernel rerun):
  ``s·b·h·(10 + 24/t)``;
* full (each layer's input kept, the rest recomputed): ``2·s·b·h``.

Data parallelism is DDP's (chapter 02) with ``gradient_as_bucket_view=True`` (the gradients are
views into DDP's buckets; the default keeps a second fp32 copy, 4 more bytes per parameter): each
of the dp replicas holds its parameters, gradients and optimizer state in full; with
``fsdp=True`` FSDP2 (chapter 07b) shards all three over dp. A pipeline of pp stages under 1F1B
(chapter 04b) holds L/pp layers per GPU, and its first stage keeps the activations of pp
micro-batches in flight: L/pp · pp = L layers' worth, whatever pp.

Left out: embeddings and logits, the bf16 working copies of the weights, the working set of a
recomputed layer, temporary buffers, the allocator's fragmentation: an estimate needs a margin.

Units: bytes.
"""

from __future__ import annotations

from typing import Literal, get_args

from mgtutorial.perf.costmodel import BF16_FP32_REDUCE, Dtypes
from mgtutorial.perf.scaling import Transformer

Recompute = Literal["none", "selective", "full"]
"""How much of a layer's forward backward recomputes (chapter 07a, section 5)."""
RECOMPUTE = get_args(Recompute)
Attention = Literal["eager", "sdpa"]
"""Which attention: one that keeps its scores (eager) or ``F.scaled_dot_product_attention``'s
fused kernels, which keep a logsumexp per row instead (chapter 07a, section 5)."""
ATTENTION = get_args(Attention)


def activation_bytes(
    model: Transformer,
    micro_batch: int,
    tp: int,
    recompute: Recompute,
    heads: int,
    attention: Attention = "eager",
) -> float:
    """Bytes of activations one layer keeps for backward (Korthikanti et al. 2022, §4; with
    ``attention="sdpa"`` the scores' term becomes the fused kernel's logsumexp). Raises
    ValueError for an unknown ``recompute`` or ``attention``."""
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: use one of {ATTENTION}.")
    s, b, h, t = model.seq, micro_batch, model.hidden, tp
    scores = 5 * heads * s / t if attention == "eager" else 4 * heads / t  # bytes per token
    per_token = {"none": h * (10 + 24 / t) + scores, "selective": h * (10 + 24 / t), "full": 2 * h}
    if recompute not in per_token:
        raise ValueError(f"recompute={recompute!r}: use one of {RECOMPUTE}.")
    return s * b * per_token[recompute]


def check_layout(model: Transformer, gpus: int, dp: int, tp: int, pp: int, heads: int) -> None:
    """Raises ValueError for a layout that cannot run: dp·tp·pp ≠ gpus, tp not dividing the
    heads, pp not dividing the layers."""
    if dp * tp * pp != gpus or min(dp, tp, pp) < 1:
        raise ValueError(f"dp·tp·pp = {dp}·{tp}·{pp} = {dp * tp * pp}: must equal {gpus} GPUs.")
    if heads % tp:
        raise ValueError(f"tp = {tp} does not divide the {heads} heads: pick a divisor.")
    if model.layers % pp:
        raise ValueError(f"pp = {pp} does not divide the {model.layers} layers: pick a divisor.")


def memory_per_gpu(
    model: Transformer,
    dp: int,
    tp: int,
    pp: int,
    recompute: Recompute = "none",
    micro_batch: int = 1,
    *,
    heads: int,
    dtypes: Dtypes = BF16_FP32_REDUCE,
    fsdp: bool = False,
    attention: Attention = "eager",
) -> dict[str, float]:
    """Bytes one GPU holds for a layout: ``{"params", "grads", "optimizer", "activations",
    "total"}``. Parameters, gradients and Adam(W) state: Ψ/(tp·pp) per GPU (also ÷ dp with
    ``fsdp``), at ``dtypes.per_param`` bytes each; activations: L layers' worth of
    :func:`activation_bytes` (1F1B's first stage) for that ``attention``. Raises ValueError for
    an unknown recompute or attention."""
    shard = model.params / (tp * pp * (dp if fsdp else 1))
    out = {k: shard * n for k, n in zip(("params", "grads", "optimizer"), dtypes.per_param)}
    out["activations"] = model.layers * activation_bytes(
        model, micro_batch, tp, recompute, heads, attention
    )
    out["total"] = sum(out.values())
    return out
