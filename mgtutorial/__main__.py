"""Command line: ``python -m mgtutorial <command> ...``.

Commands::

    python -m mgtutorial ddp --nproc 2 --epochs 3 --dataset auto --runs-dir runs
    torchrun --standalone --nproc-per-node 2 -m mgtutorial ddp --epochs 3
    python -m mgtutorial pipeline --schedule 1f1b --microbatches 4   # one stage per rank
    python -m mgtutorial data cifar10          # download CIFAR-10 once (170 MB)
    python -m mgtutorial describe              # hardware and the backend the course picks
    python -m mgtutorial check                 # the laptop check for a workshop (WORKSHOP.md)

``ddp`` and ``pipeline`` started from a plain shell launches its own ranks (:func:`mgtutorial.launch`), shows
progress and writes ``<run dir>/loss.png``. Under ``torchrun`` (``RANK`` is set) it *is* one rank
and runs the worker directly, without launching again.

The options of ``ddp``, ``pipeline``, ``hello`` and ``check`` are generated from a config dataclass
(:class:`~mgtutorial.ddp.DDPConfig`, :class:`~mgtutorial.pipeline.schedules.PipelineConfig`,
:class:`~mgtutorial.hello.HelloConfig`, :class:`~mgtutorial.workshop.laptop_check.CheckConfig`): one ``--field-name`` per field, with its default and its
docstring as help, so ``--help`` and the notebooks' configs never disagree.

``check`` imports neither torch nor psutil before its checks do: on a broken install it still prints
its table, with a FAIL row and the fix for each missing package. The other commands import torch.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import re
import sys
import textwrap
import traceback
import types
import typing
from pathlib import Path

from mgtutorial.workshop import laptop_check

# Options whose names differ from their config field.
_ALIASES = {"timeout_s": ["--timeout"], "n_microbatches": ["--microbatches"]}


def field_docs(cls) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal under it), base classes first."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def add_config_options(p: argparse.ArgumentParser, cls, choices: dict | None = None) -> None:
    """One option per field of the config dataclass ``cls``: ``--field-name`` with the field's type,
    default and docstring (plus "(default: …)" unless the docstring says it); a bool that defaults to
    True becomes ``--no-field-name``; ``choices`` maps field names to their allowed values."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        doc = (
            re.sub(r":\w+:`~?([^`]+)`", r"\1", docs.get(f.name, ""))
            .replace("``", "")
            .replace("%", "%%")
        )
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            names = [f"--no-{flag[2:]}"] if default else [flag]
            p.add_argument(
                *names,
                dest=f.name,
                action="store_false" if default else "store_true",
                help=f"{doc} On by default; this switch turns it off." if default else doc,
            )
            continue
        args = typing.get_args(kind)
        if typing.get_origin(kind) is typing.Literal:  # a choice: the type of its values
            kind = type(args[0])
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(a for a in args if a is not type(None))
        literal = typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None
        if literal:  # a choice: the values' type, and the values as argparse's choices
            kind = type(literal[0])
        extra = (
            {"nargs": "+", "type": typing.get_args(kind)[0]}
            if typing.get_origin(kind) is list
            else {"type": kind}
        )
        p.add_argument(
            flag,
            *_ALIASES.get(f.name, []),
            dest=f.name,
            default=default,
            choices=(choices or {}).get(f.name, literal),
            help=doc if "(default:" in doc else f"{doc} (default: %(default)s)",
            **extra,
        )


def _config_parser(sub, name: str, cls, help: str, func, choices: dict) -> None:
    p = sub.add_parser(name, help=help, description=help)
    add_config_options(p, cls, choices)
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks to launch (default: one per GPU if ≥ 2 GPUs, else 2); ignored under torchrun",
    )
    p.add_argument("--runs-dir", default="runs", help="parent folder of run directories")
    p.add_argument("--run-name", default=None, help="under torchrun: run directory name")
    p.set_defaults(func=func, config_class=cls)


def _config(args):
    return args.config_class(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(args.config_class)}
    )


def _run_under_torchrun(args, worker, cfg, name: str):
    from mgtutorial.runtime import env, live, runlog

    # Every rank must agree on the directory: derive it from what torchrun gives all of them.
    run_name = args.run_name or f"{name}-torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}"
    os.environ.setdefault(runlog.RUN_DIR_ENV, str(Path(args.runs_dir).resolve() / run_name))
    run_dir = runlog.run_dir()
    if callable(
        getattr(cfg, "validate", None)
    ):  # before anything is written: a refused config leaves no folder
        cfg.validate(env.world_size())
    run_dir.mkdir(parents=True, exist_ok=True)
    if env.rank() == 0:
        runlog.write_config(
            run_dir,
            f"{worker.__module__}:{worker.__qualname__}",
            env.world_size(),
            cfg.backend,
            cfg,
        )
    try:
        summary = worker(cfg)
    except (
        ValueError,
        OSError,
    ):  # a rank's error mid-run: its traceback too, not only _run's one line
        traceback.print_exc()
        raise
    if env.rank() == 0:
        live.save_loss_png(run_dir, runlog.read_run(run_dir))
    return run_dir, summary


def _launch_locally(args, worker, cfg, name: str):
    from mgtutorial.runtime import env, live
    from mgtutorial.runtime.launcher import launch

    nproc = env.default_nprocs() if args.nproc is None else args.nproc

    run = launch(worker, cfg, nproc, runs_dir=args.runs_dir, name=name)
    print(
        f"launched {nproc} rank(s) ({env.resolve_backend(cfg.backend, nproc)}); logs in {run.run_dir}"
    )
    result = live.follow_terminal(run)
    return run.run_dir, result.values[0], result


