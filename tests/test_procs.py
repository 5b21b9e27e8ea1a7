"""Finding a job's processes (mgtutorial.runtime.procs): ranks by either start method are found,
multiprocessing's services and zombies are not; the leftover checks of both conftest.py files use
these functions."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time

import psutil
import pytest

from mgtutorial.runtime import procs

HANG_GUARD_S = 30  # only there to end a hung test, never a measure of speed


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _pids(found) -> set[int]:
    return {p.pid for p in found}


@pytest.mark.parametrize(
    "cmdline, is_rank",
    [
        (
            [
                "python",
                "-c",
                "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=6)",
            ],
            True,
        ),
        (
            ["/venv/bin/python", "/venv/bin/torchrun", "--standalone", "-m", "mgtutorial", "ddp"],
            True,
        ),
        (["python", "-u", "-m", "mgtutorial", "ddp", "--epochs", "1"], True),
        (["python", "-c", "from multiprocessing.resource_tracker import main;main(5)"], False),
        (["python", "-c", "from multiprocessing.forkserver import main; main(3, 4)"], False),
        (
            ["/home/me/mgtutorial/.venv/bin/python", "-m", "ipykernel_launcher", "-f", "k.json"],
            False,
        ),
    ],
)
def test_rank_cmdline(cmdline, is_rank):
    assert procs.is_rank_cmdline(cmdline) is is_rank


def test_leftover_rank_is_found():
    # what the root conftest.py does after every test and at the end of the session
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "mgtutorial-fake-rank"]
    )
    child = psutil.Process(proc.pid)
    try:
        # until the child has exec'd, its command line is pytest's
        missed = "a live child with 'mgtutorial' in its arguments was not recognised as a rank"
        _until(lambda: child in procs.rank_descendants(), missed)
        assert procs.survivors([child], grace_s=0.5) == [child]
    finally:
        proc.kill()
        proc.wait()
    assert procs.survivors([child], grace_s=0.5) == []


@pytest.mark.timeout(HANG_GUARD_S * 2)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_rank_is_found_by_either_start_method_and_the_services_are_not(method):
    rank = multiprocessing.get_context(method).Process(target=time.sleep, args=(60,), daemon=True)
    rank.start()
    try:
        _until(lambda: rank.pid in _pids(procs.rank_processes()), f"the {method} child not found")
        # the resource tracker (and the fork server): their command lines name them; a rank forked
        # from the server has the server's command line too, so it is left out by pid
        services = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid != rank.pid and any(s in " ".join(p.cmdline()) for s in procs.SERVICES)
        ]
        assert services, "multiprocessing started no resource tracker or fork server"
        for found in (
            procs.rank_processes(),
            procs.rank_descendants(),
            procs.non_service_children(),
        ):
            assert rank.pid in _pids(found)
            assert not _pids(services) & _pids(found), "a service was taken for a rank"
        assert procs.is_running(rank.pid)
    finally:
        rank.kill()
        rank.join(HANG_GUARD_S)
    assert not procs.is_running(rank.pid)
    assert rank.pid not in _pids(procs.rank_processes())


def test_a_zombie_is_not_found_nor_running():
    proc = subprocess.Popen([sys.executable, "-c", "pass", "mgtutorial-fake-rank"])
    child = psutil.Process(proc.pid)
    try:
        # ended but not waited for: a zombie until proc.wait() reaps it
        _until(lambda: child.status() == psutil.STATUS_ZOMBIE, "the child never ended")
        assert not procs.is_running(proc.pid)
        assert proc.pid not in _pids(procs.rank_descendants())
        assert proc.pid not in _pids(procs.non_service_children())
        assert procs.survivors([child], grace_s=0) == []
    finally:
        proc.wait()


@pytest.mark.timeout(HANG_GUARD_S * 2)
def test_what_a_rank_started_is_found_and_killed():
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        _until(lambda: procs.descendants_of([proc.pid]), "the grandchild never started")
        (grandchild,) = procs.descendants_of([proc.pid])
        # as Run.stop does: the rank and what it started
        procs.kill([psutil.Process(proc.pid), grandchild], timeout_s=5)
        assert not procs.is_running(proc.pid) and not procs.is_running(grandchild.pid)
        assert procs.descendants_of([proc.pid, 2**22 + 1]) == []  # a pid that is gone is skipped
    finally:
        proc.kill()
        proc.wait()
