"""How long a ``%%ranks`` cell takes once the pool is up: one all-reduce of a small tensor.

Benchmark for ``%%ranks`` (mgtutorial/runtime/ranks_magic.py, notebooks/00_setup.ipynb). In an
IPython shell (the one IPython's own tests use, showing HTML as a notebook does), it starts a pool,
runs a warm-up cell, then times ``--cells`` cells of::

    %%ranks
    t = torch.ones(4, device=device)
    dist.all_reduce(t)
    t

from the shell's ``run_cell`` to its return (the cell sent to every rank, run, every rank's answer
back and displayed). It also times the pool's start and a cell that does nothing. Prints the
median and 90th percentile and writes them with every sample as JSON; asserts nothing::

    python benchmarks/ranks_magic.py --out benchmarks/results/ranks_magic.json
    python benchmarks/ranks_magic.py --nprocs 4 --cells 200 --out /tmp/ranks_magic.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

ALL_REDUCE = "%%ranks\nt = torch.ones(4, device=device)\ndist.all_reduce(t)\nt"
NOTHING = "%%ranks\npass"


def timed_cells(shell, source: str, n: int) -> list[float]:
    """Seconds per cell for ``n`` runs of ``source``; raises if a cell failed."""
    from IPython.utils.capture import capture_output

    samples = []
    for _ in range(n):
        with capture_output():
            start = time.perf_counter()
            result = shell.run_cell(source, store_history=True)
            samples.append(time.perf_counter() - start)
        if not result.success:
            raise RuntimeError(f"the cell failed: {result.error_in_exec!r}")
    return samples


def summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "median_s": statistics.median(ordered),
        "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "min_s": ordered[0],
        "samples_s": samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--nprocs", type=int, default=2, help="ranks in the pool")
    parser.add_argument("--cells", type=int, default=100, help="timed cells of each kind")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    from IPython.testing import globalipapp

    globalipapp.start_ipython()
    shell = globalipapp.get_ipython()
    shell.display_formatter.active_types = ["text/plain", "text/html"]
    os.chdir(tempfile.mkdtemp(prefix="mgtutorial-ranks-bench-"))  # the pool's runs/ goes there
    shell.run_line_magic("load_ext", "mgtutorial")
    try:
        start = time.perf_counter()
        shell.run_line_magic("ranks", f"start {args.nprocs}")
        start_s = time.perf_counter() - start
        timed_cells(shell, ALL_REDUCE, 5)  # warm-up
        all_reduce = summary(timed_cells(shell, ALL_REDUCE, args.cells))
        nothing = summary(timed_cells(shell, NOTHING, args.cells))
        backend = shell.magics_manager.registry["RanksMagics"].pool.run.backend
    finally:
        shell.run_line_magic("ranks", "stop")
    report = {
        "nprocs": args.nprocs,
        "backend": backend,
        "cells": args.cells,
        "pool_start_s": start_s,
        "all_reduce_cell": all_reduce,
        "empty_cell": nothing,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{args.nprocs} ranks ({backend}); pool start {start_s:.2f} s")
    for name, row in (("all-reduce cell", all_reduce), ("empty cell", nothing)):
        print(
            f"{name:>16}: median {row['median_s'] * 1e3:.1f} ms, "
            f"p90 {row['p90_s'] * 1e3:.1f} ms over {args.cells} cells"
        )
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
