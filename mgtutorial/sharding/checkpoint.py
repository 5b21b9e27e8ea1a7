"""Checkpoints of a sharded (FSDP2) model: a full state dict for one process, and a distributed
checkpoint (DCP) that every rank writes its shard of and any number of ranks can load.

Taught in notebooks/07b_fsdp2.ipynb, section 6. Follows
https://pytorch.org/docs/stable/distributed.checkpoint.html (``dcp.save`` / ``dcp.load``,
``get_model_state_dict`` / ``set_model_state_dict``) and
https://pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html.
:func:`part_save` and :func:`part_load` run inside :func:`mgtutorial.sharding.worker.worker`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from mgtutorial.common.compare import max_abs_diff
from mgtutorial.sharding.fsdp import apply_fsdp, mesh_for
from mgtutorial.sharding.model import make_model, reference, train


def check_checkpoint(checkpoint_id: str | os.PathLike, state_dict: dict, prefix: str = "") -> None:
    """Refuse to load a DCP checkpoint whose tensors do not have the shapes of ``state_dict``
    (saved under ``prefix``, e.g. ``"model."``).

    Reads only the checkpoint's metadata. Raises ValueError naming the first tensor that is missing
    or has another shape (global shapes: a checkpoint saved by 2 ranks fits a model on 4).
    """
    meta = dcp.FileSystemReader(str(checkpoint_id)).read_metadata().state_dict_metadata
    saved = {k.removeprefix(prefix): v for k, v in meta.items() if k.startswith(prefix)}
    for name, t in state_dict.items():
        if name not in saved:
            raise ValueError(
                f"tensor {name!r} of the model is not in checkpoint {Path(checkpoint_id).name!r} "
                f"(it has {sorted(saved)[:4]}…): was it saved from another model?"
            )
        have, want = tuple(saved[name].size), tuple(t.shape)
        if have != want:
            raise ValueError(
                f"tensor {name!r}: the checkpoint holds shape {have}, the model {want}. "
                "Build the model with the configuration it was saved with (width, blocks)."
            )


def full_state_dict(model) -> dict:
    """The whole model's state dict, gathered to rank 0 on CPU (other ranks get ``{}``)."""
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def save_dcp(model, optimizer, checkpoint_id: str | os.PathLike) -> None:
    """Every rank writes its shards of the model AND of the optimizer state (``get_state_dict``:
    Adam(W)'s ``exp_avg``, ``exp_avg_sq`` and ``step``), as ``{"model": …, "optim": …}``."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(checkpoint_id))


def load_dcp(model, checkpoint_id: str | os.PathLike, optimizer=None) -> None:
    """Load a DCP checkpoint of :func:`save_dcp` into ``model`` (and ``optimizer``, to resume
    training): sharded (inside a process group) or plain (one process, the model only). Raises
    ValueError first if the shapes differ (:func:`check_checkpoint`)."""
    sharded = dist.is_initialized()
    if sharded and optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model) if sharded else model.state_dict()}
    check_checkpoint(checkpoint_id, state["model"], prefix="model.")
    with warnings.catch_warnings():
        # one process on purpose: DCP's "assuming single process" note is noise
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=str(checkpoint_id), no_dist=not sharded)
    if "optim" in state:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    elif sharded:
        set_model_state_dict(model, state["model"])
    else:
        model.load_state_dict(state["model"], strict=True)


def files_written(folder: str | os.PathLike) -> dict[str, int]:
    """``{file name: bytes}`` of a checkpoint folder."""
    return {p.name: p.stat().st_size for p in sorted(Path(folder).iterdir())}


def part_save(cfg, ctx) -> dict:
    """Train FSDP2 ``cfg.steps`` steps, then write ``full.pt`` (rank 0) and ``dcp/`` (every
    rank)."""
    root = Path(cfg.checkpoint_dir)
    model = apply_fsdp(make_model(cfg).to(ctx.device), mesh_for(cfg, ctx))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    train(model, opt.step, cfg, ctx, opt.zero_grad)
    full = full_state_dict(model)
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        torch.save(full, root / "full.pt.tmp")
        os.replace(root / "full.pt.tmp", root / "full.pt")
    save_dcp(model, opt, root / "dcp")
    dist.barrier()
    return {
        "full_keys": sorted(full),
        "files": files_written(root / "dcp"),
        "local_shards": {
            k: list(v.to_local().shape) for k, v in get_model_state_dict(model).items()
        },
    }


def part_load(cfg, ctx) -> dict:
    """Load ``dcp/`` (model and optimizer) into a freshly sharded model (any world size); compare
    with ``full.pt``; then resume: train ``cfg.steps`` more steps and compare with one process
    that trained ``2 × cfg.steps`` without stopping, and with a resume that loads the model only
    (fresh Adam(W) state)."""
    root = Path(cfg.checkpoint_dir)
    fresh = dataclasses.replace(cfg, seed=cfg.seed + 1)  # other weights before loading
    saved = torch.load(root / "full.pt", map_location="cpu", weights_only=True)
    straight, _ = reference(dataclasses.replace(cfg, steps=2 * cfg.steps))
    out = {}
    for name in ("model_and_optimizer", "model_only"):
        model = apply_fsdp(make_model(fresh).to(ctx.device), mesh_for(cfg, ctx))
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        before = max_abs_diff(get_model_state_dict(model), saved)
        load_dcp(model, root / "dcp", opt if name == "model_and_optimizer" else None)
        after = max_abs_diff(get_model_state_dict(model), saved)
        train(model, opt.step, cfg, ctx, opt.zero_grad, first=cfg.steps)
        resumed = full_state_dict(model)
        if name == "model_and_optimizer":
            out |= {"max_diff_before": before, "max_diff_after": after}
            out["local_shards"] = {
                k: list(v.to_local().shape) for k, v in get_model_state_dict(model).items()
            }
        out[f"resumed_{name}_vs_straight"] = (
            max_abs_diff(resumed, straight.state_dict()) if ctx.is_main else None
        )
    return out
