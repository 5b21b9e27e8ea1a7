"""Checker of exercise 09b.3 (notebooks/09b_measurement.ipynb): the TP degree at which one
block's forward communication outgrows its matmuls, on DGX H100 nodes (NVLink inside a node)
and on the same nodes with their GPUs linked by PCIe instead, with the arithmetic of chapter
08's section 7 (:func:`mgtutorial.tensor_parallel.cost.comm_bytes`) and the course's one model
of the links, :meth:`mgtutorial.perf.costmodel.Hardware.ring_bw` (chapter 09a).
"""

from __future__ import annotations

import dataclasses

from mgtutorial.exercises._common import answered, attempt, close, passed, require
from mgtutorial.perf import costmodel
from mgtutorial.tensor_parallel import cost

PCIE_BW = 64e9
"""PCIe Gen5 x16, bytes/s per direction: 32 GT/s × 16 lanes ÷ 8 bits (an assumption of 09b.3)."""
NODES = {
    "dgx_h100": costmodel.H100,
    "pcie": dataclasses.replace(costmodel.H100, intra_bw=PCIE_BW),
}
"""09b.3's clusters: DGX H100 nodes (NVLink, 450 GB/s per direction inside a node) and the same
nodes with the GPUs linked by PCIe Gen5 x16 (:data:`PCIE_BW`) instead of NVLink."""
LINKS = {"nvlink": costmodel.H100.intra_bw, "infiniband": costmodel.H100.inter_bw}
"""The bandwidths ``ratio`` is checked at (B/s per direction): NVLink 4, one NDR port."""
N_HEADS = 96
"""09b.3's head count (GPT-3: 96 heads of 128 features, h = 12288): a TP degree must divide it."""


def reference_ratio(tp_degree: int, link_bw: float) -> float:
    """Chapter 08 section 7's ratio: one block's forward communication per rank over ``link_bw``
    (B/s) / its matmuls at ``costmodel.H100.peak_flops``."""
    s, h = 2048, 12288
    big = cost.comm_bytes(b=1, s=s, h=h, ffn=4 * h, tp=tp_degree, elem=2)
    comm_s = big["tp_forward"] * 2 * (tp_degree - 1) / tp_degree / link_bw
    return comm_s / (2 * big["params"] * s / tp_degree / costmodel.H100.peak_flops)


def _check_ratio(ex: str, ratio) -> None:
    peak = costmodel.H100.peak_flops
    for bw in (*LINKS.values(), 4e11):
        for n in (8, 2, 3, 4, 16, 24):
            got, want = attempt(ex, ratio, n, bw), reference_ratio(n, bw)
            if close(got, want, rel=1e-6):
                continue
            fixes = [  # (factor that would make the learner's ratio right, what it forgot)
                (
                    2 * (n - 1) / n,
                    "a ring all-reduce does not send the tensor once from each rank: how much "
                    "does each rank send (chapter 08, section 7)?",
                ),
                (n, "does each rank compute all the matmuls of the block?"),
                (
                    2 * (n - 1),
                    "two things: what a ring all-reduce sends from each rank, and what share of "
                    "the matmuls each rank computes",
                ),
                (989 / 990, f"take the peak from costmodel.H100.peak_flops ({peak:.4g} FLOP/s)"),
                (
                    LINKS["nvlink"] / bw,
                    "divide by link_bw, the link asked for, not a fixed NVLink bandwidth",
                ),
            ]
            why = next(
                (text for k, text in fixes if close(got * k, want, rel=1e-6)),
                "compare with chapter 08's section 7",
            )
            direction = "too large" if got > want else "too small"
            require(False, ex, f"ratio({n}, {bw:.3g}) = {got:.3g} is {direction}: {why}")


SHARE = 0.5
"""09b.3's bound: communication at most half the weight matmuls' time (far from any crossing of
the divisors' ratios, so the 3 % the attention-score matmuls would add cannot move the answer)."""


def crossover(ratio, largest_tp: dict | None = None) -> None:
    """09b.3: ``ratio(tp, link_bw) -> float`` (communication / compute of one block's forward at
    the GPT-3-like size of chapter 08's section 7, ``link_bw`` in B/s, peak
    ``costmodel.H100.peak_flops``, weight matmuls only) and ``largest_tp`` = {"dgx_h100",
    "pcie": int}, per cluster of :data:`NODES` the largest TP degree n dividing
    :data:`N_HEADS` with ``ratio(n, hw.ring_bw(n)) <= SHARE``. ``ratio`` is compared with the
    section's arithmetic at tp = 2, 3, 4, 8, 16, 24 and three bandwidths."""
    ex = "09b.3 crossover"
    _check_ratio(ex, ratio)
    largest_tp = largest_tp or {}
    degrees = [n for n in range(2, N_HEADS + 1) if N_HEADS % n == 0]
    found = {}
    for link, hw in NODES.items():
        guess = answered(largest_tp.get(link), ex, f'largest_tp["{link}"]')
        want = found[link] = max(n for n in degrees if reference_ratio(n, hw.ring_bw(n)) <= SHARE)
        bw = hw.ring_bw(guess) if isinstance(guess, int) and guess >= 1 else 0
        name = f'largest_tp["{link}"] = {guess!r}'
        require(isinstance(guess, int) and guess >= 2, ex, f"{name}: give an int ≥ 2")
        require(
            N_HEADS % guess == 0,
            ex,
            f"{name} does not divide the {N_HEADS} heads: each rank must hold whole heads, and "
            "transformer.check_heads refuses such a degree (chapter 08, section 3); look among "
            "the divisors of 96",
        )
        require(
            reference_ratio(guess, bw) <= SHARE,
            ex,
            f"{name}: ratio = {reference_ratio(guess, bw):.3g} > {SHARE}, the communication "
            "takes more than half the matmuls' time there; try smaller divisors of 96",
        )
        hint = f"{name}: a larger divisor of 96 still has ratio ≤ {SHARE} on this link"
        require(guess == want, ex, hint)
    above = {link: min(n for n in degrees if n > found[link]) for link in NODES}
    over = {link: reference_ratio(n, NODES[link].ring_bw(n)) for link, n in above.items()}
    passed(
        ex,
        f"ratio(8) = {reference_ratio(8, LINKS['nvlink']):.2f} over NVLink, growing with tp − 1; "
        f"communication stays within half the weight matmuls' time up to tp = "
        f"{found['dgx_h100']} on DGX H100 nodes and {found['pcie']} over PCIe; one divisor "
        f"further the ratio is {over['dgx_h100']:.2f} (tp = {above['dgx_h100']}, a group that "
        f"straddles two nodes) and {over['pcie']:.2f} (tp = {above['pcie']})",
    )
