"""Checkers of chapter 00's exercises (notebooks/00_setup.ipynb): the sum of ranks, rank, local
rank and device on several machines, a worker of your own in a file (an all-reduced MAX), and
which rank a failure names."""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path

from mgtutorial.exercises._common import (
    ExerciseError,
    FileWorkerConfig,
    RankFailed,
    answered,
    file_worker,
    function_from,
    passed,
    require,
    run_file,
    run_ranks,
)
from mgtutorial.hello import HelloConfig, hello
from mgtutorial.runtime import env, runlog


def rank_sums(predicted: dict) -> None:
    """00.1: ``predicted[n]`` is the all-reduced sum every rank receives from ``hello`` on n ranks.

    Launches ``hello`` with 3 and 4 ranks (more ranks than cores is fine: they take turns).
    """
    ex = "00.1 rank sums"
    for n in (3, 4):
        guess = answered(predicted.get(n), ex, f"predicted[{n}]")
        got = {
            rec["rank_sum"]
            for rec in run_ranks(ex, hello, HelloConfig(), n, name="hello").values.values()
        }
        require(
            got == {guess},
            ex,
            f"with {n} ranks every rank received something other than {guess}: each rank "
            f"contributes its own rank, 0 … {n - 1}, and the all-reduce adds them (not the world "
            f"size, not a count)",
        )
    passed(ex, "3 ranks receive 3 and 4 ranks receive 6, on every rank")


MACHINES, GPUS_PER_MACHINE = 3, 2  # 00.2: the job's layout
ASKED = (3, 4)  # 00.2: the global ranks asked about


def rank_layout(predicted: dict) -> None:
    """00.2: ``predicted[r]`` is ``(machine, local_rank, device)`` of global rank ``r`` (3 and 4)
    in a job of 3 machines with 2 GPUs each, one rank per GPU, ranks numbered machine by machine
    as ``torchrun`` does for a job whose machines run the same number of ranks (``GROUP_RANK`` ×
    ranks per machine + ``LOCAL_RANK``). The device is what
    :func:`mgtutorial.runtime.env.device_for` gives the rank under NCCL."""
    ex = "00.2 rank layout"
    for r in ASKED:
        guess = answered(predicted.get(r), ex, f"predicted[{r}]")
        require(
            isinstance(guess, (tuple, list)) and len(guess) == 3,
            ex,
            f"predicted[{r}] is {guess!r}: give (machine, local rank, device), the device "
            "as a string such as 'cuda:N'",
        )
        machine, local, device = guess
        require(
            isinstance(device, str),
            ex,
            f"predicted[{r}]'s device is {device!r}: give it as a string such as 'cuda:N'",
        )
        local_truth = r % GPUS_PER_MACHINE
        require(
            machine == r // GPUS_PER_MACHINE,
            ex,
            f"rank {r}'s machine: ranks are numbered machine by machine, "
            f"{GPUS_PER_MACHINE} per machine, and machines count from 0",
        )
        require(
            local == local_truth,
            ex,
            f"rank {r}'s local rank: it counts the ranks on its own machine, from 0",
        )
        require(
            str(device) == str(env.device_for("nccl", local_truth)),
            ex,
            f"rank {r}'s device: each machine has GPUs 0 … {GPUS_PER_MACHINE - 1}, and a rank "
            "picks the one numbered by its local rank (cuda:<global rank> would not exist there)",
        )
    passed(
        ex,
        f"on {MACHINES} machines of {GPUS_PER_MACHINE} GPUs, ranks {ASKED[0]} and {ASKED[1]} sit "
        "on machines 1 and 2 as local ranks 1 and 0, each on the GPU of its local rank",
    )


VALUES = (5, 9, 2)  # 00.3: rank r contributes VALUES[r]


def _own_value_worker(cfg: FileWorkerConfig):
    """Rank-side (00.3): give the learner's function only this rank's value,
    ``cfg.options["value"]``."""
    rank = int(os.environ["RANK"])
    return file_worker(dataclasses.replace(cfg, options={"value": cfg.options["values"][rank]}))


