"""Per-rank JSON-lines logs: torn lines, concurrent writers, each record exactly once."""

from __future__ import annotations

import json
import threading

from mgtutorial.runtime import runlog


def test_torn_last_line_waits_for_its_newline(tmp_path):
    path = tmp_path / "rank0.jsonl"
    reader = runlog.LogReader(path)
    assert reader.read_new() == []  # missing file reads as empty
    path.write_text('{"step": 1}\n{"step": 2')
    assert reader.read_new() == [{"step": 1}]
    assert reader.read_new() == []
    with open(path, "a") as f:
        f.write('}\n{"step": 3}\n')
    assert reader.read_new() == [{"step": 2}, {"step": 3}]


def test_reads_only_new_bytes(tmp_path):
    path = tmp_path / "rank0.jsonl"
    with runlog.RunLog(tmp_path, rank=0) as log:
        for i in range(2000):
            log.write(step=i)
        reader = runlog.LogReader(path)
        assert len(reader.read_new()) == 2000
        assert reader.offset == path.stat().st_size
        log.write(step=2000)
        new = reader.read_new()
    assert [r["step"] for r in new] == [2000]  # not the 2000 earlier lines again


def test_concurrent_writer_each_record_once(tmp_path):
    n = 5000
    stop = threading.Event()

    def write():
        with runlog.RunLog(tmp_path, rank=3) as log:
            for i in range(n):
                log.write(kind="train", step=i, loss=float(i), pad="x" * (i % 50))
        stop.set()

    reader = runlog.RunReader(tmp_path)
    t = threading.Thread(target=write)
    t.start()
    seen = []
    while not stop.is_set():
        seen += reader.read_new()
    t.join()
    seen += reader.read_new()
    assert [r["step"] for r in seen] == list(range(n))
    assert all(r["rank"] == 3 and "time" in r for r in seen)


def test_error_file_first_error_wins_and_secondary_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        path = runlog.write_error(exc, tmp_path)
    runlog.write_error(RuntimeError("[gloo] Connection closed by peer"), tmp_path)
    rec = json.loads(path.read_text())
    assert rec["rank"] == 1 and rec["message"] == "boom" and not rec["secondary"]
    assert "Traceback" in rec["traceback"]
    assert runlog.is_secondary(
        "RuntimeError: [../third_party/gloo] Connection closed by peer [127.0.0.1]:1"
    )
