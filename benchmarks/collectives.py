"""Collective sweep: all-reduce, all-gather, reduce-scatter, broadcast from 4 KiB to 64 MiB.

Benchmark for notebooks/09a_cost_model.ipynb and notebooks/09b_measurement.ipynb. For each
collective and size it reports nccl-tests' ``algbw`` and ``busbw`` (bytes/s) and ``time_s`` (median
over repeats of the slowest rank), and fits ``t = α + β·S`` per collective
(:func:`mgtutorial.perf.costmodel.fit_alpha_beta`). Run, not asserted on::

    python benchmarks/collectives.py --out benchmarks/results/collectives.json    # 2 ranks, gloo
    python benchmarks/collectives.py --nprocs 2 4 --out /tmp/collectives.json     # also 4 ranks
    torchrun --standalone --nproc-per-node 8 benchmarks/collectives.py --out c.json  # GPUs, NCCL

Under ``torchrun`` the ranks run the sweep in this process (NCCL on GPUs); otherwise it starts
them with :func:`mgtutorial.launch` (one thread per rank). The top-level ``alpha_s`` and
``beta_s_per_byte`` are all-reduce's at the smallest world size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from mgtutorial import launch
from mgtutorial.perf import costmodel, sweeps
from mgtutorial.runtime import env

SIZES = [4 * 1024 * 4**i for i in range(8)]  # 4 KiB … 64 MiB


def report(records: list[dict]) -> dict:
    """Per world size and collective: the points with algbw/busbw, and the α–β fit."""
    out: dict = {}
    for r in records:
        n, op = r["world_size"], r["op"]
        entry = out.setdefault(str(n), {}).setdefault(op, {"points": []})
        entry["points"].append(
            {
                "nbytes": r["nbytes"],
                "time_s": r["time_s"],
                "algbw": costmodel.algbw(r["nbytes"], r["time_s"]),
                "busbw": costmodel.busbw(op, r["nbytes"], r["time_s"], n),
            }
        )
    for ops in out.values():
        for entry in ops.values():
            pts = entry["points"]
            entry["alpha_s"], entry["beta_s_per_byte"] = costmodel.fit_alpha_beta(
                [p["nbytes"] for p in pts], [p["time_s"] for p in pts]
            )
    return out


def print_table(results: dict) -> None:
    for n, ops in results.items():
        print(f"\n{n} ranks — busbw in GB/s (time in ms)")
        print(f"{'size':>10}" + "".join(f"{op:>22}" for op in ops))
        sizes = [p["nbytes"] for p in next(iter(ops.values()))["points"]]
        for i, s in enumerate(sizes):
            cells = "".join(
                f"{o['points'][i]['busbw'] / 1e9:>12.3f} ({o['points'][i]['time_s'] * 1e3:7.2f})"
                for o in ops.values()
            )
            print(f"{s / 1024:>8.0f}Ki" + cells)
        print(f"{'α (µs)':>10}" + "".join(f"{o['alpha_s'] * 1e6:>22.1f}" for o in ops.values()))
        print(
            f"{'1/β (GB/s)':>10}"
            + "".join(f"{1 / o['beta_s_per_byte'] / 1e9:>22.3f}" for o in ops.values())
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument(
        "--nprocs", type=int, nargs="+", default=[2], help="world sizes to sweep (launch only)"
    )
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed calls per point (median kept)"
    )
    parser.add_argument("--max-mib", type=float, default=64, help="largest size in MiB")
    args = parser.parse_args()
    sizes = [s for s in SIZES if s <= args.max_mib * 1024 * 1024]
    cfg = sweeps.SweepConfig(sizes=sizes, repeats=args.repeats)
    start = time.monotonic()
    if env.is_distributed_env():  # under torchrun: we are a rank
        records = sweeps.sweep_worker(cfg)
        if env.rank() != 0:
            return 0
    else:
        os.environ["OMP_NUM_THREADS"] = "1"
        records = []
        with tempfile.TemporaryDirectory(prefix="mgtutorial-coll-") as tmp:
            for n in args.nprocs:
                records += (
                    launch(sweeps.sweep_worker, cfg, n, runs_dir=tmp, threads_per_rank=1)
                    .wait()
                    .values[0]
                )
    results = report(records)
    print_table(results)
    first = results[min(results, key=int)]["all_reduce"]
    out = {
        "alpha_s": first["alpha_s"],
        "beta_s_per_byte": first["beta_s_per_byte"],
        "results": results,
        "backend": env.resolve_backend("auto", int(min(results, key=int))),
        "repeats": args.repeats,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "wall_s": time.monotonic() - start,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "note": "measured, not asserted on; numbers depend on the machine and its load.",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    alpha_us, beta_ns = out["alpha_s"] * 1e6, out["beta_s_per_byte"] * 1e9
    print(f"\nall-reduce fit: α = {alpha_us:.1f} µs, β = {beta_ns:.3f} ns/byte; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
