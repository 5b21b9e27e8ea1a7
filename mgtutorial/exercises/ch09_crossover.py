"""Checker of exercise 09b.3 (notebooks/09b_measurement.ipynb): the closed form the learner
derives for one block's forward TP communication over its matmuls, and the TP degree at which it
passes half, on DGX H100 nodes (NVLink inside a node) and on the same nodes with their GPUs linked
by PCIe instead; checked against the arithmetic of chapter 08b's section 2
(:func:`mgtutorial.tensor_parallel.cost.comm_bytes`) and the course's one model of the links,
:meth:`mgtutorial.perf.costmodel.Hardware.ring_bw` (chapter 09a).
"""

from __future__ import annotations

import dataclasses

from mgtutorial.exercises._common import answered, attempt_by_hand, close, passed, require
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


def reference_ratio(tp_degree: int, link_bw: float, h: int = 12288, s: int = 2048) -> float:
    """Chapter 08b section 2's ratio: one block's forward communication per rank over ``link_bw``
    (B/s) / its weight matmuls at ``costmodel.H100.peak_flops``, from
    :func:`mgtutorial.tensor_parallel.cost.comm_bytes` (bf16, ffn = 4h, one sequence of ``s``)."""
    big = cost.comm_bytes(b=1, s=s, h=h, ffn=4 * h, tp=tp_degree, elem=2)
    comm_s = big["tp_forward"] * 2 * (tp_degree - 1) / tp_degree / link_bw
    return comm_s / (2 * big["params"] * s / tp_degree / costmodel.H100.peak_flops)


RATIO_GRID = [(n, h, bw) for n in (8, 2, 3, 4, 16) for h in (4096, 12288) for bw in (450e9, 64e9)]
"""(tp, h, link_bw) at which the learner's closed form is compared with :func:`reference_ratio`."""
TOLERANCE = 0.005
"""The closed form counts the weight matrices only (12h² per block); the biases the reference
counts change it by 13/(12h), under 0.03 % at these widths."""


def _check_ratio(ex: str, ratio) -> None:
    peak = costmodel.H100.peak_flops
    for n, h, bw in RATIO_GRID:
        got = attempt_by_hand(ex, ("perf", "tensor_parallel", "exercises"), ratio, n, h, bw, peak)
        want = reference_ratio(n, bw, h)
        if close(got, want, rel=TOLERANCE):
            continue
        fixes = [  # (factor that would make the learner's ratio right, what it forgot)
            (
                2 * (n - 1) / n,
                "a ring all-reduce does not send the tensor once from each rank: how much "
                "does each rank send (chapter 08b, section 2)?",
            ),
            (n, "does each rank compute all the matmuls of the block?"),
            (
                2 * (n - 1),
                "two things: what a ring all-reduce sends from each rank, and what share of "
                "the matmuls each rank computes",
            ),
            (2, "a bf16 activation is 2 bytes, and a matmul does 2 FLOPs per multiply-add"),
            (0.5, "a bf16 activation is 2 bytes, and a matmul does 2 FLOPs per multiply-add"),
            (3, "count both matmuls of the MLP (h → 4h → h) and the four h × h of attention"),
        ]
        why = next(
            (text for k, text in fixes if close(got * k, want, rel=TOLERANCE)),
            "write both times for one block's forward: the bytes each rank sends over link_bw, "
            "and its share of the FLOPs over peak",
        )
        direction = "too large" if isinstance(got, (int, float)) and got > want else "wrong"
        require(False, ex, f"ratio({n}, {h}, {bw:.3g}, peak) = {got!r} is {direction}: {why}")


SHARE = 0.5
"""09b.3's bound: communication at most half the weight matmuls' time (far from any crossing of
the divisors' ratios, so the 3 % the attention-score matmuls would add cannot move the answer)."""


def h_min_reference(tp_degree: int = 8, link_bw: float = LINKS["nvlink"]) -> float:
    """The hidden size at which :func:`reference_ratio` equals :data:`SHARE` (bisection)."""
    lo, hi = 1.0, 1e7
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if reference_ratio(tp_degree, link_bw, mid) > SHARE else (lo, mid)
    return hi


def crossover(ratio, largest_tp: dict | None = None, h_min=None) -> None:
    """09b.3: ``ratio(tp, h, link_bw, peak) -> float``, the closed form of communication / compute
    of one block's forward (weight matmuls only, bf16, ffn = 4h), worked out by the learner (calls
    into ``mgtutorial.perf`` or ``mgtutorial.tensor_parallel`` are refused) and compared with
    :func:`reference_ratio` on :data:`RATIO_GRID`; ``largest_tp`` = {"dgx_h100", "pcie": int},
    per cluster of :data:`NODES` the largest TP degree n dividing :data:`N_HEADS` with
    ``ratio(n, 12288, hw.ring_bw(n), peak) <= SHARE``; ``h_min`` (float), the hidden size below
    which TP = 8 over NVLink exceeds :data:`SHARE` (within 1 %)."""
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
            "transformer.check_heads refuses such a degree (chapter 08a, section 3); look among "
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
    h_star = h_min_reference()
    h_min = answered(h_min, ex, "h_min")
    require(
        close(h_min, h_star, rel=0.01),
        ex,
        f"h_min = {h_min!r}: at that width ratio(8, h_min, NVLink) = "
        + (
            f"{reference_ratio(8, LINKS['nvlink'], h_min):.3g}, not {SHARE}: solve your closed "
            "form for h"
            if isinstance(h_min, (int, float)) and h_min > 0
            else "undefined: give a hidden size, a positive number"
        ),
    )
    above = {link: min(n for n in degrees if n > found[link]) for link in NODES}
    over = {link: reference_ratio(n, NODES[link].ring_bw(n)) for link, n in above.items()}
    passed(
        ex,
        f"your closed form matches the cost model; ratio(8) = "
        f"{reference_ratio(8, LINKS['nvlink']):.2f} over NVLink, growing with tp − 1; "
        f"within half the weight matmuls' time up to tp = {found['dgx_h100']} on DGX H100 nodes "
        f"and {found['pcie']} over PCIe (one divisor further: {over['dgx_h100']:.2f} at tp = "
        f"{above['dgx_h100']}, a group that straddles two nodes, and {over['pcie']:.2f} at tp = "
        f"{above['pcie']}); TP = 8 over NVLink needs h ≥ {h_star:,.0f}",
    )
