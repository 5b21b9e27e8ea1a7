"""Rooflines: the memory-bandwidth roofline of a step's kernels, measured on this machine, and the
points where data, fully sharded and tensor parallelism become communication-bound under an α–β
model of the collectives.

Taught in notebooks/09a_cost_model.ipynb (section 5). The memory roofline follows Williams,
Waterman and Patterson, "Roofline: an insightful visual performance model" (CACM 2009): a kernel
of arithmetic intensity I (FLOPs per byte moved) runs at most at ``min(peak, I × bandwidth)``.
FLOPs as :mod:`mgtutorial.perf.scaling` counts them (2 per multiply-add); bytes are each kernel's
inputs, weights and outputs, read or written once (a lower bound on the traffic).

Units: FLOPs, bytes, seconds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mgtutorial.perf.costmodel import alpha_beta_time
from mgtutorial.perf.timing import time_op

CPU = torch.device("cpu")


def _timed(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls on one thread (the caller's thread count restored)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return min(time_op(fn, CPU, warmup=2, repeats=repeats))
    finally:
        torch.set_num_threads(before)


def memory_bandwidth(sizes: list[int], repeats: int = 20) -> float:
    """A bandwidth roof: bytes per second of the fastest read-and-write stream one thread
    achieves, over float32 buffers of each of ``sizes`` bytes, element-wise kernels of the kind
    a roofline judges (``copy_``, a ReLU written into a preallocated output, ``clamp_min(·, 0,
    out=)``, and ``torch.relu`` allocating its output, as a model's forward does; read + write
    counted), the fastest of ``repeats`` calls each. A roof is a ceiling, so the best of all is
    kept: sizes far beyond the L3 cache give DRAM's roof, sizes well inside it the cache's.
    Raises ValueError for an empty ``sizes`` or fewer than 1 repeat. Taught in
    notebooks/09a_cost_model.ipynb (section 5)."""
    if not sizes or repeats < 1:
        raise ValueError(f"sizes={sizes}, repeats={repeats}: need at least one size and repeat.")
    best = 0.0
    for nbytes in sizes:
        src = torch.ones(nbytes // 4)
        dst = torch.empty_like(src)
        calls = (  # a copy, a ReLU into a preallocated output, a ReLU that allocates its own
            lambda s=src, d=dst: d.copy_(s),
            lambda s=src, d=dst: torch.clamp_min(s, 0, out=d),
            lambda s=src: torch.relu(s),
        )
        for call in calls:
            best = max(best, 2 * nbytes / _timed(call, repeats))
    return best


def l3_bytes() -> int | None:
    """The L3 cache's size in bytes as Linux reports it (sysfs), or None where it does not."""
    try:
        text = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()
    except OSError:
        return None
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def cnn_kernels(model, batch: int, repeats: int = 7) -> list[dict]:
    """The forward kernels of :class:`mgtutorial.common.models.ArticleCNN` on ``batch`` images
    of 3×32×32, each timed alone (fastest of ``repeats``, one thread): dicts of ``name``,
    ``flops``, ``bytes`` (float32 inputs, weights, biases, outputs), ``seconds``, ``intensity``
    (FLOPs per byte) and ``flops_per_s``."""
    x = torch.randn(batch, 3, 32, 32)
    conv = model.conv1(x)
    relu = torch.relu(conv)
    pool = F.max_pool2d(relu, 2)
    flat = pool.flatten(1)
    hid = model.fc1(flat)
    out = model.fc2(hid)
    conv1, fc1, fc2 = model.conv1, model.fc1, model.fc2
    kernels = [  # name, call, FLOPs, tensors read and written (weights and biases included)
        ("conv1", lambda: conv1(x), 2 * conv.numel() * 3 * 25, (x, conv1.weight, conv1.bias, conv)),
        ("relu", lambda: torch.relu(conv), conv.numel(), (conv, relu)),
        ("max_pool", lambda: F.max_pool2d(relu, 2), relu.numel(), (relu, pool)),
        (
            "fc1",
            lambda: fc1(flat),
            2 * batch * fc1.weight.numel(),
            (flat, fc1.weight, fc1.bias, hid),
        ),
        ("fc2", lambda: fc2(hid), 2 * batch * fc2.weight.numel(), (hid, fc2.weight, fc2.bias, out)),
    ]
    rows = []
    with torch.no_grad():
        for name, call, flops, tensors in kernels:
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            seconds = _timed(call, repeats)
            rows.append(
                {
                    "name": name,
                    "flops": flops,
                    "bytes": nbytes,
                    "seconds": seconds,
                    "intensity": flops / nbytes,
                    "flops_per_s": flops / seconds,
                }
            )
    return rows


def ridge(peak_flops: float, bandwidth: float) -> float:
    """The arithmetic intensity (FLOPs/byte) where the roofline bends: ``peak / bandwidth``;
    below it a kernel is memory-bound."""
    return peak_flops / bandwidth


def comm_bound_batch(
    comm_s: float, flops_per_sample: float, peak_flops: float, hidden_share: float = 0.0
) -> float:
    """The per-rank batch below which a step's communication ``comm_s`` (seconds, independent of
    the batch: gradients or parameters) exceeds the compute that can hide it: compute =
    batch × ``flops_per_sample`` / ``peak_flops``; ``hidden_share`` of it lies before the
    communication can start (0: all of it could hide it). Without overlap (gloo on a CPU, where
    the collectives add to the step) the same batch with ``hidden_share=0`` is where
    communication is half the step. Returns ``comm_s / (per-sample time × (1 − hidden_share))``,
    in samples."""
    return comm_s / (flops_per_sample / peak_flops * (1 - hidden_share))


def tp_ratio(hidden: int, tokens: int, tp: int, alpha: float, beta: float, peak: float) -> float:
    """Megatron TP's communication / compute for one MLP block (hidden ``hidden``, 4h inner, on
    ``tokens`` tokens, fp32), forward + backward, under an α–β all-reduce: 2 all-reduces of
    tokens × hidden × 4 bytes against 3 × 2 × tokens × 8h² / tp FLOPs at ``peak``. For many
    tokens it tends to β·peak·tp / (6·h): the tokens cancel, only h and tp move it."""
    comm = 2 * alpha_beta_time(tokens * hidden * 4, alpha, beta)
    compute = 3 * 2 * tokens * 8 * hidden**2 / tp / peak
    return comm / compute
