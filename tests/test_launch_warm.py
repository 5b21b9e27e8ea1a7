"""Warm launches from the fork server see what the learner has now; the store listens on loopback
only; a rank killed by a signal is the root cause; the ranks die with their launcher."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import workers

from mgtutorial import launch
from mgtutorial.runtime.failure import WorkerFailed
from mgtutorial.runtime.launcher import start_fork_server
from mgtutorial.runtime.procs import rank_processes

TESTS = Path(__file__).resolve().parent
HANG_GUARD_S = 120  # only there to end a hung test, never a measure of speed


@pytest.mark.timeout(HANG_GUARD_S)
def test_each_launch_runs_current_source_env_and_sys_path(
    tmp_path, runs, monkeypatch, no_leftovers
):
    pkg = tmp_path / "learner"
    pkg.mkdir()
    monkeypatch.syspath_prepend(str(pkg))  # a folder the fork server has never seen
    source = pkg / "my_worker.py"
    body = (
        "import workers\n\ndef worker(cfg):\n"
        "    return {{'version': {v!r}, 'env': workers.env_probe(cfg)['env']}}\n"
    )
    monkeypatch.setenv("MGT_PROBE_GONE", "was set")
    values = []
    for version, probe in (("first", "one"), ("second edition", "two")):
        source.write_text(body.format(v=version))  # a different size: no stale bytecode either way
        sys.modules.pop("my_worker", None)
        import my_worker

        monkeypatch.setenv("MGT_PROBE", probe)
        cfg = workers.ProbeConfig(names=["MGT_PROBE", "MGT_PROBE_GONE"])
        result = launch(my_worker.worker, cfg, 2, runs_dir=runs).wait(timeout=HANG_GUARD_S)
        values.append(result.values)
        monkeypatch.delenv("MGT_PROBE_GONE", raising=False)  # unset after the first launch
    assert [v[0]["version"] for v in values] == ["first", "second edition"]
    assert [v[1]["env"] for v in values] == [
        {"MGT_PROBE": "one", "MGT_PROBE_GONE": "was set"},
        {"MGT_PROBE": "two", "MGT_PROBE_GONE": None},
    ]


@pytest.mark.timeout(HANG_GUARD_S)
def test_ranks_fork_from_a_server_without_course_modules(runs, no_leftovers):
    run = launch(workers.env_probe, workers.ProbeConfig(), 2, runs_dir=runs)
    pids = set(run.pids.values())
    run.wait(timeout=HANG_GUARD_S)
    assert run.start_method == "forkserver"
    server = [
        p
        for p in psutil.Process().children()
        if "multiprocessing.forkserver" in " ".join(p.cmdline())
    ]
    assert len(server) == 1
    preload = " ".join(server[0].cmdline())
    assert "torch" in preload and "mgtutorial" not in preload and "workers" not in preload
    assert server[0].num_threads() == 1  # no thread pool was started there: forking it is safe
    assert not pids & {p.pid for p in rank_processes()}  # and the ranks are gone


def _fork_servers() -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process().children()
        if "multiprocessing.forkserver" in " ".join(p.cmdline())
    ]


@pytest.mark.timeout(HANG_GUARD_S)
def test_the_fork_server_started_ahead_is_the_one_launch_forks_from(runs, no_leftovers):
    assert start_fork_server()  # returns while the server imports torch
    (server,) = _fork_servers()
    assert "torch" in " ".join(server.cmdline())
    assert start_fork_server() and _fork_servers() == [server]  # a second call starts no other
    run = launch(workers.env_probe, workers.ProbeConfig(), 2, runs_dir=runs)
    ppids = {psutil.Process(pid).ppid() for pid in run.pids.values() if psutil.pid_exists(pid)}
    run.wait(timeout=HANG_GUARD_S)
    assert ppids <= {server.pid} and _fork_servers() == [server]


@pytest.mark.timeout(HANG_GUARD_S)
@pytest.mark.slow
def test_spawn_is_an_option(runs, no_leftovers):
    run = launch(
        workers.env_probe,
        workers.ProbeConfig(names=["RANK"]),
        2,
        runs_dir=runs,
        start_method="spawn",
    )
    result = run.wait(timeout=HANG_GUARD_S)
    assert run.start_method == "spawn"
    assert {r: v["env"]["RANK"] for r, v in result.values.items()} == {0: "0", 1: "1"}
    with pytest.raises(ValueError, match="start_method='fork'"):
        launch(workers.env_probe, workers.ProbeConfig(), 2, runs_dir=runs, start_method="fork")


@pytest.mark.timeout(HANG_GUARD_S)
def test_backend_argument_reaches_ranks_and_run(runs, no_leftovers):
    cfg = workers.ProbeConfig(names=["MGTUTORIAL_BACKEND"])  # a config without a backend field
    run = launch(workers.env_probe, cfg, 2, runs_dir=runs, backend="gloo")
    result = run.wait(timeout=HANG_GUARD_S)
    assert run.backend == "gloo"
    assert all(
        v["backend"] == "gloo" and v["env"]["MGTUTORIAL_BACKEND"] == "gloo"
        for v in result.values.values()
    )


@pytest.mark.timeout(HANG_GUARD_S)
def test_only_loopback_sockets_listen(runs, no_leftovers):
    run = launch(workers.sleeper, workers.SleepConfig(seconds=HANG_GUARD_S), 2, runs_dir=runs)
    try:
        _wait_for_records(run)
        procs = [psutil.Process()] + [psutil.Process(pid) for pid in run.pids.values()]
        listening = [
            (p.pid, c.laddr)
            for p in procs
            for c in p.net_connections("inet")
            if c.status == "LISTEN"
        ]
        assert (os.getpid(), ("127.0.0.1", run.master_port)) in [
            (pid, tuple(a)) for pid, a in listening
        ]
        assert [a for _, a in listening if a.ip != "127.0.0.1"] == []
        rank_ports = {
            c.raddr.port
            for pid in run.pids.values()
            for c in psutil.Process(pid).net_connections("inet")
            if c.raddr
        }
        assert run.master_port in rank_ports  # the ranks are the store's clients
    finally:
        run.stop()


@pytest.mark.timeout(HANG_GUARD_S)
@pytest.mark.parametrize("sig", ["SIGSEGV", "SIGKILL"])
def test_rank_killed_by_signal_is_the_root_cause(sig, runs, no_leftovers):
    run = launch(
        workers.crash_after_allreduce,
        workers.CrashConfig(rank=1, signal_name=sig),
        2,
        runs_dir=runs,
    )
    with pytest.raises(WorkerFailed) as info:
        run.wait(timeout=HANG_GUARD_S)
    assert info.value.rank == 1, str(info.value)
    assert info.value.exc_type == "ProcessExited"
    if sig == "SIGSEGV":
        assert "SIGSEGV" in str(info.value)
    else:
        assert "SIGKILL" in str(info.value)


@pytest.mark.timeout(HANG_GUARD_S)
@pytest.mark.slow
def test_ranks_end_when_the_launcher_is_killed(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent)!r}]
        import workers
        from mgtutorial import launch
        if __name__ == "__main__":
            cfg = workers.SleepConfig(seconds=600)
            run = launch(workers.sleeper, cfg, 2, runs_dir={str(tmp_path)!r})
            print(" ".join(str(p) for p in run.pids.values()), flush=True)
            run.wait()
        """)
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        ranks = [psutil.Process(int(p)) for p in proc.stdout.readline().split()]
        assert len(ranks) == 2
        proc.kill()  # no atexit, no signal handler: only the ranks' own watch can end them
        proc.wait()
        gone, alive = psutil.wait_procs(ranks, timeout=HANG_GUARD_S / 2)
        assert alive == []
    finally:
        proc.kill()


def _wait_for_records(run):
    while not all(
        run.log_path(r, "jsonl").exists() and run.log_path(r, "jsonl").stat().st_size
        for r in range(run.nprocs)
    ):
        assert run.poll() is None
        time.sleep(0.1)
