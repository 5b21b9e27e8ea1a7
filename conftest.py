"""Session-wide check: no rank process outlives the test session (tests and notebooks alike).

Ranks are grandchildren when nbval runs a notebook (pytest → kernel → ranks), and they would be
re-parented away from pytest if the kernel died first. So the rank-like descendants of this
process are recorded after every test item, and at the end of the session every one recorded
must have exited within a grace period; otherwise the session fails and the survivors are listed
(and then killed, so that they do not outlive the report either).
"""

from __future__ import annotations

import os
import time

import psutil

GRACE_S = 5.0
_seen: dict[int, psutil.Process] = {}


def is_rank_cmdline(cmdline: list[str]) -> bool:
    """True for a process that looks like a rank or a rank launcher.

    Matches multiprocessing's spawned children (``spawn_main``), ``torchrun`` (or
    ``torch.distributed.run``) and anything with ``mgtutorial`` in its arguments. ``argv[0]`` is
    ignored for that last match because the interpreter's own path may contain the repository's
    name. multiprocessing's ``resource_tracker`` and fork server live as long as their parent and
    are not ranks; a rank forked from the fork server has the server's command line, which
    :func:`rank_descendants` tells apart by its parent.
    """
    text = " ".join(cmdline)
    if "resource_tracker" in text or "multiprocessing.forkserver" in text:
        return False
    if "spawn_main" in text or "torch.distributed.run" in text:
        return True
    if any(os.path.basename(arg) == "torchrun" for arg in cmdline[:2]):
        return True
    return any("mgtutorial" in arg for arg in cmdline[1:])


def rank_descendants(root: psutil.Process | None = None) -> list[psutil.Process]:
    """Live, non-zombie descendants of ``root`` (default: this process) that look like ranks."""
    root = root or psutil.Process()
    found = []
    try:
        children = root.children(recursive=True)
    except psutil.Error:
        return found
    for p in children:
        try:
            forked = "multiprocessing.forkserver" in " ".join(p.parent().cmdline())
            if p.status() != psutil.STATUS_ZOMBIE and (forked or is_rank_cmdline(p.cmdline())):
                found.append(p)
        except psutil.Error:
            pass
    return found


def survivors(procs, grace_s: float = GRACE_S) -> list[psutil.Process]:
    """Those of ``procs`` still running (not zombies) after waiting up to ``grace_s`` seconds."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                pass
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.2)


def _remember() -> None:
    for p in rank_descendants():
        _seen.setdefault(p.pid, p)  # psutil.Process checks the create time: a reused pid is not it


def pytest_runtest_teardown(item, nextitem):
    _remember()


def pytest_sessionfinish(session, exitstatus):
    _remember()
    left = survivors(list(_seen.values()))
    if not left:
        return
    lines = []
    for p in left:
        try:
            lines.append(f"  pid {p.pid}: {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.Error:
            pass
    print(f"\nERROR: {len(left)} rank process(es) still running {GRACE_S:.0f} s after the tests "
          "that started them (now killed):\n" + "\n".join(lines))
    session.exitstatus = 1
