"""Chapter 05's checkers both ways on their own (the notebooks' sections run in
tests/test_exercises.py): a right answer passes, a typical mistake fails with its hint, and no hint
holds the value the checker expects."""

from __future__ import annotations

import textwrap

import pytest

from mgtutorial.exercises import ExerciseError, ch05a, ch05b, ch05c


def right_ranks(node_rank, nprocs):
    before = sum(nprocs[:node_rank])
    return [
        {"RANK": before + local, "LOCAL_RANK": local, "WORLD_SIZE": sum(nprocs)}
        for local in range(nprocs[node_rank])
    ]


def test_ranks_of_both_ways_and_the_hint_does_not_give_the_rank(capsys):
    ch05a.ranks_of(right_ranks)
    assert capsys.readouterr().out.startswith("✓ 05a.1 ranks of a node: ")

    def node_zero_only(node_rank, nprocs):  # global ranks restarting at 0 on every node
        return [dict(row, RANK=row["LOCAL_RANK"]) for row in right_ranks(node_rank, nprocs)]

    with pytest.raises(ExerciseError, match="your RANK=0 is not the one torchrun sets") as info:
        ch05a.ranks_of(node_zero_only)
    assert "RANK=4" not in str(info.value)  # node 1 of 4+4, local rank 0: torchrun's is 4


def right_mapping(slurm, hostnames):
    gpus = int(slurm["SLURM_GPUS_ON_NODE"])
    return {
        "--nnodes": slurm["SLURM_NNODES"],
        "--nproc-per-node": str(gpus),
        "--rdzv-id": slurm["SLURM_JOB_ID"],
        "--rdzv-endpoint": f"{hostnames[0]}:29500",
        "OMP_NUM_THREADS": str(max(1, int(slurm["SLURM_CPUS_PER_TASK"]) // gpus)),
    }


def test_slurm_mapping_both_ways_and_the_hint_does_not_give_the_value(capsys):
    ch05a.slurm_mapping(right_mapping)
    assert capsys.readouterr().out.startswith("✓ 05a.3 SLURM to torchrun: ")

    def no_floor(slurm, hostnames):  # forgets that a rank gets at least one thread
        threads = int(slurm["SLURM_CPUS_PER_TASK"]) // int(slurm["SLURM_GPUS_ON_NODE"])
        return dict(right_mapping(slurm, hostnames), OMP_NUM_THREADS=str(threads))

    with pytest.raises(ExerciseError, match="your OMP_NUM_THREADS '0' is not what") as info:
        ch05a.slurm_mapping(no_floor)
    assert "OMP_NUM_THREADS 1" not in str(info.value) and "'1'" not in str(info.value)


RESTORE = """
import os

import torch

from mgtutorial.common import models


def restore(path, model, optimizer, device):
    {guard}
    state = torch.load(path, map_location=device, weights_only=True)
    models.unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return {{k: state[k] for k in ("epoch", "step", "batch", "samples")}}
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_restore_keyed_on_the_restart_count_fails_where_the_counts_differ(
    tmp_path, capsys, no_leftovers
):
    """05b.1's replay gives the restarted ranks the counts of two nodes' agents, 0 and 1: a restore
    that loads the snapshot only on a restarted count fails there, the right one passes."""
    right, keyed = tmp_path / "right.py", tmp_path / "keyed.py"
    right.write_text(textwrap.dedent(RESTORE.format(guard="pass")))
    only_restarted = (
        'if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":  # "not restarted": start afresh\n'
        '        return {"epoch": 0, "step": 0, "batch": 0, "samples": 0}'
    )
    keyed.write_text(textwrap.dedent(RESTORE.format(guard=only_restarted)))
    ch05b.resume_after_kill(str(right), runs_dir=str(tmp_path / "runs"))
    assert "(restart counts 0 and 1)" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match="05b.1 resume after a kill: .*keyed.py"):
        ch05b.resume_after_kill(str(keyed), runs_dir=str(tmp_path / "runs"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_last_step_skipped_asks_what_ended_the_wait_not_a_helper_s_class(capsys, no_leftovers):
    """05c.2: the answer is what ended rank 0's wait, told from gloo's own error (which is a
    RuntimeError either way), not the class hang_worker re-raises it as."""
    right = {"failing_rank": 0, "ended_by": "timeout", "detail_names_rank": 1}
    ch05c.last_step_skipped(right)
    assert "its collective timeout" in capsys.readouterr().out
    for wrong, hint in [
        (dict(right, ended_by="peer gone"), "was not ended by 'peer gone'"),
        (dict(right, ended_by="TimeoutError"), "answer 'timeout' or 'peer gone'"),
    ]:
        with pytest.raises(ExerciseError, match=hint) as info:
            ch05c.last_step_skipped(wrong)
        assert "'timeout'" not in str(info.value) or "answer 'timeout' or" in str(info.value)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_restore_returning_no_samples_is_named_as_the_cause(tmp_path, no_leftovers):
    zero = tmp_path / "zero.py"
    zero.write_text(
        textwrap.dedent(RESTORE.format(guard="pass")).replace(
            'return {k: state[k] for k in ("epoch", "step", "batch", "samples")}',
            'return {**{k: state[k] for k in ("epoch", "step", "batch")}, "samples": 0}',
        )
    )
    with pytest.raises(ExerciseError, match="restore returned 'samples': 0 for a snapshot of step"):
        ch05b.resume_after_kill(str(zero), runs_dir=str(tmp_path / "runs"))
