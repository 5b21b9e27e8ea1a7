"""05a.4's probe and checker: what a restart of a two-node ``torchrun`` job finds at
``MASTER_ADDR:MASTER_PORT``, with the agents sharing their store (torch's default) and with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.

The probe (``python -m mgtutorial.exercises.ch05a_store OUT_DIR``, one rank per simulated node,
``--max-restarts 1``) opens the ranks' store as ``init_process_group``'s ``env://`` rendezvous does
(``torch.distributed.rendezvous``). In attempt 0 rank 0 writes a key and rank 1 fails once it has
read it; in attempt 1 both ranks record the port they were given and whether the key is still
there. Taught in notebooks/05a_torchrun_multinode.ipynb, section 4 (PyTorch: torchrun,
https://docs.pytorch.org/docs/stable/elastic/run.html).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import sys
from pathlib import Path

from mgtutorial.exercises._common import ExerciseError, answered, passed, require

KEY = "left-by-attempt-0"
"""The key rank 0 writes in attempt 0, before rank 1 fails."""


def probe(out_dir: str) -> int:
    """One rank of the probe job: records ``{"attempt", "rank", "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE", "store host", "key found"}`` (``"store host"``: ``"agent"``
    where torch's ``env://`` rendezvous makes this rank a client of the agent's store, else
    ``"rank 0"``, which then opens it) to ``OUT_DIR/attempt<a>-rank<r>.json``; the
    attempt is told by a marker file rank 1 writes before it fails (each agent counts its restarts
    for itself: chapter 05b). Returns the rank's exit code (1: rank 1 in attempt 0)."""
    import importlib

    import torch.distributed as dist

    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module, not the function
    out, rank = Path(out_dir), int(os.environ["RANK"])
    marker = out / "rank1-failed"
    attempt = 1 if marker.exists() else 0
    store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=30)))
    found = store.check([KEY])
    master = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    record = {
        "attempt": attempt,
        "rank": rank,
        "MASTER_PORT": os.environ["MASTER_PORT"],
        "TORCHELASTIC_USE_AGENT_STORE": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
        "store host": "agent" if rdzv._agent_store_serves(*master) else "rank 0",  # torch's rule
        "key found": found,
    }
    (out / f"attempt{attempt}-rank{rank}.json").write_text(json.dumps(record))
    if attempt == 0 and rank == 0:
        store.set(KEY, "written by rank 0 of attempt 0")
        store.wait(["never-set"], datetime.timedelta(seconds=60))  # until the agent stops it
        return 0
    if attempt == 0:
        store.wait([KEY])
        marker.touch()
        return 1  # the failure that makes both agents restart their ranks
    store.set(f"attempt1-done{rank}", "1")  # the store's host stays up until both have read
    store.wait(["attempt1-done0", "attempt1-done1"])
    return 0


MODES = {"default": {}, "disabled": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}}
"""The agents' extra environment of each of 05a.4's two jobs."""
QUESTIONS = {
    "store host": "who hosts the store at MASTER_ADDR:MASTER_PORT: 'agent' or 'rank 0'",
    "same port": "whether attempt 1's ranks get the MASTER_PORT of attempt 0 (a bool)",
    "key found": "whether attempt 1 finds the key rank 0 wrote in attempt 0 (a bool)",
}
_WHERE = {  # where torch decides it
    "store host": "_create_c10d_store in torch.distributed.rendezvous",
    "same port": "when DynamicRendezvousHandler.next_rendezvous builds RendezvousStoreInfo",
    "key found": "which process holds the store, and what a restart ends",
}


def run_probes(runs_dir: str | os.PathLike, timeout: float = 150) -> dict[str, list[dict]]:
    """Run the probe job of each of :data:`MODES` (two simulated nodes, one rank each,
    ``--max-restarts 1``), both at once; returns ``{mode: [records, by attempt then rank]}``.
    Raises TimeoutError if they run longer than ``timeout`` s (every agent is stopped either way),
    RuntimeError if an agent fails."""
    from mgtutorial.scale import torchrun

    jobs, runs = {}, Path(runs_dir).resolve()
    with contextlib.ExitStack() as stack:  # leaving the block stops every agent of both jobs
        for mode, env in MODES.items():
            out = runs / f"ex05a-store-{mode}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            jobs[mode] = (
                out,
                stack.enter_context(
                    torchrun.simulated_nodes(
                        [str(out)],
                        log_dir=out / "agents",
                        extra_env=env,
                        max_restarts=1,
                        module="mgtutorial.exercises.ch05a_store",
                    )
                ),
            )
        codes = {mode: agents.wait(timeout=timeout) for mode, (_, agents) in jobs.items()}
    records = {}
    for mode, (out, agents) in jobs.items():
        if codes[mode] != [0, 0]:
            raise RuntimeError(f"05a.4's {mode} job failed ({codes[mode]}): see {agents.log_dir}")
        files = [out / f"attempt{a}-rank{r}.json" for a in (0, 1) for r in (0, 1)]
        records[mode] = [json.loads(f.read_text()) for f in files]
    return records


def store_after_restart(predicted: dict, runs_dir: str = "runs/exercises") -> None:
    """05a.4: for ``mode`` "default" and "disabled" (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in
    the agents' environment), ``predicted[mode]`` answers :data:`QUESTIONS` about a two-node job
    whose rank 1 fails once (``--max-restarts 1``): ``"store host"`` (``"agent"`` or
    ``"rank 0"``), ``"same port"`` and ``"key found"`` (bools).

    Runs both jobs at once (:func:`run_probes`) and compares with what their ranks recorded."""
    ex = "05a.4 the store after a restart"
    for mode in MODES:
        for key in QUESTIONS:
            answered((predicted.get(mode) or {}).get(key, ...), ex, f"predicted[{mode!r}][{key!r}]")
        require(
            predicted[mode]["store host"] in ("agent", "rank 0"),
            ex,
            f"predicted[{mode!r}]['store host'] is {predicted[mode]['store host']!r}: answer "
            "'agent' or 'rank 0'",
        )
        for key in ("same port", "key found"):
            require(
                isinstance(predicted[mode][key], bool),
                ex,
                f"predicted[{mode!r}][{key!r}] is {predicted[mode][key]!r}: answer True or False",
            )
    try:
        records = run_probes(runs_dir)
    except TimeoutError as e:
        raise ExerciseError(ex, f"{e}: the machine may be busy, run the checker again") from e
    wrong = 0
    for mode, (a0r0, _, a1r0, a1r1) in records.items():
        seen = {
            "store host": a1r1["store host"],
            "same port": a0r0["MASTER_PORT"] == a1r0["MASTER_PORT"],
            "key found": a1r0["key found"] and a1r1["key found"],
        }
        wrong += sum(predicted[mode][key] != truth for key, truth in seen.items())
    n = len(MODES) * len(QUESTIONS)
    require(
        not wrong,
        ex,
        f"{wrong} of your {n} predictions differ from what the restarted ranks recorded; read "
        + "; ".join(f"for {key!r}: {where}" for key, where in _WHERE.items()),
    )
    passed(
        ex,
        "both restarts ran as you predicted: who hosts the store, whether MASTER_PORT stays, and "
        "whether attempt 0's key survives",
    )


if __name__ == "__main__":
    sys.exit(probe(sys.argv[1]))
