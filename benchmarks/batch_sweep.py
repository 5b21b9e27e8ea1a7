"""(c) of benchmarks/launch_and_scaling.py: the ceiling of 2-rank scaling and the scaling DDP
reaches, by per-rank batch size (notebooks/09a_cost_model.ipynb and
notebooks/09b_measurement.ipynb). Imported and run by launch_and_scaling.py (``--parts
sweep``)."""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path

from launch_timing import RUN_TIMEOUT_S

from mgtutorial.runtime.launcher import launch


def batch_sweep(batches: list[int], repeats: int) -> dict:
    """(c) ``ceiling_2v1`` and ``scaling_2v1_by_batch`` (chapter 09), in one run.

    Per repeat, one 2-rank job of :func:`mgtutorial.perf.sweeps.step_worker` on digits; for each
    per-rank batch in turn: rank 0 training alone (rank 1 idle at a barrier), both ranks training
    independently at once (no DDP, no collectives: the ceiling), then DDP on both. Interleaving
    the three per batch lets a drifting machine load touch them alike. Ratios by
    :func:`mgtutorial.perf.scaling.scaling_ratios`; medians over repeats.
    """
    from mgtutorial.perf import scaling, sweeps

    cfg = sweeps.StepConfig(
        dataset="digits",
        backend="gloo",
        warmup=3,
        steps=15,
        variants=[
            {"batch_size": b, "mode": m} for b in batches for m in ("alone", "independent", "ddp")
        ],
    )
    per_repeat = []
    tmp = Path(tempfile.mkdtemp(prefix="mgtutorial-batch-"))
    try:
        for i in range(repeats):
            values = (
                launch(sweeps.step_worker, cfg, 2, runs_dir=tmp, threads_per_rank=1)
                .wait(timeout=RUN_TIMEOUT_S)
                .values
            )
            per_repeat.append(scaling.scaling_ratios(values))
            print(
                f"[batch sweep {i + 1}/{repeats}] "
                + ", ".join(
                    f"b={r['batch_size']}: {r['scaling_2v1']:.2f}/{r['ceiling_2v1']:.2f}"
                    for r in per_repeat[-1]
                ),
                flush=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {
        key: {
            str(b): statistics.median(rep[j][key] for rep in per_repeat)
            for j, b in enumerate(batches)
        }
        for key in ("ceiling_2v1", "scaling_2v1", "fraction")
    }
    ceiling = statistics.median(r["ceiling_2v1"] for rep in per_repeat for r in rep)
    best = max(med["scaling_2v1"], key=med["scaling_2v1"].get)
    print(f"\n{'per-rank batch':<16}{'scaling_2v1':>12}{'ceiling_2v1':>12}{'fraction':>10}")
    for b in map(str, batches):
        cells = (med["scaling_2v1"][b], med["ceiling_2v1"][b])
        print(f"{b:<16}" + "".join(f"{c:>12.3f}" for c in cells) + f"{med['fraction'][b]:>10.3f}")
    return {
        "ceiling_2v1": ceiling,
        "ceiling_2v1_by_batch": med["ceiling_2v1"],
        "scaling_2v1_by_batch": med["scaling_2v1"],
        "best_batch": int(best),
        "raw_batch_sweep": per_repeat,
        "aim_best_scaling_ge_0.9_ceiling": med["scaling_2v1"][best] >= 0.9 * ceiling,
    }
