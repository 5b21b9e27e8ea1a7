"""scripts/minimal_ddp.py under torchrun: 2 ranks × batch b train exactly like 1 rank × batch 2b."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "minimal_ddp.py"


def _torchrun(nprocs: int, batch_size: int) -> list[float]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nprocs),
        str(SCRIPT),
        "--epochs",
        "2",
        "--batch-size",
        str(batch_size),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("epoch ")]
    assert [ln.split(":")[0] for ln in lines] == ["epoch 1/2", "epoch 2/2"]  # rank 0 only prints
    return [float(re.search(r"mean loss (\S+)", ln).group(1)) for ln in lines]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_two_ranks_match_one_rank_on_the_combined_batch():
    two, one = _torchrun(2, 16), _torchrun(1, 32)
    assert two == pytest.approx(one, abs=2e-4)  # printed with 4 decimals
    assert _torchrun(1, 16) != pytest.approx(two, abs=2e-4)  # the comparison can fail
