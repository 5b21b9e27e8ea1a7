"""The step-time model of notebooks/09b_measurement.ipynb, checked with more repeats.

Each repeat is one all-reduce sweep (α–β fitted on the fastest call, in wall time and in the
process's CPU time) and one 2-rank job of :func:`mgtutorial.perf.sweeps.step_worker` that trains,
per per-rank batch in turn, "lockstep" (independent ranks with a barrier after every step) and
"ddp". Predicted DDP step = lockstep step (its barrier stands for the logging's all-reduce) +
the buckets' α + β·S + the bucket copies (measured once); the same terms in CPU time predict
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

import torch

from mgtutorial import launch
from mgtutorial.common import models
from mgtutorial.perf import costmodel, scaling, sweeps, timing

SIZES = [4096 * 4**i for i in range(6)]  # 4 KiB … 4 MiB, as 09b


def copy_seconds() -> float:
    """Gradients into one flat bucket and back, one thread, the fastest of 20 calls."""
    model = models.ArticleCNN(in_shape=(3, 32, 32))
    grads = [torch.randn_like(p) for p in model.parameters()]
    flat = torch.empty(sum(g.numel() for g in grads))

    def copies():
        torch.cat([g.view(-1) for g in grads], out=flat)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.view(-1).copy_(part)

    torch.set_num_threads(1)
    return min(timing.time_op(copies, torch.device("cpu"), warmup=2, repeats=20))


def one_repeat(batches: list[int], runs: Path, copies: float) -> dict[int, dict]:
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
    added = {
        k: sum(costmodel.alpha_beta_time(b, *fit) for b in buckets) + copies
        for k, fit in fits.items()
    }
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
    copies = copy_seconds()
    reps = []
    with tempfile.TemporaryDirectory(prefix="mgtutorial-step-model-") as tmp:
        for i in range(args.repeats):
            reps.append(one_repeat(args.batches, Path(tmp), copies))
            print(
                f"[{i + 1}/{args.repeats}]",
                {b: {k: round(v, 2) for k, v in r.items()} for b, r in reps[-1].items()},
                flush=True,
            )
    result = {
        "load_average": os.getloadavg(),
        "copies_s": copies,
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
