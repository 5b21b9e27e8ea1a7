"""Shared fixtures: a run directory per test, the no-leftover-process check, and a check that no
test leaves the variables that steer a run changed (later tests and notebook kernels inherit
them)."""

from __future__ import annotations

import os
import time

import pytest

from mgtutorial.runtime.procs import non_service_children as rank_processes

_STEERING = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
)


def _steering_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("MGTUTORIAL_") or k in _STEERING}


@pytest.fixture(autouse=True)
def environment_unchanged():
    """Fails the test if it left a MGTUTORIAL_* or rank variable set, unset or changed."""
    before = _steering_env()
    yield
    after = _steering_env()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"the test left these variables changed: {changed} (use monkeypatch.setenv)"


@pytest.fixture
def no_leftovers():
    """Fails the test if any child process it started is still alive 5 s after it ended."""
    before = {p.pid for p in rank_processes()}
    yield
    deadline = time.monotonic() + 5
    while True:
        left = [p for p in rank_processes() if p.pid not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for p in left:
        p.kill()
    assert not left, f"processes left running: {[(p.pid, p.cmdline()) for p in left]}"


@pytest.fixture
def runs(tmp_path):
    """A fresh runs directory for this test."""
    d = tmp_path / "runs"
    d.mkdir()
    return d
