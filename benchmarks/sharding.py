"""Bytes per rank and step time of DDP, ZeRO-1, ZeRO-2 (by hand) and FSDP2 (reshard after forward
True / False) at N = 1, 2, 4 ranks, measured against the memory formula.

Benchmark for notebooks/07a_zero_memory.ipynb and notebooks/07b_fsdp2.ipynb. Follows
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html.

Each N is one launch of :func:`mgtutorial.sharding.worker.worker` with the ``bench`` part
(:func:`mgtutorial.sharding.worker.part_bench`): every set-up trains the chapter's ``BlockStack``
(``--blocks`` blocks of ``--width`` features) for ``--steps`` AdamW steps after one warm-up step;
each rank then sums the bytes of the distinct storages behind its parameters, gradients and Adam(W)
state. Run it, don't assert on it::

    python benchmarks/sharding.py --out benchmarks/results/sharding.json

It prints a table and writes JSON with keys ``bytes_measured`` and ``bytes_formula``
(set-up → N → rank → {params, grads, optimizer, total}), ``step_s`` (set-up → N → mean seconds
per step, the slowest rank), ``all_equal`` (measured == formula in every cell) and the settings.
On 2 shared CPU cores, times at N = 4 mostly measure processes waiting for a core.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

from mgtutorial import launch
from mgtutorial.sharding import memory
from mgtutorial.sharding.model import make_model
from mgtutorial.sharding.worker import BENCH, ShardConfig, worker

RANKS = (1, 2, 4)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument(
        "--width", type=int, default=250, help="features per block (not a multiple of 4: padding)"
    )
    parser.add_argument("--blocks", type=int, default=4, help="blocks of the model")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per set-up")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (a multiple of 4)")
    args = parser.parse_args()
    cfg = ShardConfig(
        parts=["bench"],
        width=args.width,
        blocks=args.blocks,
        steps=args.steps,
        batch_size=args.batch_size,
        backend="gloo",
    )
    shapes = [p.shape for p in make_model(cfg).parameters()]
    measured, formula, step_s = ({k: {} for k in BENCH} for _ in range(3))
    with tempfile.TemporaryDirectory() as runs:
        for n in RANKS:
            run = launch(worker, cfg, n, runs_dir=runs, threads_per_rank=1)
            values = run.wait(timeout=600).values
            for name, scheme in BENCH.items():
                measured[name][n] = {r: values[r]["bench"][name]["bytes"] for r in range(n)}
                formula[name][n] = {
                    r: memory.memory_per_rank(shapes, n, scheme, rank=r) for r in range(n)
                }
                step_s[name][n] = max(values[r]["bench"][name]["step_s"] for r in range(n))
    all_equal = measured == formula
    print(
        f"Ψ = {sum(math.prod(s) for s in shapes):,} parameters; bytes on rank 0 "
        "(measured = formula?) and ms per step"
    )
    print(f"{'set-up':<14}" + "".join(f"{'N=' + str(n):>26}" for n in RANKS))
    for name in BENCH:
        cells = [
            f"{measured[name][n][0]['total']:>11,} "
            f"{'=' if measured[name][n] == formula[name][n] else '≠'} "
            f"{1e3 * step_s[name][n]:>8.2f} ms"
            for n in RANKS
        ]
        print(f"{name:<14}" + "".join(f"{c:>26}" for c in cells))
    print("measured == formula in every cell:", all_equal)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "bytes_measured": measured,
                "bytes_formula": formula,
                "step_s": step_s,
                "all_equal": all_equal,
                "settings": vars(args),
            },
            indent=1,
        )
    )
    print("wrote", args.out)


if __name__ == "__main__":
    main()
