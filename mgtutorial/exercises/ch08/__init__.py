"""Checkers of chapter 08's exercises (notebooks/08a_tensor_parallel.ipynb and
notebooks/08b_tp_mesh_and_cost.ipynb), called as ``ex.ch08.<name>``:

- 08a.1 :func:`counts` (``collectives.py``): the collectives and bytes of a wider split block
- 08a.2 :func:`sequence_pair` (``sequence_pair.py``): the sequence-parallel pair (all-gather /
  reduce-scatter) written as autograd Functions, against one process and DTensor's split
- 08a.3 :func:`bias_before_g` (``hand_split.py``): the bias added before g, run in the chapter's
  hand-split MLP on 2 ranks (:func:`split_mlp_worker`, ``split_mlp.py``)
- 08b.1 :func:`block_plan` (``plan.py``): a sequence-parallel DTensor plan, and the heads of each
  rank, for a Llama-style block with grouped-query attention
- 08b.2 :func:`loss_bytes` (``loss_bytes.py``): the all-reduces of the vocabulary-parallel loss
"""

from __future__ import annotations

from mgtutorial.exercises.ch08.collectives import counts
from mgtutorial.exercises.ch08.hand_split import NAMES, bias_before_g
from mgtutorial.exercises.ch08.loss_bytes import loss_bytes, loss_worker
from mgtutorial.exercises.ch08.plan import GatedBlock, block_plan, plan_worker
from mgtutorial.exercises.ch08.sequence_pair import pair_worker, sequence_pair
from mgtutorial.exercises.ch08.split_mlp import SplitMLPConfig, split_mlp_worker

__all__ = [
    "GatedBlock",
    "NAMES",
    "SplitMLPConfig",
    "bias_before_g",
    "block_plan",
    "counts",
    "loss_bytes",
    "loss_worker",
    "pair_worker",
    "plan_worker",
    "sequence_pair",
    "split_mlp_worker",
]
