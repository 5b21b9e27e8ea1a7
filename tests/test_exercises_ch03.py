"""The pieces of chapter 03's checkers that need no ranks: the patched collectives, the hint for
a sum instead of a mean (mgtutorial/exercises/ddp_checks.py), and Join's one-process reference
(mgtutorial/exercises/ch03c.py); then wrong answers run in ranks, each checker failing with its
own hint. Both ways on the notebooks' solutions and starters: tests/test_exercises.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mgtutorial import ddp, exercises
from mgtutorial.exercises import ExerciseError
from mgtutorial.exercises.ch03c import JoinConfig, join_model, join_reference, uneven_batches
from mgtutorial.exercises.ddp_checks import compare_with_reference, patched
from mgtutorial.runtime import env


def test_patched_refuses_and_restores():
    original = dist.all_reduce
    with patched([], (), ("all_reduce",)):
        with pytest.raises(RuntimeError, match="dist.all_reduce is not allowed"):
            dist.all_reduce(torch.zeros(1))
    assert dist.all_reduce is original


def test_patched_records_before_calling_through():
    original, seen = dist.broadcast, []
    dist.broadcast = lambda tensor, *a, **k: "work"  # stands in for a process group
    try:
        with patched(seen, ("broadcast",)):
            assert dist.broadcast(torch.zeros(3, dtype=torch.float16), 0) == "work"
    finally:
        dist.broadcast = original
    assert seen == [["broadcast", "float16", 3, "work"]]


CFG = ddp.DDPConfig(dataset="synthetic", batch_size=8, max_steps=2, evaluate=False)


def _displaced(scale: float) -> dict:
    """The reference's parameters moved ``scale`` times as far from the initial ones."""
    init = ddp.build(CFG, env.DistContext.single_process())[0].state_dict()
    ref = ddp.combined_batch_reference(CFG, 2).state_dict()
    return {k: init[k] + scale * (ref[k] - init[k]) for k in ref}


def test_compare_with_reference_passes_the_reference_and_names_a_sum():
    assert compare_with_reference("9.9 x", [_displaced(1.0)] * 2, CFG) < 1e-6
    with pytest.raises(ExerciseError, match="moved 2.0× as far .* divide by the world size"):
        compare_with_reference("9.9 x", [_displaced(2.0)] * 2, CFG)
    with pytest.raises(ExerciseError, match="rank 0's and rank 1's parameters differ"):
        compare_with_reference("9.9 x", [_displaced(1.0), _displaced(0.5)], CFG)


def test_join_reference_on_one_rank_is_plain_sgd():
    cfg = JoinConfig(path="unused")
    model = join_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    batches = uneven_batches(cfg, 0, 1)
    assert len(batches) == cfg.batches + cfg.extra  # one rank is the last rank
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    torch.testing.assert_close(join_reference(cfg, 1), model.state_dict())


def test_uneven_batches_give_the_last_rank_more():
    cfg = JoinConfig(path="unused")
    assert [len(uneven_batches(cfg, r, 2)) for r in range(2)] == [
        cfg.batches,
        cfg.batches + cfg.extra,
    ]


# --- wrong answers, run in ranks: each checker fails with its own hint --------------------------

