"""What tensor parallelism moves in one training step, against data parallelism, from the sizes of
the block of :mod:`mgtutorial.tensor_parallel.transformer` (pure arithmetic, no process).

Taught in notebooks/08b_tp_mesh_and_cost.ipynb (section 2, and exercise 09b.3); the link speeds and
peak FLOP/s it is compared with are :data:`mgtutorial.perf.costmodel.H100`'s, and the bytes per
element come from the course's one dtype table, :class:`mgtutorial.perf.costmodel.Dtypes`.
"""

from __future__ import annotations

from mgtutorial.perf.costmodel import BF16_FP32_REDUCE, Dtypes


def comm_bytes(
    b: int,
    s: int,
    h: int,
    ffn: int,
    tp: int,
    layers: int = 1,
    elem: int | None = None,
    dtypes: Dtypes = BF16_FP32_REDUCE,
) -> dict:
    """What one training step moves, from the sizes; bytes per element from ``dtypes`` (default:
    bf16 activations, fp32 gradients, as chapter 07's ``reduce_dtype=float32`` and DDP under
    autocast), or ``elem`` for every tensor if given.

    TP: per block, one all-reduce of a ``(b, s, h)`` activation after attention and one after the
    MLP in forward, two more in backward: ``tp_forward = 2·b·s·h·act·layers``. DDP: one all-reduce
    of every gradient per step: ``ddp_step = params·grad``. A ring all-reduce sends
    ``2·(n − 1)/n`` times the tensor's bytes from each rank (``*_per_rank``).

    Returns {"tp_forward", "tp_step", "tp_step_per_rank", "ddp_step": bytes, "params": the block's
    parameter count times ``layers``}.
    """
    act, grad = elem or dtypes.nbytes("activations"), elem or dtypes.nbytes("grads")
    params = layers * (4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h)
    tp_forward = 2 * b * s * h * act * layers
    return {
        "tp_forward": tp_forward,
        "tp_step": 2 * tp_forward,
        "ddp_step": params * grad,
        "params": params,
        "tp_step_per_rank": 2 * tp_forward * 2 * (tp - 1) // tp,
    }
