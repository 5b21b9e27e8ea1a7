"""Checker of chapter 10b's exercise (notebooks/10b_expert_parallel.ipynb): the split sizes of the
dispatch all-to-all for a given routing (10b.1).

The learner's function is compared with
:func:`mgtutorial.context_expert.expert_parallel.split_sizes` on a fixed routing and on random
ones; no hint prints the expected answer.
"""

from __future__ import annotations

import torch

from mgtutorial.context_expert.expert_parallel import split_sizes
from mgtutorial.exercises._common import attempt, passed, require

EXPERTS = torch.tensor([[0, 3], [2, 3], [3, 1], [0, 1], [3, 2]])
"""10b.1's routing of one rank: each token's two experts (first choice first)."""
KEPT = torch.tensor([[True, True], [True, False], [True, True], [True, True], [False, True]])
"""Which of :data:`EXPERTS`'s assignments fit in their expert's capacity."""


def _cases():
    yield EXPERTS, KEPT, 4, 2
    g = torch.Generator().manual_seed(0)
    for experts, ranks in ((8, 4), (8, 2), (6, 3)):
        e = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(16)])
        yield e, torch.rand(16, 2, generator=g) < 0.8, experts, ranks


def splits(fn) -> None:
    """10b.1: ``fn(experts, kept, num_experts, ranks) -> list[int]``, the rows this rank sends to
    each rank in the dispatch (``input_split_sizes`` of ``all_to_all_single``)."""
    ex = "10b.1 split sizes"
    for experts, kept, n_exp, ranks in _cases():
        got = attempt(ex, fn, experts.clone(), kept.clone(), n_exp, ranks)
        got = got.tolist() if isinstance(got, torch.Tensor) else got
        want = split_sizes(experts, kept, n_exp, ranks)
        case = f"(experts={n_exp}, ranks={ranks})"
        require(
            isinstance(got, list) and len(got) == ranks,
            ex,
            f"{case}: return one count per destination rank ({ranks} of them), not per expert",
        )
        if got == want:
            continue
        if sum(got) == experts.numel():
            hint = "dropped assignments (kept is False) are not sent"
        elif got == torch.bincount(experts[kept] % ranks, minlength=ranks).tolist():
            hint = (
                f"expert e lives on rank e // (experts / ranks): ranks hold consecutive experts, "
                f"not every {ranks}-th"
            )
        else:
            hint = "count each kept (token, expert) pair once, by the rank that holds the expert"
        require(False, ex, f"{case}: {hint}")
    passed(ex, "your split sizes == the dispatch's input_split_sizes on 4 routings")
