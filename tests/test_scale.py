"""Chapter 05: torchrun on simulated nodes, elastic restart from snapshots, hangs, SLURM script."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import pytest
import torch

from mgtutorial import ddp, launch
from mgtutorial.__main__ import build_parser, main
from mgtutorial.runtime import runlog
from mgtutorial.runtime.run import WorkerFailed
from mgtutorial.scale import elastic, hangs, restarts, slurm, torchrun
from mgtutorial.scale.output import agent_times, digest

ROOT = Path(__file__).resolve().parents[1]


def test_torchrun_command_forms():
    one = torchrun.torchrun_command(["ddp"], nproc_per_node=2)
    assert one[1:] == ["--nproc-per-node", "2", "--standalone", "-m", "mgtutorial", "ddp"]
    dyn = torchrun.torchrun_command(
        ["ddp"], nproc_per_node=4, nnodes=2, rdzv_endpoint="head:29500", run_id="j1"
    )
    assert "--node-rank" not in dyn and dyn[dyn.index("--rdzv-endpoint") + 1] == "head:29500"
    static = torchrun.torchrun_command(
        ["ddp"], nnodes=2, node_rank=1, rdzv_endpoint="head:29500", max_restarts=3
    )
    assert (
        static[static.index("--node-rank") + 1] == "1"
        and static[static.index("--master-addr") + 1] == "head"
    )
    assert static[static.index("--max-restarts") + 1] == "3"
    other = torchrun.torchrun_command(["out"], module="mgtutorial.exercises.ch05a_store")
    assert other[-3:] == ["-m", "mgtutorial.exercises.ch05a_store", "out"]
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        torchrun.torchrun_command(["ddp"], nnodes=2)
    with pytest.raises(ValueError, match="node_rank=2"):
        torchrun.torchrun_command(["ddp"], nnodes=2, node_rank=2, rdzv_endpoint="h:1")


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_two_simulated_nodes_give_distinct_ranks(tmp_path, no_leftovers):
    with torchrun.simulated_nodes(
        ["hello", "--runs-dir", str(tmp_path), "--run-name", "two"],
        nnodes=2,
        nproc_per_node=1,
        log_dir=tmp_path / "agents",
    ) as agents:
        assert agents.wait(100) == [0, 0], agents.output(0)[-2000:]
    rows = torchrun.rank_table(runlog.read_run(tmp_path / "two"))
    assert [r["RANK"] for r in rows] == [0, 1]
    assert [r["LOCAL_RANK"] for r in rows] == [0, 0]  # one process per node: local rank 0 on both
    assert sorted(r["GROUP_RANK"] for r in rows) == [0, 1] and {r["WORLD_SIZE"] for r in rows} == {
        2
    }


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_killed_rank_restarts_from_snapshot_and_matches_uninterrupted(tmp_path, no_leftovers):
    base = [
        "elastic",
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
    code, out = torchrun.run_torchrun(
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
    code, out = torchrun.run_torchrun(
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


def _elastic_attempt(
    cfg: elastic.ElasticConfig, runs, restart: int
) -> tuple[list[dict], WorkerFailed]:
    """Attempt ``restart`` of an elastic job, started by launch as torchrun would start it
    (``TORCHELASTIC_RESTART_COUNT``): its records and its failure (None if every rank finished)."""
    run = launch(
        elastic.elastic_worker,
        cfg,
        2,
        runs_dir=runs,
        name=f"attempt{restart}",
        extra_env={"TORCHELASTIC_RESTART_COUNT": str(restart)},
    )
    failure = None
    try:
        run.wait(timeout=90)
    except WorkerFailed as e:
        failure = e
    finally:
        run.stop()
    return runlog.read_run(run.run_dir), failure


@pytest.mark.timeout(240)
def test_elastic_trainer_kills_the_named_rank_and_resumes_from_its_snapshot(runs, no_leftovers):
    # 12 steps of one epoch, a snapshot every 4; rank 1 SIGKILLs itself once it has logged step 10
    # (its RuntimeError with fail_how="raise": tests/test_launch.py)
    cfg = elastic.ElasticConfig(
        dataset="digits",
        epochs=1,
        max_steps=12,
        evaluate=False,
        backend="gloo",
        timeout_s=30,
        checkpoint=str(runs / "snap.pt"),
        checkpoint_every=4,
        resume=True,
        fail_rank=1,
        fail_step=10,
        fail_how="sigkill",
    )
    before, failure = _elastic_attempt(cfg, runs, 0)
    assert failure is not None and failure.rank == 1 and "SIGKILL" in failure.message, failure
    steps = {
        r: [x["step"] for x in before if x["kind"] == "train" and x["rank"] == r] for r in (0, 1)
    }
    assert steps[1] == list(range(1, 11))  # rank 1 logged step 10, then failed
    assert steps[0][-1] in (10, 11)  # rank 0 cannot finish step 11 without rank 1
    snaps = [(x["step"], x["batch"]) for x in before if x["kind"] == "checkpoint"]
    assert snaps == [(4, 4), (8, 8)]  # mid-epoch snapshots, none after the failure

    after, failure = _elastic_attempt(cfg, runs, 1)  # the restart: no fault, resumes from step 8
    assert failure is None, failure
    resumes = {
        (x["rank"], x["step"], x["batch"], x["attempt"]) for x in after if x["kind"] == "resume"
    }
    assert resumes == {(0, 8, 8, 1), (1, 8, 8, 1)}
    assert sorted({x["step"] for x in after if x["kind"] == "train"}) == list(range(9, 13))

    final = torch.load(cfg.checkpoint, map_location="cpu", weights_only=True)
    assert (final["step"], final["epoch"], final["batch"]) == (12, 0, 12)
    uninterrupted = ddp.combined_batch_reference(dataclasses.replace(cfg, fail_rank=-1), 2)
    torch.testing.assert_close(final["model"], uninterrupted.state_dict())


MOVED = ["--checkpoint-every", "--fail-rank", "--fail-step", "--fail-how"]  # from ddp to elastic


def test_base_trainer_takes_no_step_snapshots_and_injects_no_fault():
    base = {f.name for f in dataclasses.fields(ddp.DDPConfig)}
    fields = {f.name for f in dataclasses.fields(elastic.ElasticConfig)}
    assert fields - base == {"checkpoint_every", "pause_s", "fail_rank", "fail_step", "fail_how"}
    overridden = [m for m in vars(elastic.ElasticTrainer) if callable(getattr(ddp.Trainer, m, 0))]
    assert overridden == ["_log_step"]  # one method of the loop


@pytest.mark.parametrize(
    "cfg, match",
    [
        (elastic.ElasticConfig(checkpoint_every=-3), "checkpoint_every=-3: must be at least 0"),
        (elastic.ElasticConfig(fail_rank=7), r"fail_rank=7: must be -1 \(none\) or a rank of the"),
        (elastic.ElasticConfig(fail_step=0), r"fail_step=0: must be at least 1 \(or -1: never\)"),
        (elastic.ElasticConfig(fail_how="segfault"), "fail_how='segfault': must be one of 'raise'"),
        (elastic.ElasticConfig(epochs=0), "epochs=0: must be at least 1"),  # chapter 02's checks
        (elastic.ElasticConfig(resume=True), "resume=True needs the file to resume from"),
        (hangs.HangConfig(backend="mpi"), "backend='mpi': must be one of 'auto', 'gloo', 'nccl'"),
        (hangs.HangConfig(skip_rank=2), r"skip_rank=2: must be -1 \(none\) or a rank of the job"),
        (hangs.HangConfig(timeout_s=0), "timeout_s=0: must be positive"),
        (hangs.HangConfig(steps=0), "steps=0: must be at least 1"),
    ],
)
def test_configs_refuse_values_out_of_range(cfg, match):
    with pytest.raises(ValueError, match=match):
        cfg.validate(2)


def test_fault_injection_and_snapshots_are_options_of_elastic_not_of_ddp(capsys):
    for command, listed in (("ddp", []), ("elastic", MOVED)):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        text = capsys.readouterr().out
        assert info.value.code == 0 and [o for o in MOVED if o in text] == listed, text
    assert "--fail-how {raise,sigkill}" in text  # the choices, read from the Literal

    argv = "elastic --checkpoint c.pt --checkpoint-every 5 --resume --fail-rank 1 --fail-step 12"
    args = build_parser().parse_args([*argv.split(), "--fail-how", "sigkill"])
    fields = dataclasses.fields(args.config_class)
    cfg = args.config_class(**{f.name: getattr(args, f.name) for f in fields})
    assert cfg == elastic.ElasticConfig(
        checkpoint="c.pt",
        checkpoint_every=5,
        resume=True,
        fail_rank=1,
        fail_step=12,
        fail_how="sigkill",
    )
    defaults = build_parser().parse_args(["elastic"])
    assert args.config_class(**{f.name: getattr(defaults, f.name) for f in fields}) == type(cfg)()
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["elastic", "--fail-how", "segfault"])
    assert info.value.code == 2 and "invalid choice: 'segfault'" in capsys.readouterr().err


def expected_type(message: str) -> str:
    """The type :func:`hangs.hang_worker` must raise for the backend error its ``message`` quotes,
    told from the backend's own words: gloo's timeout or DETAIL's monitored barrier is a
    TimeoutError; a peer that left or DETAIL's fingerprint mismatch a RuntimeError. An error of
    neither kind fails the test."""
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
        hangs.hang_worker, hangs.HangConfig(timeout_s=timeout_s, rank_work_s=60), 2, runs_dir=runs
    )
    # both ranks end up waiting (rank 1's step-2 call was paired with rank 0's smaller step-1 call);
    # whichever times out first is reported
    with pytest.raises(
        WorkerFailed, match=r"all_reduce of step 2 on rank [01] (timed out|failed) after"
    ) as info:
        run.wait(timeout=45)
    r, err = info.value.rank, info.value
    # the rank whose own timeout struck says so in its type; a rank whose peer left first is a
    # RuntimeError
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
        hangs.hang_worker,
        hangs.HangConfig(timeout_s=30, rank_work_s=60),
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
    cfg = hangs.HangConfig(skip_step=2, timeout_s=2, rank_work_s=20, backend="gloo")
    run = launch(
        hangs.hang_worker, cfg, 2, runs_dir=runs, extra_env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
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
        hangs.hang_worker, hangs.HangConfig(timeout_s=60, rank_work_s=60), 2, runs_dir=runs
    )
    try:
        pids = hangs.pids_at_collective(run.run_dir, step=2, nranks=2, timeout=40)
        time.sleep(0.5)
        dump = hangs.py_spy_dump(pids[0])
    finally:
        run.stop()
    assert sorted(pids) == [0, 1]
    assert "all_reduce" in dump and "hang_worker" in dump, dump
    frames = hangs.main_thread_frames(dump)
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
    assert digest(out).splitlines() == [
        "[rank 0] hello from pid … on cpu",
        "agent W: Sending process … closing signal SIGTERM",
        "agent E: failed (exitcode: -9) local_rank: 1 (pid: …)",
        "(2 more lines: tracebacks and C++ stacks)",
    ]
    info = "I1201 08:38:09.126000 28833 torch/distributed/elastic/agent/server/api.py:715] x\n"
    assert digest(out + info).splitlines()[-1] == (
        "(3 more lines: tracebacks and C++ stacks, agent INFO lines)"
    )
    ((when, level, message),) = agent_times(info, 2026)
    assert (level, message) == ("I", "x") and time.localtime(when)[:6] == (2026, 12, 1, 8, 38, 9)


JOB = {
    "SLURM_NNODES": "2",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu-a[17-18]",
    "SLURM_GPUS_ON_NODE": "4",
    "SLURM_CPUS_PER_TASK": "16",
}


def test_sbatch_builds_srun_torchrun_command():
    out = slurm.dry_run(JOB, ["gpu-a17", "gpu-a18"], ["--epochs", "3"])
    assert out.returncode == 0, out.stderr
    omp, srun = out.stdout.splitlines()
    assert omp == "OMP_NUM_THREADS=4"
    assert srun.split() == [
        "srun",
        "--kill-on-bad-exit=1",
        "--cpus-per-task=16",  # srun does not inherit it from sbatch (Slurm >= 22.05)
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
    assert slurm.torchrun_options(out.stdout) == {
        "--nnodes": "2",
        "--nproc-per-node": "4",
        "--rdzv-id": "4242",
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": "gpu-a17:29500",
        "OMP_NUM_THREADS": "4",
    }
    bad = slurm.dry_run({}, [])  # outside a job: no SLURM_NNODES
    assert bad.returncode != 0 and "run this under sbatch" in bad.stderr


@pytest.mark.parametrize("cpus, gpus, omp", [("16", "4", "4"), ("4", "8", "1"), ("6", "4", "1")])
def test_sbatch_gives_each_rank_at_least_one_thread(cpus, gpus, omp):
    job = dict(JOB, SLURM_GPUS_ON_NODE=gpus, SLURM_CPUS_PER_TASK=cpus)
    out = slurm.dry_run(job, ["n1", "n2"])
    assert out.returncode == 0, out.stderr
    # the task's cores per rank, rounded down, and never 0
    assert slurm.torchrun_options(out.stdout)["OMP_NUM_THREADS"] == omp


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_restarted_ranks_agree_on_the_round_when_restart_counts_differ(no_leftovers):
    """Why env.distributed prefixes the store with a round the ranks agree on
    (runtime.rounds.agree_on_round). Two starts on one store, as under torchrun's node-0 agent;
    in the second, node A's rank restarts with TORCHELASTIC_RESTART_COUNT 0 (a membership change
    does not count) and node B's with 1. On the bare store the second start adds no key (it reads
    and writes the first start's: a rank can read a dead rank's address); with a prefix per restart
    count the two ranks look for each other under different keys and never meet; with the agreed
    round they form the group, on keys of their own. The ranks are forked from one process that
    imported torch once; the failing case costs its timeout (6 s), at most twice."""
    out = restarts.simulate(["bare store", "restart count", "round"], counts=(0, 1), timeout_s=6)
    for how in out:
        assert out[how]["exit codes"][0] == [0, 0], (how, out[how])  # a first start works
    assert out["bare store"]["new keys"] == 0
    assert out["restart count"]["exit codes"][1] != [0, 0]
    assert out["round"]["exit codes"][1] == [0, 0] and out["round"]["new keys"] > 0


def test_agree_on_round_ignores_a_dead_start_s_keys():
    """Rank 0 answers whatever ticket rank 1 last posted, but waits for an acknowledgement that
    holds its own round: a ticket and an acknowledgement left by an earlier start do not count."""
    import datetime
    import threading

    import torch.distributed as dist

    from mgtutorial.runtime.rounds import KEY, agree_on_round

    store, timeout = dist.HashStore(), datetime.timedelta(seconds=10)
    store.add(f"{KEY}/rounds", 5)  # five earlier starts
    store.add(f"{KEY}/tickets", 7)  # seven tickets of their ranks 1
    store.set(f"{KEY}/rank1", "6")  # a dead rank 1's ticket, answered and acknowledged
    store.set(f"{KEY}/ack/6", "5")
    got = {}
    zero = threading.Thread(target=lambda: got.update({0: agree_on_round(store, 0, 2, timeout)}))
    zero.start()
    got[1] = agree_on_round(store, 1, 2, timeout)
    zero.join(timeout=20)
    assert got == {0: 6, 1: 6}  # the round after the five, whichever rank arrived first


def test_agent_env_sets_one_omp_thread_only_when_unset(monkeypatch):
    # torchrun's agent passes its own OMP_NUM_THREADS on; torchrun sets 1 only if unset and
    # nproc > 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("RANK", "3")  # a notebook started inside a job must not leak its identity
    e = torchrun.agent_env()
    assert e["OMP_NUM_THREADS"] == "1" and "RANK" not in e and e["GLOO_SOCKET_IFNAME"]
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert torchrun.agent_env()["OMP_NUM_THREADS"] == "4"