HOOK = """import torch, torch.distributed as dist
def fp16_allreduce_hook(state, bucket):
    buffer = bucket.buffer()
"""
BUCKETS = """import torch, torch.distributed as dist
from mgtutorial.ddp.by_hand import BucketsByHand
class MyBucketedDDP(BucketsByHand):
    def grad_ready(self, p):
        b = self.bucket_of[p]
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b]){never}:
            grads = [q.grad for q in self.buckets[b]]
            flat = torch.cat([g.flatten() for g in grads])
            self.pending.append((dist.all_reduce(flat, async_op=True), flat, grads))
    def finish_gradient_sync(self):
        for work, flat, grads in self.pending:
            work.wait()
            {divide}
            for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
def train_step(model, loss_fn, optimizer, x, y):
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    {order}
    return loss.item()
"""
RIGHT = dict(
    never="",
    divide="flat /= self.world_size",
    order="model.finish_gradient_sync()\n    optimizer.step()",
)
JOIN = """import os, time, torch, torch.distributed as dist
from torch.distributed.algorithms.join import Join
{prelude}
def train_uneven(model, optimizer, loss_fn, batches):
    total = torch.zeros(2)
    with Join([model]):
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            {record}
    {reduce}
    return (total[0] / total[1]).item()
"""
RIGHT_JOIN = dict(
    prelude="", record="total += torch.tensor([loss.item(), 1.0])", reduce="dist.all_reduce(total)"
)
RING = """import torch, torch.distributed as dist
def exchange(send, recv, rank, world_size):
    n = world_size
    for r in [dist.isend(send, (rank + 1) % n), dist.irecv(recv, (rank - 1) % n)]:
        r.wait()
def ring_all_reduce(t, rank, world_size):
    chunks, got = t.chunk(world_size), torch.empty_like(t.chunk(world_size)[0])
    for step in range(world_size - 1):
        exchange(chunks[(rank - step) % world_size], got, rank, world_size)
        chunks[(rank - step - 1) % world_size].add_(got)
"""
WRONG = {
    "ring, no all-gather": (
        "ch03a.ring_all_reduce",
        RING,
        "holds the full sum in one chunk only: the reduce-scatter is done",
    ),
    "ring, whole tensors in the all-gather": (
        "ch03a.ring_all_reduce",
        RING
        + """    mine = (rank + 1) % world_size
    full = torch.zeros_like(t)
    full.chunk(world_size)[mine].copy_(chunks[mine])
    send, recv = full.clone(), torch.empty_like(t)
    for step in range(world_size - 1):
        exchange(send, recv, rank, world_size)
        full += recv
        send = recv.clone()
    t.copy_(full)
""",
        "rank 0 sent 30 elements for its tensor of 8",
    ),
    "overlap, wait before compute": (
        "ch03a.overlap",
        """import torch.distributed as dist
def reduce_while_computing(t, compute):
    dist.all_reduce(t, async_op=True).wait()
    compute()
""",
        "its all-reduce had already finished: on gloo a collective called without async_op",
    ),
    "overlap, no wait": (
        "ch03a.overlap",
        """import torch.distributed as dist
def reduce_while_computing(t, compute):
    work = dist.all_reduce(t, async_op=True)
    compute()
""",
        r"call work.wait\(\) before returning",
    ),
    "average, no copy back": (
        "ch03a.average_by_hand",
        """import torch, torch.distributed as dist
def average_gradients(model, world_size):
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(flat)
    flat /= world_size
""",
        "copy the reduced pieces back into the p.grad",
    ),
    "hook, one blocking all-reduce per tensor": (
        "ch03b.fp16_hook",
        HOOK
        + """    for g in bucket.gradients():
        h = g.half() / dist.get_world_size()
        dist.all_reduce(h)
        g.copy_(h)
    fut = torch.futures.Future()
    fut.set_result(buffer)
    return fut
""",
        "called dist.all_reduce 6 times",
    ),
    "hook, blocking all-reduce": (
        "ch03b.fp16_hook",
        HOOK
        + """    half = buffer.half() / dist.get_world_size()
    dist.all_reduce(half)
    buffer.copy_(half)
    fut = torch.futures.Future()
    fut.set_result(buffer)
    return fut
""",
        "blocked until done",
    ),
    "hook, returns the float16 tensor": (
        "ch03b.fp16_hook",
        HOOK
        + """    half = buffer.half() / dist.get_world_size()
    return dist.all_reduce(half, async_op=True).get_future().then(lambda f: f.value()[0])
""",
        r"returns \['float16', 404554\]",
    ),
    "hook, no division": (
        "ch03b.fp16_hook",
        HOOK
        + """    half = buffer.half()
    def back(f):
        buffer.copy_(f.value()[0])
        return buffer
    return dist.all_reduce(half, async_op=True).get_future().then(back)
""",
        r"moved [12]\.\d× as far .* divide by the world size",
    ),
    "buckets, wait after step": (
        "ch03b.bucketed_by_hand",
        BUCKETS.format(**{**RIGHT, "order": "optimizer.step()\n    model.finish_gradient_sync()"}),
        r"optimizer.step\(\) ran while 2 all-reduce\(s\) were still in flight",
    ),
    "buckets, no division": (
        "ch03b.bucketed_by_hand",
        BUCKETS.format(**{**RIGHT, "divide": "pass"}),
        r"moved [12]\.\d× as far .* divide by the world size",
    ),
    "buckets, a blocking all-reduce in the hook": (
        "ch03b.bucketed_by_hand",
        BUCKETS.format(**RIGHT)
        .replace(
            "self.pending.append((dist.all_reduce(flat, async_op=True), flat, grads))",
            "dist.all_reduce(flat)\n            self.pending.append((_Done(), flat, grads))",
        )
        .replace(
            "class MyBucketedDDP", "class _Done:\n    def wait(self): pass\nclass MyBucketedDDP"
        ),
        r"2 all-reduce\(s\) blocked until done: without async_op=True",
    ),
    "buckets, the last bucket never launched": (
        "ch03b.bucketed_by_hand",
        BUCKETS.format(**{**RIGHT, "never": " and b == 0"}),
        r"the all-reduce of bucket\(s\) \[1\] was never launched",
    ),
    "join, rank 0 stalls in its second step": (
        "ch03c.join_uneven",
        """import os, time
from torch.distributed.algorithms.join import Join
def train_uneven(model, optimizer, loss_fn, batches):
    with Join([model]):
        for i, (x, y) in enumerate(batches):
            if i == 1 and os.environ["RANK"] == "0":
                time.sleep(4)  # longer than the timeout, while every rank still trains
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            optimizer.step()
""",
        "timed out in step 2 of 6, where every rank still trains: the machine was too busy",
    ),
    "join, the loss all-reduced in every step": (
        "ch03c.join_uneven",
        JOIN.format(
            **{
                **RIGHT_JOIN,
                "record": "t = loss.detach().clone(); dist.all_reduce(t); "
                "total += torch.tensor([t.item(), 1.0])",
            }
        ),
        "rank 0 had trained its 4 batches and waited inside Join .* which Join does not shadow",
    ),
    "join, each rank's own mean": (
        "ch03c.join_uneven",
        JOIN.format(**{**RIGHT_JOIN, "reduce": "pass"}),
        "the ranks returned different mean losses",
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", WRONG)
@pytest.mark.slow
def test_checkers_name_what_is_wrong(name, tmp_path, monkeypatch):
    checker, source, hint = WRONG[name]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "answer.py").write_text(source)
    module, function = checker.split(".")
    with pytest.raises(ExerciseError, match=hint):
        getattr(getattr(exercises, module), function)("answer.py")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "predicted, hint",
    [
        (
            {0.001: [650, 401472, 2432], 0.005: [402122, 2400, 32]},
            "DDP did not make 3 buckets: .* not in model.parameters",
        ),
        (
            {0.001: [650, 401472, 2400, 32], 0.005: ["402122", 2400, 32]},
            r"predicted\[0.005\] is .*integers",
        ),
    ],
)
def test_bucket_layout_names_the_rule(predicted, hint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ExerciseError, match=hint):
        exercises.ch03b.bucket_layout(predicted)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_join_passes_when_a_rank_starts_late(tmp_path, monkeypatch, capsys):
    """Rank 1 imports the module 4 s late (longer than DDP's 3 s timeout): no error, since only
    DDP's own group has the short timeout."""
    monkeypatch.chdir(tmp_path)
    late = 'if os.environ.get("RANK") == "1":\n    time.sleep(4)'
    (tmp_path / "answer.py").write_text(JOIN.format(**{**RIGHT_JOIN, "prelude": late}))
    exercises.ch03c.join_uneven("answer.py")
    assert capsys.readouterr().out.startswith("✓ 03c.1 join: ")
