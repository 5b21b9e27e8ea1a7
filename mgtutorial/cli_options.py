"""Command-line options generated from a config dataclass: one ``--field-name`` per field, with the
field's type, default, docstring (as help) and, for a ``Literal[...]`` field, its allowed values
(:func:`mgtutorial.common.config.choices`), so ``--help`` and the notebooks' configs never disagree.

Used by ``python -m mgtutorial`` (:mod:`mgtutorial.__main__`); follows
https://docs.python.org/3/library/argparse.html. Imports no torch: the ``check`` command builds
its options from :class:`~mgtutorial.workshop.laptop_check.CheckConfig` on a broken install too.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing

from mgtutorial.common.config import choices

ALIASES = {
    "timeout_s": ["--timeout"],
    "n_microbatches": ["--microbatches"],
    "nprocs": ["--nproc"],  # the spelling of ddp, pipeline, hello and elastic, accepted by check
}
"""Options whose names differ from their config field: field -> extra option names."""


def field_docs(cls) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal under it), base classes first."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            doc = after.value if isinstance(after, ast.Expr) else None
            text = doc.value if isinstance(doc, ast.Constant) else None
            if isinstance(node, ast.AnnAssign) and isinstance(text, str):
                docs[node.target.id] = " ".join(text.split())
    return docs


def plain_help(doc: str) -> str:
    """A docstring made fit for ``--help``: reST roles and literals unmarked, ``%`` escaped."""
    return re.sub(r":\w+:`~?([^`]+)`", r"\1", doc).replace("``", "").replace("%", "%%")


def argparse_type(hint) -> dict:
    """``type`` (and ``nargs`` for a list) for a field typed ``hint``: ``X | None`` is read as X,
    ``list[X]`` as one or more X, ``Literal[...]`` as the type of its values."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is list:
        return {"nargs": "+", **argparse_type(typing.get_args(hint)[0])}
    if typing.get_origin(hint) is typing.Literal:
        return {"type": type(typing.get_args(hint)[0])}
    return {"type": hint}


def add_config_options(p: argparse.ArgumentParser, cls) -> None:
    """One option per field of the config dataclass ``cls``: ``--field-name`` with the field's
    type, default and docstring (plus "(default: …)" unless the docstring says it), and argparse
    ``choices`` for a ``Literal`` field; a bool that defaults to True becomes ``--no-field-name``.
    """
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        doc, flag = plain_help(docs.get(f.name, "")), "--" + f.name.replace("_", "-")
        if hints[f.name] is bool:
            on = f"{doc} On by default; this switch turns it off."
            p.add_argument(
                f"--no-{flag[2:]}" if default else flag,
                dest=f.name,
                action="store_false" if default else "store_true",
                help=on if default else doc,
            )
            continue
        allowed = choices(cls, f.name)
        p.add_argument(
            flag,
            *ALIASES.get(f.name, []),
            dest=f.name,
            default=default,
            choices=None if allowed is None else [a for a in allowed if a is not None],
            help=doc if "(default:" in doc else f"{doc} (default: %(default)s)",
            **argparse_type(hints[f.name]),
        )


def config_from(args: argparse.Namespace):
    """The config that parsed ``args`` describe: ``args.config_class`` built from its fields."""
    cls = args.config_class
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def plain_text(rst: str) -> str:
    """A docstring as a terminal shows it: reST roles (``:func:`~a.b``` → ``b``), literal marks
    and ``::`` removed."""
    import re

    text = re.sub(r":\w+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], rst)
    return text.replace("``", "").replace("::\n", ":\n")
