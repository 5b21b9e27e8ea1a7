"""Chapter 05: torchrun on simulated nodes, elastic restart from snapshots, hangs, SLURM script."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mgtutorial import launch
from mgtutorial.runtime import runlog
from mgtutorial.runtime.run import WorkerFailed
from mgtutorial.scale import torchrun as scale

ROOT = Path(__file__).resolve().parents[1]


def test_torchrun_command_forms():
    one = scale.torchrun_command(["ddp"], nproc_per_node=2)
    assert one[1:] == ["--nproc-per-node", "2", "--standalone", "-m", "mgtutorial", "ddp"]
    dyn = scale.torchrun_command(
        ["ddp"], nproc_per_node=4, nnodes=2, rdzv_endpoint="head:29500", run_id="j1"
    )
    assert "--node-rank" not in dyn and dyn[dyn.index("--rdzv-endpoint") + 1] == "head:29500"
    static = scale.torchrun_command(
        ["ddp"], nnodes=2, node_rank=1, rdzv_endpoint="head:29500", max_restarts=3
    )
    assert (
        static[static.index("--node-rank") + 1] == "1"
        and static[static.index("--master-addr") + 1] == "head"
    )
    assert static[static.index("--max-restarts") + 1] == "3"
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        scale.torchrun_command(["ddp"], nnodes=2)
    with pytest.raises(ValueError, match="node_rank=2"):
        scale.torchrun_command(["ddp"], nnodes=2, node_rank=2, rdzv_endpoint="h:1")


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_two_simulated_nodes_give_distinct_ranks(tmp_path, no_leftovers):
    with scale.simulated_nodes(
        ["hello", "--runs-dir", str(tmp_path), "--run-name", "two"],
        nnodes=2,
        nproc_per_node=1,
        log_dir=tmp_path / "agents",
    ) as agents:
        assert agents.wait(100) == [0, 0], agents.output(0)[-2000:]
    rows = scale.rank_table(runlog.read_run(tmp_path / "two"))
    assert [r["RANK"] for r in rows] == [0, 1]
    assert [r["LOCAL_RANK"] for r in rows] == [0, 0]  # one process per node: local rank 0 on both
    assert sorted(r["GROUP_RANK"] for r in rows) == [0, 1] and {r["WORLD_SIZE"] for r in rows} == {
        2
    }


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_killed_rank_restarts_from_snapshot_and_matches_uninterrupted(tmp_path, no_leftovers):
    base = [
        "ddp",
        "--dataset",
        "digits",
        "--epochs",
        "2",
        "--no-evaluate",
        "--checkpoint-every",
        "5",
        "--resume",
        "--runs-dir",
        str(tmp_path),
    ]
    code, out = scale.run_torchrun(
        base
        + [
            "--checkpoint",
            str(tmp_path / "a.pt"),
            "--run-name",
            "a",
            "--fail-rank",
            "1",
            "--fail-step",
            "32",
            "--fail-how",
            "sigkill",
        ],
        max_restarts=1,
        log_dir=tmp_path / "ag",
        timeout=200,
    )
    assert code == 0, out[-3000:]
    recs = runlog.read_run(tmp_path / "a")
    resumes = [r for r in recs if r.get("kind") == "resume"]
    assert {(r["rank"], r["attempt"], r["step"]) for r in resumes} == {(0, 1, 30), (1, 1, 30)}
    code, out = scale.run_torchrun(
        base + ["--checkpoint", str(tmp_path / "b.pt"), "--run-name", "b"],
        log_dir=tmp_path / "bg",
        timeout=200,
    )
    assert code == 0, out[-3000:]
    a, b = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in "ab")
    assert a["step"] == b["step"] and a["epoch"] == b["epoch"] == 2
    for k in b["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k])
    for k in ("model", "optimizer", "epoch", "step"):
        assert k in a  # what a snapshot holds


def expected_type(message: str) -> str:
    """The type :func:`scale.hang_worker` must raise for the backend error its ``message`` quotes, told
    from the backend's own words: gloo's timeout or DETAIL's monitored barrier is a TimeoutError; a peer
    that left or DETAIL's fingerprint mismatch a RuntimeError. An error of neither kind fails the test."""
    backend = message.split(" s): ", 1)[-1]
    if "Timed out waiting" in backend or "failed to pass monitoredBarrier" in backend:
        return "TimeoutError"
    if "Detected mismatch between collectives" in backend or re.search(
        r"Connection (closed|reset) by peer|Socket closed|Broken pipe", backend
    ):
        return "RuntimeError"
    pytest.fail(f"a backend error this test does not classify: {backend!r}")


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_skipped_collective_times_out_naming_it(runs, no_leftovers):
    timeout_s = 3
    run = launch(
        scale.hang_worker, scale.HangConfig(timeout_s=timeout_s, rank_work_s=60), 2, runs_dir=runs
    )
    # both ranks end up waiting (rank 1's step-2 call was paired with rank 0's smaller step-1 call);
    # whichever times out first is reported
    with pytest.raises(
        WorkerFailed, match=r"all_reduce of step 2 on rank [01] (timed out|failed) after"
    ) as info:
        run.wait(timeout=45)
    r, err = info.value.rank, info.value
    # the rank whose own timeout struck says so in its type; a rank whose peer left first is a RuntimeError
    assert err.exc_type == expected_type(err.message), err.message
    assert ("timed out after" in err.message) == (err.exc_type == "TimeoutError"), err.message
    start = [
        x
        for x in runlog.read_run(run.run_dir)
        if x.get("kind") == "collective_start" and x["rank"] == r
    ][-1]
    failed = runlog.read_json(run.run_dir / f"rank{r}.error.json")["time"]
    assert failed - start["time"] >= timeout_s - 0.5  # a timeout cannot strike before it is due


