"""Command line: ``python -m mgtutorial <command> [options]``.

Commands::

    python -m mgtutorial ddp --nproc 2 --epochs 3 --dataset auto --runs-dir runs
    torchrun --standalone --nproc-per-node 2 -m mgtutorial ddp --epochs 3
    python -m mgtutorial pipeline --schedule 1f1b --microbatches 4   # one stage per rank
    python -m mgtutorial data cifar10          # download CIFAR-10 once (170 MB)
    python -m mgtutorial describe              # hardware and the backend the course picks
    python -m mgtutorial check                 # the laptop check for a workshop (WORKSHOP.md)

``ddp`` and ``pipeline`` started from a plain shell launch their own ranks
(:func:`mgtutorial.launch`), show progress and write ``<run dir>/loss.png``. Under ``torchrun``
(``RANK`` is set) each process *is* one rank and runs the worker directly, without launching again.

The options of ``ddp``, ``pipeline``, ``hello`` and ``check`` are generated from a config dataclass
(:class:`~mgtutorial.ddp.DDPConfig`, :class:`~mgtutorial.pipeline.schedules.PipelineConfig`,
:class:`~mgtutorial.hello.HelloConfig`, :class:`~mgtutorial.workshop.laptop_check.CheckConfig`)
by :mod:`mgtutorial.cli_options`: one ``--field-name`` per field, with its default, its docstring
as help and, for a ``Literal`` field, its allowed values, so ``--help`` and the notebooks' configs
never disagree.

``check`` imports neither torch nor psutil before its checks do: on a broken install it still prints
its table, with a FAIL row and the fix for each missing package. The other commands import torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from mgtutorial.cli_options import add_config_options, config_from, plain_text
from mgtutorial.workshop import laptop_check


def _config_parser(sub, name: str, cls, help: str, func) -> None:
    p = sub.add_parser(name, help=help, description=help)
    add_config_options(p, cls)
    p.add_argument(
        "--nproc",
        "--nprocs",  # check's spelling, accepted here too
        dest="nproc",
        type=int,
        default=None,
        help="ranks to launch (default: one per GPU if ≥ 2 GPUs, else 2); ignored under torchrun",
    )
    p.add_argument("--runs-dir", default="runs", help="parent folder of run directories")
    p.add_argument(
        "--run-name",
        default=None,
        help="the run directory's name: under torchrun exactly this (refused if it holds an "
        "earlier run); launched from here, the start of <name>-<time>-<id> (default: the command)",
    )
    p.set_defaults(func=func, config_class=cls, parser=p)


def _run_under_torchrun(args, worker, cfg, name: str):
    from mgtutorial.runtime import env, live, runlog, torchelastic

    # Every rank must agree on the directory: derive it from what torchrun gives all of them.
    run_name = args.run_name or f"{name}-torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}"
    os.environ.setdefault(runlog.RUN_DIR_ENV, str(Path(args.runs_dir).resolve() / run_name))
    run_dir = runlog.run_dir()
    if callable(getattr(cfg, "validate", None)):
        cfg.validate(env.world_size())  # before anything is written: a refused config leaves none
    torchelastic.claim_run_dir(run_dir, env.rank())  # a restart continues its own run only
    if env.rank() == 0:
        ref = f"{worker.__module__}:{worker.__qualname__}"
        runlog.write_config(run_dir, ref, env.world_size(), cfg.backend, cfg)
    try:
        summary = worker(cfg)
    except (ValueError, OSError):  # a rank's error mid-run: its traceback too, not only one line
        traceback.print_exc()
        raise
    if env.rank() == 0:
        live.save_loss_png(run_dir, runlog.read_run(run_dir))
    return run_dir, summary


def _launch_locally(args, worker, cfg, name: str):
    from mgtutorial.runtime import env, live
    from mgtutorial.runtime.launcher import launch

    nproc = env.default_nprocs() if args.nproc is None else args.nproc
    if nproc < 1:  # named as this command spells it, not as launch() does (nprocs=)
        raise ValueError(f"--nproc {nproc}: need at least 1 rank (try --nproc 2)")
    run = launch(worker, cfg, nproc, runs_dir=args.runs_dir, name=args.run_name or name)
    print(f"launched {nproc} rank(s) ({run.backend}); logs in {run.run_dir}")
    result = live.follow_terminal(run)
    return run.run_dir, result.values[0], result


def _run(args, worker, cfg, name: str, report) -> int:
    """Launch ranks, or be one rank under torchrun; then let rank 0 print ``report(summary)``."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from mgtutorial.common.finite import LossNotFinite
    from mgtutorial.runtime import env
    from mgtutorial.runtime.failure import WorkerFailed

    torchrun = env.is_distributed_env()
    rank = f"[rank {env.rank()}] " if torchrun else ""
    try:
        if torchrun:
            run_dir, summary = _run_under_torchrun(args, worker, cfg, name)
            if env.rank() == 0:
                print(f"[rank 0] done: {report(summary)}; logs in {run_dir}", flush=True)
        else:
            run_dir, summary, result = _launch_locally(args, worker, cfg, name)
            print(f"done in {result.duration_s:.1f} s: {report(summary)}")
            if (run_dir / "loss.png").exists():
                print(f"loss curve: {run_dir / 'loss.png'}")
    except (WorkerFailed, ValueError, TypeError, OSError, LossNotFinite) as exc:
        print(f"{rank}error: {exc}", file=sys.stderr)  # on a line of its own, after the bar
        if torchrun:  # the agent's report shows it as this rank's error (as @record would)
            from mgtutorial.runtime.torchelastic import record_failure

            record_failure(exc)
        return 1
    except (KeyboardInterrupt, SignalException):
        if not torchrun:
            print("interrupted: every rank was stopped.", file=sys.stderr)
        elif env.rank() == 0:  # one line for the job; torchrun's own report follows it
            print("interrupted: torchrun stops every rank.", file=sys.stderr)
        return 130
    return 0


