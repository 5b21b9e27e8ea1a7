"""The launcher: checks before start, root-cause failures, stop/interrupt, ports, no leftovers."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import workers

from mgtutorial import ddp, launch
from mgtutorial.hello import HelloConfig, hello
from mgtutorial.runtime import env, launcher, runlog, torchelastic
from mgtutorial.runtime.failure import WorkerFailed
from mgtutorial.runtime.launcher import WorkerNotImportable


def defined_in_main(cfg):  # pretend this came from a notebook cell
    return None


defined_in_main.__module__ = "__main__"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attempt", range(3))
def test_failing_rank_is_named(attempt, runs, no_leftovers):
    # rank 1 raises at step 2; rank 0 would wait 600 s in its collective if nobody stopped it
    run = launch(workers.fail_at_step, workers.FailConfig(rank=1, step=2), 2, runs_dir=runs)
    with pytest.raises(WorkerFailed) as info:
        run.wait(timeout=30)
    err = info.value
    assert err.rank == 1, str(err)
    assert err.exc_type == "RuntimeError"
    assert "injected failure on rank 1 at step 2" in str(err)
    assert str(run.log_path(1)) in str(err)
    assert not runlog.read_json(run.run_dir / "rank1.error.json")["secondary"]
    assert run.status == "failed" and run.alive() == 0


@pytest.mark.timeout(30)
def test_failing_rank_0_is_named_too(runs, no_leftovers):
    run = launch(workers.fail_at_step, workers.FailConfig(rank=0, step=1), 2, runs_dir=runs)
    with pytest.raises(WorkerFailed) as info:
        run.wait(timeout=30)
    assert info.value.rank == 0 and "injected failure on rank 0 at step 1" in str(info.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranks", [(1,), (0, 1)], ids=["one-rank", "every-rank"])
def test_interrupted_rank_ends_the_run(ranks, runs, no_leftovers):
    # torch.multiprocessing turns a rank's KeyboardInterrupt into exit code 0 with no return
    # value, which TorchElastic reports as neither a result nor a failure: without the launcher's
    # own check the run would stay "running" forever (and watch() with it)
    run = launch(workers.interrupted, workers.InterruptConfig(ranks=ranks), 2, runs_dir=runs)
    with pytest.raises(WorkerFailed) as info:
        run.wait(timeout=40)
    assert info.value.rank in ranks and info.value.exc_type == "KeyboardInterrupt", str(info.value)
    assert run.status == "failed" and run.alive() == 0


def test_more_ranks_than_the_fork_server_can_start_is_refused_before_start(runs):
    n = launcher.FORKSERVER_MAX_RANKS + 1
    with pytest.raises(ValueError, match=rf"nprocs={n}: .* start_method='spawn'"):
        launch(hello, HelloConfig(), n, runs_dir=runs, start_method="forkserver")
    assert not list(runs.iterdir()), "nothing may be started or created"


def test_worker_from_main_is_refused_before_start(runs):
    with pytest.raises(WorkerNotImportable, match=r"\.py file"):
        launch(defined_in_main, None, 2, runs_dir=runs)
    with pytest.raises(WorkerNotImportable, match="<locals>"):
        launch(lambda cfg: None, None, 2, runs_dir=runs)
    assert not list(runs.iterdir()), "nothing may be started or created"


def test_bad_configurations_are_refused_before_start(runs, monkeypatch):
    with pytest.raises(ValueError, match="nprocs=0"):
        launch(hello, HelloConfig(), 0, runs_dir=runs)
    # a bool is an int to Python, not a rank count
    with pytest.raises(ValueError, match="nprocs=True"):
        launch(hello, HelloConfig(), True, runs_dir=runs)
    with pytest.raises(ValueError, match="backend='mpi'"):
        launch(hello, HelloConfig(backend="mpi"), 2, runs_dir=runs)
    monkeypatch.setattr(env, "gpu_count", lambda: 0)
    with pytest.raises(ValueError, match="needs CUDA GPUs.*gloo"):
        launch(hello, HelloConfig(backend="nccl"), 2, runs_dir=runs)
    monkeypatch.setattr(env, "gpu_count", lambda: 1)
    with pytest.raises(ValueError, match="2 ranks per node needs 2 GPUs, but 1"):
        launch(hello, HelloConfig(backend="nccl"), 2, runs_dir=runs)
    with pytest.raises(ValueError, match="backend='gloo' but cfg.backend='nccl'"):
        launch(hello, HelloConfig(backend="nccl"), 2, backend="gloo", runs_dir=runs)
    with pytest.raises(ValueError, match="batch_size=0: must be at least 1"):
        launch(ddp.worker, ddp.DDPConfig(batch_size=0), 2, runs_dir=runs)
    with pytest.raises(
        FileNotFoundError, match="(?s)CIFAR-10 is not in .*python -m mgtutorial data cifar10"
    ):
        launch(
            ddp.worker,
            ddp.DDPConfig(dataset="cifar10", data_root=str(runs / "nothing")),
            2,
            runs_dir=runs,
        )
    assert not list(runs.iterdir())


@pytest.mark.timeout(30)
def test_taken_port_gives_clear_error_at_once(runs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"master_port={port}.*already in use"):
            launch(hello, HelloConfig(), 2, runs_dir=runs, master_port=port)
    assert not list(runs.iterdir())


@pytest.mark.timeout(60)
def test_back_to_back_launches_both_succeed(runs, no_leftovers):
    for _ in range(2):
        result = launch(hello, HelloConfig(), 2, runs_dir=runs).wait(timeout=30)
        assert sorted(result.values) == [0, 1]
        assert all(v["rank_sum"] == 1 and v["world_size"] == 2 for v in result.values.values())
        assert {v["rank"] for v in result.values.values()} == {0, 1}
    assert len(list(runs.iterdir())) == 2


def _first_record(run, timeout=30):
    deadline = time.monotonic() + timeout
    while not list(run.run_dir.glob("rank*.jsonl")) or not all(
        run.log_path(r, "jsonl").exists() and run.log_path(r, "jsonl").stat().st_size
        for r in range(run.nprocs)
    ):
        assert time.monotonic() < deadline, "ranks never started logging"
        time.sleep(0.1)


@pytest.mark.timeout(60)
def test_stop_leaves_no_process(runs, no_leftovers):
    run = launch(workers.sleeper, workers.SleepConfig(seconds=120), 2, runs_dir=runs)
    _first_record(run)
    pids = list(run.pids.values())
    assert run.alive() == 2 and run.poll() is None
    run.stop()
    assert run.status == "stopped" and run.alive() == 0
    assert not [
        p
        for p in pids
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]


@pytest.mark.timeout(60)
def test_interrupt_while_waiting_stops_all_ranks(runs, no_leftovers):
    run = launch(workers.sleeper, workers.SleepConfig(seconds=120), 2, runs_dir=runs)
    _first_record(run)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        run.wait()
    assert run.status == "stopped" and run.alive() == 0


@pytest.mark.timeout(60)
def test_rank_that_finished_then_aborted_counts_as_finished(runs, no_leftovers):
    run = launch(workers.finish_then_abort, workers.AbortConfig(rank=1), 2, runs_dir=runs)
    with pytest.warns(RuntimeWarning, match="every rank finished its work"):
        result = run.wait(timeout=30)
    assert result.values == {0: "done", 1: "done"}
    assert result.exit_codes[1] == -signal.SIGABRT


@pytest.mark.timeout(60)
def test_environment_contract(runs, no_leftovers):
    result = launch(hello, HelloConfig(), 2, runs_dir=runs).wait(timeout=30)
    for r, rec in result.values.items():
        assert rec["local_rank"] == r and rec["world_size"] == 2 and rec["backend"] == "gloo"
        # no elastic agent: is_torchelastic_launched() is False
        assert rec["env"]["TORCHELASTIC_RUN_ID"] is None
    out = (result.run_dir / "rank1.out").read_text()
    assert "[rank 1] hello, world size 2" in out  # each rank's stdout lands in its own file
    assert "[rank 1]" not in (result.run_dir / "rank0.out").read_text()


def _levels() -> list[int]:
    return [logging.getLogger(name).level for name in torchelastic.LOGGERS]


def test_importing_the_engine_leaves_torchelastic_loggers_alone():
    code = (
        "import logging, torch.distributed.elastic.multiprocessing.api, torch.multiprocessing\n"
        "from mgtutorial.runtime import torchelastic\n"
        "names = torchelastic.LOGGERS\n"
        "before = [logging.getLogger(n).level for n in names]\n"
        "import mgtutorial.runtime.launcher, mgtutorial.runtime.run\n"
        "print(before == [logging.getLogger(n).level for n in names])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("True"), out.stdout


@pytest.mark.timeout(90)
def test_torchelastic_loggers_are_quiet_only_while_a_run_is_active(runs, no_leftovers):
    mine = logging.INFO  # a learner's own setting, for their own torchrun code
    saved = _levels()
    for name in torchelastic.LOGGERS:
        logging.getLogger(name).setLevel(mine)
    try:
        first = launch(workers.sleeper, workers.SleepConfig(seconds=120), 2, runs_dir=runs)
        assert _levels() == [logging.CRITICAL] * 2
        second = launch(workers.fail_at_step, workers.FailConfig(rank=1, step=1), 2, runs_dir=runs)
        with pytest.raises(WorkerFailed):
            second.wait(timeout=30)
        assert _levels() == [logging.CRITICAL] * 2, "restored while another run was active"
        first.stop()
        assert _levels() == [mine] * 2
        launch(hello, HelloConfig(), 1, runs_dir=runs).wait(timeout=30)
        assert _levels() == [mine] * 2
    finally:
        for name, level in zip(torchelastic.LOGGERS, saved):
            logging.getLogger(name).setLevel(level)


def test_silence_loggers_releases_once_per_holder():
    saved = _levels()
    release_a, release_b = torchelastic.silence_loggers(), torchelastic.silence_loggers()
    release_a()
    release_a()  # a second call does nothing: b still holds them
    assert _levels() == [logging.CRITICAL] * 2
    release_b()
    assert _levels() == saved