@pytest.mark.timeout(60)
def test_debug_detail_names_the_mismatch(runs, no_leftovers):
    run = launch(
        scale.hang_worker,
        scale.HangConfig(timeout_s=30, rank_work_s=60),
        2,
        runs_dir=runs,
        extra_env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
    )
    with pytest.raises(
        WorkerFailed, match="Detected mismatch between collectives"
    ) as info:  # not a timeout
        run.wait(timeout=45)
    assert info.value.exc_type == expected_type(info.value.message) == "RuntimeError", (
        info.value.exc_type
    )
    assert re.search(r"all_reduce of step [12] on rank [01] failed after", info.value.message), (
        info.value.message
    )


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_debug_detail_names_the_rank_that_never_arrives(runs, no_leftovers):
    # rank 1 skips the last all-reduce and works alone: DETAIL's monitored barrier (the group's
    # timeout) names it, and hang_worker reports that as a timeout
    cfg = scale.HangConfig(skip_step=2, timeout_s=2, rank_work_s=20, backend="gloo")
    run = launch(
        scale.hang_worker, cfg, 2, runs_dir=runs, extra_env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    )
    try:
        with pytest.raises(
            WorkerFailed, match=r"Ranks? 1 failed to pass monitoredBarrier in 2000 ms"
        ) as info:
            run.wait(timeout=45)
    finally:
        run.stop()
    assert (info.value.rank, info.value.exc_type) == (0, "TimeoutError"), info.value
    assert "all_reduce of step 2 on rank 0 timed out after" in info.value.message, (
        info.value.message
    )


@pytest.mark.timeout(60)
def test_py_spy_shows_where_a_hung_rank_waits(runs, no_leftovers):
    run = launch(
        scale.hang_worker, scale.HangConfig(timeout_s=60, rank_work_s=60), 2, runs_dir=runs
    )
    try:
        pids = scale.pids_at_collective(run.run_dir, step=2, nranks=2, timeout=40)
        time.sleep(0.5)
        dump = scale.py_spy_dump(pids[0])
    finally:
        run.stop()
    assert sorted(pids) == [0, 1]
    assert "all_reduce" in dump and "hang_worker" in dump, dump
    frames = scale.main_thread_frames(dump)
    assert frames[0].startswith("all_reduce") and any(
        f.startswith("hang_worker") for f in frames
    ), frames


def test_digest_keeps_rank_lines_and_agent_messages_without_machine_noise():
    out = (
        "[rank 0] hello from pid 4321 on cpu\n"
        "W1201 08:38:09.062000 28833 torch/distributed/elastic/multiprocessing/api.py:1028] "
        "Sending process 28861 closing signal SIGTERM\n"
        "E1201 08:38:09.126000 28833 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
        "(exitcode: -9) local_rank: 1 (pid: 28862) of binary: /somewhere/.venv/bin/python\n"
        'Traceback (most recent call last):\n  File "x.py", line 1\n'
    )
    assert scale.digest(out).splitlines() == [
        "[rank 0] hello from pid … on cpu",
        "agent W: Sending process … closing signal SIGTERM",
        "agent E: failed (exitcode: -9) local_rank: 1 (pid: …)",
        "(2 more lines: tracebacks and C++ stacks)",
    ]