def _ddp_report(summary: dict) -> str:
    acc, steps = summary.get("test_acc"), summary["steps"]
    return f"{steps} step{'' if steps == 1 else 's'} per rank" + (
        f", final test accuracy {acc:.1%}" if acc is not None else ""
    )


def _hello_report(summary: dict) -> str:
    return (
        f"rank {summary['rank']} of {summary['world_size']} (node {summary['group_rank']}, "
        f"local rank {summary['local_rank']}, {summary['device']}); "
        f"sum of ranks {summary['rank_sum']}"
    )


def _pipeline_report(summary: dict) -> str:
    return f"stage 0 peak activations {summary['peak_activation_bytes'] / 2**10:.0f} KiB"


def _run_data(args) -> int:
    from mgtutorial.common import data

    if args.name != "cifar10":
        print(f"{args.name!r} needs no download (it ships with scikit-learn).")
        return 0
    root = Path(args.root or data.data_root())
    try:
        data.fetch_cifar10(root)
    except ValueError as exc:  # --root names a file, or a folder that cannot be written
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError) as exc:  # offline, a proxy, a full disk, a corrupt archive
        print(
            f"error: could not download CIFAR-10 into {root}: {type(exc).__name__}: {exc}\n"
            "Nothing was left behind. The chapters run without it on the digits set "
            "(dataset='auto').",
            file=sys.stderr,
        )
        return 1
    print(f"CIFAR-10 is in {root}; dataset='auto' now uses it.")
    return 0


def _check(args) -> int:
    cfg = config_from(args)
    try:
        cfg.validate()
    except ValueError as exc:
        args.parser.error(str(exc))  # a usage error (exit code 2), before any check runs
    return laptop_check.main(cfg)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line: one subcommand per worker, its options generated from the worker's config.
    ``command``: the first word of the command line; ``check`` imports no torch, and a command
    other than ``pipeline`` does not import torch.distributed.pipelining (seconds per rank)."""
    parser = argparse.ArgumentParser(
        prog="python -m mgtutorial",
        description=plain_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    if command != "check":
        _add_commands(sub, command not in ("ddp", "elastic", "hello", "data", "describe"))
    p = sub.add_parser(
        "check", help="the laptop check for the morning of a workshop: a pass/fail table"
    )
    add_config_options(p, laptop_check.CheckConfig)
    p.set_defaults(func=_check, config_class=laptop_check.CheckConfig, parser=p)
    return parser


def _add_commands(sub, pipeline_too: bool = True) -> None:
    """Every command but ``check`` (these import torch); ``pipeline`` only if ``pipeline_too``."""
    from mgtutorial import ddp
    from mgtutorial.hello import HelloConfig, hello
    from mgtutorial.scale import elastic

    _config_parser(
        sub,
        "ddp",
        ddp.DDPConfig,
        "DDP training of the article's CNN (chapter 02)",
        lambda args: _run(args, ddp.worker, config_from(args), "ddp", _ddp_report),
    )
    _config_parser(
        sub,
        "elastic",
        elastic.ElasticConfig,
        "DDP training with snapshots and an injected fault, restarted by torchrun (chapter 05b)",
        lambda args: _run(args, elastic.elastic_worker, config_from(args), "elastic", _ddp_report),
    )
    if pipeline_too:
        from mgtutorial.pipeline import schedules

        _config_parser(
            sub,
            "pipeline",
            schedules.PipelineConfig,
            "pipeline-parallel training of the article's MLP, one stage per rank (chapter 04)",
            lambda args: _run(
                args, schedules.worker, config_from(args), "pipeline", _pipeline_report
            ),
        )
    _config_parser(
        sub,
        "hello",
        HelloConfig,
        "each rank reports who it is and all-reduces its rank (chapters 00, 05)",
        lambda args: _run(args, hello, config_from(args), "hello", _hello_report),
    )
    p = sub.add_parser("data", help="fetch a dataset")
    p.add_argument("name", choices=["cifar10", "digits"])
    p.add_argument(
        "--root",
        default=None,
        help="target folder (default $MGTUTORIAL_DATA or ~/.cache/mgtutorial/data)",
    )
    p.set_defaults(func=_run_data, parser=p)
    p = sub.add_parser("describe", help="hardware and the choices the course makes on it")
    p.set_defaults(func=_describe, parser=p)


def main_recorded() -> int:
    """:func:`main`, under torchrun with ``@record``: the agent reports this rank's traceback."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return main()
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(main)()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(argv[0] if argv else None)
    except ImportError as exc:  # torch or psutil missing or broken: say where the diagnosis is
        from mgtutorial.workshop.laptop_packages import import_failed

        print(import_failed(exc, argv), file=sys.stderr)
        return 1
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # refused with the command's own usage line, not the top one (a partial list)
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.func(args)


def _describe(args) -> int:
    from mgtutorial.runtime import machine

    for key, value in machine.describe().items():
        print(f"{key:>15}: {value}")
    return 0


if __name__ == "__main__":
    code = main_recorded()
    env = sys.modules.get("mgtutorial.runtime.env")  # not imported when torch is missing
    if env is not None and env.is_distributed_env():
        # one rank under torchrun: leave without C++ teardown, which can abort a finished rank
        from mgtutorial.runtime._rank import exit_now

        exit_now(code)
    sys.exit(code)
