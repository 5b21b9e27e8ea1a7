"""Command line: ``python -m mgtutorial <command> ...``.

Commands::

    python -m mgtutorial ddp --nproc 2 --epochs 3 --dataset auto --runs-dir runs
    torchrun --standalone --nproc-per-node 2 -m mgtutorial ddp --epochs 3
    python -m mgtutorial pipeline --schedule 1f1b --microbatches 4   # one stage per rank
    python -m mgtutorial data cifar10          # download CIFAR-10 once (170 MB)
    python -m mgtutorial describe              # hardware and the backend the course picks

``ddp`` and ``pipeline`` started from a plain shell launches its own ranks (:func:`mgtutorial.launch`), shows
progress and writes ``<run dir>/loss.png``. Under ``torchrun`` (``RANK`` is set) it *is* one rank
and runs the worker directly, without launching again.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import data, ddp, env, pipeline, runlog
from .launch import launch
from .run import WorkerFailed


def _ddp_parser(sub) -> None:
    p = sub.add_parser("ddp", help="DDP training of the article's CNN (chapter 02)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--dataset", default="auto", choices=data.DATASETS)
    p.add_argument("--data-root", default=None)
    p.add_argument("--download", action="store_true", help="allow downloading CIFAR-10")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--no-evaluate", action="store_true", help="skip the test-set accuracy at each epoch end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=None, help="checkpoint file (saved by rank 0 each epoch)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also snapshot every N steps (0: epoch ends only)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds")
    p.add_argument("--fail-rank", type=int, default=-1, help="fault injection: this rank fails (first attempt only)")
    p.add_argument("--fail-step", type=int, default=-1, help="… at this step")
    p.add_argument("--fail-how", default="raise", choices=["raise", "sigkill"])
    _common_args(p)


def _common_args(p) -> None:
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to launch (default: one per GPU if ≥ 2 GPUs, else 2); ignored under torchrun")
    p.add_argument("--backend", default="auto", choices=env.BACKENDS)
    p.add_argument("--runs-dir", default="runs", help="parent folder of run directories")
    p.add_argument("--run-name", default=None, help="under torchrun: run directory name")


def _config(args) -> ddp.DDPConfig:
    return ddp.DDPConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, dataset=args.dataset,
                         data_root=args.data_root, download=args.download, max_steps=args.max_steps,
                         backend=args.backend, seed=args.seed, checkpoint=args.checkpoint,
                         resume=args.resume, evaluate=not args.no_evaluate,
                         checkpoint_every=args.checkpoint_every, timeout_s=args.timeout,
                         fail_rank=args.fail_rank, fail_step=args.fail_step, fail_how=args.fail_how)


def _run_under_torchrun(args, worker, cfg, name: str):
    # Every rank must agree on the directory: derive it from what torchrun gives all of them.
    run_name = args.run_name or f"{name}-torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}"
    os.environ.setdefault(runlog.RUN_DIR_ENV, str(Path(args.runs_dir).resolve() / run_name))
    run_dir = runlog.run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    if env.rank() == 0:
        runlog.write_config(run_dir, f"{worker.__module__}:{worker.__qualname__}", env.world_size(),
                            cfg.backend, cfg)
    if callable(getattr(cfg, "validate", None)):
        cfg.validate(env.world_size())
    summary = worker(cfg)
    if env.rank() == 0:
        from . import live

        live.save_loss_png(run_dir, runlog.read_run(run_dir))
    return run_dir, summary


def _launch_locally(args, worker, cfg, name: str):
    nproc = env.default_nprocs() if args.nproc is None else args.nproc
    from . import live

    run = launch(worker, cfg, nproc, runs_dir=args.runs_dir, name=name)
    print(f"launched {nproc} rank(s) ({env.resolve_backend(cfg.backend, nproc)}); logs in {run.run_dir}")
    result = live.follow_terminal(run)
    return run.run_dir, result.values[0], result


def _run(args, worker, cfg, name: str, report) -> int:
    """Launch ranks, or be one rank under torchrun; then let rank 0 print ``report(summary)``."""
    try:
        if env.is_distributed_env():
            run_dir, summary = _run_under_torchrun(args, worker, cfg, name)
            if env.rank() == 0:
                print(f"[rank 0] done: {report(summary)}; logs in {run_dir}", flush=True)
        else:
            run_dir, summary, result = _launch_locally(args, worker, cfg, name)
            print(f"done in {result.duration_s:.1f} s: {report(summary)}")
            if (run_dir / "loss.png").exists():
                print(f"loss curve: {run_dir / 'loss.png'}")
    except (WorkerFailed, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _ddp_report(summary: dict) -> str:
    acc = summary.get("test_acc")
    return f"{summary['steps']} steps per rank" + (f", final test accuracy {acc:.1%}" if acc is not None else "")


def _hello_report(summary: dict) -> str:
    return (f"rank {summary['rank']} of {summary['world_size']} (node {summary['group_rank']}, local rank "
            f"{summary['local_rank']}, {summary['device']}); sum of ranks {summary['rank_sum']}")


def _pipeline_report(summary: dict) -> str:
    return f"stage 0 peak activations {summary['peak_activation_bytes'] / 2**10:.0f} KiB"


def _run_data(args) -> int:
    if args.name != "cifar10":
        print(f"{args.name!r} needs no download (it ships with scikit-learn).")
        return 0
    root = Path(args.root or data.data_root())
    data.load_cifar10(root, download=True)
    print(f"CIFAR-10 is in {root}; dataset='auto' now uses it.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mgtutorial", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _ddp_parser(sub)
    p = sub.add_parser("pipeline", help="pipeline-parallel training of the article's MLP, one stage per rank (chapter 04)")
    p.add_argument("--schedule", default="1f1b", choices=pipeline.SCHEDULES)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64, help="per step, whole pipeline")
    p.add_argument("--steps", type=int, default=4)
    _common_args(p)
    p = sub.add_parser("data", help="fetch a dataset")
    p.add_argument("name", choices=["cifar10", "digits"])
    p.add_argument("--root", default=None, help="target folder (default $MGTUTORIAL_DATA or ~/.cache/mgtutorial/data)")
    p = sub.add_parser("hello", help="each rank reports who it is and all-reduces its rank (chapters 00, 05)")
    _common_args(p)
    sub.add_parser("describe", help="hardware and the choices the course makes on it")
    args = parser.parse_args(argv)
    if args.command == "ddp":
        return _run(args, ddp.worker, _config(args), "ddp", _ddp_report)
    if args.command == "pipeline":
        cfg = pipeline.PipelineConfig(schedule=args.schedule, n_microbatches=args.microbatches,
                                      batch_size=args.batch_size, steps=args.steps, backend=args.backend)
        return _run(args, pipeline.worker, cfg, "pipeline", _pipeline_report)
    if args.command == "hello":
        return _run(args, env.hello, env.HelloConfig(backend=args.backend), "hello", _hello_report)
    if args.command == "data":
        return _run_data(args)
    for key, value in env.describe().items():
        print(f"{key:>15}: {value}")
    return 0


if __name__ == "__main__":
    code = main()
    if env.is_distributed_env():
        # one rank under torchrun: leave without C++ teardown, which can abort a finished rank
        from ._rank import exit_now

        exit_now(code)
    sys.exit(code)
