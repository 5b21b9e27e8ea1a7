"""Pipeline throughput and bubbles on 2 CPU ranks: naive split vs GPipe vs 1F1B, m ∈ {1, 2, 4, 8}.

Benchmark for notebooks/04a_pipeline_gpipe.ipynb and notebooks/04b_pipeline_schedules.ipynb. Follows
https://pytorch.org/docs/stable/distributed.pipelining.html (ScheduleGPipe, Schedule1F1B).

Each configuration is one launch of :func:`mgtutorial.pipeline.schedules.worker` (2 ranks = 2
stages, gloo, one thread per rank) on an MLP whose two stages cost the same (``--width`` wide, 2
layers per stage), so the measured bubble can be held against the ideal (p − 1)/(m + p − 1):

* ``naive``: the model split over 2 ranks with no micro-batching (GPipe with m = 1): one stage works
  at a time, whatever m says — the same number is reported for every m;
* ``gpipe``: ``ScheduleGPipe`` with m micro-batches; ``1f1b``: ``Schedule1F1B`` (m ≥ 2);
  ``interleaved``: ``ScheduleInterleaved1F1B`` with two stages per rank (its formula is
  (p − 1)/(2m + p − 1)).

Stage 0 computes its input's gradient too (``input_grad=True``) so that both stages do the same
work.

samples/s = batch size ÷ median step time (the first ``--warmup`` steps left out); bubble =
1 − busy ÷ (stages × step span), from the forward/backward events each stage logs
(:func:`mgtutorial.pipeline.bubble.bubble_measured`), median over steps. Run it, don't assert on
it::

    python benchmarks/pipeline.py --out benchmarks/pipeline.json

It prints a table and writes JSON with keys ``naive``, ``gpipe``, ``1f1b``, ``interleaved`` (m →
samples/s), ``bubble_measured``, ``bubble_formula`` and ``bubble_model`` (schedule → m → fraction;
the model is the formula with the run's mean delay per box, ``delay_ms``, see
notebooks/04z_appendix_delays.ipynb), ``speedup_gpipe_m8_vs_naive``, the load average at
start and end, and ``cpu_count``. Both bubble conventions are reported: ``bubble_measured`` is the
idle fraction of the step, (p − 1)/(m + p − 1) ideally; ``bubble_vs_compute`` the idle time over the
busy time, b / (1 − b), (p − 1)/m ideally (Megatron-LM, the Ultra-Scale Playbook). ``best_speedup``
is the best samples/s of any schedule and m ≥ 2 over the naive split's, with where it was reached.
With ``--device-ms`` > 0 every configuration runs again on the simulated device
(:mod:`mgtutorial.pipeline.simulated`: each box lasts a set time on the wall clock, the rank
sleeping with its core free for what the arithmetic leaves; the whole model's forward of a batch
lasts that long) and the same keys appear under ``simulated``, measured the same way."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from mgtutorial import launch
from mgtutorial.pipeline import bubble, schedules, timeline
from mgtutorial.runtime import runlog

MICROBATCHES = (1, 2, 4, 8)


def measure(
    schedule: str, m: int, args, runs_dir: str, device_ms: float = 0.0
) -> tuple[float, float, float, float]:
    """(samples/s, bubble fraction, model bubble, mean delay per box in s) of one run, each the
    median over the measured steps (the model: ``bubble.step_costs``, the formula with the step's
    delay per box)."""
    cfg = schedules.PipelineConfig(
        schedule=schedule,
        n_microbatches=m,
        batch_size=args.batch_size,
        steps=args.warmup + args.steps,
        sizes=[64 if device_ms else args.width] * 5,
        save_params=False,
        backend="gloo",
        input_grad=True,
        device_ms=device_ms,
    )
    run = launch(schedules.worker, cfg, 2, runs_dir=runs_dir, threads_per_rank=1)
    try:
        result = run.wait(timeout=600)
    finally:
        if run.status == "running":
            run.stop()
    times = result.values[0]["step_times_s"][args.warmup :]
    records = runlog.read_run(run.run_dir)
    by = "rank" if schedule == "interleaved" else "stage"
    steps, v = range(args.warmup + 1, cfg.steps + 1), 2 if schedule == "interleaved" else 1
    measured = timeline.median_over_steps(
        records, lambda evs: bubble.bubble_measured(evs, by=by), steps
    )
    model, delay = (
        timeline.median_over_steps(records, lambda evs: bubble.step_costs(evs, by, v)[k], steps)
        for k in ("model", "delay")
    )
    return args.batch_size / statistics.median(times), measured, model, delay


def sweep(args, runs_dir: str, device_ms: float = 0.0) -> dict:
    """Every schedule and m on one kind of device (the CPU, or the simulated one)."""
    out = {
        "naive": {},
        "gpipe": {},
        "1f1b": {},
        "interleaved": {},
        "bubble_measured": {"gpipe": {}, "1f1b": {}, "interleaved": {}},
        "bubble_vs_compute": {"gpipe": {}, "1f1b": {}, "interleaved": {}},
        "bubble_model": {"gpipe": {}, "1f1b": {}, "interleaved": {}},
        "delay_ms": {"gpipe": {}, "1f1b": {}, "interleaved": {}},
        "bubble_formula": {},
        "bubble_formula_vs_compute": {},
    }
    kind = f"simulated device ({device_ms:g} ms)" if device_ms else "CPU"
    naive, naive_bubble, _, _ = measure("gpipe", 1, args, runs_dir, device_ms)
    print(f"{kind}: naive split (m=1): {naive:8.0f} samples/s, bubble {naive_bubble:.3f}")
    for m in MICROBATCHES:
        out["naive"][m] = naive
        out["bubble_formula"][m] = bubble.bubble_formula(2, m)
        out["bubble_formula_vs_compute"][m] = (2 - 1) / m
        for schedule in ("gpipe", "1f1b", "interleaved"):
            if schedule != "gpipe" and m < 2:
                continue
            rate, measured, model, delay = measure(schedule, m, args, runs_dir, device_ms)
            out[schedule][m] = rate
            out["bubble_measured"][schedule][m] = measured
            out["bubble_vs_compute"][schedule][m] = measured / (1 - measured)
            out["bubble_model"][schedule][m], out["delay_ms"][schedule][m] = model, 1e3 * delay
            v = 2 if schedule == "interleaved" else 1
            formula = bubble.bubble_formula(2, m, stages_per_rank=v)
            print(
                f"{kind} {schedule:>11} m={m}: {rate:8.0f} samples/s, bubble {measured:.3f} of the "
                f"step (formula {formula:.3f}), {measured / (1 - measured):.3f} of the compute "
                f"(formula {(2 - 1) / (v * m):.3f}); delay per box {1e3 * delay:.1f} ms",
                flush=True,
            )
    out["speedup_gpipe_m8_vs_naive"] = out["gpipe"][8] / naive
    rates = [(out[s][m], s, m) for s in ("gpipe", "1f1b", "interleaved") for m in out[s] if m > 1]
    rate, schedule, m = max(rates)
    out["best_speedup"] = {"speedup": rate / naive, "schedule": schedule, "m": m}
    out["bubble_max_abs_error_gpipe"] = max(
        abs(out["bubble_measured"]["gpipe"][m] - out["bubble_formula"][m]) for m in MICROBATCHES
    )
    print(
        f"{kind}: GPipe m=8 vs naive {out['speedup_gpipe_m8_vs_naive']:.2f}× (ideal 1.78×); best "
        f"{rate / naive:.2f}× ({schedule}, m={m}); largest GPipe bubble error "
        f"{out['bubble_max_abs_error_gpipe']:.3f}"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument(
        "--batch-size", type=int, default=512, help="samples per step (whole pipeline)"
    )
    parser.add_argument("--width", type=int, default=1024, help="layer width of the balanced MLP")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out at the start")
    parser.add_argument(
        "--device-ms",
        type=float,
        default=240.0,
        help="also run on a simulated device whose whole-model forward of a batch lasts this "
        "many ms (0: skip)",
    )
    args = parser.parse_args()
    started, load = time.time(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as runs_dir:
        out = sweep(args, runs_dir)
        if args.device_ms:
            out["simulated"] = sweep(args, runs_dir, args.device_ms)
    out.update(
        settings=vars(args),
        torch=torch.__version__,
        load_average_1min_start=load,
        load_average_1min_end=os.getloadavg()[0],
        cpu_count=os.cpu_count(),
        wall_s=time.time() - started,
    )
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
