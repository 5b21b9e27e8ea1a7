"""Backend and device choice from the hardware and the environment (no process group)."""

from __future__ import annotations

import pytest
import torch

from mgtutorial.runtime import env, machine


def test_auto_backend_follows_hardware(monkeypatch):
    monkeypatch.setattr(env, "gpu_count", lambda: 0)
    assert env.resolve_backend("auto", 2) == "gloo"
    monkeypatch.setattr(env, "gpu_count", lambda: 2)
    assert env.resolve_backend("auto", 2) == "nccl"
    assert env.resolve_backend("auto", 4) == "gloo"  # fewer GPUs than ranks: CPU
    with pytest.raises(ValueError, match="'mpi'"):
        env.resolve_backend("mpi")


def test_device_from_local_rank_not_global_rank(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert (env.rank(), env.local_rank(), env.world_size()) == (5, 1, 8)
    assert env.device_for("nccl") == torch.device("cuda", 1)
    assert env.device_for("gloo") == torch.device("cpu")


def test_plain_process_defaults(monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    assert (env.rank(), env.local_rank(), env.world_size(), env.local_world_size()) == (0, 0, 1, 1)
    with env.distributed() as ctx:
        assert not ctx.initialized and ctx.world_size == 1
        assert env.global_mean(2.5, ctx) == 2.5


def test_describe_explains_choice():
    d = machine.describe()
    assert d["torch"] == torch.__version__
    assert d["backend"] in ("gloo", "nccl") and d["why"]
    if not torch.cuda.is_available():
        assert d["backend"] == "gloo" and d["rank0_device"] == "cpu" and d["default_nprocs"] == 2
