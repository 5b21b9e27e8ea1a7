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
import typing


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
        """Refuse a value outside its ``Literal`` choices (see :func:`check_choices`); ``nprocs``
        is the world size the config is launched with (None: not known here).

        Raises:
            ValueError: naming the field, its value and the allowed values.
        """
        check_choices(self)
