"""Chapters 05b/05c with real torchrun agents: a restart across two simulated nodes whose agents
count restarts for themselves, a node joining a ``--nnodes 1:2`` job, and ``@record``'s root cause.
"""

from __future__ import annotations

import json
import re

import pytest

from mgtutorial.runtime import runlog, torchelastic
from mgtutorial.runtime.launcher import free_port
from mgtutorial.scale import elastic, hangs, torchrun

TINY = [
    "elastic",
    "--dataset",
    "digits",
    "--epochs",
    "1",
    "--no-evaluate",
    "--resume",
    "--backend",
    "gloo",
]


def test_torchrun_command_takes_an_elastic_node_range_and_rendezvous_options():
    cmd = torchrun.torchrun_command(
        ["hello"], nnodes="1:2", rdzv_endpoint="h:1", run_id="r", rdzv_conf="last_call_timeout=1"
    )
    assert cmd[cmd.index("--nnodes") + 1] == "1:2"
    assert cmd[cmd.index("--rdzv-conf") + 1] == "last_call_timeout=1"
    assert "--rdzv-conf" not in torchrun.torchrun_command(["hello"], nnodes=2, rdzv_endpoint="h:1")


@pytest.mark.parametrize(
    "cfg, match",
    [
        (elastic.ElasticConfig(pause_s=-1), "pause_s"),
        (hangs.HangConfig(dump_after_s=-1), "dump_after_s"),
    ],
)
def test_new_options_refuse_negative_values(cfg, match):
    with pytest.raises(ValueError, match=match):
        cfg.validate(2)


def _counts(output: str) -> list[int]:
    return [int(c) for c in re.findall(r"restart_count=(\d+)", output)]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_rank_killed_on_two_nodes_restarts_both_from_one_snapshot(tmp_path, no_leftovers):
    args = TINY + ["--max-steps", "16", "--checkpoint-every", "5", "--runs-dir", str(tmp_path)]
    args += ["--checkpoint", str(tmp_path / "k.pt"), "--run-name", "k"]
    args += ["--fail-rank", "1", "--fail-step", "12", "--fail-how", "sigkill"]
    with torchrun.simulated_nodes(
        args, nnodes=2, max_restarts=1, log_dir=tmp_path / "ag", extra_env={"LOGLEVEL": "INFO"}
    ) as agents:
        assert agents.wait(280) == [0, 0], agents.output(1)[-3000:]
        outputs = [agents.output(n) for n in range(2)]
    host = {int(re.findall(r"global_ranks=\[(\d+)\]", out)[0]): n for n, out in enumerate(outputs)}
    assert _counts(outputs[host[1]])[-1] == 1  # the killed rank's agent counted the failure
    assert _counts(outputs[host[0]])[-1] in (0, 1)  # the healthy one may not (membership change)
    resumes = [r for r in runlog.read_run(tmp_path / "k") if r["kind"] == "resume"]
    assert sorted((r["rank"], r["step"]) for r in resumes) == [(0, 10), (1, 10)]
    assert {r["rank"]: r["attempt"] for r in resumes}[1] == 1
    steps = [r["step"] for r in runlog.read_run(tmp_path / "k") if r["kind"] == "train"]
    assert max(steps) == 16


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_second_node_joins_a_running_job_and_doubles_the_world_size(tmp_path, no_leftovers):
    args = TINY + ["--epochs", "2", "--checkpoint-every", "5", "--runs-dir", str(tmp_path)]
    args += ["--checkpoint", str(tmp_path / "g.pt"), "--run-name", "g", "--pause-s", "0.3"]
    cmd = torchrun.torchrun_command(
        args,
        nproc_per_node=1,
        nnodes="1:2",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        run_id="g",
        rdzv_conf="last_call_timeout=1",
    )
    extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with torchrun.Agents([cmd], tmp_path / "ag", extra) as agents:
        torchrun.wait_for_step(tmp_path / "g", 3, timeout=200)
        agents.join(cmd)
        assert agents.wait(280) == [0, 0], agents.output(1)[-3000:]
    recs = sorted(runlog.read_run(tmp_path / "g"), key=lambda r: r["time"])
    t_join = min(r["time"] for r in recs if r["kind"] == "resume")
    worlds = [
        len({r["rank"] for r in recs if r["kind"] == "train" and before == (r["time"] < t_join)})
        for before in (True, False)
    ]
    assert worlds == [1, 2]
    snapshot = [r for r in recs if r["kind"] == "checkpoint" and r["time"] < t_join][-1]
    resumed = next(r for r in recs if r["kind"] == "resume")
    assert resumed["batch"] == snapshot["batch"] // 2  # the position converted, in samples
    plans = [r["steps"] for r in recs if r["kind"] == "plan" and r["rank"] == 0]
    assert (plans[0], plans[-1]) == (2 * 45, 2 * 23)  # 1437 samples: 45, then 23 batches of 32


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_record_makes_the_failing_rank_the_root_cause_with_its_traceback(tmp_path, no_leftovers):
    args = ["elastic", "--dataset", "digits", "--max-steps", "6", "--no-evaluate"]
    args += ["--runs-dir", str(tmp_path), "--run-name", "r"]
    args += ["--fail-rank", "1", "--fail-step", "3", "--fail-how", "raise"]
    code, out = torchrun.run_torchrun(args, timeout=180, log_dir=tmp_path / "ag")
    assert code != 0
    report = out[out.index("Root Cause") :]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", report)
    assert "RuntimeError: injected failure on rank 1 at step 3" in report


def test_a_run_folder_is_continued_by_its_own_job_only(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    torchelastic.claim_run_dir(run_dir, 0)
    (run_dir / "config.json").write_text("{}")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a healthy node's count after a restart
    torchelastic.claim_run_dir(run_dir, 0)  # the same job: continued, whatever the count
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")
    with pytest.raises(ValueError, match="already holds an earlier run"):
        torchelastic.claim_run_dir(run_dir, 0)
    torchelastic.claim_run_dir(run_dir, 1)  # only rank 0 checks


def test_a_handled_error_is_written_to_the_rank_s_error_file(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    torchelastic.record_failure(ValueError("nowhere to go"))  # outside torchrun: nothing
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise ValueError("--lr -1: must be positive")
    except ValueError as exc:
        torchelastic.record_failure(exc)
    written = json.loads(error_file.read_text())
    assert "--lr -1: must be positive" in json.dumps(written)
