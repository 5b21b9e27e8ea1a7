"""The step-time model of notebooks/09b_measurement.ipynb, checked with more repeats.

Each repeat is one all-reduce sweep (α–β fitted on the fastest call, in wall time and in the
process's CPU time) and one 2-rank job of :func:`mgtutorial.perf.sweeps.step_worker` that trains,
per per-rank batch in turn, "lockstep" (independent ranks with a barrier after every step) and
"ddp". Predicted DDP step = lockstep step (its barrier stands for the logging's all-reduce) +
the buckets' α + β·S + DDP's own work (hooks, bucket copies; measured once on a world of
one, :func:`mgtutorial.perf.sweeps.ddp_own_worker`); the same terms in CPU time predict
DDP's CPU time per step. Writes, per batch, the median over repeats of predicted / measured in
both clocks, and the load average.
Run, not asserted on::

    python benchmarks/step_model.py --out benchmarks/results/step_model.json --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from mgtutorial import launch
from mgtutorial.common import models
from mgtutorial.perf import costmodel, scaling, sweeps

SIZES = [4096 * 4**i for i in range(6)]  # 4 KiB … 4 MiB, as 09b


def own_seconds(runs: Path) -> float:
    """DDP's own work per step (hooks, bucket copies): DDP on a world of one against the plain
    model, the median of 300 pairs of one-image steps (:func:`sweeps.ddp_own_worker`)."""
    cfg = sweeps.OwnConfig()
    return (
        launch(sweeps.ddp_own_worker, cfg, 1, runs_dir=runs, threads_per_rank=1)
        .wait()
        .values[0]["own_s"]
    )


def one_repeat(batches: list[int], runs: Path, own: float) -> dict[int, dict]:
    """Predicted / measured DDP step per batch, wall and CPU, from one sweep and one step job."""
    opts = dict(runs_dir=runs, threads_per_rank=1)
    sweep_cfg = sweeps.SweepConfig(ops=["all_reduce"], sizes=SIZES, repeats=10, backend="gloo")
    points = launch(sweeps.sweep_worker, sweep_cfg, 2, **opts).wait().values[0]
    nbytes = [p["nbytes"] for p in points]
    fits = {
        k: costmodel.fit_alpha_beta(nbytes, [p[k] for p in points])
        for k in ("time_min_s", "cpu_min_s")
    }
    grads = [p.numel() * 4 for p in reversed(list(models.ArticleCNN().parameters()))]
    buckets = costmodel.bucket_layout(grads, 25 * 2**20, 2**20)
    added = {k: costmodel.ddp_added_time(buckets, *fit, own)["added"] for k, fit in fits.items()}
    modes = ("lockstep", "ddp")
    variants = [{"batch_size": b, "mode": m} for b in batches for m in modes]
    step_cfg = sweeps.StepConfig(
        dataset="digits", backend="gloo", warmup=2, steps=10, variants=variants
    )
    job = launch(sweeps.step_worker, step_cfg, 2, **opts).wait().values
    got = {(v["batch_size"], v["mode"], r): v for r in job for v in job[r]}
    out = {}
    for b in batches:
        wall = {
            m: scaling.lockstep_time([got[b, m, r]["step_times"] for r in job], min) for m in modes
        }
        cpu = {m: statistics.mean(min(got[b, m, r]["cpu_times"]) for r in job) for m in modes}
        out[b] = {
            "wall_ratio": (wall["lockstep"] + added["time_min_s"]) / wall["ddp"],
            "cpu_ratio": (cpu["lockstep"] + added["cpu_min_s"]) / cpu["ddp"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--repeats", type=int, default=3, help="sweeps + step jobs (default 3)")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    args = parser.parse_args()
    reps = []
    with tempfile.TemporaryDirectory(prefix="mgtutorial-step-model-") as tmp:
        own = own_seconds(Path(tmp))
        for i in range(args.repeats):
            reps.append(one_repeat(args.batches, Path(tmp), own))
            print(
                f"[{i + 1}/{args.repeats}]",
                {b: {k: round(v, 2) for k, v in r.items()} for b, r in reps[-1].items()},
                flush=True,
            )
    result = {
        "load_average": os.getloadavg(),
        "own_s": own,
        "by_batch": {
            str(b): {
                k: statistics.median(r[b][k] for r in reps) for k in ("wall_ratio", "cpu_ratio")
            }
            for b in args.batches
        },
        "within_15_percent": {
            k: all(abs(statistics.median(r[b][k] for r in reps) - 1) <= 0.15 for b in args.batches)
            for k in ("wall_ratio", "cpu_ratio")
        },
        "raw": reps,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["by_batch"], indent=2), "\nwritten to", args.out)


if __name__ == "__main__":
    main()
