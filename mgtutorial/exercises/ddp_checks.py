"""What the checkers of chapters 03a and 03b share: ``torch.distributed`` calls recorded or refused
while the learner's code runs in a rank (:func:`patched`), each rank's parameters saved in the run's
directory, and the comparison with one process on the combined batch, whose hint tells a sum from a
mean (:func:`compare_with_reference`).

Used by :mod:`mgtutorial.exercises.ch03a`, :mod:`mgtutorial.exercises.ch03b` and
:mod:`mgtutorial.exercises.ch03b_buckets` (notebooks/03a_collectives.ipynb,
notebooks/03b_ddp_internals.ipynb).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist

from mgtutorial import ddp
from mgtutorial.common.compare import float32_tolerance, max_abs_diff
from mgtutorial.exercises._common import ExerciseError, require
from mgtutorial.runtime import env, runlog

NO_ALL_REDUCE_SEEN = (
    "no dist.all_reduce call was seen: call it as dist.all_reduce(...) (import "
    "torch.distributed as dist), not a name imported from it: the checker counts the calls made "
    "through torch.distributed"
)
"""The hint when :func:`patched` recorded no all-reduce although the result may be right."""


@contextlib.contextmanager
def patched(record: list | None = None, names: tuple[str, ...] = (), refuse: tuple[str, ...] = ()):
    """Inside the block, each ``torch.distributed.<name>`` appends ``[name, dtype, elements,
    returned]`` of its first (tensor) argument to ``record`` before calling through; each name in
    ``refuse`` raises RuntimeError naming it. The originals are restored on leaving."""
    originals = {n: getattr(dist, n) for n in (*names, *refuse)}

    def recorder(name, fn):
        def call(tensor, *args, **kwargs):
            entry = [name, str(tensor.dtype).removeprefix("torch."), tensor.numel(), None]
            record.append(entry)
            entry[3] = fn(tensor, *args, **kwargs)
            return entry[3]

        return call

    def refuser(name):
        def call(*args, **kwargs):
            raise RuntimeError(f"dist.{name} is not allowed in this exercise")

        return call

    for n in names:
        setattr(dist, n, recorder(n, originals[n]))
    for n in refuse:
        setattr(dist, n, refuser(n))
    try:
        yield record
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


def save_params(module: torch.nn.Module, rank: int) -> None:
    """Rank-side: save ``module``'s state dict as ``rank<r>.params.pt`` in the run's directory."""
    torch.save(module.state_dict(), runlog.run_dir() / f"rank{rank}.params.pt")


def load_params(run_dir: Path, nprocs: int) -> list[dict]:
    """The state dicts :func:`save_params` wrote, rank 0 first."""
    return [
        torch.load(Path(run_dir) / f"rank{r}.params.pt", weights_only=True) for r in range(nprocs)
    ]


def _displacement(state: dict, init: dict) -> float:
    """‖state − init‖ over all the parameters together."""
    return torch.cat([(state[k].float() - init[k].float()).flatten() for k in init]).norm().item()


def compare_with_reference(
    ex: str,
    ranks: list[dict],
    cfg: ddp.DDPConfig,
    tol: float | None = None,
    what: str = "the mean of the ranks' gradients",
    unsynced: str = "",
) -> float:
    """Require every rank's parameters equal (< 1e-6) and rank 0's equal (< ``tol``; default
    chapter 02's float32 tolerance for the device the ranks ran on) to
    ``ddp.combined_batch_reference(cfg)``; the hint says how far they moved against the reference
    (2× on 2 ranks: a sum, not a mean). ``unsynced`` ends the hint when the ranks differ (default:
    all-reduce the gradients). Returns the largest difference to the reference."""
    for r, state in enumerate(ranks[1:], 1):
        d = max_abs_diff(ranks[0], state)
        require(
            d < 1e-6,
            ex,
            f"after {cfg.max_steps} steps rank 0's and rank {r}'s parameters differ by up to "
            f"{d:.2g}: each stepped with its own gradient; "
            + (unsynced or f"all-reduce the gradients so that every rank steps with {what}"),
        )
    init = ddp.build(cfg, env.DistContext.single_process())[0].state_dict()
    reference = ddp.combined_batch_reference(cfg, len(ranks)).state_dict()
    d = max_abs_diff(ranks[0], reference)
    if tol is None:
        gpus = env.resolve_backend(cfg.backend, len(ranks)) == "nccl"
        tol = float32_tolerance("cuda" if gpus else "cpu")
    if d < tol:
        return d
    moved = _displacement(ranks[0], init) / _displacement(reference, init)
    if abs(moved - len(ranks)) < 0.25 * len(ranks):
        hint = (
            f"the parameters moved {moved:.1f}× as far as one process's on the combined batch: "
            f"the all-reduce sums; divide by the world size"
        )
    else:
        hint = (
            f"rank 0's parameters differ from one process on the combined batch by up to "
            f"{d:.2g} (they moved {moved:.2f}× as far): every rank must step with {what}"
        )
    raise ExerciseError(ex, hint)
