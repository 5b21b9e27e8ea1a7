"""A key prefix that every rank of one start of a job agrees on, on a store that outlives starts.

Taught in notebooks/05b_elastic_restarts.ipynb (section 1, the restart across nodes) and used by
:func:`mgtutorial.runtime.env.distributed`. Follows
https://pytorch.org/docs/stable/elastic/agent.html and pytorch/pytorch#135712.

Under ``torchrun``'s c10d rendezvous the node-0 agent hosts the ranks' ``TCPStore``
(``TORCHELASTIC_USE_AGENT_STORE=True``, torch 2.14: ``DynamicRendezvousHandler.next_rendezvous``
creates it once and keeps it for later rounds), so after a restart the new ranks meet on the store
that still holds the dead ranks' keys. ``TORCHELASTIC_RESTART_COUNT`` cannot separate the starts:
each agent counts its own restarts, and an agent that restarts its healthy ranks for a membership
change does not count it (``SimpleElasticAgent._invoke_run``), so after one node fails its ranks
start with 1 while the other node's start with 0. :func:`agree_on_round` asks the store instead.
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

KEY = "mgtutorial/round"


def agree_on_round(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta
) -> int:
    """The round number every rank of this start returns: the next value of the store's counter
    ``KEY/rounds``, which only rank 0 of each start adds to, so no earlier start used it and the
    first start is round 1, whatever order the ranks arrive in.

    Rank r > 0 takes a ticket from another counter, ``KEY/tickets``, and posts it under
    ``KEY/rank<r>``; rank 0 answers under ``KEY/answer/<ticket>`` (a key only this start can know)
    and waits for each rank's acknowledgement, all ranks at once (``multi_get``/``multi_set``: a few
    round trips per pass, not a few per rank). A ticket left by a dead rank of an earlier start may
    be answered too; nobody reads that answer, and its old acknowledgement holds another round, so
    rank 0 waits on.

    Raises:
        TimeoutError: (``dist.DistStoreError``) a rank did not arrive within ``timeout``.
    """
    if rank != 0:
        ticket = store.add(f"{KEY}/tickets", 1)
        store.set(f"{KEY}/rank{rank}", str(ticket))
        store.wait([f"{KEY}/answer/{ticket}"], timeout)
        answer = store.get(f"{KEY}/answer/{ticket}")
        store.set(f"{KEY}/ack/{ticket}", answer)
        return int(answer)
    round_ = store.add(f"{KEY}/rounds", 1)
    pending, deadline = set(range(1, world_size)), time.monotonic() + timeout.total_seconds()
    while pending:  # a few store round trips per pass, however many ranks
        ranks = sorted(pending)
        store.wait([f"{KEY}/rank{r}" for r in ranks], timeout)  # this start's, or a dead one's
        theirs = [v.decode() for v in store.multi_get([f"{KEY}/rank{r}" for r in ranks])]
        store.multi_set([f"{KEY}/answer/{t}" for t in theirs], [str(round_)] * len(theirs))
        acks = [f"{KEY}/ack/{t}" for t in theirs]
        try:
            store.wait(acks, datetime.timedelta(milliseconds=50))
            got = [v.decode() for v in store.multi_get(acks)]
            pending -= {r for r, v in zip(ranks, got) if v == str(round_)}
        except dist.DistStoreError:  # not every acknowledgement is in yet
            pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"ranks {sorted(pending)} did not join round {round_} in time")
        time.sleep(0.005 if pending else 0)
    return round_
