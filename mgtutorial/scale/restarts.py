"""A restart across two nodes whose agents count restarts differently, simulated on this machine.

Run by tests/test_scale.py and cited in notebooks/05b_elastic_restarts.ipynb (section 1), which
shows the counts differing with two real torchrun agents.
Follows pytorch/pytorch#135712 and #108158: ``TORCHELASTIC_RESTART_COUNT`` is each agent's own
count. When node B's rank fails, B's agent restarts its ranks with count 1; node A's agent sees B
waiting at the rendezvous, restarts its healthy ranks for that membership change, and does not
count it: A's ranks start again with 0.

:func:`simulate` plays both starts of such a job: the kernel hosts one ``TCPStore`` for both, as
the node-0 agent does, and each rank is a fresh process (``TORCHELASTIC_USE_AGENT_STORE=True``)
that joins a gloo group, all-reduces a one and exits. The ranks are forked from one helper process
that has imported torch once (:data:`SERVER_SCRIPT`): a start costs a fork per rank, not a Python
start and torch's import per rank. ``how`` says which keys the ranks use:
"bare store" (none of their own), "restart count" (``PrefixStore("attempt_<count>")``) or
"round" (:func:`mgtutorial.runtime.env.distributed`, whose prefix comes from
:func:`mgtutorial.runtime.rounds.agree_on_round`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Literal

import torch.distributed as dist

How = Literal["bare store", "restart count", "round"]
ROOT = Path(__file__).resolve().parents[2]

SERVER_SCRIPT = """
import datetime, json, os, signal, sys, time, traceback
import torch, torch.distributed as dist
from mgtutorial.runtime import env


def rank(how, late, timeout_s):  # one rank of one start, in a forked child
    if os.environ["RANK"] == "1":
        time.sleep(late)  # rank 1 comes late: rank 0 reads the store first
    t = torch.ones(1)
    if how == "round":
        with env.distributed("gloo", timeout_s=timeout_s):
            dist.all_reduce(t)
        return int(t.item())
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank_, world = next(dist.rendezvous("env://", timeout=timeout))
    if how == "restart count":
        store = dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group("gloo", store=store, rank=rank_, world_size=world, timeout=timeout)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())


def fork_rank(how, port, r, count, late, timeout_s):
    pid = os.fork()
    if pid:
        return pid
    os.environ.update(MASTER_PORT=str(port), RANK=str(r), TORCHELASTIC_RESTART_COUNT=str(count))
    code = 1
    try:
        code = 0 if rank(how, late, timeout_s) == 2 else 2  # 2: the all-reduce summed wrongly
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


for line in sys.stdin:  # one start per line: {"ranks": [[how, port, rank, count], ...], ...}
    start = json.loads(line)
    late, timeout_s = start["late_s"], start["timeout_s"]
    pids = [fork_rank(*spec, late, timeout_s) for spec in start["ranks"]]
    deadline, codes = time.monotonic() + late + 2 * timeout_s, {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes and (status := os.waitpid(pid, os.WNOHANG))[0]:
                codes[pid] = os.waitstatus_to_exitcode(status[1])
        if len(codes) < len(pids) and time.monotonic() > deadline:
            for pid in set(pids) - set(codes):  # still waiting at twice its timeout: -9
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    print(json.dumps([codes[pid] for pid in pids]), flush=True)
"""
"""The helper process of :func:`simulate`: imports torch once, then reads one start per line of
its stdin (the ranks' ``how``, store port, rank and restart count, rank 1's delay, the timeout),
forks the ranks, and answers each line with their exit codes, as JSON (1: the rank raised, its
traceback on stderr; 2: its all-reduce did not sum both ranks; -9: killed, still running
``late_s`` + 2 × ``timeout_s`` after the start, as a rank whose peer's address is stale can be,
retrying to connect)."""


class RankServer:
    """:data:`SERVER_SCRIPT` in a process group of its own; leaving the block ends it and any rank
    it forked."""

    def __init__(self):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            WORLD_SIZE="2",
            LOCAL_RANK="0",
            TORCHELASTIC_USE_AGENT_STORE="True",
            PYTHONPATH=str(ROOT),
            OMP_NUM_THREADS="1",
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            start_new_session=True,
        )

    def start(self, ranks: list[tuple[How, int, int, int]], late_s: float, timeout_s: float):
        """Fork one rank per ``(how, store port, rank, restart count)`` and wait for them all;
        returns their exit codes, in order. Raises RuntimeError if the helper died."""
        request = {"ranks": ranks, "late_s": late_s, "timeout_s": timeout_s}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the ranks' helper process exited ({self.proc.wait()})")
        return json.loads(answer)

    def __enter__(self) -> RankServer:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


def simulate(
    hows: list[How],
    counts: tuple[int, int] = (0, 1),
    late_s: float = 1.0,
    timeout_s: float = 6.0,
) -> dict:
    """Two starts of a 2-rank job per ``how``, all ``hows`` side by side, each on a store of its
    own: start 0 with both counts 0, then start 1 with ``counts`` (node A's rank 0, node B's rank
    1), rank 1 ``late_s`` seconds after rank 0, every wait at most ``timeout_s`` seconds. Returns
    {how: {"exit codes": [[start 0], [start 1]], "new keys": keys start 1 added}}; a rank's exit
    code is 0 if it joined the group and its all-reduce summed both ranks."""
    servers = {h: dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False) for h in hows}
    out = {h: {"exit codes": [], "new keys": 0} for h in hows}
    with RankServer() as ranks:
        for start, (cs, late) in enumerate((((0, 0), 0.0), (counts, late_s))):
            before = {h: s.num_keys() for h, s in servers.items()}
            specs = [(h, s.port, r, cs[r]) for h, s in servers.items() for r in (0, 1)]
            codes = ranks.start(specs, late, timeout_s)
            for i, h in enumerate(servers):
                out[h]["exit codes"].append(codes[2 * i : 2 * i + 2])
                if start == 1:
                    out[h]["new keys"] = servers[h].num_keys() - before[h]
    return out
