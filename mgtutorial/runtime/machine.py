"""What this machine has, and what the course chooses on it: ``python -m mgtutorial describe``.

Taught in notebooks/00_setup.ipynb (its first cell). The choices themselves are made in
:mod:`mgtutorial.runtime.env` (:func:`~mgtutorial.runtime.env.resolve_backend`,
:func:`~mgtutorial.runtime.env.default_nprocs`, :func:`~mgtutorial.runtime.env.device_for`);
this module reports them, with the reason.
"""

from __future__ import annotations

import os
import platform

import torch

from mgtutorial.runtime import env


def describe(nprocs: int | None = None) -> dict:
    """A summary of this machine and the choices the course makes on it for ``nprocs`` ranks
    (default: :func:`~mgtutorial.runtime.env.default_nprocs`).

    Returns a dict: ``python``, ``torch``, ``torchvision`` (versions), ``cpus`` (logical),
    ``gpus`` (CUDA device names), ``default_nprocs`` (the ranks assumed), ``backend`` (what
    "auto" picks for them), ``rank0_device`` and ``why`` (the reason, in words).
    """
    import torchvision

    gpus = env.gpu_count()
    ranks = nprocs or env.default_nprocs()
    backend = env.resolve_backend("auto", ranks)
    why = (
        f"{gpus} CUDA GPU(s) ≥ {ranks} ranks → one GPU per rank with NCCL"
        if backend == "nccl"
        else ("no CUDA GPU" if gpus == 0 else f"{gpus} GPU(s) < {ranks} ranks") + " → gloo on CPU"
    )
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cpus": os.cpu_count(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "default_nprocs": ranks,
        "backend": backend,
        "rank0_device": str(env.device_for(backend, 0)),
        "why": why,
    }
