"""The base of every worker configuration and the range checks their ``validate`` share, so a bad
value is refused in the launcher (before any rank starts) with a message naming the field, its
value and the fix.

A choice is typed ``Literal[...]``: :func:`choices` reads the allowed values from the type
(``typing.get_args``), for :meth:`Config.validate` and for the command line's ``choices``.

Used by the config dataclasses of every chapter (``DDPConfig.validate`` in notebooks/02_ddp.ipynb,
``PipelineConfig`` in notebooks/04a_pipeline_gpipe.ipynb, …) and so by the command line.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import types
import typing
from pathlib import Path

SEED_MAX = 2**31 - 1
"""The largest seed every generator the course seeds accepts (torch's, Python's, and numpy's under
scikit-learn's split), with room for the offsets the workers add (``seed + epoch``)."""


def _number(cfg, name: str) -> float:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: must be a finite number.")
    return value


def at_least(cfg, minimum: float, *names: str, hint: str = "") -> None:
    """Raise ``ValueError`` unless every field in ``names`` is a finite number ≥ ``minimum``."""
    for name in names:
        if (value := _number(cfg, name)) < minimum:
            raise ValueError(f"{name}={value!r}: must be at least {minimum}{hint}.")


def positive(cfg, *names: str) -> None:
    """Raise ``ValueError`` unless every field in ``names`` is a finite number > 0."""
    for name in names:
        if (value := _number(cfg, name)) <= 0:
            raise ValueError(f"{name}={value!r}: must be positive.")


def rank_or_none(cfg, name: str, count: int, what: str = "rank") -> None:
    """Raise ``ValueError`` unless field ``name`` is a fault-injection target: −1 (none) or one of
    the job's ``count`` ranks (or stages, as ``what`` says), 0 … count − 1."""
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value < count:
        raise ValueError(
            f"{name}={value!r}: must be -1 (none) or a {what} of the job, 0 … {count - 1} "
            f"({count} {what}s)."
        )


def _type_name(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    names = {int: "an int", float: "a number", bool: "True or False", str: "a str"}
    return names.get(hint, "None" if hint is type(None) else getattr(hint, "__name__", str(hint)))


def _fits(value, hint) -> bool:
    """Whether ``value`` has the type ``hint`` (int, float, bool, str, None, ``list[X]``, unions of
    these); a ``Literal`` or any other type passes here (:func:`check_choices` checks literals)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in typing.get_args(hint))
    if origin is list:
        return isinstance(value, list) and all(_fits(v, typing.get_args(hint)[0]) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint in (str, type(None)):
        return isinstance(value, hint)
    return True


def check_types(cfg) -> None:
    """Raise ``TypeError`` naming the field, its value and the type it needs when a field of the
    dataclass ``cfg`` holds a value of another type (``epochs=2.5`` where an int is needed)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not _fits(value, hints[f.name]):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            raise TypeError(
                f"{f.name}={value!r} is a {type(value).__name__}: it must be "
                f"{_type_name(hints[f.name])} (the default is {default!r})."
            )


def check_seed(cfg, name: str = "seed") -> None:
    """Raise ``ValueError`` unless field ``name`` is an int seed in 0 … :data:`SEED_MAX`."""
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SEED_MAX:
        raise ValueError(
            f"{name}={value!r}: a seed must be an int from 0 to {SEED_MAX} (2**31 - 1), the range "
            "every random generator the course seeds accepts; e.g. 0 or 1234."
        )


def check_timeout(cfg, name: str = "timeout_s") -> None:
    """Raise ``ValueError`` unless field ``name`` is at least 1 second: below that, ranks time out
    while they are still starting and meeting, before any step."""
    at_least(
        cfg,
        1,
        name,
        hint=" s: ranks need a few seconds to start and meet before their first collective "
        "(the default is fine; a hang test uses 2-5 s)",
    )


def check_writable_folder(folder, name: str) -> None:
    """Raise ``ValueError`` naming the setting ``name`` unless ``folder`` can be created and
    written: its nearest existing ancestor is a folder in which a file can be created now (a probe
    file, removed at once; nothing else is created).

    Raises:
        ValueError: a file stands where a folder is needed, or the folder cannot be written (a
            read-only file system, no permission), with the path and the fix.
    """
    target = Path(folder).expanduser().absolute()
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(
            f"{name}={str(folder)!r}: {existing} is a file, not a folder. Name a folder (it is "
            "created if missing)."
        )
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise ValueError(
            f"{name}={str(folder)!r}: cannot write in {existing} ({exc.strerror}). Name a folder "
            "you can write to."
        ) from None


def choices(cls, name: str) -> tuple | None:
    """The allowed values of field ``name`` of the dataclass ``cls`` when it is typed
    ``Literal[...]`` (or ``Literal[...] | None``, None then allowed too), else None."""
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return args
    if typing.get_origin(hint) is list:  # list[Literal[...]]: the choices of every item
        return typing.get_args(args[0]) if typing.get_origin(args[0]) is typing.Literal else None
    literals = [a for a in args if typing.get_origin(a) is typing.Literal]
    if len(literals) == 1 and set(args) - set(literals) <= {type(None)}:
        return typing.get_args(literals[0]) + ((None,) if type(None) in args else ())
    return None


def check_choices(cfg) -> None:
    """Raise ``ValueError`` naming the field, its value and the allowed values when a
    ``Literal``-typed field of the dataclass ``cfg`` holds something else."""
    for f in dataclasses.fields(cfg):
        allowed = choices(type(cfg), f.name)
        value = getattr(cfg, f.name)
        items = value if isinstance(value, list) else [value]
        if allowed is not None and any(v not in allowed for v in items):
            listed = ", ".join(repr(a) for a in allowed)
            raise ValueError(f"{f.name}={value!r}: must be one of {listed}.")


class Config:
    """Base of the worker configurations (keyword-only dataclasses, one docstring per field).

    :meth:`validate` runs in the launcher before any rank starts (and in the command line);
    subclasses extend it with their own range checks and call ``super().validate(nprocs)``.
    """

    def validate(self, nprocs: int | None = None) -> None:
        """Refuse a value of the wrong type (:func:`check_types`), outside its ``Literal`` choices
        (:func:`check_choices`) or, for a ``seed`` field, outside :data:`SEED_MAX`; ``nprocs`` is
        the world size the config is launched with (None: not known here).

        Raises:
            TypeError: naming the field, its value and the type it needs.
            ValueError: naming the field, its value and the allowed values.
        """
        check_types(self)
        check_choices(self)
        if any(f.name == "seed" for f in dataclasses.fields(self)):
            check_seed(self)