def _run(args, worker, cfg, name: str, report) -> int:
    """Launch ranks, or be one rank under torchrun; then let rank 0 print ``report(summary)``."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from mgtutorial.runtime import env
    from mgtutorial.runtime.run import WorkerFailed

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
    except (WorkerFailed, ValueError, OSError) as exc:  # OSError: e.g. --runs-dir names a file
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SignalException):
        print("interrupted: every rank was stopped.", file=sys.stderr)
        return 130
    return 0


def _ddp_report(summary: dict) -> str:
    acc = summary.get("test_acc")
    return f"{summary['steps']} steps per rank" + (
        f", final test accuracy {acc:.1%}" if acc is not None else ""
    )


def _hello_report(summary: dict) -> str:
    return (
        f"rank {summary['rank']} of {summary['world_size']} (node {summary['group_rank']}, local rank "
        f"{summary['local_rank']}, {summary['device']}); sum of ranks {summary['rank_sum']}"
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
        data.load_cifar10(root, download=True)
    except (OSError, RuntimeError) as exc:  # offline, a proxy, a full disk, a corrupt archive
        print(
            f"error: could not download CIFAR-10 into {root}: {type(exc).__name__}: {exc}\n"
            "Check the network (or copy cifar-10-batches-py/ there by hand); the chapters run "
            "without it on the digits set (dataset='auto').",
            file=sys.stderr,
        )
        return 1
    print(f"CIFAR-10 is in {root}; dataset='auto' now uses it.")
    return 0


def _check(p: argparse.ArgumentParser, args) -> int:
    cfg = _config(args)
    try:
        cfg.validate()
    except ValueError as exc:
        p.error(str(exc))  # a usage error (exit code 2), before any check runs
    return laptop_check.main(cfg)


def build_parser(check_only: bool = False) -> argparse.ArgumentParser:
    """The command line: one subcommand per worker, its options generated from the worker's config.
    ``check_only``: only the ``check`` command, without importing torch."""
    parser = argparse.ArgumentParser(
        prog="python -m mgtutorial",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    if not check_only:
        _add_commands(sub)
    p = sub.add_parser(
        "check", help="the laptop check for the morning of a workshop: a pass/fail table"
    )
    add_config_options(p, laptop_check.CheckConfig)
    p.set_defaults(func=lambda args: _check(p, args), config_class=laptop_check.CheckConfig)
    return parser


def _add_commands(sub) -> None:
    """Every command but ``check``; these import torch."""
    from mgtutorial import ddp
    from mgtutorial.common import data
    from mgtutorial.hello import HelloConfig, hello
    from mgtutorial.pipeline import schedules as pipeline
    from mgtutorial.runtime import env
    from mgtutorial.scale import elastic

    choices = {
        "dataset": data.DATASETS,
        "backend": env.BACKENDS,
        "schedule": pipeline.SCHEDULES,
        "fail_how": ("raise", "sigkill"),
    }
    _config_parser(
        sub,
        "ddp",
        ddp.DDPConfig,
        "DDP training of the article's CNN (chapter 02)",
        lambda args: _run(args, ddp.worker, _config(args), "ddp", _ddp_report),
        choices,
    )
    _config_parser(
        sub,
        "elastic",
        elastic.ElasticConfig,
        "DDP training with snapshots and an injected fault, restarted by torchrun (chapter 05b)",
        lambda args: _run(args, elastic.elastic_worker, _config(args), "elastic", _ddp_report),
        choices,
    )
    _config_parser(
        sub,
        "pipeline",
        pipeline.PipelineConfig,
        "pipeline-parallel training of the article's MLP, one stage per rank (chapter 04)",
        lambda args: _run(args, pipeline.worker, _config(args), "pipeline", _pipeline_report),
        choices,
    )
    _config_parser(
        sub,
        "hello",
        HelloConfig,
        "each rank reports who it is and all-reduces its rank (chapters 00, 05)",
        lambda args: _run(args, hello, _config(args), "hello", _hello_report),
        choices,
    )
    p = sub.add_parser("data", help="fetch a dataset")
    p.add_argument("name", choices=["cifar10", "digits"])
    p.add_argument(
        "--root",
        default=None,
        help="target folder (default $MGTUTORIAL_DATA or ~/.cache/mgtutorial/data)",
    )
    p.set_defaults(func=_run_data)
    p = sub.add_parser("describe", help="hardware and the choices the course makes on it")
    p.set_defaults(func=_describe)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(check_only=argv[:1] == ["check"])
    except ImportError as exc:  # torch or psutil missing or broken: say where the diagnosis is
        print(
            f"error: {type(exc).__name__}: {exc}\n`python -m mgtutorial check` lists what is missing "
            "or broken and the command that fixes it.",
            file=sys.stderr,
        )
        return 1
    args = parser.parse_args(argv)
    return args.func(args)


def _describe(args) -> int:
    from mgtutorial.runtime import env

    for key, value in env.describe().items():
        print(f"{key:>15}: {value}")
    return 0


if __name__ == "__main__":
    code = main()
    env = sys.modules.get("mgtutorial.runtime.env")  # not imported when torch is missing
    if env is not None and env.is_distributed_env():
        # one rank under torchrun: leave without C++ teardown, which can abort a finished rank
        from mgtutorial.runtime._rank import exit_now

        exit_now(code)
    sys.exit(code)
