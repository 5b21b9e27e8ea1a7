"""Per-rank JSON-lines logs: the only channel from worker processes back to the notebook.

Taught in notebooks/00_setup.ipynb (where the files are and how to read them).

A spawned rank's ``print`` goes to a file, not to the notebook cell, so each rank writes one JSON
object per line to ``<run dir>/rank<r>.jsonl`` and flushes every line. The notebook reads the files
incrementally with :class:`LogReader` (only new complete lines; a half-written last line is kept for
the next read) and draws from them.

Files in a run directory::

    config.json          the worker's config
    rank<r>.jsonl        metrics and events of rank r (this module)
    rank<r>.out / .err   rank r's stdout / stderr
    rank<r>.error.json   written when rank r raised: type, message, traceback, time
    rank<r>.result.json  written when rank r's worker returned
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import traceback
from pathlib import Path

RUN_DIR_ENV = "MGTUTORIAL_RUN_DIR"

# Substrings of errors that a rank gets *because another rank failed* (its peer vanished). Error
# types alone (DistStoreError, DistNetworkError) say nothing: a rank's own rendezvous timeout or a
# taken port has them too.
_SECONDARY_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "SIGTERM",
)


def run_dir() -> Path:
    """This rank's run directory: ``$MGTUTORIAL_RUN_DIR`` (set by the launcher), else
    ``runs/default``."""
    return Path(os.environ.get(RUN_DIR_ENV, "runs/default"))


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def rank_file(directory: str | os.PathLike, rank: int, suffix: str) -> Path:
    """``<directory>/rank<rank>.<suffix>``: the one place the per-rank file names are made
    (suffixes "jsonl", "out", "err", "error.json", "result.json")."""
    return Path(directory) / f"rank{rank}.{suffix}"


def _atomic_write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, default=str))
    os.replace(tmp, path)


class RunLog:
    """Append-only JSON-lines writer for one rank: ``<run dir>/rank<r>.jsonl``.

    Each :meth:`write` is one line, flushed at once, with ``rank`` and ``time`` (unix seconds)
    added. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, directory: str | os.PathLike | None = None, rank: int | None = None):
        self.rank = _rank() if rank is None else rank
        self.dir = Path(directory) if directory is not None else run_dir()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = rank_file(self.dir, self.rank, "jsonl")
        self._f = open(self.path, "a", buffering=1, encoding="utf-8")

    def write(self, **record) -> dict:
        """Append one record; returns it as written (with ``rank`` and ``time``)."""
        record = {"rank": self.rank, "time": time.time(), **record}
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        return record

    # The record schema: one writer per kind, called by every worker and relied on by every reader
    # (mgtutorial.runtime.live, the figures, the notebooks). ``step`` counts optimizer steps from 1.

    def train(
        self, *, step: int, epoch: int, loss: float, global_loss: float, samples: int, **extra
    ) -> dict:
        """``kind="train"``: this rank's ``loss`` at ``step``; ``global_loss``, the loss of the
        whole job (the mean over ranks under data parallelism, the last stage's in a pipeline);
        ``samples``, the samples this rank (the pipeline, for pipelines) has trained on so far."""
        return self.write(
            kind="train",
            step=step,
            epoch=epoch,
            loss=loss,
            global_loss=global_loss,
            samples=samples,
            **extra,
        )

    def eval(self, *, step: int, epoch: int, test_acc: float, test_loss: float) -> dict:
        """``kind="eval"``: test accuracy (0–1) and mean test loss after ``step``, in epoch
        ``epoch``."""
        return self.write(
            kind="eval", step=step, epoch=epoch, test_acc=test_acc, test_loss=test_loss
        )

    def plan(self, *, steps: int) -> dict:
        """``kind="plan"``: the optimizer steps this run will take in all (progress bars use it)."""
        return self.write(kind="plan", steps=steps)

    def checkpoint(self, *, step: int, epoch: int, batch: int, path: str) -> dict:
        """``kind="checkpoint"``: a checkpoint written at ``step`` (``epoch`` epochs + ``batch``
        batches done) to ``path``."""
        return self.write(kind="checkpoint", step=step, epoch=epoch, batch=batch, path=path)

    def resume(self, *, step: int, epoch: int, batch: int, attempt: int) -> dict:
        """``kind="resume"``: training continues from a checkpoint, in restart ``attempt``."""
        return self.write(kind="resume", step=step, epoch=epoch, batch=batch, attempt=attempt)

    def event(
        self,
        *,
        event: str,
        start: float,
        end: float,
        stage: int,
        microbatch: int,
        step: int,
        **extra,
    ) -> dict:
        """``kind="event"``: one timeline box — a ``"forward"`` or ``"backward"`` of ``microbatch``
        on ``stage`` from ``start`` to ``end`` (unix s), in ``step``."""
        return self.write(
            kind="event",
            event=event,
            start=start,
            end=end,
            stage=stage,
            microbatch=microbatch,
            step=step,
            **extra,
        )

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MemoryLog(RunLog):
    """A :class:`RunLog` that keeps its records in ``records`` (a list) instead of a file: the same
    schema for work done inside one process (chapter 04's naive split)."""

    def __init__(self, rank: int = 0):
        self.rank, self.records = rank, []

    def write(self, **record) -> dict:
        record = {"rank": self.rank, "time": time.time(), **record}
        self.records.append(record)
        return record

    def close(self) -> None:
        pass


