"""A launched run lives until it ends or is stopped, whether or not its handle is kept, and can be
found again (``latest_runs``, ``watch()`` of the last one)."""

from __future__ import annotations

import gc
import subprocess
import sys
import time
from pathlib import Path

import pytest
import workers

from mgtutorial import last_run, latest_runs, launch, watch
from mgtutorial.runtime import run as run_module
from mgtutorial.runtime import runlog


@pytest.mark.timeout(150)
def test_a_run_whose_handle_is_dropped_trains_to_the_end(runs, no_leftovers):
    launch(workers.fixed_loss, workers.FixedLossConfig(steps=3), 2, runs_dir=runs)  # not kept
    gc.collect()  # what a notebook's next statement, or a script's next line, may cause
    (run_dir,) = runs.iterdir()
    results = [runlog.rank_file(run_dir, r, "result.json") for r in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(p.exists() for p in results) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(p.exists() for p in results), "the ranks of a dropped run did not finish"
    run = last_run()
    assert run.run_dir == run_dir and latest_runs(1) == [run]
    result = watch()  # the last run, found again
    assert result.values[0]["step"] == 3 and result.values[1]["global_loss"] == 1.5
    assert run.status == "succeeded" and run not in run_module._ACTIVE  # let go once it ended


@pytest.mark.timeout(120)
def test_latest_runs_lists_newest_first_with_their_status(runs, no_leftovers):
    first = launch(workers.fixed_loss, workers.FixedLossConfig(steps=1), 2, runs_dir=runs)
    first.wait(timeout=100)
    second = launch(workers.sleeper, workers.SleepConfig(seconds=60), 2, runs_dir=runs)
    try:
        listed = latest_runs(2)
        assert listed == [second, first]
        assert [r.status for r in listed] == ["running", "succeeded"]
    finally:
        second.stop()
    assert second.status == "stopped" and second not in run_module._ACTIVE


def test_watch_without_a_run_says_what_to_do(monkeypatch):
    monkeypatch.setattr(run_module, "_LAUNCHED", type(run_module._LAUNCHED)())
    with pytest.raises(LookupError, match=r"no run was launched from this process yet"):
        watch()


@pytest.mark.timeout(150)
def test_a_script_that_ends_before_its_run_stops_it_and_says_so(runs, no_leftovers):
    tests = Path(__file__).resolve().parent
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import workers\n"
        "from mgtutorial import launch\n"
        "launch(workers.sleeper, workers.SleepConfig(seconds=60), 2, runs_dir=sys.argv[2])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tests), str(runs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (run_dir,) = runs.iterdir()
    assert f"stopping run {run_dir.name}: still running as this process exits" in out.stderr
    assert "Traceback" not in out.stderr
