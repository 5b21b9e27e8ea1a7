"""Checks of a model split into pipeline stages, used by exercise 04b.1 (a balanced split,
notebooks/04b_pipeline_schedules.ipynb). The model is an
:class:`~mgtutorial.common.models.ArticleMLP`, its blocks ``model.subnets``.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from mgtutorial.common.models import count_parameters
from mgtutorial.exercises._common import ExerciseError, require


def smallest_largest_stage(counts: list[int], k: int) -> int:
    """The smallest possible sum of the largest of ``k`` consecutive non-empty stages of blocks
    whose sizes are ``counts`` (a split's parameter counts), found by trying every cut."""
    n = len(counts)
    return min(
        max(sum(counts[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
        for cuts in itertools.combinations(range(1, n), k - 1)
    )


def check_split(
    ex: str, where: str, model, stages, k: int, whole_model: str = "every stage is the whole model"
) -> None:
    """Raise :class:`ExerciseError` with a hint (``where`` names the call that made ``stages``)
    unless ``stages`` is a list of ``k`` callable modules, none empty, that hold ``model``'s own
    parameters (no copies), each exactly once, whose forward one after the other equals
    ``model``'s, and whose largest stage holds as few parameters as a split into consecutive
    sub-networks allows (:func:`smallest_largest_stage`). ``whole_model`` is the hint's words for
    stages that are each the whole model."""
    n = len(stages) if hasattr(stages, "__len__") else "?"
    require(
        isinstance(stages, (list, tuple)) and n == k,
        ex,
        f"{where} returned {type(stages).__name__} of {n} items: return a list of {k} modules "
        "(e.g. nn.Sequential of sub-networks)",
    )
    for i, st in enumerate(stages):
        require(
            isinstance(st, nn.Module) and not isinstance(st, nn.ModuleList),
            ex,
            f"{where}: stage {i} is of type {type(st).__name__}: each stage must be one callable "
            "module; a slice of model.subnets is a ModuleList, which has no forward: wrap it, "
            "nn.Sequential(*model.subnets[a:b])",
        )
    counts, whole = [count_parameters(st) for st in stages], count_parameters(model)
    require(
        all(counts),
        ex,
        f"{where} has an empty stage (parameters {counts}): every stage needs at least one "
        "sub-network",
    )
    own = {id(p) for p in model.parameters()}
    require(
        all(id(p) in own for st in stages for p in st.parameters()),
        ex,
        f"{where}: the stages hold copies, not the model's parameters: wrap model.subnets[a:b], "
        "do not build new layers",
    )
    require(
        k == 1 or counts != [whole] * k,
        ex,
        f"{where}: {whole_model}; give each stage its own consecutive sub-networks, "
        "nn.Sequential(*model.subnets[a:b])",
    )
    require(
        sum(counts) == whole,
        ex,
        f"{where}: the stages hold {sum(counts):,} parameters, the model {whole:,}: is a "
        "sub-network missing or repeated? Every parameter belongs to exactly one stage",
    )
    x = out = torch.randn(5, model.sizes[0])
    with torch.no_grad():
        try:
            for st in stages:
                out = st(out)
        except Exception as err:
            raise ExerciseError(
                ex,
                f"{where}: running the stages in order failed ({type(err).__name__}: {err}): "
                "keep the sub-networks in order, each exactly once",
            ) from None
        want = model(x)
    require(
        out.shape == want.shape and torch.allclose(out, want, atol=1e-6),
        ex,
        f"{where}: the stages applied in order do not compute the model's output: keep the "
        "sub-networks in order, each exactly once",
    )
    sizes = [count_parameters(sn) for sn in model.subnets]
    if max(counts) == smallest_largest_stage(sizes, k):
        return
    splits = [
        [sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes)))]
        for cuts in itertools.combinations(range(1, len(sizes)), k - 1)
    ]
    most_even = min(max(c) - min(c) for c in splits)
    why = (
        "yours is the most even split (the smallest largest − smallest), but the step waits for "
        "the largest stage alone"
        if max(counts) - min(counts) == most_even
        else "balance the parameters, not the number of sub-networks"
    )
    raise ExerciseError(
        ex,
        f"{where}: a split with a smaller largest stage exists (yours: {counts}): {why}; choose "
        "the cuts that make the largest stage smallest",
    )
