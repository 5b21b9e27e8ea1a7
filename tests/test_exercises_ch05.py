"""Chapter 05's checkers both ways on their own (the notebooks' sections run in
tests/test_exercises.py): a right answer passes, a typical mistake fails with its hint, and no hint
holds the value the checker expects."""

from __future__ import annotations

import copy
import inspect
import os
import textwrap

import pytest

from mgtutorial.exercises import ExerciseError, RankFailed, ch05a, ch05a_store, ch05b, ch05c
from mgtutorial.exercises._common import run_file


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


FIXED = (
    "torchrun --nnodes 3 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint n005:29400 "
    "--rdzv-id job-977 -m mgtutorial ddp --epochs 3"
)


def test_fixed_command_both_ways_and_no_hint_gives_the_value(capsys, monkeypatch):
    """05a.2: torchrun's parser and config_from_args read the learner's line; each thing the broken
    line gets wrong fails with its own hint, and the kernel's environment is left as it was."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # config_from_args would set it
    ch05a.fixed_command(FIXED)
    assert capsys.readouterr().out.startswith("✓ 05a.2 a broken command: torchrun reads 3 nodes")
    ch05a.fixed_command(FIXED.replace("--nproc-per-node 8", "--nproc-per-node gpu").split())
    for wrong, hint in [
        (ch05a.BROKEN, "localhost:29500: on each node that names the node itself"),
        (FIXED.replace("--nproc-per-node 8", "--nproc-per-node 4"), "--nproc-per-node 4 starts"),
        (FIXED.replace("n005:29400", "n005:abc"), "c10d rendezvous refuses it"),
        (FIXED.replace("n005:29400", "n005:99999"), "c10d rendezvous refuses it"),
        (FIXED.replace("n005:29400", "n005:0"), "port 0 lets the host pick"),
        (FIXED.replace("--nnodes 3", "--nnodes 1:2:3"), "torchrun refuses these options"),
        (FIXED.replace("n005", "localhost"), "every node waits at a rendezvous of its own"),
        (FIXED.replace("n005", "gpu-a17"), "'gpu-a17' is not a node of the allocation"),
        (FIXED.replace("--nnodes 3", "--nnodes 3 --node-rank 2"), "c10d ignores it"),
        (FIXED.replace("--rdzv-backend c10d ", ""), "the rendezvous backend is 'static'"),
        (FIXED.replace("--nnodes 3", "--nnodes 2"), "count the nodes SLURM gave the job"),
        (FIXED.replace(" --rdzv-id job-977", ""), "give the job an --rdzv-id"),
        (FIXED.replace("--rdzv-id", "--rdzv-name"), "torchrun has no option --rdzv-name"),
    ]:
        with pytest.raises(ExerciseError, match=hint) as info:
            ch05a.fixed_command(wrong)
        assert "8 " not in str(info.value) and "n003:" not in str(info.value)
    assert "OMP_NUM_THREADS" not in os.environ


def test_a_localhost_endpoint_is_a_rendezvous_of_its_own_on_every_node():
    """What 05a.2's statement and hint say of the broken line: torchrun's c10d backend hosts the
    rendezvous store itself when the endpoint matches its machine, and "localhost" (or any
    loopback address) matches every machine; every node then waits for the others at its own."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, utils

    assert utils._matches_machine_hostname("localhost")
    assert utils._matches_machine_hostname("127.0.0.1")
    src = inspect.getsource(c10d_rendezvous_backend._create_tcp_store)
    assert "is_host = _matches_machine_hostname(host)" in src


STORE_RIGHT = {
    "default": {"store host": "agent", "same port": True, "key found": True},
    "disabled": {"store host": "rank 0", "same port": False, "key found": False},
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_store_after_restart_both_ways(tmp_path, capsys, monkeypatch, no_leftovers):
    """05a.4: the two real restarts run once (about a minute); the checker then reads the same
    records for the right answer and for one wrong answer per question."""
    records = ch05a_store.run_probes(tmp_path)
    monkeypatch.setattr(ch05a_store, "run_probes", lambda runs_dir: records)
    ch05a.store_after_restart(STORE_RIGHT)
    assert capsys.readouterr().out.startswith("✓ 05a.4 the store after a restart: ")
    for mode, key, value in [
        ("disabled", "same port", True),  # as if the handler kept its store info
        ("disabled", "key found", True),  # as if the store outlived rank 0
        ("default", "store host", "rank 0"),
        ("default", "same port", False),
    ]:
        wrong = copy.deepcopy(STORE_RIGHT)
        wrong[mode][key] = value
        with pytest.raises(ExerciseError, match="1 of your 6 predictions differ") as info:
            ch05a.store_after_restart(wrong)
        assert mode not in str(info.value)  # the hint does not say which one
    wrong = copy.deepcopy(STORE_RIGHT)
    wrong["disabled"] = dict(STORE_RIGHT["default"])  # "the same as by default"
    with pytest.raises(ExerciseError, match="3 of your 6 predictions differ"):
        ch05a.store_after_restart(wrong)
    with pytest.raises(ExerciseError, match="'key found'\\] is 'True': answer True or False"):
        ch05a.store_after_restart(
            {**STORE_RIGHT, "default": {**STORE_RIGHT["default"], "key found": "True"}}
        )
    with pytest.raises(ExerciseError, match="answer 'agent' or 'rank 0'"):
        ch05a.store_after_restart(
            {**STORE_RIGHT, "default": {**STORE_RIGHT["default"], "store host": "node 0"}}
        )


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
    progress = {{k: state[k] for k in ("epoch", "step", "batch", "samples")}}
    progress["batch"] = state["batch"] * state["world_size"] // torch.distributed.get_world_size()
    return progress
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
            "return progress",
            'return {**progress, "samples": 0}',
        )
    )
    with pytest.raises(ExerciseError, match="restore returned 'samples': 0 for a snapshot of step"):
        ch05b.resume_after_kill(str(zero), runs_dir=str(tmp_path / "runs"))


