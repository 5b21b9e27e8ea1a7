"""Command line: ``python -m mgtutorial <command> ...``.

Commands::

    python -m mgtutorial ddp --nproc 2 --epochs 2 --dataset auto --runs-dir runs
    torchrun --standalone --nproc-per-node 2 -m mgtutorial ddp --epochs 2
    python -m mgtutorial data cifar10          # download CIFAR-10 once (170 MB)
    python -m mgtutorial describe              # hardware and the backend the course picks

``ddp`` started from a plain shell launches its own ranks (:func:`mgtutorial.launch`), shows
progress and writes ``<run dir>/loss.png``. Under ``torchrun`` (``RANK`` is set) it *is* one rank
and runs the worker directly, without launching again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from . import data, ddp, env, live, runlog
from .launch import WorkerFailed, launch


def _ddp_parser(sub) -> None:
    p = sub.add_parser("ddp", help="DDP training of the article's CNN (chapter 02)")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to launch (default: one per GPU if ≥ 2 GPUs, else 2); ignored under torchrun")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--dataset", default="auto", choices=data.DATASETS)
    p.add_argument("--data-root", default=None)
    p.add_argument("--download", action="store_true", help="allow downloading CIFAR-10")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--no-evaluate", action="store_true", help="skip the test-set accuracy at each epoch end")
    p.add_argument("--backend", default="auto", choices=env.BACKENDS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=None, help="checkpoint file (saved by rank 0 each epoch)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    p.add_argument("--runs-dir", default="runs", help="parent folder of run directories")
    p.add_argument("--run-name", default=None, help="under torchrun: run directory name")


def _config(args) -> ddp.DDPConfig:
    return ddp.DDPConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, dataset=args.dataset,
                         data_root=args.data_root, download=args.download, max_steps=args.max_steps,
                         backend=args.backend, seed=args.seed, checkpoint=args.checkpoint,
                         resume=args.resume, evaluate=not args.no_evaluate)


def _run_ddp_under_torchrun(args, cfg) -> int:
    # Every rank must agree on the directory: derive it from what torchrun gives all of them.
    name = args.run_name or f"ddp-torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}"
    run_dir = Path(args.runs_dir).resolve() / name
    os.environ.setdefault(runlog.RUN_DIR_ENV, str(run_dir))
    run_dir = runlog.run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    if env.rank() == 0:
        (run_dir / "config.json").write_text(json.dumps(
            {"worker": "mgtutorial.ddp:worker", "nprocs": env.world_size(), "backend": cfg.backend,
             "config": dataclasses.asdict(cfg)}, indent=2))
    summary = ddp.worker(cfg)
    if env.rank() == 0:
        fig = live.loss_figure(runlog.read_run(run_dir), run_dir.name)
        (run_dir / "loss.png").write_bytes(live.figure_png(fig))
        acc = summary.get("test_acc")
        print(f"[rank 0] done: {summary['steps']} steps"
              + (f", final test accuracy {acc:.1%}" if acc is not None else "")
              + f"; logs and loss.png in {run_dir}", flush=True)
    return 0


def _run_ddp(args) -> int:
    cfg = _config(args)
    if env.is_distributed_env():
        return _run_ddp_under_torchrun(args, cfg)
    nproc = args.nproc or env.default_nprocs()
    run = launch(ddp.worker, cfg, nproc, runs_dir=args.runs_dir, name="ddp")
    print(f"launched {nproc} rank(s) ({env.resolve_backend(cfg.backend, nproc)}); logs in {run.run_dir}")
    try:
        result = live.follow_terminal(run)
    except WorkerFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    summary = result.values[0]
    acc = summary.get("test_acc")
    print(f"done in {result.duration_s:.1f} s: {summary['steps']} steps per rank"
          + (f", final test accuracy {acc:.1%}" if acc is not None else ""))
    print(f"loss curve: {run.run_dir / 'loss.png'}")
    return 0


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
    p = sub.add_parser("data", help="fetch a dataset")
    p.add_argument("name", choices=["cifar10", "digits"])
    p.add_argument("--root", default=None, help="target folder (default $MGTUTORIAL_DATA or ~/.cache/mgtutorial/data)")
    sub.add_parser("describe", help="hardware and the choices the course makes on it")
    args = parser.parse_args(argv)
    if args.command == "ddp":
        return _run_ddp(args)
    if args.command == "data":
        return _run_data(args)
    for key, value in env.describe().items():
        print(f"{key:>15}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