def max_value(path: str = "ex00_worker.py") -> None:
    """00.3: ``my_hello(cfg)`` in ``path`` returns ``{"rank": int, "max": int}``, ``max`` being the
    all-reduced MAX of every rank's ``cfg.options["value"]`` (5, 9 and 2 on ranks 0, 1 and 2).

    Runs 3 ranks; each sees only its own value, so the largest can only come from a collective.
    """
    ex = "00.3 your own worker"
    function_from(path, "my_hello", ex)  # a missing file or function: named before any rank starts
    cfg = FileWorkerConfig(
        path=str(Path(path).resolve()), function="my_hello", options={"values": list(VALUES)}
    )
    values = run_ranks(
        ex, _own_value_worker, cfg, len(VALUES), timeout_s=20, name=Path(path).stem
    ).values
    for rank, value in sorted(values.items()):
        require(
            not (isinstance(value, str) and "tensor(" in value),
            ex,
            f"rank {rank} returned {value}: a tensor does not cross to the notebook; return Python "
            "numbers, e.g. int(t.item())",
        )
        require(
            isinstance(value, dict) and {"rank", "max"} <= set(value),
            ex,
            f"rank {rank} returned {value!r}: return a dict with 'rank' and 'max'",
        )
        require(
            value["rank"] == rank, ex, f"rank {rank} reported rank {value['rank']}: use ctx.rank"
        )
        got, own = value["max"], VALUES[rank]
        require(
            isinstance(got, (int, float)) and not isinstance(got, bool),
            ex,
            f"rank {rank} reported max {got!r}: return one number, e.g. int(t.item()), not a "
            "list or tensor",
        )
        require(
            got != sum(VALUES),
            ex,
            f"rank {rank} received {got}, the sum of {list(VALUES)}: you summed, "
            "pass op=dist.ReduceOp.MAX to dist.all_reduce",
        )
        require(
            got != own or own == max(VALUES),
            ex,
            f"rank {rank} reported its own value {own}: no collective brought it the others' "
            "values. Put it in a tensor and dist.all_reduce it with op=dist.ReduceOp.MAX "
            "(dist.reduce leaves the result on one rank only)",
        )
        require(
            got == max(VALUES),
            ex,
            f"rank {rank} reported max {got}, but the largest of "
            f"{list(VALUES)} is {max(VALUES)}: all-reduce with op=dist.ReduceOp.MAX",
        )
    passed(
        ex,
        f"3 ranks ran my_hello from your file; their values {', '.join(map(str, VALUES))} "
        f"all-reduced to {max(VALUES)} on every rank",
    )


def failing_rank(path: str = "ex00_fail.py", predicted_rank=...) -> None:
    """00.4: ``worker(cfg)`` in ``path`` raises ``ValueError`` on rank 1 only; predict the rank
    named.

    Also reads rank 0's ``rank0.error.json`` (see :func:`mgtutorial.runtime.failure.root_cause`):
    rank 0 may record an error of its own only as a consequence (``secondary``) of rank 1's."""
    ex = "00.4 a failing rank"
    guess = answered(predicted_rank, ex, "predicted_rank")
    name = f"{Path(path).stem}-{uuid.uuid4().hex[:6]}"  # a name of its own: its run's folder
    try:
        run_file(ex, path, "worker", 2, timeout_s=30, name=name)
    except RankFailed as e:
        require(e.exc_type == "ValueError", ex, f"a rank failed, but not with ValueError: {e.hint}")
        named = e.rank
    else:
        raise ExerciseError(
            ex, "every rank finished: raise ValueError on rank 1 (if ctx.rank == 1: …)"
        )
    run_dir = max(Path("runs/exercises").glob(f"{name}-*"))
    rank0 = runlog.read_json(runlog.rank_file(run_dir, 0, "error.json"))
    require(named == 1, ex, f"rank {named} failed: only rank 1 should raise")
    require(
        not rank0 or rank0["secondary"],
        ex,
        f"rank 0 raised {rank0 and rank0['type']} itself: only "
        "rank 1 should raise (if ctx.rank == 1: …)",
    )
    require(
        guess == named,
        ex,
        f"the error names rank {named}, you predicted {guess}: launch names the "
        "rank whose error came first, not the ranks that failed or were stopped "
        "because of it",
    )
    passed(
        ex,
        "rank 1 raised ValueError, launch named rank 1; "
        + ("rank 0's own error was marked as a consequence" if rank0 else "rank 0 was stopped"),
    )