def test_sbatch_builds_srun_torchrun_command(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in {
        "srun": 'echo "srun $*"',
        "scontrol": 'printf "gpu-a17\\ngpu-a18\\n"',
    }.items():
        (fake / name).write_text(f"#!/bin/sh\n{body}\n")
        (fake / name).chmod(stat.S_IRWXU)
    env = dict(
        os.environ,
        PATH=f"{fake}:{os.environ['PATH']}",
        SLURM_NNODES="2",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu-a[17-18]",
        SLURM_GPUS_ON_NODE="4",
        SLURM_CPUS_PER_TASK="16",
    )
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm/ddp.sbatch"), "--epochs", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "srun",
        "--kill-on-bad-exit=1",
        "torchrun",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--rdzv-id",
        "4242",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "gpu-a17:29500",
        "-m",
        "mgtutorial",
        "ddp",
        "--epochs",
        "3",
    ]
    bad = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm/ddp.sbatch")],
        env={"PATH": env["PATH"]},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode != 0 and "run this under sbatch" in bad.stderr


@pytest.mark.parametrize("cpus, gpus, omp", [("16", "4", "4"), ("4", "8", "1"), ("6", "4", "1")])
def test_sbatch_gives_each_rank_at_least_one_thread(tmp_path, cpus, gpus, omp):
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in {
        "srun": 'echo "$OMP_NUM_THREADS"',
        "scontrol": 'printf "n1\\nn2\\n"',
    }.items():
        (fake / name).write_text(f"#!/bin/sh\n{body}\n")
        (fake / name).chmod(stat.S_IRWXU)
    env = dict(
        os.environ,
        PATH=f"{fake}:{os.environ['PATH']}",
        SLURM_NNODES="2",
        SLURM_JOB_ID="1",
        SLURM_JOB_NODELIST="n[1-2]",
        SLURM_GPUS_ON_NODE=gpus,
        SLURM_CPUS_PER_TASK=cpus,
    )
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm/ddp.sbatch")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == omp  # the task's cores per rank, rounded down, and never 0


# One rank of an attempt on a store that outlives it, as torchrun's rank-0 agent hosts it (c10d
# rendezvous, shared TCPStore: MASTER_PORT is the same server for every attempt, and torch's own
# round prefix ``torch.rendezvous.<run id>.<round>`` applies to the agents' rendezvous store only).
ATTEMPT = """
import datetime, os, sys, time, torch, torch.distributed as dist
from mgtutorial.runtime import env
if os.environ["RANK"] == "1":
    time.sleep(float(sys.argv[2]))  # rank 1 of this attempt comes late: rank 0 reads the store first
if sys.argv[1] == "env.distributed":  # with its PrefixStore("attempt_<TORCHELASTIC_RESTART_COUNT>")
    with env.distributed("gloo", timeout_s=6):
        dist.all_reduce(t := torch.ones(1))
else:  # the same, on the bare store
    timeout = datetime.timedelta(seconds=6)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    dist.all_reduce(t := torch.ones(1))
    dist.destroy_process_group()
print("all_reduce", int(t))
"""


def _attempt(how: str, port: int, attempt: int) -> list[int]:
    env_ = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT=str(attempt),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ATTEMPT, how, "2" if attempt else "0"],
            env={**env_, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    codes = []
    for p in procs:
        try:
            p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
        codes.append(p.returncode)
    return codes


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["env.distributed", "bare store"])
@pytest.mark.slow
def test_restarted_ranks_need_the_per_attempt_prefix(how, no_leftovers):
    """Why env.distributed wraps the store in a per-attempt PrefixStore. On the bare store, attempt 1
    writes and reads under the very key names attempt 0 left behind (the key count does not grow):
    a rank can read a dead rank's gloo address before the new one is written, and then fails
    (``Gloo connectFullMesh failed ... Connect timeout``, about every other run here, depending on
    which side of the pair connects). Under the prefix each attempt has keys of its own and works."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    assert _attempt(how, server.port, 0) == [0, 0]  # the first attempt works either way
    first = server.num_keys()
    again = _attempt(how, server.port, 1)
    if how == "env.distributed":
        assert again == [0, 0] and server.num_keys() > first  # keys of its own
    else:
        assert server.num_keys() == first  # nothing new: attempt 1 used attempt 0's keys


def test_agent_env_sets_one_omp_thread_only_when_unset(monkeypatch):
    # torchrun's agent passes its own OMP_NUM_THREADS on; torchrun sets 1 only if unset and nproc > 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("RANK", "3")  # a notebook started inside a job must not leak its identity
    e = scale.agent_env()
    assert e["OMP_NUM_THREADS"] == "1" and "RANK" not in e and e["GLOO_SOCKET_IFNAME"]
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert scale.agent_env()["OMP_NUM_THREADS"] == "4"
