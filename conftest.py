"""Session-wide check: no rank process outlives the test session (tests and notebooks alike).

Ranks are grandchildren when nbval runs a notebook (pytest → kernel → ranks), and they would be
re-parented away from pytest if the kernel died first. So the rank-like descendants of this
process are recorded after every test item, and at the end of the session every one recorded
must have exited within a grace period; otherwise the session fails and the survivors are listed
(and then killed, so that they do not outlive the report either).
"""

from __future__ import annotations

import psutil

from mgtutorial.runtime.procs import rank_descendants, survivors

GRACE_S = 5.0
_seen: dict[int, psutil.Process] = {}


def _remember() -> None:
    for p in rank_descendants():
        _seen.setdefault(p.pid, p)  # psutil.Process checks the create time: a reused pid is not it


def pytest_runtest_teardown(item, nextitem):
    _remember()


def pytest_sessionfinish(session, exitstatus):
    _remember()
    left = survivors(list(_seen.values()), GRACE_S)
    if not left:
        return
    lines = []
    for p in left:
        try:
            lines.append(f"  pid {p.pid}: {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.Error:
            pass
    print(
        f"\nERROR: {len(left)} rank process(es) still running {GRACE_S:.0f} s after the tests "
        "that started them (now killed):\n" + "\n".join(lines)
    )
    session.exitstatus = 1
