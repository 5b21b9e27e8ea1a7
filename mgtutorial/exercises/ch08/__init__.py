"""Checkers of chapter 08's exercises (notebooks/08_tensor_parallel.ipynb), called as
``ex.ch08.<name>``:

- 08.1 :func:`counts` (``collectives.py``): the collectives and bytes of a wider split block
- 08.2 :func:`f_and_g` and 08.3 :func:`bias_before_g` (``hand_split.py``): Megatron's f and g
  written by hand, and the bias added before g; both run the chapter's hand-split MLP with the
  learner's pieces in 2 ranks (:func:`split_mlp_worker`, ``split_mlp.py``)
- 08.4 :func:`block_plan` (``plan.py``): a sequence-parallel DTensor plan for a Llama-style block
"""

from __future__ import annotations

from mgtutorial.exercises.ch08.collectives import counts
from mgtutorial.exercises.ch08.hand_split import NAMES, bias_before_g, f_and_g
from mgtutorial.exercises.ch08.plan import GatedBlock, block_plan, plan_worker
from mgtutorial.exercises.ch08.split_mlp import SplitMLPConfig, split_mlp_worker

__all__ = [
    "GatedBlock",
    "NAMES",
    "SplitMLPConfig",
    "bias_before_g",
    "block_plan",
    "counts",
    "f_and_g",
    "plan_worker",
    "split_mlp_worker",
]
