"""Every CUDA-only path of the course in one run: ``make gpu-check``
(or ``python scripts/gpu_check.py``).

Each item (see ``scripts/gpu_check_items.py``) runs in its own process with a time limit; the
report goes to ``gpu-check/report.json`` and ``gpu-check/report.md``: the GPUs, the torch / CUDA /
cuDNN / NCCL versions, and per item passed / failed (with the error) / skipped (with the reason),
with its figures. Each item's output is in ``gpu-check/logs/<item>.log``. Sized for a few minutes
on one GPU; items marked "≥ 2 GPUs" run on all the GPUs there are.

    python scripts/gpu_check.py                  # everything this machine can run
    python scripts/gpu_check.py --list           # the items, the chapter each backs, GPUs needed
    python scripts/gpu_check.py --only fsdp2_memory,nccl_async
    python scripts/gpu_check.py --notebooks      # also execute every notebook under CUDA (nbval),
                                                 # executed copies in gpu-check/notebooks/

Without CUDA every item is reported skipped, with the reason, and the exit status is 0; with
CUDA it is 1 when an item failed. Keep a report next to the benchmarks with the machine named::

    mkdir -p benchmarks/results/gpu-check-<machine>
    cp gpu-check/report.json gpu-check/report.md benchmarks/results/gpu-check-<machine>/

``--device cpu`` is the dry run the tests use: every item's code on CPU with gloo and 2 ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from gpu_check_items import ITEMS, NO_TF32, CheckFailed, Item, Skip, Where  # noqa: E402

LOG_TAIL = 3000  # characters of an item's output kept in the report when it fails
NOTEBOOK_TIMEOUT_S = 300


def gpu_count() -> int:
    """CUDA devices visible here (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl_version() -> str | None:
    """NCCL's version as "2.21.5", or None when this torch has no NCCL."""
    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def driver_version() -> str | None:
    """The NVIDIA driver's version from ``nvidia-smi`` (None where it is missing or fails)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (
        out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    )


def versions() -> dict:
    """The machine and the software: host, python, torch, CUDA (torch's build), cuDNN, NCCL, the
    driver, and each GPU's name, memory (GiB) and compute capability."""
    gpus = []
    for i in range(gpu_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append(
            {
                "index": i,
                "name": p.name,
                "memory_GiB": round(p.total_memory / 2**30, 1),
                "capability": f"{p.major}.{p.minor}",
            }
        )
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": nccl_version(),
        "driver": driver_version(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gpu_count": len(gpus),
        "gpus": gpus,
    }


def select(
    items: list[Item], gpus: int, only: list[str] | None = None, device: str = "cuda"
) -> list[tuple[Item, str | None]]:
    """Pair each item to run with None, or with the reason it is skipped on a machine with
    ``gpus`` GPUs.

    ``only``: item names to keep (in the registry's order); ``device="cpu"`` (the dry run) runs
    every item whatever the GPUs.

    Raises:
        ValueError: a name in ``only`` is not an item (the message lists the known ones).
    """
    known = [it.name for it in items]
    unknown = [n for n in only or [] if n not in known]
    if unknown:
        raise ValueError(f"unknown item(s) {unknown}; the items are: {', '.join(known)}")
    chosen = [it for it in items if not only or it.name in only]
    out = []
    for it in chosen:
        reason = None
        if device == "cuda" and gpus == 0:
            reason = "no CUDA GPU on this machine (torch.cuda.is_available() is False)"
        elif device == "cuda" and gpus < it.min_gpus:
            reason = f"needs {it.min_gpus} GPUs, this machine has {gpus}"
        out.append((it, reason))
    return out


def _kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End the item's process and everything it started (its own process group): TERM, then KILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap our own child, so that only live members keep the group
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _tail(path: Path, n: int = LOG_TAIL) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-n:]


def run_item(
    it: Item,
    *,
    device: str,
    gpus: int,
    out_dir: Path,
    timeout_s: float | None = None,
    pythonpath: tuple[str, ...] = (),
) -> dict:
    """Run one item in a fresh process (its own process group) and return its report entry.

    The entry has ``name, chapter, min_gpus, what, status`` ("passed" | "failed" | "skipped"),
    ``duration_s``, ``figures`` and, when it did not pass, ``error`` or ``reason`` and ``log_tail``.
    A process that outlives ``timeout_s`` (default ``it.timeout_s``) is killed with everything it
    started, and the item fails with "timed out after … s". Output goes to
    ``out_dir/logs/<name>.log``.
    """
    timeout_s = it.timeout_s if timeout_s is None else timeout_s
    logs, work = out_dir / "logs", out_dir / "work" / it.name
    logs.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log, result = logs / f"{it.name}.log", work / "result.json"
    environ = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(
            [*pythonpath, str(ROOT), str(SCRIPTS), os.environ.get("PYTHONPATH", "")]
        ),
    )
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        it.target,
        "--device",
        device,
        "--gpus",
        str(gpus),
        "--workdir",
        str(work),
        "--result",
        str(result),
    ]
    entry = {"name": it.name, "chapter": it.chapter, "min_gpus": it.min_gpus, "what": it.what}
    start = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=environ, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        except KeyboardInterrupt:  # its own session does not get the terminal's Ctrl-C: end it here
            _kill_group(proc)
            raise
        _kill_group(proc)  # also after a normal exit: nothing it started may outlive it
    entry["duration_s"] = round(time.monotonic() - start, 2)
    outcome = json.loads(result.read_text()) if result.exists() else {}
    entry["figures"] = outcome.get("figures", {})
    if code is None:
        entry.update(status="failed", error=f"timed out after {timeout_s:g} s (process killed)")
    elif outcome.get("status") in ("passed", "skipped", "failed"):
        entry.update({k: v for k, v in outcome.items() if k in ("status", "error", "reason")})
    else:
        entry.update(
            status="failed", error=f"the item's process exited with code {code} without a result"
        )
    if entry["status"] == "failed":
        entry["log_tail"] = _tail(log)
    elif entry["status"] == "passed":
        shutil.rmtree(work, ignore_errors=True)  # run folders, checkpoints: kept only for failures
    return entry


