"""How long until 2 ranks train, started four ways; how DDP throughput scales 1 → 2 ranks; and
the ceiling of that scaling by batch size.

Benchmark for notebooks/02_ddp.ipynb (and the launcher of notebooks/00_setup.ipynb). Follows
https://pytorch.org/tutorials/intermediate/ddp_tutorial.html and
https://pytorch.org/docs/stable/elastic/run.html (torchrun). CPU, gloo, one thread per rank
(``OMP_NUM_THREADS=1``), the chapter's CNN on the bundled digits.

(a) "call → first logged step", 2 ranks,
    ``DDPConfig(dataset="digits", max_steps=5, evaluate=False)`` (benchmarks/launch_timing.py):

    launch_cold_s  ``mgtutorial.launch(ddp.worker, cfg, 2)``, the first launch of a fresh process
                   (a subprocess per repeat): it starts the fork server, which imports torch
    launch_warm_s  the same call again in this process, ranks forked from the running fork server
                   (one unmeasured launch first starts the server)
    mp_spawn_s     ``torch.multiprocessing.spawn(..., join=False)`` of ``spawn_rank``, which
                   sets the torchrun variables and calls ``ddp.worker(cfg)``
    torchrun_s     ``torchrun --standalone --nproc-per-node 2 -m mgtutorial ddp ...``, a
                   subprocess

    Each is the time from the call to the ``kind == "train", step == 1`` record of any rank in
    ``rank*.jsonl`` (the record's own ``time`` stamp, so the polling period does not count). It
    includes interpreter start, ``import torch``, the
    rendezvous, ``init_process_group``, loading the data, building and wrapping the model and one
    step with its all-reduces. Every run is then waited for.

(b) Training throughput (samples/s, summed over ranks, as each rank's worker returns it) of
    ``launch(ddp.worker, DDPConfig(dataset="digits", epochs=E × nprocs, evaluate=False), nprocs)``
    with 1 and with 2 ranks; each rank trains the same number of steps either way.
    ``scaling_2v1`` = median samples/s with 2 ranks ÷ median with 1 rank (2.0 would be perfect).

(c) The batch sweep of chapter 09 (benchmarks/batch_sweep.py).

Medians over ``--repeats`` runs; each repeat runs the measurements of (a) and (b) in turn, so
drifting machine load touches them alike. Run it, don't assert on it (the numbers depend on the
machine and on what else runs there)::

    python benchmarks/launch_and_scaling.py --out benchmarks/launch_and_scaling.json
    python benchmarks/launch_and_scaling.py --repeats 1 --out /tmp/smoke.json   # a quick look
    python benchmarks/launch_and_scaling.py --parts launch --out /tmp/launch.json   # (a) only

It prints a table and writes JSON (medians, the raw lists, the machine, and an ``aims`` note on
whether a warm ``launch`` takes ≤ 0.1 × and a cold one ≤ 1.0 × the time of ``mp.spawn``, and
whether 2 ranks give ≥ 1.85× the throughput of 1).
Run directories go to a temporary folder that is deleted at the end; no process is left behind,
also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from batch_sweep import batch_sweep
from launch_timing import (
    NPROCS,
    RUN_TIMEOUT_S,
    latency_config,
    time_launch,
    time_launch_cold,
    time_mp_spawn,
    time_torchrun,
)

from mgtutorial import ddp
from mgtutorial.runtime.launcher import launch


def throughput(tmp: Path, nprocs: int, epochs_per_rank: int) -> float:
    """(b) samples/s summed over ranks for ``nprocs`` ranks, each training the same number of
    steps."""
    cfg = ddp.DDPConfig(
        dataset="digits", epochs=epochs_per_rank * nprocs, evaluate=False, backend="gloo"
    )
    run = launch(ddp.worker, cfg, nprocs, runs_dir=tmp, name=f"tput{nprocs}", threads_per_rank=1)
    try:
        result = run.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if run.status == "running":
            run.stop()
    return sum(v["samples_per_s"] for v in result.values.values())


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def print_table(rows: list[tuple[str, str, dict]]) -> None:
    print(f"\n{'measurement':<34}{'unit':<10}{'median':>10}{'min':>10}{'max':>10}")
    print("-" * 74)
    for label, unit, s in rows:
        print(
            f"{label:<34}{unit:<10}" + "".join(f"{s[k]:>10.3f}" for k in ("median", "min", "max"))
        )


PARTS = ("launch", "throughput", "sweep")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs per measurement (median taken)"
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="what to measure: (a) launch, (b) throughput, (c) sweep (default: all three)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=6,
        help="passes over digits per rank-equivalent in (b): 1 rank trains EPOCHS "
        "epochs, 2 ranks 2×EPOCHS (each rank the same number of steps)",
    )
    parser.add_argument(
        "--batches",
        type=int,
        nargs="*",
        default=[32, 64, 128, 256],
        help="(c) per-rank batch sizes of the ceiling/scaling sweep (none: skip it)",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be ≥ 1")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every rank, however it is started
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)

    start = time.monotonic()
    raw = measure(args.parts, args.repeats, args.epochs)
    wall = time.monotonic() - start
    report = summarise(raw, args.parts)
    report.update(
        repeats=args.repeats,
        epochs_per_rank_equivalent=args.epochs,
        latency_config=dataclasses.asdict(latency_config()),
        nprocs_latency=NPROCS,
        backend="gloo",
        threads_per_rank=1,
        torch=torch.__version__,
        python=platform.python_version(),
        cpu_count=os.cpu_count(),
        platform=platform.platform(),
        wall_s=wall,
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        note="measured, not asserted on; numbers depend on the machine and its load.",
    )
    print(
        f"{args.repeats} repeat(s), {wall:.0f} s wall, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, gloo, 1 thread per rank."
    )
    if "sweep" in args.parts and args.batches:
        sweep = batch_sweep(args.batches, args.repeats)
        report["aims"]["best scaling_2v1_by_batch >= 0.9 × ceiling_2v1"] = sweep.pop(
            "aim_best_scaling_ge_0.9_ceiling"
        )
        report.update(sweep)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"aims: {report['aims']}\nwrote {out}")
    return 0


def measure(parts: list[str], repeats: int, epochs: int) -> dict[str, list[float]]:
    """The raw values of (a) and (b), ``repeats`` of each, interleaved per repeat."""
    kinds = {}
    if "launch" in parts:
        kinds.update(
            launch_cold_s=time_launch_cold,
            launch_warm_s=time_launch,
            mp_spawn_s=time_mp_spawn,
            torchrun_s=time_torchrun,
        )
    if "throughput" in parts:
        kinds.update(
            samples_per_s_1rank=lambda tmp: throughput(tmp, 1, epochs),
            samples_per_s_2ranks=lambda tmp: throughput(tmp, 2, epochs),
        )
    raw: dict[str, list[float]] = {k: [] for k in kinds}
    if not kinds:
        return raw
    tmp = Path(tempfile.mkdtemp(prefix="mgtutorial-bench-"))
    start = time.monotonic()
    try:
        time_launch(tmp)  # starts this process's fork server: what launch_warm_s does not count
        for i in range(repeats):
            for key, run in kinds.items():
                raw[key].append(run(tmp))
                unit = "samples/s" if key.startswith("samples") else "s"
                print(
                    f"[repeat {i + 1}/{repeats}] {key:<22} {raw[key][-1]:10.3f} {unit}"
                    f"   ({time.monotonic() - start:.0f} s elapsed)",
                    flush=True,
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return raw


def summarise(raw: dict[str, list[float]], parts: list[str]) -> dict:
    """Medians, the table printed, and the ``aims`` of the parts measured."""
    stats = {k: summary(v) for k, v in raw.items()}
    report = {k: s["median"] for k, s in stats.items()}
    report.update(raw=dict(raw), stats=stats, aims={})
    rows = []
    if "launch" in parts:
        rows += [
            ("(a) launch() cold → first step", "s", stats["launch_cold_s"]),
            ("(a) launch() warm → first step", "s", stats["launch_warm_s"]),
            ("(a) mp.spawn → first step", "s", stats["mp_spawn_s"]),
            ("(a) torchrun → first step", "s", stats["torchrun_s"]),
        ]
        warm, cold, spawn = (report[k] for k in ("launch_warm_s", "launch_cold_s", "mp_spawn_s"))
        report["aims"]["launch_warm_s <= 0.1 x mp_spawn_s"] = warm <= 0.1 * spawn
        report["aims"]["launch_cold_s <= 1.0 x mp_spawn_s"] = cold <= spawn
    if "throughput" in parts:
        one, two = raw["samples_per_s_1rank"], raw["samples_per_s_2ranks"]
        ratios = [b / a for a, b in zip(one, two)]
        scaling = report["samples_per_s_2ranks"] / report["samples_per_s_1rank"]
        rows += [
            ("(b) DDP throughput, 1 rank", "samples/s", stats["samples_per_s_1rank"]),
            ("(b) DDP throughput, 2 ranks", "samples/s", stats["samples_per_s_2ranks"]),
            ("(b) scaling 2 ranks / 1 rank *", "×", {**summary(ratios), "median": scaling}),
        ]
        report["scaling_2v1"] = scaling
        report["raw"]["scaling_2v1_per_repeat"] = ratios
        report["aims"]["scaling_2v1 >= 1.85"] = scaling >= 1.85
    if rows:
        print_table(rows)
    if "throughput" in parts:
        print("* median column: ratio of the medians; min/max: over the per-repeat ratios.")
    return report


if __name__ == "__main__":
    sys.exit(main())
