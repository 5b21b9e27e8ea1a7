"""Chapter 07a: activation memory kept for backward, predicted and read from the allocator (the
profiler's memory events), and what full and selective recomputation save and cost (one process;
values and FLOP counts, never durations)."""

from __future__ import annotations

import pytest
import torch

from mgtutorial.sharding import memory, recompute


def test_kept_bytes_equal_the_prediction_and_grads_are_unchanged():
    got = recompute.measure(batch=16, h=8, f=32, blocks=3, repeats=1)
    for mode, v in got.items():
        assert v["kept"] == v["predicted"] + 4, mode  # + the loss's fp32 scalar
        assert v["same_grads"], mode
    assert got["full"]["kept"] < got["selective"]["kept"] < got["none"]["kept"]
    # full recomputes w1 (w2's output is never needed: non-reentrant checkpoint stops early);
    # selective recomputes only gelu, which FlopCounterMode does not count
    w1_forward = 3 * 2 * 16 * 8 * 32
    assert got["full"]["flops"] - got["none"]["flops"] == w1_forward
    assert got["selective"]["flops"] == got["none"]["flops"]


def test_allocator_bytes_sees_allocations_and_frees():
    def work():
        keep = torch.empty(1000)  # 4000 bytes kept
        tmp = torch.empty(2000)  # 8000 bytes, freed on return
        del tmp
        return keep

    kept, seen = memory.allocator_bytes(work)
    assert seen == {"net": 4000, "peak": 12000} and kept.numel() == 1000


def test_predicted_bytes_names_a_bad_mode():
    with pytest.raises(ValueError, match="mode='half'"):
        recompute.predicted_bytes(1, 1, 1, 1, "half")