class LogReader:
    """Incremental reader of one JSON-lines file.

    :meth:`read_new` returns the records appended since the last call: complete lines only (a
    torn last line waits for its newline), each exactly once. It remembers a byte offset and reads
    only from there, so a call costs the size of the new data, not of the file. A missing file
    reads as empty.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.offset = 0

    def read_new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        records = []
        for line in data[: end + 1].splitlines():
            if line.strip():
                records.append(json.loads(line))
        return records


class RunReader:
    """Reads every ``rank<r>.jsonl`` of a run directory incrementally; keeps all records seen.

    ``records`` is the list of everything read so far (all ranks, in read order).
    """

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self._readers: dict[Path, LogReader] = {}
        self.records: list[dict] = []

    def read_new(self) -> list[dict]:
        new: list[dict] = []
        for path in sorted(self.dir.glob("rank*.jsonl")):
            reader = self._readers.setdefault(path, LogReader(path))
            new.extend(reader.read_new())
        self.records.extend(new)
        return new


def of_kind(records: list[dict], kind: str) -> list[dict]:
    """The records of one kind (see the :class:`RunLog` writers), in their order."""
    return [r for r in records if r.get("kind") == kind]


def read_run(directory: str | os.PathLike) -> list[dict]:
    """All records of a finished run (every rank), in file order per rank."""
    reader = RunReader(directory)
    reader.read_new()
    return reader.records


def is_secondary(message: str) -> bool:
    """True for errors a rank gets because a *peer* died (closed connection, store gone,
    SIGTERM)."""
    return any(marker in message for marker in _SECONDARY_MARKERS)


def write_error(exc: BaseException, directory: str | os.PathLike | None = None) -> Path:
    """Record this rank's exception in ``rank<r>.error.json`` (the first error wins: later calls
    keep it).

    Fields: rank, type, message, traceback, time (unix s, taken now, before any teardown),
    secondary (see :func:`is_secondary`).
    """
    d = Path(directory) if directory is not None else run_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = rank_file(d, _rank(), "error.json")
    if path.exists():
        return path
    kind, text = type(exc).__name__, "".join(traceback.format_exception(exc))
    secondary = is_secondary(f"{kind}: {exc}")
    record = {"rank": _rank(), "type": kind, "message": str(exc), "traceback": text}
    _atomic_write_json(path, {**record, "time": time.time(), "secondary": secondary})
    return path


def write_config(
    directory: str | os.PathLike, worker_ref: str, nprocs: int, backend: str, cfg
) -> Path:
    """Write ``<run dir>/config.json``: the worker (``module:name``), ranks, backend and the config
    dataclass (or None)."""
    config = dataclasses.asdict(cfg) if cfg is not None else None
    record = {"worker": worker_ref, "nprocs": nprocs, "backend": backend, "config": config}
    path = Path(directory) / "config.json"
    path.write_text(json.dumps(record, indent=2))
    return path


def write_result(value, directory: str | os.PathLike | None = None) -> Path:
    """Record that this rank's worker returned, with its (JSON-able) return value."""
    d = Path(directory) if directory is not None else run_dir()
    path = rank_file(d, _rank(), "result.json")
    _atomic_write_json(path, {"rank": _rank(), "time": time.time(), "value": value})
    return path


def read_json(path: str | os.PathLike) -> dict | None:
    """The JSON object in ``path``, or None if the file is missing."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
