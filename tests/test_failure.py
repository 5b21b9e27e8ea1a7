"""The root cause of a failed run, decided from the files its ranks left (no process started)."""

from __future__ import annotations

import signal

from mgtutorial.runtime.failure import WorkerFailed, innermost_frame, root_cause


def _error(run_dir, rank, message, time, secondary):
    (run_dir / f"rank{rank}.error.json").write_text(
        f'{{"rank": {rank}, "type": "RuntimeError", "message": "{message}", "traceback": "", '
        f'"time": {time}, "secondary": {str(secondary).lower()}}}'
    )


def test_root_cause_prefers_primary_then_silent_then_secondary(tmp_path):
    _error(tmp_path, 0, "Connection closed by peer", 1.0, True)
    _error(tmp_path, 1, "bad input", 2.0, False)
    assert root_cause(tmp_path, 2, {0: 1, 1: 1}).rank == 1  # primary, although later
    (tmp_path / "rank1.error.json").unlink()
    failed = root_cause(tmp_path, 2, {0: 1, 1: None})
    assert (failed.rank, failed.exc_type) == (1, "ProcessExited")  # silent beats a consequence
    assert "SIGKILL" in failed.message
    (tmp_path / "rank1.err").write_text(
        "Fatal Python error: Segmentation fault\n\nCurrent thread ...\n"
    )
    assert "SIGSEGV (Segmentation fault)" in root_cause(tmp_path, 2, {0: 1, 1: None}).message
    assert "signal SIGBUS" in root_cause(tmp_path, 2, {0: 1, 1: -signal.SIGBUS}).message
    (tmp_path / "rank1.result.json").write_text('{"rank": 1, "time": 3.0, "value": null}')
    # only a secondary error is left
    assert root_cause(tmp_path, 2, {0: 1, 1: 0}).message == "Connection closed by peer"


def test_root_cause_prefers_the_rank_seen_dying_among_silent_ones(tmp_path):
    failed = root_cause(tmp_path, 3, {0: None, 1: -signal.SIGTERM, 2: -signal.SIGKILL})
    assert failed.rank == 2 and "signal SIGKILL" in failed.message
    assert "before its log existed" in failed.message


def test_worker_failed_names_rank_type_place_and_log(tmp_path):
    tb = (
        "Traceback (most recent call last):\n"
        '  File "/x/train.py", line 3, in <module>\n    main()\n'
        '  File "/x/train.py", line 9, in main\n    raise ValueError("bad")\n'
        "ValueError: bad\n"
    )
    assert innermost_frame(tb) == 'File "/x/train.py", line 9, in main'
    assert innermost_frame("") == ""
    err = WorkerFailed(1, "ValueError", "bad", tmp_path / "rank1.err", tb, 1)
    assert str(err).splitlines() == [
        "rank 1 failed with ValueError: bad",
        '  at File "/x/train.py", line 9, in main',
        f"  rank 1's log: {tmp_path / 'rank1.err'}",
        "  the other ranks were stopped.",
    ]
