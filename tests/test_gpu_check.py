"""scripts/gpu_check.py: item selection by GPU count, one process per item (pass, fail, skip,
crash, time-out), the report (JSON + Markdown), versions; and every item's code as a CPU dry run."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
from gpu_check_items import ITEMS, Item  # noqa: E402

FAKES = """
import os, subprocess, sys, time
from gpu_check_items import CheckFailed, Skip

def passes(w):
    return {"device": w.device, "rows": [{"size": 1, "GBps": 0.5}, {"size": 2, "GBps": 1.0}]}

def fails(w):
    raise CheckFailed("parameters differ by 0.3", {"max_param_diff": 0.3})

def skips(w):
    raise Skip("this GPU has no bf16")

def crashes(w):
    os._exit(3)

def hangs(w):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    time.sleep(120)
"""


def fake(name: str, min_gpus: int = 1, timeout_s: float = 60) -> Item:
    return Item(
        name, "99_fake", min_gpus, timeout_s, f"fake item {name}", f"gpu_check_fakes:{name}"
    )


@pytest.fixture
def fakes(tmp_path):
    (tmp_path / "gpu_check_fakes.py").write_text(textwrap.dedent(FAKES))
    return str(tmp_path)


def test_select_by_gpu_count_and_names():
    items = [fake("a", 1), fake("b", 2), fake("c", 1)]
    no_gpu = gpu_check.select(items, 0)
    assert [(it.name, "no CUDA GPU" in r) for it, r in no_gpu] == [
        ("a", True),
        ("b", True),
        ("c", True),
    ]
    one = gpu_check.select(items, 1)
    assert [(it.name, r) for it, r in one] == [
        ("a", None),
        ("b", "needs 2 GPUs, this machine has 1"),
        ("c", None),
    ]
    assert all(r is None for _, r in gpu_check.select(items, 4))
    assert all(
        r is None for _, r in gpu_check.select(items, 0, device="cpu")
    )  # the dry run runs all
    assert [it.name for it, _ in gpu_check.select(items, 1, only=["c", "a"])] == [
        "a",
        "c",
    ]  # registry order
    with pytest.raises(ValueError, match=r"unknown item\(s\) \['z'\]; the items are: a, b, c"):
        gpu_check.select(items, 1, only=["a", "z"])


def test_registry_covers_one_and_two_gpu_items():
    names = list(ITEMS)
    assert len(names) == len(set(names)) == 25
    assert {
        "nccl_world_size_1",
        "ddp_cuda0_vs_cpu",
        "device_basics",
        "fsdp2_memory",
        "cuda_event_timing",
        "nccl_async",
        "laptop_gpu_row",
        "nccl_exit_without_destroy",
    } == {n for n, it in ITEMS.items() if it.min_gpus == 1}
    assert all(
        it.min_gpus in (1, 2, 4) and it.timeout_s > 0 and it.chapter and it.what
        for it in ITEMS.values()
    )
    # one-GPU items first, so a short window on a small machine is spent on what it can run
    assert [it.min_gpus for it in ITEMS.values()] == sorted(it.min_gpus for it in ITEMS.values())


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_run_item_reports_pass_fail_skip_crash(tmp_path, fakes, no_leftovers):
    out = tmp_path / "gc"
    got = {
        n: gpu_check.run_item(fake(n), device="cpu", gpus=0, out_dir=out, pythonpath=(fakes,))
        for n in ("passes", "fails", "skips", "crashes")
    }
    assert got["passes"]["status"] == "passed" and got["passes"]["figures"]["device"] == "cpu"
    assert (
        "error" not in got["passes"] and not (out / "work" / "passes").exists()
    )  # cleaned on success
    assert got["fails"]["status"] == "failed"
    assert got["fails"]["error"] == "CheckFailed: parameters differ by 0.3"
    assert got["fails"]["figures"] == {"max_param_diff": 0.3}
    assert "parameters differ by 0.3" in got["fails"]["log_tail"]  # the traceback is in its log
    assert (got["skips"]["status"], got["skips"]["reason"]) == ("skipped", "this GPU has no bf16")
    assert got["crashes"]["status"] == "failed"
    assert got["crashes"]["error"] == "the item's process exited with code 3 without a result"
    assert sorted(p.name for p in (out / "logs").iterdir()) == [f"{n}.log" for n in sorted(got)]


@pytest.mark.timeout(60)
def test_run_item_times_out_and_kills_everything_it_started(tmp_path, fakes, no_leftovers):
    entry = gpu_check.run_item(
        fake("hangs"), device="cpu", gpus=0, out_dir=tmp_path, timeout_s=1.5, pythonpath=(fakes,)
    )
    assert entry["status"] == "failed"
    assert entry["error"] == "timed out after 1.5 s (process killed)"


@pytest.mark.timeout(60)
def test_kill_group_ends_grandchildren(no_leftovers):
    code = (
        "import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); "
        "print(p.pid, flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    grandchild = psutil.Process(int(proc.stdout.readline()))
    gpu_check._kill_group(proc)
    proc.stdout.close()
    assert proc.returncode is not None
    assert not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE


def _report(entries):
    return {
        "started": "2026-01-01T00:00:00",
        "device": "cuda",
        "duration_s": 12.0,
        "versions": gpu_check.versions(),
        "items": entries,
        "summary": gpu_check.summarize(entries),
    }


def test_report_json_and_markdown(tmp_path):
    entries = [
        {
            "name": "busbw",
            "chapter": "09",
            "min_gpus": 2,
            "what": "bandwidth",
            "status": "passed",
            "duration_s": 3.0,
            "figures": {
                "world_size": 2,
                "rows": [{"bytes": 1024, "busbw_GBps": 0.25}, {"bytes": 2048, "busbw_GBps": 0.5}],
            },
        },
        {
            "name": "fsdp",
            "chapter": "07",
            "min_gpus": 1,
            "what": "memory",
            "status": "failed",
            "duration_s": 1.0,
            "error": "CheckFailed: 300 MiB, formula 256 MiB",
            "figures": {"measured_steady_MiB": 300.0},
        },
        {
            "name": "tp",
            "chapter": "08",
            "min_gpus": 2,
            "what": "parity",
            "status": "skipped",
            "reason": "needs 2 GPUs, this machine has 1",
            "figures": {},
        },
    ]
    js, md = gpu_check.write_report(_report(entries), tmp_path)
    loaded = json.loads(js.read_text())
    assert loaded["summary"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert [e["status"] for e in loaded["items"]] == ["passed", "failed", "skipped"]
    assert loaded["versions"]["torch"] == torch.__version__
    text = md.read_text()
    assert "1 passed, 1 failed, 1 skipped" in text
    assert "| tp | 08 | 2 | skipped | 0.0 | needs 2 GPUs, this machine has 1 |" in text
    assert "CheckFailed: 300 MiB, formula 256 MiB" in text
    assert "| bytes | busbw_GBps |\n|---|---|\n| 1024 | 0.25 |\n| 2048 | 0.5 |" in text
    assert "* measured_steady_MiB: 300" in text


def test_versions_describe_this_machine():
    v = gpu_check.versions()
    assert v["torch"] == torch.__version__ and v["cuda"] == torch.version.cuda
    assert v["gpu_count"] == len(v["gpus"]) == gpu_check.gpu_count()
    assert v["nccl"] is None or v["nccl"].count(".") == 2


@pytest.mark.timeout(60)
def test_without_cuda_everything_is_skipped_and_exit_0(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "gpu_count", lambda: 0)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert [e["name"] for e in report["items"]] == list(ITEMS)
    assert {e["status"] for e in report["items"]} == {"skipped"}
    assert all("no CUDA GPU" in e["reason"] for e in report["items"])
    assert (tmp_path / "report.md").exists() and not (tmp_path / "work").exists()


def test_notebooks_without_cuda_are_skipped_and_nothing_is_written(tmp_path):
    before = {p: p.stat().st_mtime_ns for p in (ROOT / "notebooks").glob("*.ipynb")}
    got = gpu_check.run_notebooks(tmp_path, gpus=0)
    assert [e["name"] for e in got] == sorted(p.name for p in before)
    assert {(e["status"], e["reason"]) for e in got} == {("skipped", "no CUDA GPU")}
    assert not (tmp_path / "notebooks").exists()
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "notebooks").glob("*.ipynb")} == before


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.timeout(4 * it.timeout_s + 60)) for n, it in ITEMS.items()],
)
@pytest.mark.slow
def test_dry_run_on_cpu(name, tmp_path, no_leftovers):
    """The item's code on CPU with gloo (2 ranks where it takes all GPUs): no typos, no API
    misuse."""
    it = ITEMS[name]
    entry = gpu_check.run_item(
        it, device="cpu", gpus=0, out_dir=tmp_path, timeout_s=4 * it.timeout_s
    )
    assert entry["status"] == "passed", entry.get("error", "") + "\n" + entry.get("log_tail", "")
    assert entry["figures"]
