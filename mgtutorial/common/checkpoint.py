"""Checkpoints: the unwrapped model, the optimizer and the progress, written atomically by rank 0.

Taught in notebooks/02_ddp.ipynb (save on rank 0, barrier, load with ``map_location``) and
notebooks/05b_elastic_restarts.ipynb (mid-epoch snapshots for elastic restarts). Follows
https://pytorch.org/tutorials/intermediate/ddp_tutorial.html#save-and-load-checkpoints and
https://pytorch.org/docs/stable/generated/torch.load.html (``weights_only``).
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mgtutorial.common import models
from mgtutorial.common.config import check_writable_folder


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer,
    epoch: int,
    step: int,
    batch: int = 0,
    samples: int = 0,
) -> None:
    """Write the *unwrapped* model's state_dict, the optimizer's, and progress, atomically.

    ``epoch`` is the number of completed epochs, ``step`` the global step, ``batch`` the batches
    per rank already done in epoch ``epoch`` (a mid-epoch snapshot; 0 at an epoch end), ``samples``
    the samples rank 0 has trained on so far; the world size they were counted at is saved too
    (``world_size``: a job resumed at another world size converts ``batch``, chapter 05b). Saved to
    ``path.tmp`` then renamed, so a crash never leaves half a file. Call on rank 0 only, then
    ``barrier`` on every rank.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "model": models.unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "step": step,
        "batch": batch,
        "samples": samples,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _written_by_torch_save(path: Path) -> bool:
    """torch.save's format: a zip archive holding ``<name>/data.pkl``."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/data.pkl") for name in archive.namelist())


def check_checkpoint_path(path: str | os.PathLike | None, resume: bool = False) -> None:
    """Refuse, before any rank starts, a checkpoint setting that would lose something.

    Raises:
        ValueError: ``resume`` without a ``path``; ``path`` is a folder, or its folder cannot be
            written (:func:`~mgtutorial.common.config.check_writable_folder`); or ``path`` exists
            and is not a file :func:`torch.save` wrote (it would be overwritten by the first save,
            or fail to load on resume).
    """
    if path is None:
        if resume:
            raise ValueError(
                "resume=True needs the file to resume from: set checkpoint (--checkpoint PATH)."
            )
        return
    path = Path(path)
    check_writable_folder(path.parent, f"checkpoint={str(path)!r}, whose folder")
    if path.is_dir():
        raise ValueError(f"checkpoint={str(path)!r} is a folder: name a file, e.g. runs/ddp.pt.")
    if path.exists() and not _written_by_torch_save(path):
        raise ValueError(
            f"checkpoint={str(path)!r} exists and is not a checkpoint: it would be overwritten. "
            "Name a new file (e.g. runs/ddp.pt), or delete that one if it is yours to lose."
        )


def settings_path(path: str | os.PathLike) -> Path:
    """The file beside checkpoint ``path`` that records the settings it was trained with
    (``<path>.json``), so that a resume with other settings is refused before any rank starts."""
    return Path(f"{path}.json")


def save_settings(path: str | os.PathLike, settings: dict) -> None:
    """Write ``settings`` (JSON: the data set, the batch size, …) beside checkpoint ``path``,
    atomically; rank 0 calls it with :func:`save_checkpoint`."""
    target = settings_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(settings, sort_keys=True))
    os.replace(tmp, target)


def check_same_settings(path: str | os.PathLike | None, settings: dict) -> None:
    """Refuse to resume from checkpoint ``path`` with ``settings`` other than those it recorded
    (:func:`save_settings`): its progress (batches done in the epoch, steps planned) would not
    mean the same thing. A checkpoint without a record is not checked.

    Raises:
        ValueError: naming each setting that differs, both values, and the fix.
    """
    try:
        saved = json.loads(settings_path(path).read_text()) if path else {}
    except (OSError, ValueError):
        return
    differ = {k: (saved[k], v) for k, v in settings.items() if k in saved and saved[k] != v}
    if differ:
        listed = ", ".join(
            f"{k}={new!r} (the checkpoint's: {old!r})" for k, (old, new) in differ.items()
        )
        raise ValueError(
            f"resume=True from {path}, but {listed}: its progress counts batches of the "
            "settings it was trained with. Resume with those, or name a new checkpoint file."
        )


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer=None, device: torch.device | str = "cpu"
) -> dict:
    """Load a :func:`save_checkpoint` file into ``model`` (strict) and ``optimizer``.

    ``map_location=device`` puts tensors on this rank's device; ``weights_only=True`` refuses
    arbitrary pickled code. Returns the checkpoint dict (``epoch``, ``step``).

    Raises:
        ValueError: ``path`` is not a file :func:`save_checkpoint` wrote (another format, truncated,
            or a torch file without ``model``); the message names the file.
    """
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{path} is not a checkpoint written by save_checkpoint ({first}); "
            "point checkpoint at the file a previous run saved, or delete it to start afresh."
        ) from exc
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"{path} holds no 'model' entry: it was not written by save_checkpoint.")
    models.unwrap(model).load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return state