EARLY_STOP = """
import torch
import torch.distributed as dist

from mgtutorial.exercises.ch05c import THRESHOLD, batch_loss
from mgtutorial.runtime import env


def worker(cfg):
    with env.distributed(cfg.backend, timeout_s=cfg.options["timeout_s"]) as ctx:
        log = []
        for step in range(10):
            loss = torch.tensor([batch_loss(ctx.rank, step)], device=ctx.device)
            mean = loss.clone()
            dist.all_reduce(mean)
            mean /= ctx.world_size
            if ctx.rank == 0:
                log.append((step, mean.item()))
            {stop}
                break
        summary = torch.tensor([step + 1.0, mean.item()], device=ctx.device)
        dist.all_reduce(summary)
        return {{"log": log, "steps": int(summary[0].item())}}
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_early_stop_both_ways(tmp_path, capsys, no_leftovers):
    """05c.1: the starter (each rank stops on its own loss) fails with DETAIL's fingerprints, and
    without DETAIL waits until the collective timeout (as the exercise says); the highest own loss
    of any rank (all-reduced with MAX) passes with both sets of losses; stops that keep the ranks
    together on another value (the mean, one rank's own loss broadcast, any rank's flag, a fixed
    step) fail in at least one of them, and no stop at all fails too."""
    flag = "flag = (loss < THRESHOLD).float()\n            "
    files = {}
    for name, stop in [
        ("starter", "if loss.item() < THRESHOLD:"),
        (
            "right",
            "worst = loss.clone()\n            dist.all_reduce(worst, op=dist.ReduceOp.MAX)\n"
            "            if worst.item() < THRESHOLD:",
        ),
        ("mean", "if mean.item() < THRESHOLD:"),
        ("rank0", flag + "dist.broadcast(flag, 0)\n            if flag.item():"),
        ("rank1", flag + "dist.broadcast(flag, 1)\n            if flag.item():"),
        ("anyrank", flag + "dist.all_reduce(flag, dist.ReduceOp.MAX)\n            if flag.item():"),
        ("step5", "if step == 5:"),
        ("never", "if False:"),
    ]:
        files[name] = tmp_path / f"{name}.py"
        files[name].write_text(textwrap.dedent(EARLY_STOP.format(stop=stop)))
    ch05c.early_stop(str(files["right"]))
    assert "after step 5 and, with other losses, after step 3" in capsys.readouterr().out
    with pytest.raises(
        ExerciseError,
        match=r"DETAIL stopped the job: rank \d was calling ALLREDUCE"
        r" of shape \[\d\] as its collective #3 \(counting from 0\) while its peer called",
    ) as info:
        ch05c.early_stop(str(files["starter"]))
    assert "BARRIER" not in str(info.value)  # both calls are the worker's own all-reduces
    with pytest.raises(RankFailed, match="Timed out|closed"):  # without DETAIL: the timeout
        run_file("05c.1", files["starter"], "worker", 2, options={"timeout_s": 3}, timeout_s=60)
    for name, layout, last in [
        ("mean", 0, 3),
        ("rank0", 0, 2),
        ("anyrank", 0, 2),
        ("rank1", 1, 1),  # right with the first losses, where rank 1 is the slow one
    ]:
        with pytest.raises(
            ExerciseError, match=f"no. {layout}, the job stopped after step {last},"
        ):
            ch05c.early_stop(str(files[name]))
    for name, layout, last in [("step5", 1, 5), ("never", 0, 9)]:
        with pytest.raises(ExerciseError, match=f"no. {layout}, rank 0 logged up to step {last},"):
            ch05c.early_stop(str(files[name]))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_restore_calling_the_package_s_loader_is_refused(tmp_path, no_leftovers):
    """05b.1 withholds checkpoint.load_checkpoint in its ranks: a restore that calls it (under
    either name it is imported by) fails and says so; the right one passes (the test above)."""
    for n, call in enumerate(("checkpoint.load_checkpoint", "trainer.load_checkpoint")):
        copied = tmp_path / f"copied{n}.py"
        copied.write_text(
            "from mgtutorial.common import checkpoint\n"
            "from mgtutorial.ddp import trainer\n\n\n"
            "def restore(path, model, optimizer, device):\n"
            f"    state = {call}(path, model, optimizer, device)\n"
            '    return {k: state[k] for k in ("epoch", "step", "batch", "samples")}\n'
        )
        with pytest.raises(ExerciseError, match="load_checkpoint is withheld in 05b.1"):
            ch05b.resume_after_kill(str(copied), runs_dir=str(tmp_path / "runs"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_restore_not_converting_the_batch_to_the_new_world_size_fails(tmp_path, no_leftovers):
    """05b.1's restart runs at world size 2 on a snapshot counted at 3: the snapshot's batch as it
    stands resumes at the wrong place of the epoch (the right one passes, the tests above)."""
    unconverted = tmp_path / "unconverted.py"
    right = textwrap.dedent(RESTORE.format(guard="pass"))
    converting = [line for line in right.splitlines() if "world_size" in line]
    assert len(converting) == 1
    unconverted.write_text(right.replace(converting[0] + "\n", ""))
    with pytest.raises(
        ExerciseError, match="resumed at step 8, batch 8 of the epoch: .*world size 3"
    ):
        ch05b.resume_after_kill(str(unconverted), runs_dir=str(tmp_path / "runs"))
