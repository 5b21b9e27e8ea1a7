"""A restart across two nodes whose agents count restarts differently, simulated on this machine.

Run by tests/test_scale.py and cited in notebooks/05b_elastic_restarts.ipynb (section 1), which
shows the counts differing with two real torchrun agents.
Follows pytorch/pytorch#135712 and #108158: ``TORCHELASTIC_RESTART_COUNT`` is each agent's own
count. When node B's rank fails, B's agent restarts its ranks with count 1; node A's agent sees B
waiting at the rendezvous, restarts its healthy ranks for that membership change, and does not
count it: A's ranks start again with 0.

:func:`simulate` plays both starts of such a job: the kernel hosts one ``TCPStore`` for both, as
the node-0 agent does, and each rank is a fresh process (``TORCHELASTIC_USE_AGENT_STORE=True``)
that joins a gloo group, all-reduces a one and exits. ``how`` says which keys the ranks use:
"bare store" (none of their own), "restart count" (``PrefixStore("attempt_<count>")``) or
"round" (:func:`mgtutorial.runtime.env.distributed`, whose prefix comes from
:func:`mgtutorial.runtime.rounds.agree_on_round`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import torch.distributed as dist

How = Literal["bare store", "restart count", "round"]
ROOT = Path(__file__).resolve().parents[2]

RANK_SCRIPT = """
import datetime, os, sys, time, torch, torch.distributed as dist
from mgtutorial.runtime import env
how, late, timeout_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
if os.environ["RANK"] == "1":
    time.sleep(late)  # rank 1 comes late: rank 0 reads the store first
t = torch.ones(1)
if how == "round":
    with env.distributed("gloo", timeout_s=timeout_s):
        dist.all_reduce(t)
else:
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    if how == "restart count":
        store = dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    dist.all_reduce(t)
    dist.destroy_process_group()
print("all_reduce", int(t.item()))
"""


def start_ranks(how: How, port: int, counts: tuple[int, int], late_s: float, timeout_s: float):
    """The two rank processes of one start: rank r sees ``TORCHELASTIC_RESTART_COUNT=counts[r]``
    and the store at 127.0.0.1:``port``."""
    base = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
        TORCHELASTIC_USE_AGENT_STORE="True",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    return [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, how, str(late_s), str(timeout_s)],
            env={**base, "RANK": str(r), "LOCAL_RANK": "0", "TORCHELASTIC_RESTART_COUNT": str(c)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r, c in enumerate(counts)
    ]


def finish(procs, timeout: float) -> list[int]:
    """Exit codes of ``procs`` (killed after ``timeout`` s: then −9)."""
    codes = []
    for p in procs:
        try:
            p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
        codes.append(p.returncode)
    return codes


def simulate(
    hows: list[How],
    counts: tuple[int, int] = (0, 1),
    late_s: float = 1.0,
    timeout_s: float = 6.0,
) -> dict:
    """Two starts of a 2-rank job per ``how``, all ``hows`` side by side, each on a store of its
    own: start 0 with both counts 0, then start 1 with ``counts`` (node A's rank 0, node B's rank
    1). Returns {how: {"exit codes": [[start 0], [start 1]], "new keys": keys start 1 added}}."""
    servers = {h: dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False) for h in hows}
    out = {h: {"exit codes": [], "new keys": 0} for h in hows}
    for start, (cs, late) in enumerate((((0, 0), 0.0), (counts, late_s))):
        before = {h: s.num_keys() for h, s in servers.items()}
        procs = {h: start_ranks(h, s.port, cs, late, timeout_s) for h, s in servers.items()}
        for h, ps in procs.items():
            out[h]["exit codes"].append(finish(ps, timeout=timeout_s + 60))
            if start == 1:
                out[h]["new keys"] = servers[h].num_keys() - before[h]
    return out
