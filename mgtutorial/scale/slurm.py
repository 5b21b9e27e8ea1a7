"""SLURM's batch script, ``scripts/slurm/ddp.sbatch``, run without SLURM to see what it would start.

Taught in notebooks/05a_torchrun_multinode.ipynb, section 3, and the reference of its exercise
05a.3: the script runs with the variables SLURM sets in a job and stand-ins for ``srun`` (prints
the ``OMP_NUM_THREADS`` it was given and the command it would run once per node) and ``scontrol``
(prints the node names). Follows https://slurm.schedmd.com/sbatch.html and
https://slurm.schedmd.com/srun.html.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

STAND_INS = {
    "srun": 'echo "OMP_NUM_THREADS=$OMP_NUM_THREADS"; echo "srun $*"',
    "scontrol": "printf '%s\\n' {hostnames}",
}
"""The stand-ins' shell commands; ``{hostnames}`` becomes the node names."""

SCRIPT_DEFAULTS = ("OMP_NUM_THREADS", "GPUS_PER_NODE", "RDZV_PORT", "TORCHRUN")
"""Variables the script reads with a default of its own: a dry run starts without them."""


def script() -> Path:
    """``scripts/slurm/ddp.sbatch``, beside the package or the notebooks' folder.

    Raises:
        FileNotFoundError: in neither place (an installed package without the repository).
    """
    for root in (Path(__file__).resolve().parents[2], Path.cwd().parent, Path.cwd()):
        if (root / "scripts" / "slurm" / "ddp.sbatch").is_file():
            return root / "scripts" / "slurm" / "ddp.sbatch"
    raise FileNotFoundError("scripts/slurm/ddp.sbatch is not beside the package or the notebooks")


def dry_run(
    slurm: dict[str, str], hostnames: Sequence[str], args: Sequence[str] = (), timeout: float = 30
) -> subprocess.CompletedProcess:
    """Run the batch script with SLURM's variables ``slurm`` (``SLURM_NNODES``, ``SLURM_JOB_ID``,
    ``SLURM_JOB_NODELIST``, ``SLURM_GPUS_ON_NODE``, ``SLURM_CPUS_PER_TASK``: strings), the node
    names ``hostnames`` and the script's arguments ``args`` (they go to ``python -m mgtutorial
    ddp``), with :data:`STAND_INS` first on PATH and none of this process's ``SLURM_*`` or
    :data:`SCRIPT_DEFAULTS` variables.

    Returns the finished process (text); on success its stdout has two lines,
    ``OMP_NUM_THREADS=<n>`` and ``srun <options> torchrun <options> -m mgtutorial ddp <args>``.
    Raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds.
    """
    names = " ".join(shlex.quote(h) for h in hostnames)
    with tempfile.TemporaryDirectory() as fake:
        for name, body in STAND_INS.items():
            path = Path(fake) / name
            path.write_text(f"#!/bin/sh\n{body.format(hostnames=names)}\n")
            path.chmod(stat.S_IRWXU)
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k not in SCRIPT_DEFAULTS
        }
        env.update(slurm, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
        command = ["bash", str(script()), *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun_options(stdout: str) -> dict[str, str]:
    """What a :func:`dry_run`'s output says the script passes on: torchrun's options with their
    values (``{"--nnodes": "2", "--nproc-per-node": "4", …}``) and ``"OMP_NUM_THREADS"``."""
    omp, srun = stdout.strip().splitlines()
    argv = shlex.split(srun)
    options = argv[argv.index("torchrun") + 1 : argv.index("-m")]
    return {**dict(zip(options[::2], options[1::2])), "OMP_NUM_THREADS": omp.split("=", 1)[1]}