def child(target: str, device: str, gpus: int, workdir: Path, result: Path) -> int:
    """Inside an item's process: run ``target`` ("module:function"), write its outcome as JSON."""
    os.environ.update(NO_TF32)  # before CUDA starts: fp32 means fp32 in every comparison and timing
    module, name = target.split(":")
    try:
        fn = getattr(importlib.import_module(module), name)
        out = {"status": "passed", "figures": fn(Where(device, gpus, workdir))}
    except Skip as exc:
        out = {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - every failure is reported, not raised
        traceback.print_exc()
        out = {
            "status": "failed",
            "error": f"{type(exc).__name__}: {exc}",
            "figures": exc.figures if isinstance(exc, CheckFailed) else {},
        }
    result.write_text(json.dumps(out, indent=1, default=str))
    return 0 if out["status"] != "failed" else 1


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _table(rows: list[dict]) -> list[str]:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [
        "| " + " | ".join(keys) + " |",
        "|" + "---|" * len(keys),
        *("| " + " | ".join(_cell(r.get(k, "")) for k in keys) + " |" for r in rows),
    ]


def render_markdown(report: dict) -> str:
    """The report as Markdown: machine and versions, one summary row per item, then each item's
    figures."""
    v = report["versions"]
    gpus = ", ".join(f"{g['name']} ({g['memory_GiB']} GiB)" for g in v["gpus"]) or "none"
    counts = report["summary"]
    lines = [
        f"# GPU check — {v['host']}",
        "",
        f"{report['started']} · {report['duration_s']:.0f} s · device `{report['device']}` · "
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped",
        "",
        f"* GPUs ({v['gpu_count']}): {gpus}",
        f"* torch {v['torch']}, CUDA {v['cuda']}, cuDNN {v['cudnn']}, NCCL {v['nccl']}, "
        f"driver {v['driver']}",
        f"* python {v['python']} on {v['platform']}",
        "",
        "| item | chapter | GPUs | status | s | note |",
        "|---|---|---|---|---|---|",
    ]
    for e in report["items"]:
        note = e.get("error") or e.get("reason") or e["what"]
        lines.append(
            f"| {e['name']} | {e['chapter']} | {e['min_gpus']} | {e['status']} | "
            f"{e.get('duration_s', 0):.1f} | {note.replace('|', '/').splitlines()[0]} |"
        )
    for e in report["items"]:
        if not e.get("figures") and e["status"] != "failed":
            continue
        lines += ["", f"## {e['name']} — {e['status']}", "", e["what"], ""]
        if e.get("error"):
            lines += ["```", e["error"], "```", ""]
        for key, val in e.get("figures", {}).items():
            if isinstance(val, list) and val and all(isinstance(r, dict) for r in val):
                lines += ["", f"{key}:", "", *_table(val), ""]
            elif isinstance(val, dict) and val and all(isinstance(r, dict) for r in val.values()):
                lines += ["", f"{key}:", "", *_table([{"": k, **r} for k, r in val.items()]), ""]
            else:
                lines.append(f"* {key}: {_cell(val)}")
    if report.get("notebooks"):
        lines += ["", "## notebooks under CUDA (nbval, then executed copies in notebooks/)", ""]
    for nb in report.get("notebooks", []):
        note = nb.get("error") or nb.get("reason")
        lines.append(
            f"* {nb['name']}: {nb['status']}" + (f" — {note.splitlines()[-1]}" if note else "")
        )
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.md`` into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / "report.json", out_dir / "report.md"
    js.write_text(json.dumps(report, indent=1, default=str) + "\n")
    md.write_text(render_markdown(report))
    return js, md


def summarize(entries: list[dict]) -> dict:
    """Counts of passed / failed / skipped entries."""
    return {s: sum(e["status"] == s for e in entries) for s in ("passed", "failed", "skipped")}


def run_notebooks(
    out_dir: Path, gpus: int, timeout_s: float = NOTEBOOK_TIMEOUT_S, names: list[str] | None = None
) -> list[dict]:
    """Execute copies of notebooks/*.ipynb (or of ``names``) under CUDA into ``out_dir/notebooks``:
    nbval first (deterministic cells compared with the committed CPU outputs), then
    ``nbconvert --execute`` to keep the executed copy. The committed notebooks are never written.
    Returns one entry per notebook: ``name``, ``status`` and ``error`` or ``reason``."""
    names = names or sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    if gpus == 0:
        return [{"name": n, "status": "skipped", "reason": "no CUDA GPU"} for n in names]
    nb_dir = out_dir / "notebooks"
    shutil.rmtree(nb_dir, ignore_errors=True)
    nb_dir.mkdir(parents=True)
    environ = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    out = []
    for name in names:
        copy = nb_dir / name
        shutil.copy(ROOT / "notebooks" / name, copy)
        steps = [
            [
                sys.executable,
                "-m",
                "pytest",
                str(copy),
                "--nbval-lax",
                "-q",
                "-p",
                "no:cacheprovider",
            ],
            [
                sys.executable,
                "-m",
                "jupyter",
                "nbconvert",
                "--to",
                "notebook",
                "--execute",
                "--inplace",
                str(copy),
            ],
        ]
        entry = {"name": name, "status": "passed"}
        for cmd in steps:
            try:
                r = subprocess.run(
                    cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout_s
                )
                error = None if r.returncode == 0 else (r.stdout + r.stderr)[-LOG_TAIL:]
            except subprocess.TimeoutExpired:
                error = f"timed out after {timeout_s:g} s"
            if error:
                entry.update(status="failed", error=f"{cmd[2]}: {error}")
                break
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out", type=Path, default=ROOT / "gpu-check", help="report folder (default gpu-check/)"
    )
    ap.add_argument("--only", help="comma-separated item names (see --list)")
    ap.add_argument("--list", action="store_true", help="list the items and exit")
    ap.add_argument(
        "--notebooks", action="store_true", help="also run every notebook under CUDA with nbval"
    )
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the dry run (every item on CPU with gloo; for tests)",
    )
    ap.add_argument(
        "--timeout-scale", type=float, default=1.0, help="multiply every item's time limit"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--gpus", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, args.device, args.gpus, args.workdir, args.result)
    items = list(ITEMS.values())
    if args.list:
        for it in items:
            print(f"{it.name:26} {it.chapter:28} ≥{it.min_gpus} GPU  {it.what}")
        return 0
    gpus = gpu_count()
    try:
        plan = select(items, gpus, args.only.split(",") if args.only else None, args.device)
    except ValueError as exc:
        ap.error(str(exc))
    started, t0 = datetime.datetime.now().isoformat(timespec="seconds"), time.monotonic()
    entries = []
    for it, reason in plan:
        if reason:
            entry = {
                "name": it.name,
                "chapter": it.chapter,
                "min_gpus": it.min_gpus,
                "what": it.what,
                "status": "skipped",
                "reason": reason,
                "figures": {},
            }
        else:
            print(f"{it.name} …", flush=True)
            entry = run_item(
                it,
                device=args.device,
                gpus=gpus,
                out_dir=args.out,
                timeout_s=it.timeout_s * args.timeout_scale,
            )
        print(
            f"{it.name:26} {entry['status']:8} "
            f"{entry.get('error') or entry.get('reason') or ''}".rstrip(),
            flush=True,
        )
        entries.append(entry)
    with contextlib.suppress(OSError):
        (args.out / "work").rmdir()  # only when empty: failed items keep their run folders there
    report = {
        "started": started,
        "argv": sys.argv[1:] if argv is None else argv,
        "device": args.device,
        "versions": versions(),
        "items": entries,
        "summary": summarize(entries),
    }
    if args.notebooks:
        report["notebooks"] = run_notebooks(args.out, gpus if args.device == "cuda" else 0)
    report["duration_s"] = round(time.monotonic() - t0, 1)
    js, md = write_report(report, args.out)
    print(
        f"{report['summary']} → {md.relative_to(ROOT) if md.is_relative_to(ROOT) else md}, "
        f"{js.name}"
    )
    failed = report["summary"]["failed"] + sum(
        nb["status"] == "failed" for nb in report.get("notebooks", [])
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
